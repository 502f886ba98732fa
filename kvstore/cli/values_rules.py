"""The Helm chart's cross-field rules (helm/kvstore/templates/validate.yaml), checked on a values file merged over
the chart's values.yaml and already checked against its values.schema.json (values.py). Pure: no I/O.

Invariant: the same rules as the chart's templates, with the same value names in the messages: a values file
`kvstore up --values` accepts is one `helm install` renders, and a bad one raises ValueError naming the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstore.config import parse_size


def value_bytes(values: Mapping[str, Any], path: str) -> int:
    """The size at a dotted path of the values (`node.budgets.dram`), in bytes; ValueError naming the path."""
    v: Any = values
    for part in path.split("."):
        v = v[part]
    try:
        return parse_size(v if isinstance(v, str) else int(v))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def check_rules(v: Mapping[str, Any]) -> None:
    """The cross-field rules of templates/validate.yaml, with the same value names in the messages."""
    node = v["node"]
    if node.get("enabled", True):
        need = value_bytes(v, "node.budgets.dram") + value_bytes(v, "node.memoryOverhead")
        limit = (node.get("resources") or {}).get("limits", {}).get("memory")
        if limit and need > value_bytes(v, "node.resources.limits.memory"):
            raise ValueError(
                f"node.budgets.dram ({node['budgets']['dram']}) + node.memoryOverhead "
                f"({node['memoryOverhead']}) = {need} bytes exceeds node.resources.limits.memory ({limit})"
            )
        if value_bytes(v, "node.budgets.hbm") > 0 and int(node["gpu"]["count"]) == 0:
            raise ValueError(
                f"node.budgets.hbm is {node['budgets']['hbm']} but node.gpu.count is 0: an HBM tier needs a GPU"
            )
        if int(node["gpu"]["count"]) > 0 and not node["gpu"]["resourceName"]:
            raise ValueError("node.gpu.resourceName is empty but node.gpu.count > 0")
        if value_bytes(v, "node.budgets.maxPageBytes") <= 0:
            raise ValueError("node.budgets.maxPageBytes must be > 0")
        nvme = value_bytes(v, "node.budgets.nvme")
        if node["kind"] == "DaemonSet" and nvme > 0 and not node["nvme"].get("hostPath"):
            raise ValueError("node.nvme.hostPath is empty but node.budgets.nvme > 0")
        if node["kind"] == "StatefulSet" and node["nvme"].get("size") and value_bytes(v, "node.nvme.size") < nvme:
            raise ValueError(
                f"node.nvme.size ({node['nvme']['size']}) is smaller than node.budgets.nvme ({node['budgets']['nvme']})"
            )
    check_fast_path_rules(v)
    check_engine_rules(v)
    if v["rayCluster"]["enabled"]:
        for pool in ("prefill", "decode"):
            p = v["workers"][pool]
            if int(p["gpusPerPod"]) > 0 and not v["workers"]["gpu"]["resourceName"]:
                raise ValueError(f"workers.gpu.resourceName is empty but workers.{pool}.gpusPerPod > 0")
            if not p["minReplicas"] <= p["replicas"] <= p["maxReplicas"]:
                raise ValueError(
                    f"workers.{pool}.replicas ({p['replicas']}) must lie within workers.{pool}.minReplicas "
                    f"({p['minReplicas']}) and workers.{pool}.maxReplicas ({p['maxReplicas']})"
                )
    tls = v["tls"]
    if tls["enabled"]:
        if not tls["secretName"] and not tls["certManager"]["enabled"]:
            raise ValueError("tls.enabled is true but neither tls.secretName nor tls.certManager.enabled is set")
        if tls["certManager"]["enabled"] and not tls["certManager"]["issuerRef"]["name"]:
            raise ValueError("tls.certManager.issuerRef.name is empty")
        rtls = v["redis"]["tls"]
        if v["redis"]["enabled"] and rtls["enabled"] and not tls["certManager"]["enabled"] and not rtls["secretName"]:
            raise ValueError(
                "redis.tls.secretName is empty: with tls.secretName, give Redis a Secret for its "
                "Service name, or set redis.tls.enabled: false"
            )
    elif tls["mutual"]:
        raise ValueError("tls.mutual is true but tls.enabled is false: mutual TLS runs over TLS")
    elif v["auth"]["enabled"] and not v["auth"].get("allowPlaintextTokens"):
        raise ValueError(
            "auth.enabled is true but tls.enabled is false: tokens would cross the network in clear "
            "to nodes clients cannot verify; enable TLS, or set auth.allowPlaintextTokens: true "
            "for a trusted pod network"
        )
    tenants = v["auth"].get("tenants") or []
    if tenants and not v["auth"]["enabled"]:
        raise ValueError("auth.tenants is set but auth.enabled is false: tenants are bound to tokens; enable auth")
    for t in tenants:
        if t.get("mtlsSubjects") and not tls["mutual"]:
            raise ValueError(
                f"auth.tenants[{t['name']}].mtlsSubjects is set but tls.mutual is false: certificate "
                "subjects bind tenants only with mutual TLS"
            )
    redis = v["redis"]
    ext = redis["external"]
    if (
        not redis["enabled"]
        and (node.get("enabled", True) or v["rayCluster"]["enabled"])
        and not (ext["url"] or ext["existingSecret"])
    ):
        raise ValueError(
            "redis.enabled is false but neither redis.external.url nor redis.external.existingSecret is set"
        )
    if "password=" in (ext.get("url") or "").lower():
        raise ValueError(
            "redis.external.url carries a password (in its query): put a URL with credentials in the Secret "
            "named by redis.external.existingSecret"
        )
    sentinel = redis.get("sentinel") or {}
    if sentinel.get("enabled"):
        if not redis["enabled"]:
            raise ValueError(
                "redis.sentinel.enabled runs sentinels beside the chart's Redis, but redis.enabled is false: "
                "for an external Redis behind Sentinel, give its redis+sentinel:// URL in redis.external.url"
            )
        if not redis["auth"]["enabled"]:
            raise ValueError(
                "redis.sentinel.enabled needs redis.auth.enabled: sentinels anyone may reconfigure could point "
                "every node at a Redis of their own"
            )
    if (redis.get("cluster") or {}).get("enabled"):
        if not redis["enabled"]:
            raise ValueError(
                "redis.cluster.enabled runs a Redis Cluster as the chart's Redis, but redis.enabled is false: for "
                "an external Redis Cluster, give its redis+cluster:// URL in redis.external.url"
            )
        if sentinel.get("enabled"):
            raise ValueError(
                "redis.cluster.enabled and redis.sentinel.enabled: choose one (a Redis Cluster fails its masters "
                "over by itself)"
            )
        if not redis["auth"]["enabled"]:
            raise ValueError(
                "redis.cluster.enabled needs redis.auth.enabled: anyone who can reach a cluster's servers could "
                "reconfigure them (CLUSTER commands) and redirect every node"
            )


def _ports(v: Mapping[str, Any]) -> dict[str, int]:
    node = v["node"]
    return {
        "node.port": node["port"],
        "node.metricsPort": node["metricsPort"],
        "node.dataPlanes.tcp.port": node["dataPlanes"]["tcp"]["port"],
    }


def check_fast_path_rules(v: Mapping[str, Any]) -> None:
    """UCX/RDMA (node.dataPlanes.ucx): templates/validate.yaml's rules, the same value names."""
    node = v["node"]
    ucx = node["dataPlanes"]["ucx"]
    rdma, net = ucx.get("rdma") or {}, ucx.get("network") or {}
    if not node.get("enabled", True):
        return
    if not ucx["enabled"]:
        if rdma.get("enabled"):
            raise ValueError(
                "node.dataPlanes.ucx.rdma.enabled is true but node.dataPlanes.ucx.enabled is false: "
                "RDMA is used through the UCX plane; enable it"
            )
        if net.get("hostNetwork") or net.get("attachments"):
            raise ValueError(
                "node.dataPlanes.ucx.network is set but node.dataPlanes.ucx.enabled is false: the host "
                "or secondary network is for the UCX plane; enable it"
            )
        return
    for name, port in _ports(v).items():
        if int(port) == int(ucx["port"]):
            raise ValueError(
                f"node.dataPlanes.ucx.port ({ucx['port']}) is also {name}: give the UCX listener a port of its own"
            )
    if ucx.get("tcpPortRange"):
        lo, hi = (int(x) for x in ucx["tcpPortRange"].split("-"))
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(
                f"node.dataPlanes.ucx.tcpPortRange {ucx['tcpPortRange']!r} is not LO-HI with 1 <= LO <= HI <= 65535"
            )
        for name, port in {**_ports(v), "node.dataPlanes.ucx.port": ucx["port"]}.items():
            if lo <= int(port) <= hi:
                raise ValueError(
                    f"node.dataPlanes.ucx.tcpPortRange {ucx['tcpPortRange']!r} holds {name} ({port}): "
                    "UCX's lanes would collide with it"
                )
    if v["tls"]["enabled"] and not ucx.get("allowPlaintext"):
        raise ValueError(
            "node.dataPlanes.ucx.enabled with tls.enabled: UCX is not encrypted, so clients configured "
            "for TLS would skip it; set node.dataPlanes.ucx.allowPlaintext: true to declare the fabric "
            "trusted (tokens and pages cross it in clear), or turn UCX off"
        )
    if "UCX_TCP_PORT_RANGE" in (ucx.get("env") or {}):
        raise ValueError(
            "node.dataPlanes.ucx.env.UCX_TCP_PORT_RANGE: set node.dataPlanes.ucx.tcpPortRange instead "
            "(the NetworkPolicy opens that range)"
        )
    if rdma.get("enabled") and not rdma.get("resources") and not rdma.get("hostDevices"):
        raise ValueError(
            "node.dataPlanes.ucx.rdma.resources is empty and node.dataPlanes.ucx.rdma.hostDevices is "
            "false: the pods would see no RDMA device; name your RDMA device plugin's resource"
        )


_CHART_VLLM_FLAGS = ("--kv-transfer-config", "--port", "--host", "--model")
_CHART_LMCACHE_FLAGS = ("--l2-adapter", "--port", "--host")


def check_engine_rules(v: Mapping[str, Any]) -> None:
    """engines (vLLM + LMCache): templates/validate.yaml's rules, the same value names."""
    e = v["engines"]
    if not e["enabled"]:
        return
    lm = e["lmcache"]
    if lm["target"] == "local" and not v["node"].get("enabled", True):
        raise ValueError(
            "engines.lmcache.target is local but node.enabled is false: there is no cache node on the "
            "engines' hosts; deploy nodes or use target: cluster"
        )
    redis = v["redis"]
    if lm["target"] == "cluster" and (
        (redis["enabled"] and redis["auth"]["enabled"])
        or (not redis["enabled"] and redis["external"]["existingSecret"])
    ):
        raise ValueError(
            "engines.lmcache.target is cluster but the Redis URL needs a password, which would appear on "
            "lmcache's command line: use target: local, or an index without a password"
        )
    if int(e["gpu"]["count"]) > 0 and not e["gpu"]["resourceName"]:
        raise ValueError("engines.gpu.resourceName is empty but engines.gpu.count > 0")
    if int(lm["port"]) == int(e["vllm"]["port"]):
        raise ValueError(
            f"engines.lmcache.port and engines.vllm.port are both {lm['port']}: the pod's two servers need two ports"
        )
    if lm.get("tenant"):
        if not v["auth"]["enabled"]:
            raise ValueError("engines.lmcache.tenant is set but auth.enabled is false: tenants are bound to tokens")
        names = [t["name"] for t in v["auth"].get("tenants") or []]
        if lm["tenant"] not in names:
            raise ValueError(f"engines.lmcache.tenant {lm['tenant']!r} is not one of auth.tenants ({', '.join(names)})")
    for where, args, owned in (
        ("engines.vllm.args", e["vllm"].get("args") or [], _CHART_VLLM_FLAGS),
        ("engines.lmcache.args", lm.get("args") or [], _CHART_LMCACHE_FLAGS),
    ):
        for arg in args:
            for flag in owned:
                if arg == flag or arg.startswith(flag + "="):
                    raise ValueError(f"{where} sets {flag}, which the chart sets")
