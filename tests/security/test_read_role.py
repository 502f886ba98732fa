"""Suspicions about what read-only access can do, settled against real nodes:
- on a full node a promotion makes room by dropping the coldest page, so a read token that could
  promote (Get, Prefetch, Lookup with prefetch) could evict pages just by reading: fixed, a read-only
  principal never changes where pages live (its Gets are served in place, Prefetch and Lookup with
  prefetch need a read-write token), while read-write readers keep promoting;
- /metrics (unauthenticated by design, for Prometheus) carries counters only: no namespace, key,
  token or Redis credential."""

from __future__ import annotations

import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest

from kvstore.cli.redis_procs import RedisProcess
from kvstore.client import KVStoreClient
from kvstore.errors import PermissionDenied
from kvstore.names import TierKind
from kvstore.security import ClientSecurity
from tests.integration.conftest import LAYOUT, NS, key, page, start_node
from tests.security.conftest import READ, WRITE, token_args, wait_for


def test_read_tokens_never_move_pages_so_reading_never_evicts(tmp_path: Path) -> None:
    node = start_node(tmp_path, dram_pages=4, nvme_pages=12, name="full", extra_args=token_args(tmp_path))
    chains = [[key(i, f"full-{c}") for i in range(4)] for c in range(4)]  # 16 pages: every slot taken
    try:
        with KVStoreClient(node.addr, timeout=30, security=ClientSecurity(token=WRITE)) as rw:
            for chain in chains:
                rw.put(NS, LAYOUT, chain, [page(h) for h in chain])
            before = rw.stats()
        assert sum(t.pages for t in before.tiers) == 16
        with KVStoreClient(node.addr, timeout=30, security=ClientSecurity(token=READ)) as ro:
            for _ in range(3):
                for chain in chains:
                    assert [bytes(p) for p in ro.get(NS, chain)] == [page(h) for h in chain]  # all of it, in place
                    for move in (lambda c=chain: ro.prefetch(NS, c, target_tier=TierKind.DRAM),
                                 lambda c=chain: ro.lookup(NS, c, prefetch=True)):  # fmt: skip
                        with pytest.raises(PermissionDenied, match="read-write token"):
                            move()
            after = ro.stats()
        assert [(t.pages, t.counters.promotions, t.counters.evictions, t.counters.dropped) for t in after.tiers] == [
            (t.pages, t.counters.promotions, t.counters.evictions, t.counters.dropped) for t in before.tiers
        ]
        with KVStoreClient(node.addr, timeout=30, security=ClientSecurity(token=WRITE)) as rw:
            rw.get(NS, chains[0])  # a read-write reader still promotes (the cache's normal behaviour)
            assert sum(t.counters.promotions for t in rw.stats().tiers) > 0
    finally:
        node.close()


def test_metrics_carry_no_namespace_key_token_or_credential(tmp_path: Path, cleanup: ExitStack) -> None:
    password = "redis-" + "q" * 24
    secret_ns = "tenant-acme/llama-secret-finetune"
    redis = RedisProcess(password=password).start()
    cleanup.callback(redis.close)
    node = start_node(tmp_path, name="met", redis_url=redis.url,
                      extra_args=[*token_args(tmp_path), "--metrics-port", "0"])  # fmt: skip
    cleanup.callback(node.close)
    chain = [key(i, "met") for i in range(3)]
    with KVStoreClient(node.addr, timeout=30, security=ClientSecurity(token=WRITE)) as kv:
        kv.put(secret_ns, LAYOUT, chain, [page(h) for h in chain])
        kv.get(secret_ns, chain)
        wait_for(lambda: kv.stats().index.connected, what="index link")  # type: ignore[union-attr]
    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "kvstore_tier_hits_total" in text  # it is the real endpoint
    for secret in (secret_ns, "tenant-acme", chain[0].hex(), chain[0].hex()[:16], WRITE, READ, password):
        assert secret not in text, secret


def test_serve_help_lists_what_read_tokens_may_do() -> None:
    """`kvstore serve --help` names exactly what a read-only token may call (SECURITY.md, round 3, finding 7d: it listed
    Prefetch, which the node refuses to read tokens)."""
    import subprocess
    import sys

    from kvstore.security import WRITE_METHODS

    out = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "serve", "--help"], capture_output=True,
                         text=True, timeout=60, check=True, env={"COLUMNS": "400", "PATH": "/usr/bin:/bin"}).stdout  # fmt: skip
    line = next(x for x in out.splitlines() if "--auth-read-tokens-file" in x)
    assert "Prefetch" not in line and all(m in line for m in ("Lookup", "Get", "Stats", "Report"))
    assert "Prefetch" in WRITE_METHODS  # the node's rule the help text follows
