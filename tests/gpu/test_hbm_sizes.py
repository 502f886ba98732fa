"""Pages of every size in the HBM tier (DESIGN.md §5.3) on a real CUDA device: small and large pages promoted
into one device allocation each take their own size, are read back verified from device memory, and leave
it by demotion intact. TierManager with real media; skipped without CuPy and a GPU."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvstore.manager import TierManager
from kvstore.names import TierKind
from kvstore.tiers.hbm import cuda_unavailable_reason
from tests.unit.test_manager_sizes import BIG, CHUNK, NS_BIG, NS_SMALL, SMALL, SMALL_SLOT, config, put, served
from tests.unit.test_manager_sizes import key as page_key

REASON = cuda_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"needs CUDA through CuPy: {REASON}")]


def test_small_and_big_pages_share_hbm_at_their_own_size(tmp_path: Path) -> None:
    cfg = config(tmp_path, dram_chunks=8)
    cfg.hbm_bytes = 3 * CHUNK

    async def main() -> None:
        mgr = TierManager(cfg)
        await mgr.start()
        try:
            await put(mgr, NS_SMALL, SMALL, list(range(40)))
            await put(mgr, NS_BIG, BIG, [0])
            keys = [(NS_SMALL, page_key(i)) for i in range(40)] + [(NS_BIG, page_key(0))]
            for k in keys:  # promote each into HBM (two chunks of 68 KiB slots and one 2 MiB slot)
                entry = mgr.table.get(k)
                assert entry is not None
                assert await mgr.mover.promote(entry, TierKind.HBM, admission=False)
            hbm = mgr.table.tiers[TierKind.HBM]
            assert hbm.pages == 41 and hbm.alloc.used_bytes == 40 * SMALL_SLOT + CHUNK
            assert hbm.alloc.free_chunks == 0
            assert await served(mgr, NS_SMALL, SMALL, list(range(40))) == list(range(40))  # from device memory
            assert await served(mgr, NS_BIG, BIG, [0]) == [0]
            assert mgr.stats().tiers[0].counters.hits == 41 and mgr.stats().tiers[0].counters.checksum_failures == 0
            assert await put(mgr, NS_BIG, BIG, [1], target=TierKind.HBM) == (1, 0)  # needs a chunk: one is emptied
            await asyncio.sleep(0)
            for _ in range(100):  # the promotion runs in the background (bounded wait)
                if (e := mgr.table.get((NS_BIG, page_key(1)))) is not None and e.tier is TierKind.HBM:
                    break
                await asyncio.sleep(0.05)
            assert await served(mgr, NS_BIG, BIG, [0, 1]) == [0, 1]
            assert await served(mgr, NS_SMALL, SMALL, list(range(40))) == list(range(40))  # demoted intact
        finally:
            await mgr.close()

    asyncio.run(asyncio.wait_for(main(), 120))
