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
]


def names_value(message: str, value: str) -> bool:
    """Helm writes schema paths as /a/b/c, our rules as a.b.c: either form names the value."""
    return value in message or value in message.replace("/", ".")
