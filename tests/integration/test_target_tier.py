"""Where a Put's pages land (DESIGN.md §5.2; SECURITY.md, round 3, finding 7c): `target_tier=NVME` used to land in DRAM although the proto
says "where new pages land". Now, on every data plane alike (the target is handled once, in the
manager), NVMe-targeted pages are written through to NVMe without taking (or evicting for) a DRAM slot,
are durable when the Put returns (a kill -9 right after loses none), and a node without an NVMe tier
refuses them with INVALID_ARGUMENT naming the field, storing nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.errors import InvalidArgument
from kvstore.names import TierKind
from kvstore.wire.ucx import ucxx_installed
from tests.integration.conftest import LAYOUT, NS, key, page, start_node

PLANES = ["grpc", "shm", "tcp", *(["ucx"] if ucxx_installed() else [])]


def pages_in(kv: KVStoreClient) -> dict[TierKind, int]:
    return {t.tier: t.pages for t in kv.stats().tiers}


def test_nvme_targeted_pages_land_on_nvme_on_every_plane(kv: KVStoreClient) -> None:
    warm = [key(i, f"dram-{kv.plane}") for i in range(8)]  # DRAM is full of other pages (8 slots)
    kv.put(NS, LAYOUT, warm, [page(h) for h in warm])
    before = pages_in(kv)
    chain = [key(i, f"nvme-{kv.plane}") for i in range(5)]
    res = kv.put(NS, LAYOUT, chain, [page(h) for h in chain], target_tier=TierKind.NVME)
    assert (res.stored, res.already_present) == (5, 0)
    assert kv.lookup_detail(NS, chain).tiers == [TierKind.NVME] * 5
    after = pages_in(kv)
    assert after[TierKind.DRAM] == before[TierKind.DRAM] == 8  # no DRAM page was evicted for them
    assert after[TierKind.NVME] == before[TierKind.NVME] + 5
    assert kv.lookup_detail(NS, warm).tiers == [TierKind.DRAM] * 8
    assert [bytes(p) for p in kv.get(NS, chain)] == [page(h) for h in chain]


def test_an_nvme_targeted_put_is_durable_when_it_returns(tmp_path: Path) -> None:
    node = start_node(tmp_path, name="durable")
    chain = [key(i, "durable") for i in range(4)]
    try:
        with KVStoreClient(node.addr, timeout=30) as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain], target_tier=TierKind.NVME)
        node.kill()  # no shutdown spill: only what was durable survives
        node.start()
        with KVStoreClient(node.addr, timeout=30) as kv:
            assert [bytes(p) for p in kv.get(NS, chain)] == [page(h) for h in chain]
    finally:
        node.close()


@pytest.mark.parametrize("plane", PLANES)
def test_a_node_without_nvme_refuses_an_nvme_target_on_every_plane(tmp_path: Path, plane: str) -> None:
    node = NodeProcess(dram_bytes="1MiB", max_page_bytes=LAYOUT.page_bytes, node_id="nonvme",
                       extra_args=["--ucx"] if plane == "ucx" else []).start()  # fmt: skip
    try:
        with KVStoreClient(node.addr, timeout=30, transport=plane) as kv:
            chain = [key(i, "refused") for i in range(2)]
            with pytest.raises(InvalidArgument, match=r"target_tier.*no NVMe tier"):
                kv.put(NS, LAYOUT, chain, [page(h) for h in chain], target_tier=TierKind.NVME)
            assert kv.lookup(NS, chain) == 0 and sum(t.pages for t in kv.stats().tiers) == 0
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])  # the connection is fine for the next Put
            assert kv.lookup_detail(NS, chain).tiers == [TierKind.DRAM] * 2
    finally:
        node.close()
