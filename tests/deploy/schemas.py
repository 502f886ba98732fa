"""Offline schemas for rendered manifests: the KubeRay CRD (deploy/schemas/) made strict as the API
server's strict field validation is, and Kubernetes' own schemas through kubernetes-validate."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
RAYCLUSTER_CRD = ROOT / "deploy" / "schemas" / "ray.io_rayclusters.yaml"


def strict(schema: Any) -> Any:
    """A copy of an OpenAPI v3 CRD schema that rejects undeclared fields (as `kubectl apply
    --validate=strict` does), except where the CRD keeps unknown fields on purpose."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def raycluster_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(RAYCLUSTER_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft7Validator(schema)


def raycluster_errors(doc: dict[str, Any]) -> list[str]:
    return [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in raycluster_validator().iter_errors(doc)
    ]
