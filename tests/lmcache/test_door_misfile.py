"""A misfiled page is a miss through both LMCache doors, never another page's bytes (DESIGN.md §8: a page's
checksum binds its namespace and key as well as its bytes).

Each test stores chunks through the door on a node with NVMe, stops the node cleanly (its DRAM pages spill to
NVMe), rewrites two pages' slot headers so that each claims the other's key (devkit/slot_edits.misfile: every
header re-sealed, both payloads intact, as a metadata bug or a slot reused after a crash would leave them),
restarts the node on the same files and port, and loads through the door's own API, as the engine would:
- each misfiled chunk is a miss (the node's index still lists it: the headers say so; the checksum does not);
- the node counts both (its NVMe tier's `checksum_failures`) and drops them: a miss from then on;
- a chunk the edit left alone loads bit-exact.
The L2 adapter's loads cross the TCP plane (received into LMCache's objects, verified by the client); the legacy
plugin's default plane on this host is the same-host one (copied into the objects by the node as it verifies).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from devkit.slot_edits import PageId, misfile
from kvstore.cli.launch import NodeProcess
from kvstore.cli.waits import free_port
from kvstore.integrations.lmcache_mapping import page_key
from kvstore.names import TierKind
from kvstore.stats import NodeStats
from tests.lmcache.conftest import key, plugin_config, start_node
from tests.security.conftest import wait_for

pytest.importorskip("lmcache", reason="LMCache is an optional extra: ./dev test installs it")

from kvstore.integrations.lmcache_l2_mapping import l2_page_key  # imports LMCache
from tests.lmcache.test_l2_adapter import (
    MODEL,
    NS,
    RANK,
    keys,
    load,
    lookup,
    make,
    node_stats,
    objects,
    raw,
    store,
)
from tests.lmcache.test_plugin import NS as PLUGIN_NS
from tests.lmcache.test_plugin import REMOTE, chunks, put_and_wait, release

TRANSPORTS = ["auto", "grpc", "tcp", "shm"]  # each door's `transport` setting (auto: its default)


def nvme_failures(st: NodeStats) -> int:
    return next(t.counters.checksum_failures for t in st.tiers if t.tier is TierKind.NVME)


def misfiled_restart(node: NodeProcess, nvme: Path, pairs: list[tuple[PageId, PageId]]) -> None:
    """Stop the node cleanly, file each pair's A bytes as B and B's as A, start it again on the same files and
    port (NodeProcess.restart)."""

    def edit() -> None:
        for a, b in pairs:
            misfile(nvme, a, b)

    node.restart(edit=edit)
    assert nvme_failures(node_stats(node)) == 0  # counters start at zero: what follows is the loads' doing


def test_l2_adapter_misfiled_pages_are_misses_counted_and_dropped(tmp_path: Path) -> None:
    node = start_node(tmp_path, dram_pages=1, nvme_pages=32, port=free_port())  # the chunks live on NVMe
    made: list[Any] = []

    def adapter(**params: object) -> Any:
        made.append(make({"target": node.addr, **params}))  # as `lmcache server --l2-adapter JSON` makes it
        return made[-1]

    try:
        ks, src = keys(2 * len(TRANSPORTS) + 1, 700), objects(2 * len(TRANSPORTS) + 1, seed=70)
        assert store(adapter(), ks, src).is_successful()
        pages = [(NS, l2_page_key(MODEL, RANK, 0, k.chunk_hash)) for k in ks]
        pairs = [(2 * i, 2 * i + 1) for i in range(len(TRANSPORTS))]  # one pair of chunks per transport
        misfiled_restart(node, tmp_path / "nvme-n0", [(pages[i], pages[j]) for i, j in pairs])

        for transport, pair in zip(TRANSPORTS, pairs, strict=True):
            a = adapter(transport=transport)
            before = nvme_failures(node_stats(node))
            for i in pair:
                # LMCache's MP server asks lookup-and-lock, then loads what it was told is there.
                assert lookup(a, [ks[i]]) == [0], "the recovered index lists the page: its header claims it"
                assert load(a, [ks[i]], objects(1)) == [], f"{transport}: chunk {i} is misfiled, must be a miss"
                a.submit_unlock([ks[i]])
            assert a.report_status()["is_healthy"], transport  # a miss for the page's sake, not a node down
            wait_for(lambda: nvme_failures(node_stats(node)) == before + 2,  # noqa: B023  # waited for here
                     what=f"{transport}: both misfiled pages counted by the node")  # fmt: skip
            assert [lookup(a, [ks[i]]) for i in pair] == [[], []], "dropped by the node: never found again"

        kept = ks[-1:]
        for transport in TRANSPORTS:  # the chunk the edits left alone: bit-exact through every transport
            dst = objects(1)
            assert load(adapter(transport=transport), kept, dst) == [0] and raw(dst) == raw(src[-1:]), transport
        assert nvme_failures(node_stats(node)) == 2 * len(TRANSPORTS)
    finally:
        for a in made:
            a.close()
        node.close()


def test_legacy_plugin_misfiled_chunks_are_misses_counted_and_dropped(tmp_path: Path,
                                                                      storage_managers: Callable[..., Any]) -> None:  # fmt: skip
    node = start_node(tmp_path, dram_pages=2, nvme_pages=32, port=free_port())
    try:
        url = f"kvstore://{node.addr}"
        writer = storage_managers(plugin_config(url))
        ks = [key(800 + i) for i in range(2 * len(TRANSPORTS) + 1)]
        objs, data = chunks(writer, len(ks), seed=80)
        put_and_wait(writer, ks, objs)
        release(objs)
        pages = [(PLUGIN_NS, page_key(k.to_string())) for k in ks]
        pairs = [(2 * i, 2 * i + 1) for i in range(len(TRANSPORTS))]
        misfiled_restart(node, tmp_path / "nvme-n0", [(pages[i], pages[j]) for i, j in pairs])

        kept = ks[-1:]
        for transport, pair in zip(TRANSPORTS, pairs, strict=True):
            sm = storage_managers(plugin_config(url, transport=transport))  # an engine: nothing in LMCache's CPU
            before = nvme_failures(node_stats(node))
            for i in pair:
                assert sm.batched_contains([ks[i]])[0] == 1, "the recovered index lists the chunk: its header says so"
                assert sm.batched_get([ks[i]], location=REMOTE) == [None], f"{transport}: chunk {i} must be a miss"
            wait_for(lambda: nvme_failures(node_stats(node)) == before + 2,  # noqa: B023  # waited for here
                     what=f"{transport}: both misfiled pages counted by the node")  # fmt: skip
            assert [sm.batched_contains([ks[i]])[0] for i in pair] == [0, 0], "dropped by the node: never found again"
            got = sm.batched_get(kept, location=REMOTE)
            assert [bytes(o.byte_array) for o in got] == data[-1:], transport  # the chunk left alone: bit-exact
            release(got)
        assert nvme_failures(node_stats(node)) == 2 * len(TRANSPORTS)
    finally:
        node.close()
