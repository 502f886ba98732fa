"""The chart serves the bulk TCP data plane on a fixed port that its NetworkPolicy lets clients reach
(with a random port the policy would drop the connections, and every client would fall back to gRPC)."""

from __future__ import annotations

from pathlib import Path

from kvstore.config import NodeConfig
from tests.deploy.conftest import render


def node_docs(sets: list[str], tmp: Path) -> tuple[NodeConfig, list[int], list[int]]:
    """The node's config (from its ConfigMap), its container ports, and the ports its NetworkPolicy opens."""
    docs = render(sets=sets)
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-node")]
    (workload,) = [
        d for d in docs if d["kind"] in ("DaemonSet", "StatefulSet") and d["metadata"]["name"].endswith("-node")
    ]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-node")]
    conf = tmp / "node.toml"
    conf.write_text(cm["data"]["node.toml"])
    return (
        NodeConfig.load(conf, env={}),
        [p["containerPort"] for p in workload["spec"]["template"]["spec"]["containers"][0]["ports"]],
        [p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])],
    )


def test_the_tcp_plane_port_is_configured_exposed_and_allowed(tmp_path: Path) -> None:
    cfg, ports, allowed = node_docs([], tmp_path)
    assert cfg.tcp_enabled and cfg.tcp_port == 50052
    assert 50052 in ports and 50052 in allowed
    cfg, ports, allowed = node_docs(["node.dataPlanes.tcp.port=6000"], tmp_path)
    assert cfg.tcp_port == 6000 and 6000 in ports and 6000 in allowed
    cfg, ports, allowed = node_docs(["node.dataPlanes.tcp.enabled=false"], tmp_path)
    assert not cfg.tcp_enabled and 50052 not in ports and 50052 not in allowed
