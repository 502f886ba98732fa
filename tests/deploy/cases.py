"""Bad values files and the value each must name, shared by the chart tests (helm template) and the
`kvstore up --values` tests: both front ends refuse the same files with the same value named."""

from __future__ import annotations

from typing import Any

# (id, values overriding the chart defaults, the value the error must name)
BAD_VALUES: list[tuple[str, dict[str, Any], str]] = [
    (
        "dram-over-memory-limit",
        {"node": {"budgets": {"dram": "64Gi"}, "resources": {"limits": {"memory": "32Gi"}}}},
        "node.resources.limits.memory",
    ),
    ("node-gpu-without-resource-name", {"node": {"gpu": {"count": 1, "resourceName": ""}}}, "node.gpu.resourceName"),
    ("worker-gpu-without-resource-name", {"workers": {"gpu": {"resourceName": ""}}}, "workers.gpu.resourceName"),
    ("hbm-without-gpu", {"node": {"budgets": {"hbm": "8Gi"}}}, "node.budgets.hbm"),
    ("tls-without-secret", {"tls": {"enabled": True}}, "tls.secretName"),
    (
        "cert-manager-without-issuer",
        {"tls": {"enabled": True, "certManager": {"enabled": True}}},
        "tls.certManager.issuerRef.name",
    ),
    ("mutual-tls-without-tls", {"tls": {"mutual": True}}, "tls.mutual"),
    ("redis-tls-without-its-secret", {"tls": {"enabled": True, "secretName": "kv-tls"}}, "redis.tls.secretName"),
    ("tokens-in-clear-without-opt-in", {"auth": {"enabled": True}}, "auth.allowPlaintextTokens"),
    ("negative-node-replicas", {"node": {"kind": "StatefulSet", "replicas": -1}}, "node.replicas"),
    ("negative-prefill-replicas", {"workers": {"prefill": {"replicas": -2}}}, "workers.prefill.replicas"),
    (
        "decode-replicas-above-max",
        {"workers": {"decode": {"replicas": 9, "maxReplicas": 4}}},
        "workers.decode.replicas",
    ),
    ("pvc-smaller-than-nvme-budget", {"node": {"kind": "StatefulSet", "nvme": {"size": "10Gi"}}}, "node.nvme.size"),
    ("not-a-size", {"node": {"budgets": {"dram": "8 gigs"}}}, "node.budgets.dram"),
    ("misspelt-key", {"node": {"budget": {"dram": "8Gi"}}}, "budget"),
    ("external-redis-without-url", {"redis": {"enabled": False}}, "redis.external.url"),
    ("tenants-without-auth", {"auth": {"tenants": [{"name": "alice"}]}}, "auth.tenants"),
    (
        "tenant-subjects-without-mutual-tls",
        {
            "auth": {
                "enabled": True,
                "allowPlaintextTokens": True,
                "tenants": [{"name": "alice", "mtlsSubjects": ["a.example"]}],
            }
        },
        "mtlsSubjects",
    ),
    (
        "tenant-name-not-a-name",
        {"auth": {"enabled": True, "allowPlaintextTokens": True, "tenants": [{"name": "a/b"}]}},
        "auth.tenants.0.name",
    ),
    ("unknown-kv-encoding", {"workers": {"kvEncoding": "int4"}}, "workers.kvEncoding"),
    (
        "redis-url-with-credentials",
        {"redis": {"enabled": False, "external": {"url": "redis://:pw@h:6379/0"}}},
        "redis.external.url",
    ),
    # UCX / RDMA (node.dataPlanes.ucx)
    (
        "rdma-without-ucx",
        {"node": {"dataPlanes": {"ucx": {"rdma": {"enabled": True, "resources": {"rdma/ib": 1}}}}}},
        "node.dataPlanes.ucx.enabled",
    ),
    (
        "rdma-without-a-device",
        {"node": {"dataPlanes": {"ucx": {"enabled": True, "rdma": {"enabled": True}}}}},
        "node.dataPlanes.ucx.rdma.resources",
    ),
    (
        "ucx-port-taken-by-tcp",
        {"node": {"dataPlanes": {"ucx": {"enabled": True, "port": 50052}}}},
        "node.dataPlanes.ucx.port",
    ),
    (
        "ucx-lanes-over-grpc-port",
        {"node": {"dataPlanes": {"ucx": {"enabled": True, "tcpPortRange": "50000-50100"}}}},
        "node.dataPlanes.ucx.tcpPortRange",
    ),
    (
        "ucx-lanes-backwards",
        {"node": {"dataPlanes": {"ucx": {"enabled": True, "tcpPortRange": "50300-50200"}}}},
        "node.dataPlanes.ucx.tcpPortRange",
    ),
    (
        "ucx-env-not-ucx",
        {"node": {"dataPlanes": {"ucx": {"env": {"NET_DEVICES": "mlx5_0:1"}}}}},
        "node.dataPlanes.ucx.env",
    ),
    (
        "ucx-env-port-range",
        {"node": {"dataPlanes": {"ucx": {"enabled": True, "env": {"UCX_TCP_PORT_RANGE": "1-2"}}}}},
        "node.dataPlanes.ucx.tcpPortRange",
    ),
    (
        "ucx-with-tls-without-trusting-the-fabric",
        {
            "tls": {"enabled": True, "secretName": "kv-tls"},
            "redis": {"tls": {"enabled": False}},
            "node": {"dataPlanes": {"ucx": {"enabled": True}}},
        },
        "node.dataPlanes.ucx.allowPlaintext",
    ),
    (
        "secondary-network-without-ucx",
        {"node": {"dataPlanes": {"ucx": {"network": {"attachments": "rdma-net"}}}}},
        "node.dataPlanes.ucx.network",
    ),
    ("local-socket-relative-dir", {"node": {"localSocket": {"hostDir": "run/kvstore"}}}, "node.localSocket.hostDir"),
    # engines (vLLM + LMCache)
    (
        "engines-local-target-without-nodes",
        {"node": {"enabled": False}, "engines": {"enabled": True}},
        "engines.lmcache.target",
    ),
    (
        "engines-cluster-target-with-redis-password",
        {"engines": {"enabled": True, "lmcache": {"target": "cluster"}}},
        "engines.lmcache.target",
    ),
    (
        "engines-unknown-tenant",
        {
            "auth": {"enabled": True, "allowPlaintextTokens": True, "tenants": [{"name": "alice"}]},
            "engines": {"enabled": True, "lmcache": {"tenant": "bob"}},
        },
        "engines.lmcache.tenant",
    ),
    (
        "engines-one-port-for-two-servers",
        {"engines": {"enabled": True, "lmcache": {"port": 8000}}},
        "engines.lmcache.port",
    ),
    (
        "engines-vllm-args-own-connector",
        {"engines": {"enabled": True, "vllm": {"args": ["--kv-transfer-config={}"]}}},
        "engines.vllm.args",
    ),
    (
        "engines-lmcache-args-own-adapter",
        {"engines": {"enabled": True, "lmcache": {"args": ["--l2-adapter", "{}"]}}},
        "engines.lmcache.args",
    ),
    (
        "engines-unknown-transport",
        {"engines": {"enabled": True, "lmcache": {"transport": "rdma"}}},
        "engines.lmcache.transport",
    ),
    (
        "engines-gpu-without-resource-name",
        {"engines": {"enabled": True, "gpu": {"resourceName": ""}}},
        "engines.gpu.resourceName",
    ),
    (
        "sentinel-without-redis-auth",
        {"redis": {"sentinel": {"enabled": True}, "auth": {"enabled": False}}},
        "redis.auth.enabled",
    ),
    (
        "sentinel-with-external-redis",
        {"redis": {"enabled": False, "sentinel": {"enabled": True}, "external": {"url": "redis://h:6379/0"}}},
        "redis.external.url",
    ),
    ("sentinel-without-a-quorum", {"redis": {"sentinel": {"enabled": True, "replicas": 2}}}, "redis.sentinel.replicas"),
    (
        "sentinel-url-with-a-password",
        {"redis": {"enabled": False, "external": {"url": "redis+sentinel://h:26379/m/0?sentinel_password=x"}}},
        "redis.external.url",
    ),
    (
        "cluster-without-redis-auth",
        {"redis": {"cluster": {"enabled": True}, "auth": {"enabled": False}}},
        "redis.auth.enabled",
    ),
    (
        "cluster-and-sentinel",
        {"redis": {"cluster": {"enabled": True}, "sentinel": {"enabled": True}}},
        "redis.sentinel.enabled",
    ),
    (
        "cluster-with-external-redis",
        {"redis": {"enabled": False, "cluster": {"enabled": True}, "external": {"url": "redis://h:6379/0"}}},
        "redis.external.url",
    ),
    ("cluster-of-two-masters", {"redis": {"cluster": {"enabled": True, "masters": 2}}}, "redis.cluster.masters"),
    (
        "cluster-url-with-credentials",
        {"redis": {"enabled": False, "external": {"url": "redis+cluster://u:p@h:6379/"}}},
        "redis.external.url",
    ),
]


def names_value(message: str, value: str) -> bool:
    """Helm writes schema paths as /a/b/c, our rules as a.b.c: either form names the value."""
    return value in message or value in message.replace("/", ".")
