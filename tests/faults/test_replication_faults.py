"""Copies under faults (DESIGN.md §7.3), on real nodes and a real redis-server:

- a copy of a page damaged in its source's DRAM is refused on arrival, counted at the destination, reported to the
  source, which finds its own copy bad and drops it: the damaged bytes are stored nowhere;
- a copy cut short by SIGKILL of its source, or of its destination, leaves no half page anywhere: what the
  destination holds (before and after its restart) is whole pages, each verified;
- a node that restarts after SIGKILL with some pages lost (DRAM) and some recovered (NVMe) is named by the index
  for the recovered ones only: its entries of the old epoch count for nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devkit.faults import flip_in_slab
from kvstore.cli.launch import NodeProcess
from kvstore.cli.redis_procs import RedisProcess
from kvstore.client import KVStoreClient, ReplicateResult
from kvstore.client.cluster import ClusterClient
from kvstore.errors import KVStoreError, NamespaceNotFound
from kvstore.names import TierKind
from tests.integration.conftest import LAYOUT, NS, SLOT, key, page
from tests.security.conftest import wait_for

TTL = 1.5


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    r = RedisProcess().start()
    try:
        yield r
    finally:
        r.close()


def start(tmp_path: Path, url: str, name: str, dram_pages: int = 64) -> NodeProcess:
    return NodeProcess(dram_bytes=dram_pages * SLOT, nvme_path=tmp_path / name, nvme_bytes=64 * SLOT, node_id=name,
                       max_page_bytes=LAYOUT.page_bytes, redis_url=url, extra_args=["--index-ttl", str(TTL)],
                       env={"KVSTORE_SCRUB_BYTES_PER_SECOND": "0"},  # no scrubber: the copy is what finds the damage
                       log_path=tmp_path / f"{name}.log").start()  # fmt: skip


def test_a_copy_of_a_damaged_page_is_refused_counted_and_dropped_at_its_source(
    tmp_path: Path, redis_server: RedisProcess
) -> None:
    src, dst = start(tmp_path, redis_server.url, "s0"), start(tmp_path, redis_server.url, "d0")
    try:
        chain = [key(i, "rot-copy") for i in range(3)]
        with KVStoreClient(src.addr) as s, KVStoreClient(dst.addr) as d:
            s.put(NS, LAYOUT, chain, [page(h) for h in chain])
            assert src.proc is not None
            flip_in_slab(src.proc.pid, page(chain[1]), chain[1], at=100)
            res = d.replicate(NS, chain, "s0", layout=LAYOUT)
            assert res.copied == 1 and res.failed == 2  # page 0 copied; page 1 refused on arrival (and 2 after it)
            rep = d.stats().replication
            assert rep is not None and rep.copy_corrupt == 1 and rep.copies_in == 1
            assert [bytes(p) for p in d.get(NS, chain)] == [page(chain[0])]  # nothing damaged stored here
            stats = s.stats()
            assert stats.corrupt_confirmed == 1  # the source verified its own copy on the report: bad, dropped
            assert s.lookup(NS, chain) == 1
    finally:
        src.close()
        dst.close()


def replicate_in_background(addr: str, chain: list[bytes], source: str) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            with KVStoreClient(addr, timeout=30) as kv:
                out.append(kv.replicate(NS, chain, source, layout=LAYOUT))
        except KVStoreError as exc:
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def whole_pages_only(kv: KVStoreClient, chain: list[bytes]) -> int:
    """What `kv`'s node holds of `chain` is a prefix of whole pages, each verified and equal to the page put, and
    nothing else of the namespace: returns how many."""
    try:
        got = kv.get(NS, chain)
    except NamespaceNotFound:  # nothing of the namespace arrived at all
        assert not any(ns == NS for ns, _, _ in kv.stats().namespaces)
        return 0
    assert [bytes(p) for p in got] == [page(h) for h in chain[: len(got)]]
    held = sum(n for ns, _, n in kv.stats().namespaces if ns == NS)
    assert held == len(got)
    return len(got)


@pytest.mark.parametrize("victim", ["source", "destination"])
def test_a_copy_cut_by_sigkill_leaves_no_half_page(tmp_path: Path, redis_server: RedisProcess, victim: str) -> None:
    src = start(tmp_path, redis_server.url, "s1", dram_pages=1024)
    dst = start(tmp_path, redis_server.url, "d1", dram_pages=1024)
    try:
        chain = [key(i, f"cut-{victim}") for i in range(768)]
        with KVStoreClient(src.addr) as s:
            for a in range(0, len(chain), 256):
                s.put(NS, LAYOUT, chain[a : a + 256], [page(h) for h in chain[a : a + 256]])
        t, out = replicate_in_background(dst.addr, chain, "s1")
        time.sleep(0.05)  # the pull is under way (or done: the outcome below holds either way)
        (src if victim == "source" else dst).kill()
        t.join(60)
        assert not t.is_alive() and len(out) == 1
        if victim == "destination":
            assert isinstance(out[0], KVStoreError)
            dst.start()  # same NVMe directory: what it recovers is whole pages (copies land in DRAM: none)
        else:
            assert isinstance(out[0], ReplicateResult | KVStoreError)
        with KVStoreClient(dst.addr) as d:
            n = whole_pages_only(d, chain)
        if victim == "source" and isinstance(out[0], ReplicateResult):
            assert n == out[0].copied
    finally:
        src.close()
        dst.close()


def test_a_node_restarted_after_sigkill_is_named_only_for_what_it_recovered(
    tmp_path: Path, redis_server: RedisProcess
) -> None:
    node = start(tmp_path, redis_server.url, "r0")
    try:
        durable = [key(i, "durable") for i in range(4)]
        volatile = [key(i, "volatile") for i in range(4)]
        with KVStoreClient(node.addr) as kv:
            kv.put(NS, LAYOUT, durable, [page(h) for h in durable], target_tier=TierKind.NVME)
            kv.put(NS, LAYOUT, volatile, [page(h) for h in volatile])
        with ClusterClient(redis_server.url, local_copies=False) as cc:
            wait_for(lambda: cc.lookup(NS, volatile).matched == 4 and cc.lookup(NS, durable).matched == 4, 10,
                     "the index to list both chains")  # fmt: skip
            node.kill()  # SIGKILL: the DRAM pages are gone, their entries stay in Redis (old epoch)
            node.start()
            wait_for(lambda: any(n.node_id == "r0" and n.alive for n in cc.nodes()), 10, "r0 to register again")
            assert cc.lookup(NS, durable).matched == 4  # recovered from NVMe, republished under the new epoch
            assert cc.lookup(NS, volatile).matched == 0  # the stale entries name it no more
            assert [bytes(p) for p in cc.get(NS, durable)] == [page(h) for h in durable]
    finally:
        node.close()
