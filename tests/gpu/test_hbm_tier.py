"""The HBM tier on a real CUDA device: pages put for HBM are promoted there, read back verified on every plane,
and a node restart keeps nothing there it cannot prove (HBM is not persistent). Skipped without CuPy and a GPU."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.names import TierKind
from kvstore.tiers.hbm import cuda_unavailable_reason
from tests.integration.conftest import LAYOUT, NS, PAGE, SLOT, key, page

REASON = cuda_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"needs CUDA through CuPy: {REASON}")]


def _wait_in(kv: KVStoreClient, hashes: list[bytes], tier: TierKind) -> None:
    for _ in range(600):  # bounded: 60 s
        res = kv.lookup_detail(NS, hashes)
        if res.matched == len(hashes) and all(t is tier for t in res.tiers):
            return
        time.sleep(0.1)
    raise AssertionError(f"not all in {tier.label}: {kv.lookup_detail(NS, hashes).tiers}")


def test_pages_put_for_hbm_are_served_from_it_on_every_plane(tmp_path: Path) -> None:
    hashes = [key(i, "hbm") for i in range(64)]
    node = NodeProcess(dram_bytes=128 * SLOT, max_page_bytes=PAGE, node_id="hbm",
                       extra_args=["--hbm-bytes", str(256 * SLOT)]).start()  # fmt: skip
    with contextlib.closing(node):
        with KVStoreClient(node.addr, timeout=60, transport="grpc") as kv:
            hbm = next(t for t in kv.stats().tiers if t.tier is TierKind.HBM)
            assert hbm.available and hbm.capacity_bytes >= 256 * PAGE, hbm.detail
            kv.put(NS, LAYOUT, hashes, [page(h) for h in hashes], target_tier=TierKind.HBM)
            _wait_in(kv, hashes, TierKind.HBM)
        for plane in ("grpc", "tcp", "shm"):
            with KVStoreClient(node.addr, timeout=60, transport=plane) as kv:
                got = kv.get_pages(NS, hashes, promote=False)
                assert [bytes(p.data) for p in got] == [page(h) for h in hashes], plane
                assert {p.tier for p in got} == {TierKind.HBM}, plane
                buf = kv.shared_buffer(len(hashes) * PAGE)
                views = buf.pages(PAGE, len(hashes))
                refs = kv.get_into(NS, hashes, views, promote=False)
                assert len(refs) == len(hashes) and [bytes(v) for v in views] == [page(h) for h in hashes], plane
                buf.close()
        with KVStoreClient(node.addr, timeout=60) as kv:
            hbm = next(t for t in kv.stats().tiers if t.tier is TierKind.HBM)
            assert hbm.counters.hits >= 6 * len(hashes) and hbm.counters.checksum_failures == 0
