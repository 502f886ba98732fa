"""A page damaged in the node's DRAM after it was put (bytes flipped in the live slab) never reaches a caller
as data, on every plane (DESIGN.md §8, one pass per byte):
- across a network plane (gRPC streams, TCP, UCX) the node does not re-hash the DRAM page; the client's
  check on arrival catches it, the call is a miss from that page on, and the client reports the page: the
  node verifies its own copy, finds it bad, drops it and counts it;
- on the same-host plane the node verifies as it copies into the caller's memory: it drops and counts it;
- a damaged page nobody reads is found by the scrubber.
The next Get is a clean miss from the dropped page on, and the pages before it are served intact."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.faults import flip_in_slab
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.names import TierKind
from kvstore.wire.ucx import ucxx_installed
from tests.integration.conftest import LAYOUT, NS, key, page, start_node

PLANES = ["grpc", "shm", "tcp", *(["ucx"] if ucxx_installed() else [])]
NETWORK = {"grpc", "tcp", "ucx"}


@pytest.fixture
def node(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[NodeProcess]:
    callspec = getattr(request.node, "callspec", None)
    plane = callspec.params.get("plane", "grpc") if callspec is not None else "grpc"
    n = start_node(
        tmp_path,
        dram_pages=16,
        extra_args=["--ucx"] if plane == "ucx" else [],
        env={"UCX_NET_DEVICES": "lo", "KVSTORE_SCRUB_BYTES_PER_SECOND": "0"},  # no scrubber here: reads find it
    )
    try:
        yield n
    finally:
        n.close()


def dram(kv: KVStoreClient) -> object:
    return next(t for t in kv.stats().tiers if t.tier is TierKind.DRAM)


@pytest.mark.parametrize("plane", PLANES)
def test_a_page_damaged_in_dram_is_a_miss_reported_dropped_and_counted(node: NodeProcess, plane: str) -> None:
    chain = [key(i, f"rot-{plane}") for i in range(3)]
    with KVStoreClient(node.addr, timeout=20, transport=plane) as kv:
        kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
        assert node.proc is not None
        flip_in_slab(node.proc.pid, page(chain[1]), chain[1], at=100)  # one bit of page 1's payload, in the slab
        got = kv.get(NS, chain)
        assert [bytes(p) for p in got] == [page(chain[0])]  # page 0 intact; page 1 never handed out
        stats = kv.stats()
        assert dram(kv).counters.checksum_failures == 1  # found bad on the node (verified there), dropped
        if plane in NETWORK:  # the client caught it on arrival and reported it; the node confirmed it
            assert (stats.corrupt_reports, stats.corrupt_confirmed) == (1, 1)
        else:  # the same-host plane: the node verified as it copied; nothing to report
            assert (stats.corrupt_reports, stats.corrupt_confirmed) == (0, 0)
        assert kv.lookup(NS, chain) == 1  # gone from the node
        assert [bytes(p) for p in kv.get(NS, chain)] == [page(chain[0])]  # and the next Get is a clean miss
        kv.put(NS, LAYOUT, chain[1:2], [page(chain[1])], parent=chain[0])  # stored again, served again
        assert [bytes(p) for p in kv.get(NS, chain)] == [page(h) for h in chain]


def test_a_report_of_an_intact_page_drops_nothing(node: NodeProcess) -> None:
    """A client that saw damage the node's copy does not have (the wire, its own memory) changes nothing."""
    h = key(0, "intact")
    with KVStoreClient(node.addr, timeout=20) as kv:
        kv.put(NS, LAYOUT, [h], [page(h)])
        reply = kv._run(kv._core.report_corrupt(NS, [h, key(9, "never-stored")]))
        assert (reply.dropped, reply.intact) == (0, 1)
        stats = kv.stats()
        assert (stats.corrupt_reports, stats.corrupt_confirmed) == (2, 0)
        assert [bytes(p) for p in kv.get(NS, [h])] == [page(h)]


def test_the_scrubber_finds_a_damaged_page_nobody_reads(tmp_path: Path) -> None:
    n = start_node(tmp_path, dram_pages=16, env={"KVSTORE_SCRUB_BYTES_PER_SECOND": "16MiB"})
    try:
        chain = [key(i, "scrub") for i in range(4)]
        with KVStoreClient(n.addr, timeout=20) as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
            assert n.proc is not None
            flip_in_slab(n.proc.pid, page(chain[2]), chain[2], at=7)
            deadline = time.monotonic() + 20  # 4 pages of 16 KiB at 16 MiB/s: well under a second per pass
            while kv.lookup(NS, chain) != 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            stats = kv.stats()
            assert kv.lookup(NS, chain) == 2
            assert dram(kv).counters.checksum_failures == 1 and stats.scrubbed_bytes > 0
            assert stats.corrupt_reports == 0  # nobody read it
    finally:
        n.close()
