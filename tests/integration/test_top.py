"""`kvctl top` and `kvctl health` against real nodes, a real redis-server and real /metrics endpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.pki import make_dev_pki
from kvstore.cli.launch import NodeProcess
from kvstore.cli.redis_procs import RedisProcess
from kvstore.cli.top import Sampler, compute
from kvstore.cli.waits import free_port
from kvstore.client import KVStoreClient
from tests.integration.conftest import LAYOUT, NS, key, page, start_node


def kvctl(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, check=False)  # fmt: skip


@pytest.fixture
def cluster(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real Redis index (with a password, as the chart starts it) and two nodes with /metrics."""
    redis = RedisProcess(password="top-test-password-123").start()
    nodes: list[NodeProcess] = []
    try:
        for i in range(2):
            nodes.append(start_node(tmp_path, dram_pages=8, nvme_pages=32, name=f"t{i}", redis_url=redis.url,
                                    extra_args=["--metrics-port", "0", "--index-ttl", "30"]))  # fmt: skip
        yield redis, nodes
    finally:
        for n in nodes:
            n.close()
        redis.close()


def test_rates_over_an_interval_equal_the_operations_done_in_it(cluster) -> None:  # type: ignore[no-untyped-def]
    redis, nodes = cluster
    sampler = Sampler(redis.url, [], None, [f"127.0.0.1:{n.metrics_port}" for n in nodes], timeout=10)
    chain = [key(i, "top") for i in range(3)]
    try:
        with KVStoreClient(nodes[0].addr, transport="grpc") as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])  # 3 pages, all in DRAM
            prev = sampler.sample()
            for _ in range(5):
                assert len(kv.get(NS, chain)) == 3  # 15 DRAM hits, 5 Get RPCs
            cur = sampler.sample()
        rates, failed = compute(prev, cur)
    finally:
        sampler.close()
    assert failed == [] and [r.node_id for r in rates] == ["t0", "t1"]
    t0, t1 = rates
    dram = next(t for t in t0.tiers if t.tier == "dram")
    assert round(dram.hits_per_s * t0.interval_s) == 15 and dram.hit_ratio == 1.0
    assert round(dram.bytes_out_per_s * t0.interval_s) == 15 * LAYOUT.page_bytes
    get = next(r for r in t0.rpcs if r.method == "Get")
    assert round(get.calls_per_s * t0.interval_s) == 5 and get.p99_s is not None and get.p99_s > 0
    assert t0.index_connected is True and t0.index_lag_s is not None
    assert t1.hit_ratio is None and t1.bytes_out_per_s == 0.0  # idle node: no reads, no ratio


def test_the_index_tells_top_where_each_nodes_metrics_are(cluster) -> None:  # type: ignore[no-untyped-def]
    redis, nodes = cluster
    sampler = Sampler(redis.url, [], None, [], timeout=10)  # no --metrics flags: the node records say
    try:
        with KVStoreClient(nodes[0].addr, transport="grpc") as kv:
            h = key(0, "top-index")
            kv.put(NS, LAYOUT, [h], [page(h)])
            prev = sampler.sample()
            assert len(kv.get(NS, [h])) == 1
            cur = sampler.sample()
        rates, _ = compute(prev, cur)
    finally:
        sampler.close()
    t0 = next(r for r in rates if r.node_id == "t0")
    assert any(r.method == "Get" for r in t0.rpcs)


def test_kvctl_top_once_json_live_and_unreachable_nodes(cluster) -> None:  # type: ignore[no-untyped-def]
    redis, nodes = cluster
    metrics = [a for n in nodes for a in ("--metrics", f"127.0.0.1:{n.metrics_port}")]
    r = kvctl("top", "--once", "--json", "--interval", "0.5", "--min-nodes", "2", *metrics,
              env={"KVSTORE_REDIS_URL": redis.url})  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert sorted(n["node_id"] for n in out["nodes"]) == ["t0", "t1"] and out["unreachable"] == []
    assert {t["tier"] for t in out["nodes"][0]["tiers"]} == {"dram", "nvme"}
    r = kvctl("top", "--once", "--json", "--interval", "0.2", "--min-nodes", "3", "--redis-url", redis.url)
    assert r.returncode == 1 and "fewer than --min-nodes 3" in r.stderr
    dead = f"127.0.0.1:{free_port()}"
    r = kvctl("top", "--once", "--json", "--interval", "0.2", "--timeout", "2", "--addr", nodes[0].addr, "--addr", dead)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [n["node_id"] for n in out["nodes"]] == ["t0"] and [u["addr"] for u in out["unreachable"]] == [dead]
    r = kvctl("top", "--iterations", "2", "--interval", "0.3", "--redis-url", redis.url, *metrics)
    assert r.returncode == 0, r.stderr
    assert "kvstore top: 2 node(s)" in r.stdout and "slowest RPCs" in r.stdout
    assert "top-test-password-123" not in r.stdout  # the index URL is shown without its password
    r = kvctl("top", "--json", "--addr", nodes[0].addr)
    assert r.returncode == 1 and "--json needs --once" in r.stderr
    r = kvctl("top", "--once")
    assert r.returncode == 1 and "--redis-url" in r.stderr


def test_kvctl_health_plain_tls_and_down(tmp_path: Path) -> None:
    pki = make_dev_pki(tmp_path / "pki")
    plain = start_node(tmp_path, name="h0")
    tls = start_node(tmp_path, name="h1", extra_args=["--tls-cert", str(pki.node_cert), "--tls-key", str(pki.node_key),
                                                      "--tls-client-ca", str(pki.ca)])  # fmt: skip
    try:
        r = kvctl("health", "--addr", plain.addr)
        assert r.returncode == 0 and r.stdout.strip().endswith("SERVING"), r.stderr
        mtls = {"KVSTORE_TLS_CA": str(pki.ca), "KVSTORE_TLS_CERT": str(pki.client_cert),
                "KVSTORE_TLS_KEY": str(pki.client_key), "KVSTORE_TLS_SERVER_NAME": "localhost"}  # fmt: skip
        r = kvctl("health", "--addr", tls.addr, env=mtls)
        assert r.returncode == 0, r.stderr
        r = kvctl("health", "--addr", tls.addr, "--timeout", "3")  # plaintext against a TLS node
        assert r.returncode == 1 and "not healthy" in r.stderr
        r = kvctl("health", "--addr", f"127.0.0.1:{free_port()}", "--timeout", "2")
        assert r.returncode == 1 and "UNAVAILABLE" in r.stderr
    finally:
        tls.close()
        plain.close()
