"""The Helm chart's values, read for `kvstore up --values FILE`: the same roles as local processes.

One values file drives both: the chart (helm/kvstore) renders it into a cluster, and this module turns
it into a `LocalPlan` (Redis, N cache nodes with the chart's budgets times `local.scale`, optionally the
Ray prefill/decode workers). The file is merged over the chart's own values.yaml the way Helm merges
(maps recursively, everything else replaced, null deletes), checked against the chart's
values.schema.json, then against the same cross-field rules as templates/validate.yaml (values_rules.py), with
the same value names in the messages. A bad file raises ValueError and starts nothing.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvstore.cli.engines import EnginesPlan, check_python, find_python, plan_engines
from kvstore.cli.values_rules import check_rules, value_bytes
from kvstore.config import parse_size
from kvstore.pageformat import slot_bytes_for

# Where the chart lives in a source checkout (kvstore/cli/values.py -> repo root / helm / kvstore).
DEFAULT_CHART = Path(__file__).resolve().parents[2] / "helm" / "kvstore"
MEMORY_HEADROOM = 0.8  # a local plan may use at most this share of the machine's available memory


@dataclass(frozen=True, slots=True)
class NodePlan:
    """One local cache node's settings: the chart's node flags and node.toml, budgets scaled."""

    dram_bytes: int
    nvme_bytes: int
    hbm_bytes: int
    max_page_bytes: int
    config: dict[str, Any]  # the [node] table of node.toml, exactly as the chart renders it


@dataclass(frozen=True, slots=True)
class WorkersPlan:
    model_path: str
    dtype: str
    block_size: int
    num_blocks: int
    prefill_slots: int
    decode_slots: int
    max_inflight: int
    kv_encoding: str = "raw"  # workers.kvEncoding


@dataclass(frozen=True, slots=True)
class SentinelPlan:
    """redis.sentinel: `replicas` Redis processes (one master) and as many sentinels, as the chart runs."""

    replicas: int
    master_name: str
    down_after_ms: int
    failover_timeout_ms: int


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    """redis.cluster: a Redis Cluster of `masters` masters, each with `replicas` replicas, as the chart runs."""

    masters: int
    replicas: int
    node_timeout_ms: int


@dataclass(frozen=True, slots=True)
class LocalPlan:
    nodes: int
    node: NodePlan | None  # None: node.enabled is false
    redis_external_url: str | None  # None: start a private redis-server
    redis_password: bool
    auth_tokens: bool
    workers: WorkersPlan | None
    notes: list[str] = field(default_factory=list)  # what the local run leaves out, said out loud
    tenants: tuple[str, ...] = ()  # auth.tenants' names: a token (and index user) each
    tenants_toml: str | None = None  # the tenants file the chart renders (shares scaled like the budgets)
    engines: EnginesPlan | None = None  # the chart's engines (vLLM + LMCache), where vLLM's CPU build is here
    local_socket: bool = False  # node.localSocket: each node serves the same-host socket (where serve can)
    redis_sentinel: SentinelPlan | None = None  # redis.sentinel.enabled: Redis replicas and sentinels
    redis_cluster: ClusterPlan | None = None  # redis.cluster.enabled: a Redis Cluster


def merge(base: Any, override: Any) -> Any:
    """Helm's values merge: maps merge key by key, a null deletes the key, anything else replaces."""
    if not isinstance(base, Mapping) or not isinstance(override, Mapping):
        return copy.deepcopy(override)
    out = dict(copy.deepcopy(base))
    for k, v in override.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def load_values(files: list[Path], chart: Path = DEFAULT_CHART) -> dict[str, Any]:
    """Chart defaults merged with each file in order, checked against values.schema.json and the rules."""
    import jsonschema

    if not (chart / "values.yaml").is_file():
        raise ValueError(f"{chart}: not the kvstore chart (no values.yaml); pass --chart DIR")
    values = yaml.safe_load((chart / "values.yaml").read_text())
    for f in files:
        try:
            user = yaml.safe_load(Path(f).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"{f}: {exc}") from None
        if not isinstance(user, Mapping):
            raise ValueError(f"{f}: a values file is a YAML mapping, got {type(user).__name__}")
        values = merge(values, user)
    schema = json.loads((chart / "values.schema.json").read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(values), key=lambda e: list(e.absolute_path))
    if errors:
        where = ", ".join(str(f) for f in files) or "chart defaults"
        lines = [f"{'.'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}" for e in errors]
        raise ValueError(f"{where}: values do not match the chart's schema: " + "; ".join(lines))
    check_rules(values)
    return values


def node_toml_table(v: Mapping[str, Any]) -> dict[str, Any]:
    """The [node] table templates/node.yaml writes into node.toml."""
    node = v["node"]
    # tcp_port and ucx_port stay 0 here (free ports): local nodes share one machine, and each advertises its own.
    return {
        "policy": node["policy"],
        "grace_seconds": node["shutdown"]["drainSeconds"],
        "spill_seconds": node["shutdown"]["spillSeconds"],
        "spill_on_shutdown": True,
        "handoff_seconds": node["shutdown"]["handoffSeconds"],
        "replication": node["replication"]["enabled"],
        "replication_max_copies": node["replication"]["maxCopies"],
        "replication_hot_reads_per_second": node["replication"]["hotReadsPerSecond"],
        "replication_free_reserve": node["replication"]["freeReserve"],
        "replication_bytes_per_second": parse_size(str(node["replication"]["bytesPerSecond"])),
        "index_ttl_seconds": node["index"]["ttlSeconds"],
        "index_register_wait_seconds": node["index"]["registerWaitSeconds"],
        "shm_enabled": node["dataPlanes"]["shm"]["enabled"],
        "tcp_enabled": node["dataPlanes"]["tcp"]["enabled"],
        "ucx_enabled": node["dataPlanes"]["ucx"]["enabled"],
        "log_level": node["logLevel"],
        **node.get("config", {}),
    }


def tenants_toml(v: Mapping[str, Any], scale: float = 1.0) -> str | None:
    """The tenants file templates/node.yaml renders from auth.tenants (None without tenants); shares
    multiplied by `scale` (local.scale, as the budgets are)."""
    tenants = v["auth"].get("tenants") or []
    if not tenants:
        return None
    out = []
    for t in tenants:
        out.append(f"[tenants.{json.dumps(t['name'])}]")
        for key, name in (("dramBytes", "dram_bytes"), ("nvmeBytes", "nvme_bytes"), ("hbmBytes", "hbm_bytes")):
            if t.get(key) is not None:
                out.append(f"{name} = {int(parse_size(t[key]) * scale)}")
        out.append(f"mtls_subjects = {json.dumps(t.get('mtlsSubjects') or [])}")
    return "\n".join(out) + "\n"


def plan(v: Mapping[str, Any], root: Path, mem_available: int | None = None) -> LocalPlan:
    """The local processes for checked values `v`; NVMe goes under `root`. Raises ValueError (naming
    local.scale) when the scaled budgets do not fit this machine."""
    local = v["local"]
    scale = float(local["scale"])
    notes: list[str] = []
    node_plan = None
    n = 0
    if v["node"]["enabled"]:
        node = v["node"]
        n = int(local["nodes"]) or (int(node["replicas"]) if node["kind"] == "StatefulSet" else 1)
        page = value_bytes(v, "node.budgets.maxPageBytes")
        dram = int(value_bytes(v, "node.budgets.dram") * scale)
        nvme = int(value_bytes(v, "node.budgets.nvme") * scale)
        slot = slot_bytes_for(page)
        if dram < slot:
            raise ValueError(
                f"local.scale {scale} leaves node.budgets.dram at {dram} bytes, less than one page slot "
                f"({slot} bytes for node.budgets.maxPageBytes {node['budgets']['maxPageBytes']}): raise local.scale"
            )
        need = n * int((value_bytes(v, "node.budgets.dram") + value_bytes(v, "node.memoryOverhead")) * scale)
        avail = mem_available if mem_available is not None else _mem_available()
        if avail and need > MEMORY_HEADROOM * avail:
            raise ValueError(
                f"{n} node(s) x (node.budgets.dram + node.memoryOverhead) x local.scale {scale} = {need} "
                f"bytes, more than {MEMORY_HEADROOM:.0%} of this machine's available memory ({avail}): "
                f"lower local.scale"
            )
        free_disk = shutil.disk_usage(root if root.exists() else root.parent).free
        if n * nvme > free_disk:
            raise ValueError(
                f"{n} node(s) x node.budgets.nvme x local.scale {scale} = {n * nvme} bytes, more than "
                f"the free disk under {root} ({free_disk}): lower local.scale"
            )
        hbm = int(value_bytes(v, "node.budgets.hbm") * scale)
        node_plan = NodePlan(dram, nvme, hbm, page, node_toml_table(v))
    if v["tls"]["enabled"]:
        notes.append("tls.enabled: not reproduced locally (no certificates here); the local nodes serve plaintext")
    ext = v["redis"]["external"]
    external = None
    if not v["redis"]["enabled"]:
        if not ext["url"]:
            raise ValueError("redis.external.existingSecret names a Kubernetes Secret: locally, set redis.external.url")
        external = ext["url"]
    workers = None
    if local["workers"]:
        if not v["rayCluster"]["enabled"]:
            raise ValueError("local.workers is true but rayCluster.enabled is false: nothing to start")
        if not local["modelPath"] or not (Path(local["modelPath"]) / "config.json").is_file():
            raise ValueError(
                f"local.modelPath {local['modelPath']!r}: give a checkpoint directory with config.json "
                f"(workers.model.path is the in-cluster path)"
            )
        w = v["workers"]
        slots = {p: int(w[p]["replicas"]) * max(int(w[p]["gpusPerPod"]), 1) for p in ("prefill", "decode")}
        workers = WorkersPlan(
            str(local["modelPath"]),
            w["model"]["dtype"],
            int(w["blockSize"]),
            int(w["numBlocks"]),
            slots["prefill"],
            slots["decode"],
            int(v["rayCluster"]["router"]["maxInflight"]),
            str(w["kvEncoding"]),
        )
    engines = None
    if v["engines"]["enabled"]:
        if not (local.get("engines") or {}).get("enabled", True):
            notes.append("engines: not started locally (local.engines.enabled is false)")
        else:
            python = find_python(v)
            engines = plan_engines(v, python, check_python(python) if python else None)
            if engines is not None and n == 0:
                raise ValueError(
                    "engines.enabled: the local engine's L2 adapter needs a local cache node (node.enabled)"
                )
            notes += engines.notes if engines else []
    names = tuple(t["name"] for t in v["auth"].get("tenants") or [])
    local_socket = bool(v["node"]["enabled"] and v["node"]["localSocket"]["enabled"])
    sentinel = v["redis"].get("sentinel") or {}
    sentinel_plan = None
    if v["redis"]["enabled"] and sentinel.get("enabled"):
        sentinel_plan = SentinelPlan(
            int(sentinel["replicas"]),
            str(sentinel["masterName"]),
            int(sentinel["downAfterMilliseconds"]),
            int(sentinel["failoverTimeoutMilliseconds"]),
        )
    cluster = v["redis"].get("cluster") or {}
    cluster_plan = None
    if v["redis"]["enabled"] and cluster.get("enabled"):
        cluster_plan = ClusterPlan(
            int(cluster["masters"]), int(cluster["replicasPerMaster"]), int(cluster["nodeTimeoutMilliseconds"])
        )
    return LocalPlan(
        n,
        node_plan,
        external,
        bool(v["redis"]["enabled"] and v["redis"]["auth"]["enabled"]),
        bool(v["auth"]["enabled"]),
        workers,
        notes,
        names,
        tenants_toml(v, scale),
        engines,
        local_socket,
        sentinel_plan,
        cluster_plan,
    )


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def chart_from_env() -> Path:
    """The chart directory: KVSTORE_CHART, else the source checkout's helm/kvstore."""
    return Path(os.environ.get("KVSTORE_CHART", DEFAULT_CHART))
