"""Pages of every size in one node (kvstore/tiers/slots.py, kvstore/manager/placement.py): 64 KiB and 2 MiB
pages side by side in a node started for 2 MiB pages, each taking about its own size; eviction that frees
room of the right size (a chunk at a time between sizes); demotion, warm restart, the scrubber and shares
with mixed sizes; an older build's NVMe files adopted; and no old bytes read as a page header after a
chunk changes size. TierManager against real media (an mmap DRAM slab, NVMe segment files in a temp dir)."""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

from kvstore.config import NodeConfig
from kvstore.layout import DType, PageLayout
from kvstore.manager import TierManager
from kvstore.names import TierKind
from kvstore.pageformat import HEADER_BYTES, PageHeader, identity_digest, payload_checksum, slot_bytes_for
from kvstore.scoping import scope
from kvstore.tiers import nvme_meta
from kvstore.wire import PutOpen
from tests.unit.test_manager import key

SMALL = PageLayout(DType.UINT8, 1, 1, 32 << 10, 1)  # 64 KiB pages (SGLang's regions in the outside report)
BIG = PageLayout(DType.UINT8, 32, 1, 32 << 10, 1)  # 2 MiB pages (LMCache's chunks)
CHUNK = slot_bytes_for(BIG.page_bytes)  # the largest slot: 2 MiB + 4 KiB
SMALL_SLOT = slot_bytes_for(SMALL.page_bytes)  # 68 KiB
PER_CHUNK = CHUNK // SMALL_SLOT  # 30 small slots in a chunk
NS_SMALL, NS_BIG = "sizes/small", "sizes/big"


def data(ns: str, i: int, n: int) -> bytes:
    return random.Random(f"{ns}-{i}").randbytes(n)


def config(tmp_path: Path, dram_chunks: int, nvme_chunks: int = 0, **kw: object) -> NodeConfig:
    return NodeConfig(dram_bytes=dram_chunks * CHUNK, nvme_path=str(tmp_path / "nvme") if nvme_chunks else None,
                      nvme_bytes=nvme_chunks * CHUNK, max_page_bytes=BIG.page_bytes, policy="lru",
                      scrub_bytes_per_second=0, **kw)  # type: ignore[arg-type]  # fmt: skip


def run(fn: Callable[[TierManager], Awaitable[None]], cfg: NodeConfig, **kw: object) -> None:
    async def main() -> None:
        mgr = TierManager(cfg, **kw)  # type: ignore[arg-type]
        await mgr.start()
        try:
            await fn(mgr)
        finally:
            await mgr.close()

    asyncio.run(asyncio.wait_for(main(), 120))


async def put(
    mgr: TierManager, ns: str, layout: PageLayout, ids: list[int], target: TierKind | None = None
) -> tuple[int, int]:
    txn = mgr.begin_put(PutOpen(ns, layout, target_tier=target))
    try:
        for i in ids:
            view = await txn.add_page(key(i), layout.page_bytes, 0)
            if view is not None:
                view[:] = data(ns, i, layout.page_bytes)
        return await txn.commit()
    finally:
        txn.abort()


async def served(mgr: TierManager, ns: str, layout: PageLayout, ids: list[int]) -> list[int]:
    """The ids served back with their own bytes (a Get per page: a miss does not end the others)."""
    out = []
    for i in ids:
        async for lease in mgr.get(ns, [key(i)], promote=False):
            assert bytes(lease.payload) == data(ns, i, layout.page_bytes)
            out.append(i)
    return out


def dram(mgr: TierManager):  # type: ignore[no-untyped-def]
    return mgr.table.tiers[TierKind.DRAM]


def test_small_and_big_pages_each_take_about_their_own_size(tmp_path: Path) -> None:
    """64 small pages and 4 big ones in a node of 8 chunks: 3 chunks of small slots and 4 big ones, nothing
    evicted, everything served. (One slot size per tier held 8 pages here: 60 of them evicted.)"""

    async def body(mgr: TierManager) -> None:
        assert await put(mgr, NS_BIG, BIG, list(range(4))) == (4, 0)
        assert await put(mgr, NS_SMALL, SMALL, list(range(64))) == (64, 0)
        t = dram(mgr)
        assert t.alloc.used_bytes == 64 * SMALL_SLOT + 4 * CHUNK  # each its own size: header + payload
        assert t.alloc.free_chunks == 8 - 4 - 3  # 64 small pages in ceil(64 / 30) chunks
        st = mgr.stats().tiers[1]
        assert (st.pages, st.slots_used, st.counters.evictions) == (68, 68, 0)
        assert st.used_bytes == 64 * SMALL.page_bytes + 4 * BIG.page_bytes
        assert st.capacity_bytes == 8 * CHUNK and st.slot_bytes == CHUNK
        assert st.slots_total == 4 + 3 * PER_CHUNK + 1  # the chunks laid out, and one slot per free chunk
        assert await served(mgr, NS_SMALL, SMALL, list(range(64))) == list(range(64))
        assert await served(mgr, NS_BIG, BIG, list(range(4))) == list(range(4))

    run(body, config(tmp_path, dram_chunks=8))


def test_a_put_of_small_pages_evicts_only_the_big_pages_its_bytes_need(tmp_path: Path) -> None:
    """A tier full of big pages; a Put of 64 small pages (4.3 MiB) evicts 3 big pages (ceil(64 / 30) chunks),
    the coldest, and the 5 others stay and are served."""

    async def body(mgr: TierManager) -> None:
        assert await put(mgr, NS_BIG, BIG, list(range(8))) == (8, 0)
        assert await put(mgr, NS_SMALL, SMALL, list(range(64))) == (64, 0)
        st = mgr.stats().tiers[1]
        assert st.counters.evictions == 3 and st.counters.dropped == 3  # no NVMe here: dropped
        assert await served(mgr, NS_BIG, BIG, list(range(8))) == [3, 4, 5, 6, 7]  # LRU: 0, 1, 2 went
        assert await served(mgr, NS_SMALL, SMALL, list(range(64))) == list(range(64))

    run(body, config(tmp_path, dram_chunks=8))


def test_a_big_page_empties_one_chunk_of_small_ones(tmp_path: Path) -> None:
    """A tier full of small pages; a big page needs a whole chunk: the policy's first victim names the chunk,
    and that chunk's 30 pages (the oldest, put together) are evicted, no other."""

    async def body(mgr: TierManager) -> None:
        n = 4 * PER_CHUNK
        assert await put(mgr, NS_SMALL, SMALL, list(range(n))) == (n, 0)
        assert not dram(mgr).alloc.can_allocate(SMALL_SLOT)
        assert await put(mgr, NS_BIG, BIG, [0]) == (1, 0)
        st = mgr.stats().tiers[1]
        assert st.counters.evictions == PER_CHUNK
        assert await served(mgr, NS_SMALL, SMALL, list(range(n))) == list(range(PER_CHUNK, n))
        assert await served(mgr, NS_BIG, BIG, [0]) == [0]

    run(body, config(tmp_path, dram_chunks=4))


def test_mixed_sizes_demote_and_come_back_after_a_warm_restart(tmp_path: Path) -> None:
    """Small and big pages through a small DRAM tier: demoted into NVMe chunks of their sizes, promoted back,
    spilled at shutdown and recovered by the next start, every byte intact, the scrubber content."""
    cfg = config(tmp_path, dram_chunks=2, nvme_chunks=12)
    cfg.scrub_bytes_per_second = 1 << 30  # the scrubber on, checked below
    small, big = list(range(90)), list(range(6))

    async def first(mgr: TierManager) -> None:
        for lo in range(0, 90, 30):
            await put(mgr, NS_SMALL, SMALL, small[lo : lo + 30])
            await put(mgr, NS_BIG, BIG, big[lo // 15 : lo // 15 + 2])
        nv = mgr.stats().tiers[2]
        assert nv.counters.demotions > 0 and mgr.stats().tiers[1].counters.dropped == 0
        assert await served(mgr, NS_SMALL, SMALL, small) == small  # NVMe pages verified on the way
        assert await served(mgr, NS_BIG, BIG, big) == big
        nvme = mgr.table.tiers[TierKind.NVME]
        sizes = {nvme.alloc.class_of(c) for c in range(nvme.alloc.num_chunks)} - {0}
        assert sizes <= {SMALL_SLOT, CHUNK}
        assert mgr.scrubber is not None  # a pass hashes every DRAM page of both sizes, and each verifies
        in_dram = sum(e.payload_len for e in mgr.table if e.tier is TierKind.DRAM)
        assert await mgr.scrubber.one_pass() == in_dram > 0
        assert mgr.stats().tiers[1].counters.checksum_failures == 0

    run(first, cfg)

    async def second(mgr: TierManager) -> None:
        assert mgr.recovered_pages == 96
        assert mgr.stats().tiers[2].counters.checksum_failures == 0
        assert await served(mgr, NS_SMALL, SMALL, small) == small
        assert await served(mgr, NS_BIG, BIG, big) == big

    run(second, cfg)


def test_the_scrubber_drops_only_the_damaged_page_of_a_shared_chunk(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, NS_SMALL, SMALL, list(range(10)))
        await put(mgr, NS_BIG, BIG, [0])
        victim = mgr.entry(NS_SMALL, key(3))
        assert victim is not None
        dram(mgr).medium.view(victim.slot + HEADER_BYTES + 100, 1)[0] ^= 0xFF
        assert mgr.scrubber is not None
        await mgr.scrubber.one_pass()
        assert mgr.stats().tiers[1].counters.checksum_failures == 1
        assert await served(mgr, NS_SMALL, SMALL, list(range(10))) == [i for i in range(10) if i != 3]
        assert await served(mgr, NS_BIG, BIG, [0]) == [0]

    cfg = config(tmp_path, dram_chunks=4)
    cfg.scrub_bytes_per_second = 1 << 30
    run(body, cfg)


def test_a_tenant_share_counts_bytes_of_each_page_size(tmp_path: Path) -> None:
    """A share of 2 chunks holds 60 small pages of its tenant; more evict its own, never another tenant's."""
    a, b = scope("sizes/small", "tenant-a"), scope("sizes/small", "tenant-b")

    async def body(mgr: TierManager) -> None:
        await put(mgr, b, SMALL, list(range(30)))
        await put(mgr, a, SMALL, list(range(100, 190)))  # 90 pages into a 60-page share
        t = dram(mgr)
        assert t.tenant_bytes["tenant-a"] <= 2 * CHUNK and t.tenant_pages["tenant-a"] == 2 * PER_CHUNK
        assert len(await served(mgr, b, SMALL, list(range(30)))) == 30  # tenant-b untouched
        assert await served(mgr, a, SMALL, list(range(160, 190))) == list(range(160, 190))

    run(body, config(tmp_path, dram_chunks=6), shares={"tenant-a": {TierKind.DRAM: 2 * CHUNK}})


def test_a_tenant_at_its_share_makes_room_for_another_size_among_chunks_it_shares(tmp_path: Path) -> None:
    """Tenant A's small pages all sit in chunks beside tenant B's (no share), and A is at its share when it
    puts a big page: A's own pages give way first (oldest first) until the page fits its share, then a chunk
    is emptied by the rules of a tenant below its share (B, without a share, may lose pages; A never more
    than its share asks)."""
    a, b = scope("sizes/small", "tenant-a"), scope("sizes/small", "tenant-b")
    big_a = scope("sizes/big", "tenant-a")

    async def body(mgr: TierManager) -> None:
        for r in range(3):  # 3 chunks, each half A's pages and half B's
            await put(mgr, a, SMALL, list(range(15 * r, 15 * r + 15)))
            await put(mgr, b, SMALL, list(range(15 * r, 15 * r + 15)))
        t = dram(mgr)
        assert t.alloc.free_chunks == 0 and t.tenant_pages["tenant-a"] == 45
        assert await put(mgr, big_a, BIG, [0]) == (1, 0)
        assert t.tenant_bytes["tenant-a"] <= 45 * SMALL_SLOT  # within its share, the big page included
        left_a = await served(mgr, a, SMALL, list(range(45)))
        assert left_a == list(range(45 - len(left_a), 45))  # its oldest gave way
        assert CHUNK + len(left_a) * SMALL_SLOT <= 45 * SMALL_SLOT < CHUNK + (len(left_a) + 1) * SMALL_SLOT
        assert len(await served(mgr, b, SMALL, list(range(45)))) >= 30  # one chunk's share of B at most

    run(body, config(tmp_path, dram_chunks=3), shares={"tenant-a": {TierKind.DRAM: 45 * SMALL_SLOT}})


def forged_header(ns: str, i: int) -> bytes:
    """A valid header block of a small page `i` of `ns`, whose payload would be the 64 KiB after it: what a
    client could write into a page's payload at a header position of another slot size."""
    h, body = key(i), data(ns, i, SMALL.page_bytes)
    csum = payload_checksum(body) ^ identity_digest(ns, h, SMALL)
    return PageHeader(ns, h, SMALL, SMALL.page_bytes, csum, 10**6).pack() + body


def test_a_chunk_taken_for_another_size_reads_no_old_payload_as_a_header(tmp_path: Path) -> None:
    """A big page whose payload carries a forged small-page header exactly where a chunk of small slots has
    its second header; the big page is deleted and the chunk taken for small pages: the chunk is laid out
    anew (the old header positions erased), so a restart recovers the real small page only."""
    cfg = config(tmp_path, dram_chunks=2, nvme_chunks=1)
    bait = 1000  # the forged page's id

    async def first(mgr: TierManager) -> None:
        txn = mgr.begin_put(PutOpen(NS_BIG, BIG, target_tier=TierKind.NVME))
        view = await txn.add_page(key(0), BIG.page_bytes, 0)
        assert view is not None
        body = bytearray(data(NS_BIG, 0, BIG.page_bytes))
        at = SMALL_SLOT - HEADER_BYTES  # payload offset of the slot's byte SMALL_SLOT: small slot 1's header
        body[at : at + HEADER_BYTES + SMALL.page_bytes] = forged_header(NS_SMALL, bait)
        view[:] = body
        assert await txn.commit() == (1, 0)
        assert mgr.entry(NS_BIG, key(0)).tier is TierKind.NVME  # type: ignore[union-attr]
        assert (await mgr.delete(NS_BIG, [key(0)]))[0] == 1
        assert await put(mgr, NS_SMALL, SMALL, [1], target=TierKind.NVME) == (1, 0)
        path, off = mgr.nvme_slot_location(mgr.entry(NS_SMALL, key(1)).slot)  # type: ignore[union-attr]
        with open(path, "rb") as f:
            f.seek(off + SMALL_SLOT)
            assert f.read(HEADER_BYTES) == bytes(HEADER_BYTES)  # erased when the chunk changed size

    run(first, cfg)

    async def second(mgr: TierManager) -> None:
        assert mgr.recovered_pages == 1 and mgr.entry(NS_SMALL, key(bait)) is None
        assert await served(mgr, NS_SMALL, SMALL, [1]) == [1]

    run(second, cfg)


def test_an_older_builds_fixed_slot_files_are_adopted(tmp_path: Path) -> None:
    """A directory an older build wrote (metadata format 2, a page at the start of each 2 MiB slot): its
    pages are recovered, the tail of a small page's slot (an older big page's payload there, with a
    header in it) is never read as a page, and the metadata file is rewritten in the current format."""
    nvme = tmp_path / "nvme"
    nvme.mkdir(mode=0o700)
    body = {"format": 2, "slot_bytes": CHUNK, "slots_per_segment": 16}
    body["checksum"] = nvme_meta._body_checksum(body)  # type: ignore[assignment]
    (nvme / nvme_meta.META_NAME).write_text(json.dumps(body))
    seg = bytearray(4 * CHUNK)

    def page(slot: int, ns: str, layout: PageLayout, i: int) -> None:
        h, payload = key(i), data(ns, i, layout.page_bytes)
        csum = payload_checksum(payload) ^ identity_digest(ns, h, layout)
        block = PageHeader(ns, h, layout, layout.page_bytes, csum, 1 + i).pack()
        seg[slot * CHUNK : slot * CHUNK + HEADER_BYTES + layout.page_bytes] = block + payload

    page(0, NS_BIG, BIG, 0)
    page(1, NS_SMALL, SMALL, 1)  # slot 1 once held a big page: its old payload lies after the small one
    seg[CHUNK + SMALL_SLOT : CHUNK + SMALL_SLOT + HEADER_BYTES + SMALL.page_bytes] = forged_header(NS_SMALL, 7)
    (nvme / nvme_meta.SEGMENT_FMT.format(0)).write_bytes(bytes(seg))
    os.chmod(nvme, 0o700)

    async def body_(mgr: TierManager) -> None:
        assert mgr.recovered_pages == 2 and mgr.entry(NS_SMALL, key(7)) is None
        assert await served(mgr, NS_BIG, BIG, [0]) == [0]
        assert await served(mgr, NS_SMALL, SMALL, [1]) == [1]
        assert await put(mgr, NS_SMALL, SMALL, [2, 3], target=TierKind.NVME) == (2, 0)  # beside page 1
        assert {mgr.entry(NS_SMALL, key(i)).slot // CHUNK for i in (1, 2, 3)} == {1}  # type: ignore[union-attr]

    run(body_, config(tmp_path, dram_chunks=2, nvme_chunks=4))
    geom = nvme_meta.decode_meta((nvme / nvme_meta.META_NAME).read_bytes())
    assert geom == nvme_meta.Geometry(CHUNK, 16) and not geom.legacy

    async def again(mgr: TierManager) -> None:  # and it restarts as a directory of this build
        assert mgr.recovered_pages == 4 and mgr.entry(NS_SMALL, key(7)) is None
        assert await served(mgr, NS_SMALL, SMALL, [1, 2, 3]) == [1, 2, 3]

    run(again, config(tmp_path, dram_chunks=2, nvme_chunks=4))
