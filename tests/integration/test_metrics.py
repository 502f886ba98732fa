"""The Prometheus endpoint of a real node: what it exports agrees with the node's own Stats RPC."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import KVStoreClient
from kvstore.config import NodeConfig
from kvstore.errors import InvalidArgument
from kvstore.names import TierKind
from tests.integration.conftest import LAYOUT, NS, key, page, start_node

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample with this name whose labels include `labels`."""
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples"
    return hits[0]


def test_metrics_agree_with_stats_for_every_tier_and_count_rpcs_by_status(tmp_path: Path) -> None:
    node = start_node(tmp_path, dram_pages=4, nvme_pages=32, name="m0", extra_args=["--metrics-port", "0"])
    try:
        assert node.metrics_port
        chain = [key(i, "metrics") for i in range(10)]
        with KVStoreClient(node.addr, transport="grpc") as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])  # 4 fit in DRAM: the rest are demoted
            assert [p.hash for p in kv.get_pages(NS, chain)] == chain  # NVMe hits, promoted back
            with pytest.raises(InvalidArgument):
                kv.put(NS, LAYOUT, [chain[0][:5]], [page(chain[0])])  # a bad hash: INVALID_ARGUMENT
            stats = kv.stats()
            samples = scrape(node.metrics_port)
        for t in stats.tiers:
            if not t.available:
                continue
            lbl = {"node": "m0", "tier": t.tier.label}
            c = t.counters
            assert value(samples, "kvstore_tier_hits_total", **lbl) == c.hits
            assert value(samples, "kvstore_tier_misses_total", **lbl) == c.misses
            assert value(samples, "kvstore_tier_demotions_total", **lbl) == c.demotions
            assert value(samples, "kvstore_tier_promotions_total", **lbl) == c.promotions
            assert value(samples, "kvstore_tier_written_bytes_total", **lbl) == c.bytes_in
            assert value(samples, "kvstore_tier_read_bytes_total", **lbl) == c.bytes_out
            assert value(samples, "kvstore_tier_pages", **lbl) == t.pages
            assert value(samples, "kvstore_tier_capacity_bytes", **lbl) == t.capacity_bytes
            if t.hit_rate is not None:
                assert value(samples, "kvstore_tier_hit_ratio", **lbl) == pytest.approx(t.hit_rate)
        nvme = next(t for t in stats.tiers if t.tier is TierKind.NVME)
        assert nvme.counters.hits > 0 and value(samples, "kvstore_tier_hits_total", tier="nvme") == nvme.counters.hits
        assert value(samples, "kvstore_rpc_duration_seconds_count", method="Put", code="OK") == 1
        assert value(samples, "kvstore_rpc_duration_seconds_count", method="Put", code="INVALID_ARGUMENT") == 1
        assert value(samples, "kvstore_rpc_duration_seconds_count", method="Get", code="OK") == 1
        assert value(samples, "kvstore_rpc_duration_seconds_bucket", method="Get", code="OK", le="+Inf") == 1
        port = node.metrics_port
    finally:
        node.close()
    with pytest.raises(OSError):  # the endpoint went away with the node
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_metrics_are_off_unless_asked_for(tmp_path: Path) -> None:
    node = start_node(tmp_path, name="m1")
    try:
        assert node.metrics_port is None
    finally:
        node.close()


def test_a_taken_metrics_port_fails_the_start_with_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="Address already in use"):
            start_node(tmp_path, name="m2", extra_args=["--metrics-port", str(taken.getsockname()[1])])


def test_metrics_port_is_validated() -> None:
    with pytest.raises(ValueError, match="metrics_port"):
        NodeConfig(metrics_port=70000)
    assert NodeConfig.load(env={"KVSTORE_METRICS_PORT": "9100"}).metrics_port == 9100


def test_kvstore_up_serves_metrics_for_each_node(tmp_path: Path) -> None:
    ready = tmp_path / "up.json"
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli.main", "up", "--nodes", "1", "--dram-bytes", "4MiB",
                             "--nvme-bytes", "0", "--ready-file", str(ready)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        for _ in range(600):
            if ready.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert ready.exists(), "kvstore up did not come up"
        port = json.loads(ready.read_text())["metrics"]["node-0"]
        assert value(scrape(port), "kvstore_tier_slots_total", tier="dram") > 0
    finally:
        proc.terminate()
        proc.wait(60)
