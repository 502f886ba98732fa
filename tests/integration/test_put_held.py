"""A Put answers per page whether the node holds it (PutResult.held), on every plane: a page it refused, or that
the same Put stored and then evicted, is not held; what is held is exactly what a Lookup then finds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.wire.ucx import ucxx_installed
from tests.integration.conftest import LAYOUT, NS, key, page, start_node

PLANES = ["grpc", "shm", "tcp", *(["ucx"] if ucxx_installed() else [])]
SLOTS = 8


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """DRAM only, 8 slots, admission on second sight: a page never seen is refused once the tier is full."""
    tmp = tmp_path_factory.mktemp("held")
    args = ["--ucx", "--policy", "second-sight"]
    with contextlib.closing(start_node(tmp, dram_pages=SLOTS, nvme_pages=0, name="held", extra_args=args)) as n:
        yield n


def _on_node(kv: KVStoreClient, hashes: list[bytes]) -> list[bool]:
    return [kv.lookup(NS, [h]) == 1 for h in hashes]


@pytest.mark.parametrize("plane", PLANES)
def test_a_put_says_per_page_what_the_node_kept(full: NodeProcess, plane: str) -> None:
    resident = [key(i, f"held-{plane}") for i in range(SLOTS)]
    fresh = [key(100 + i, f"held-{plane}") for i in range(3)]
    with KVStoreClient(full.addr, timeout=30, transport=plane) as kv:
        first = kv.put(NS, LAYOUT, resident, [page(h) for h in resident], chain=False)
        assert first.held == _on_node(kv, resident)
        mixed = [resident[0], fresh[0], resident[1], fresh[1], fresh[2]]  # seen pages and never-seen ones
        res = kv.put(NS, LAYOUT, mixed, [page(h) for h in mixed], chain=False)
        assert res.held is not None and len(res.held) == len(mixed)
        assert res.held == _on_node(kv, mixed)  # what it says is what a Lookup finds
        assert not all(res.held)  # the never-seen pages were refused by the full tier
        assert res.stored + res.already_present >= sum(res.held)


@pytest.mark.parametrize("plane", PLANES)
def test_a_put_larger_than_the_tier_does_not_claim_what_it_pushed_out(tmp_path: Path, plane: str) -> None:
    hashes = [key(i, f"big-{plane}") for i in range(3 * SLOTS)]
    with (
        contextlib.closing(start_node(tmp_path, dram_pages=SLOTS, nvme_pages=0, name="big", extra_args=["--ucx"])) as n,
        KVStoreClient(n.addr, timeout=30, transport=plane, pages_per_call=len(hashes)) as kv,
    ):
        res = kv.put(NS, LAYOUT, hashes, [page(h) for h in hashes])
        assert res.held == _on_node(kv, hashes)
        assert sum(res.held) <= SLOTS < res.stored  # counted stored, yet most were pushed out by the same Put
