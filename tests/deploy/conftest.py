"""The real helm binary (fetched by ./dev setup into .tools/) rendering the real chart."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvstore"
TOOLS = ROOT / ".tools"
PROFILES = sorted((ROOT / "deploy" / "values").glob("*.yaml"))
# Render as if the cluster served these optional APIs, so every template is exercised.
API_VERSIONS = ["monitoring.coreos.com/v1/ServiceMonitor", "cert-manager.io/v1/Certificate", "ray.io/v1/RayCluster"]


def helm_binary() -> str:
    for cand in (os.environ.get("KVSTORE_HELM"), str(TOOLS / "helm" / "helm"), shutil.which("helm")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    pytest.fail("helm not found: run ./dev setup (it fetches helm into .tools/) or set KVSTORE_HELM")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120, check=False)
    if check and r.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{r.stderr}")
    return r


def render_args(files: list[Path] = (), sets: list[str] = (), api_versions: list[str] = API_VERSIONS) -> list[str]:  # type: ignore[assignment]
    args = ["template", "kv", str(CHART), "--namespace", "kvs"]
    for f in files:
        args += ["-f", str(f)]
    for s in sets:
        args += ["--set", s]
    for a in api_versions:
        args += ["--api-versions", a]
    return args


def render(
    files: list[Path] = (), sets: list[str] = (), api_versions: list[str] = API_VERSIONS
) -> list[dict[str, Any]]:  # type: ignore[assignment]
    out = helm(*render_args(files, sets, api_versions)).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def profile_id(p: Path) -> str:
    return p.stem


@pytest.fixture(params=[None, *PROFILES], ids=["chart-defaults", *[profile_id(p) for p in PROFILES]])
def profile(request: pytest.FixtureRequest) -> list[Path]:
    """Each example values file, and the chart's own defaults."""
    return [] if request.param is None else [request.param]
