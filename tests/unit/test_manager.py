"""TierManager against real media: an mmap DRAM slab and NVMe segment files in a temp dir."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from kvstore.config import NodeConfig
from kvstore.errors import DataLoss, InvalidArgument, LayoutMismatch, NamespaceNotFound, ResourceExhausted
from kvstore.layout import DType, PageLayout
from kvstore.manager import TierManager
from kvstore.names import TierKind
from kvstore.pageformat import HEADER_BYTES
from kvstore.tiers.nvme import NvmeFormatError
from kvstore.wire import PutOpen

LAYOUT = PageLayout(DType.UINT8, 1, 1, 2048, 1)  # 4096-byte pages
PAGE = LAYOUT.page_bytes
SLOT = HEADER_BYTES + PAGE
NS = "test/ns"


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(h: bytes) -> bytes:
    return random.Random(h).randbytes(PAGE)


def run(fn: Callable[[TierManager], Awaitable[None]], cfg: NodeConfig) -> None:
    async def main() -> None:
        mgr = TierManager(cfg)
        await mgr.start()
        try:
            await fn(mgr)
        finally:
            await mgr.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def config(tmp_path: Path, dram_pages: int = 4, nvme_pages: int = 16, **kw: object) -> NodeConfig:
    return NodeConfig(dram_bytes=dram_pages * SLOT, nvme_path=str(tmp_path / "nvme") if nvme_pages else None,
                      nvme_bytes=nvme_pages * SLOT, max_page_bytes=PAGE, **kw)  # type: ignore[arg-type]  # fmt: skip


async def put(mgr: TierManager, ids: list[int], ns: str = NS, layout: PageLayout = LAYOUT) -> tuple[int, int]:
    txn = mgr.begin_put(PutOpen(ns, layout))
    try:
        for i in ids:
            view = await txn.add_page(key(i), layout.page_bytes, 0)
            if view is not None:
                view[:] = payload(key(i))[: layout.page_bytes]
        return await txn.commit()
    finally:
        txn.abort()  # no-op after a commit; frees staged slots after an error (as the server does)


async def read(mgr: TierManager, ids: list[int], promote: bool = True) -> list[tuple[bytes, TierKind]]:
    out = []
    async for lease in mgr.get(NS, [key(i) for i in ids], promote=promote):
        out.append((bytes(lease.payload), lease.tier))
    return out


def tiers_of(mgr: TierManager, ids: list[int]) -> list[TierKind | None]:
    return [(e.tier if (e := mgr.entry(NS, key(i))) else None) for i in ids]


def test_put_get_lookup_and_dedup(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        assert await put(mgr, [0, 1, 2]) == (3, 0)
        assert await put(mgr, [1, 2, 3]) == (1, 2)  # existing pages are a no-op
        got = await read(mgr, [0, 1, 2, 3])
        assert [p for p, _ in got] == [payload(key(i)) for i in range(4)]
        res = mgr.lookup(NS, [key(0), key(1), key(9), key(2)])
        assert res.matched == 2 and res.namespace_known
        assert mgr.lookup("other", [key(0)]).namespace_known is False

    run(body, config(tmp_path))


def test_demotion_to_nvme_and_promotion_back(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(10)))
        tiers = tiers_of(mgr, list(range(10)))
        assert tiers.count(TierKind.DRAM) == 4 and tiers.count(TierKind.NVME) == 6
        assert tiers[0] is TierKind.NVME  # LRU pages went first
        got = await read(mgr, [0])
        assert got == [(payload(key(0)), TierKind.NVME)]  # found on NVMe...
        assert tiers_of(mgr, [0]) == [TierKind.DRAM]  # ...and promoted
        s = {t.tier: t for t in mgr.stats().tiers}
        assert s[TierKind.NVME].counters.hits == 1 and s[TierKind.DRAM].counters.misses == 1
        assert s[TierKind.DRAM].counters.promotions == 1 and s[TierKind.NVME].counters.demotions >= 6
        got = await read(mgr, [1], promote=False)
        assert got == [(payload(key(1)), TierKind.NVME)] and tiers_of(mgr, [1]) == [TierKind.NVME]

    run(body, config(tmp_path))


def test_exclusive_tiers_capacity_adds_up_then_drops(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(30)))  # 4 DRAM + 16 NVMe = 20 slots
        st = mgr.stats()
        pages = {t.tier: t.pages for t in st.tiers}
        assert pages[TierKind.DRAM] == 4 and pages[TierKind.NVME] == 16
        assert sum(t.counters.dropped for t in st.tiers) == 10
        assert tiers_of(mgr, [0])[0] is None and tiers_of(mgr, [29])[0] is TierKind.DRAM

    run(body, config(tmp_path))


def test_pinned_and_read_pages_are_never_evicted(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, [0, 1])
        assert mgr.pin(NS, [key(0), key(99)]) == (1, 1)
        gen = mgr.get(NS, [key(1)])
        lease = await gen.__anext__()  # page 1 is being read
        await put(mgr, list(range(2, 12)))
        assert tiers_of(mgr, [0, 1]) == [TierKind.DRAM, TierKind.DRAM]
        assert bytes(lease.payload) == payload(key(1))  # untouched while leased
        await gen.aclose()
        assert mgr.unpin(NS, [key(0), key(0)]) == (1, 1)
        await put(mgr, list(range(12, 20)))
        assert tiers_of(mgr, [0, 1]) == [TierKind.NVME, TierKind.NVME]

    run(body, config(tmp_path))


def test_full_with_nothing_evictable_is_resource_exhausted(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, [0, 1])
        mgr.pin(NS, [key(0), key(1)])
        with pytest.raises(ResourceExhausted, match="pinned"):
            await put(mgr, [2])
        assert tiers_of(mgr, [2]) == [None] and mgr.stats().put_rejected == 1
        assert mgr.lookup(NS, [key(0), key(1)]).matched == 2

    run(body, config(tmp_path, dram_pages=2, nvme_pages=0))


def test_pin_lease_expires(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, [0])
        mgr.pin(NS, [key(0)], ttl_seconds=5)
        assert mgr.entry(NS, key(0)).pinned  # type: ignore[union-attr]
        assert mgr.expire_pins(float("inf")) == 1
        assert not mgr.entry(NS, key(0)).pinned  # type: ignore[union-attr]

    run(body, config(tmp_path))


def test_put_transaction_is_atomic(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        txn = mgr.begin_put(PutOpen(NS, LAYOUT))
        v = await txn.add_page(key(0), PAGE, 0)
        v[:] = payload(key(0))  # type: ignore[index]
        v2 = await txn.add_page(key(1), PAGE, 12345)  # wrong declared checksum
        v2[:] = payload(key(1))  # type: ignore[index]
        with pytest.raises(DataLoss, match="checksum"):
            await txn.commit()
        assert mgr.lookup(NS, [key(0)]).matched == 0 and not mgr.lookup(NS, [key(0)]).namespace_known
        assert mgr.stats().tiers[1].slots_used == 0  # staged slots were freed

    run(body, config(tmp_path))


def test_bad_input_changes_nothing(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, [0])
        txn = mgr.begin_put(PutOpen(NS, LAYOUT))
        with pytest.raises(InvalidArgument, match=r"page\.payload_bytes"):
            await txn.add_page(key(1), PAGE - 1, 0)
        with pytest.raises(InvalidArgument, match="32 bytes"):
            await txn.add_page(b"short", PAGE, 0)
        txn.abort()
        with pytest.raises(LayoutMismatch):
            mgr.begin_put(PutOpen(NS, PageLayout(DType.UINT8, 1, 1, 1024, 1)))
        with pytest.raises(InvalidArgument, match="namespace"):
            mgr.begin_put(PutOpen("", LAYOUT))
        with pytest.raises(InvalidArgument, match="max_page_bytes"):
            mgr.begin_put(PutOpen("big", PageLayout(DType.FLOAT32, 1, 1, 4096, 1)))
        with pytest.raises(NamespaceNotFound):
            await read_ns(mgr, "unknown")
        with pytest.raises(InvalidArgument, match=r"hashes\[1\]"):
            mgr.lookup(NS, [key(0), b"x" * 31])
        assert mgr.stats().tiers[1].pages == 1

    async def read_ns(mgr: TierManager, ns: str) -> None:
        async for _ in mgr.get(ns, [key(0)]):
            pass

    run(body, config(tmp_path))


def test_restart_recovers_nvme_and_spilled_dram(tmp_path: Path) -> None:
    cfg = config(tmp_path)

    async def first(mgr: TierManager) -> None:
        await put(mgr, list(range(10)))
        await read(mgr, [0, 1, 2])  # promotions leave shadows that must survive the spill

    async def second(mgr: TierManager) -> None:
        assert mgr.recovered_pages == 10
        got = await read(mgr, list(range(10)))
        assert [p for p, _ in got] == [payload(key(i)) for i in range(10)]

    run(first, cfg)
    run(second, cfg)


def test_restart_without_spill_keeps_only_nvme(tmp_path: Path) -> None:
    cfg = config(tmp_path, spill_on_shutdown=False)

    async def first(mgr: TierManager) -> None:
        await put(mgr, list(range(10)))

    async def second(mgr: TierManager) -> None:
        assert sorted(i for i in range(10) if mgr.entry(NS, key(i))) == list(range(6))

    run(first, cfg)
    run(second, cfg)


def test_deleted_pages_never_come_back(tmp_path: Path) -> None:
    cfg = config(tmp_path)

    async def first(mgr: TierManager) -> None:
        await put(mgr, list(range(10)))
        await read(mgr, [0])  # page 0 now in DRAM with an intact NVMe shadow
        assert await mgr.delete(NS, [key(0), key(5), key(77)]) == (2, 1, 0)

    async def second(mgr: TierManager) -> None:
        assert mgr.entry(NS, key(0)) is None and mgr.entry(NS, key(5)) is None
        assert mgr.entry(NS, key(6)) is not None

    run(first, cfg)
    run(second, cfg)


@pytest.mark.parametrize("promote", [True, False], ids=["promoting-read", "bounce-read"])
def test_corrupt_nvme_slot_is_a_counted_miss(tmp_path: Path, promote: bool) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(6)))
        e = mgr.entry(NS, key(0))
        assert e is not None and e.tier is TierKind.NVME
        path, off = mgr.nvme_slot_location(e.slot)
        with open(path, "r+b") as f:
            f.seek(off + HEADER_BYTES + 100)
            byte = f.read(1)
            f.seek(off + HEADER_BYTES + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert await read(mgr, [0, 1], promote=promote) == []  # stops at the corrupt first page
        nvme = {t.tier: t for t in mgr.stats().tiers}[TierKind.NVME]
        assert nvme.counters.checksum_failures == 1
        assert mgr.entry(NS, key(0)) is None  # dropped, never returned
        assert [p for p, _ in await read(mgr, [1])] == [payload(key(1))]  # its neighbour is fine

    run(body, config(tmp_path))


def test_concurrent_puts_and_gets(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        async def worker(w: int) -> None:
            ids = list(range(w * 5, w * 5 + 5))
            await put(mgr, ids)
            got = await read(mgr, ids)
            for (p, _), i in zip(got, ids, strict=False):
                assert p == payload(key(i))

        await asyncio.gather(*(worker(w) for w in range(4)))
        assert sum(t.pages for t in mgr.stats().tiers) == 20

    run(body, config(tmp_path, dram_pages=6, nvme_pages=32))


def test_prefetch_promotes_in_background(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(8)))
        assert tiers_of(mgr, [0, 1]) == [TierKind.NVME, TierKind.NVME]
        assert mgr.prefetch(NS, [key(0), key(1), key(7), key(99)]) == (2, 1, 1)
        for _ in range(200):
            if tiers_of(mgr, [0, 1]) == [TierKind.DRAM, TierKind.DRAM]:
                break
            await asyncio.sleep(0.01)
        assert tiers_of(mgr, [0, 1]) == [TierKind.DRAM, TierKind.DRAM]
        assert mgr.stats().prefetch_completed == 2

    run(body, config(tmp_path))


def test_hbm_reports_capacity_zero_without_cuda(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        hbm = mgr.stats().tiers[0]
        assert hbm.tier is TierKind.HBM and not hbm.available and hbm.capacity_bytes == 0
        assert hbm.detail  # says why

    run(body, config(tmp_path, hbm_bytes=1 << 20))


def test_many_streams_contending_for_a_small_dram(tmp_path: Path) -> None:
    """More concurrent streams than DRAM slots: streams wait for each other's staged pages, never fail."""

    async def body(mgr: TierManager) -> None:
        async def worker(w: int) -> None:
            ids = list(range(w * 3, w * 3 + 3))
            await put(mgr, ids)
            got = await read(mgr, ids)
            assert [p for p, _ in got] == [payload(key(i)) for i in ids]

        await asyncio.gather(*(worker(w) for w in range(10)))
        assert sum(t.pages for t in mgr.stats().tiers) == 30
        dram = mgr.stats().tiers[1]
        assert dram.slots_used == dram.pages and mgr.stats().put_rejected == 0

    run(body, config(tmp_path, dram_pages=2, nvme_pages=64))


def test_cancelled_read_waits_for_its_io_before_freeing_slots(tmp_path: Path) -> None:
    """A Get cancelled mid-promotion must not free the DRAM slot the I/O thread is still filling."""

    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(6)))  # pages 0 and 1 on NVMe
        nvme = mgr.medium(TierKind.NVME)
        real_read = nvme.read
        io_done: list[bool] = []

        def slow_read(slot: int, into: memoryview) -> None:  # the real read, delayed
            time.sleep(0.3)
            real_read(slot, into)
            io_done.append(True)

        nvme.read = slow_read  # type: ignore[method-assign]
        task = asyncio.create_task(read(mgr, [0]))
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert io_done == [True]  # cancellation waited for the thread
        nvme.read = real_read  # type: ignore[method-assign]
        await put(mgr, [10, 11])
        ids = [10, 11, 0, 1, 2, 3, 4, 5]
        assert [p for p, _ in await read(mgr, ids)] == [payload(key(i)) for i in ids]
        dram = mgr.stats().tiers[1]
        assert dram.slots_used == dram.pages

    run(body, config(tmp_path))


def test_get_reads_ahead_and_releases_everything_when_closed_early(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(12)))  # 0..7 on NVMe
        nvme = mgr.medium(TierKind.NVME)
        real_preadv = nvme._preadv_all  # type: ignore[attr-defined]
        active = [0, 0]  # pages in flight now, most at once (a request may read adjacent slots)

        def slow_preadv(fd: int, parts: list[memoryview], off: int, what: str) -> None:
            pages = -(-sum(p.nbytes for p in parts) // nvme.chunk_bytes)
            active[0] += pages
            active[1] = max(active[1], active[0])
            time.sleep(0.05)
            real_preadv(fd, parts, off, what)
            active[0] -= pages

        nvme._preadv_all = slow_preadv  # type: ignore[attr-defined]
        gen = mgr.get(NS, [key(i) for i in range(8)], promote=False)
        first = await gen.__anext__()
        assert bytes(first.payload) == payload(key(0))
        await gen.aclose()  # the caller hangs up after one page
        assert active[1] > 1  # the following pages were read concurrently
        assert all(mgr.entry(NS, key(i)).readers == 0 for i in range(12))  # type: ignore[union-attr]
        nvme_stats = mgr.stats().tiers[2]
        assert nvme_stats.counters.hits == 1  # only the returned page counts

    run(body, config(tmp_path))


def test_nvme_dir_of_another_geometry_is_refused_untouched(tmp_path: Path) -> None:
    async def first(mgr: TierManager) -> None:
        await put(mgr, list(range(6)))

    run(first, config(tmp_path))
    before = {p.name: p.read_bytes() for p in (tmp_path / "nvme").iterdir()}
    other = NodeConfig(dram_bytes=1 << 20, nvme_path=str(tmp_path / "nvme"), nvme_bytes=1 << 20,
                       max_page_bytes=2 * PAGE)  # fmt: skip
    with pytest.raises(NvmeFormatError, match="max-page-bytes"):
        TierManager(other)
    assert {p.name: p.read_bytes() for p in (tmp_path / "nvme").iterdir()} == before


def slowed_reads(mgr: TierManager, delay: float) -> list[int]:
    """Wrap the real NVMe read with a delay; returns the list of slots read (appended as they finish)."""
    nvme = mgr.medium(TierKind.NVME)
    real_read = nvme.read
    done: list[int] = []

    def slow_read(slot: int, into: memoryview) -> None:
        time.sleep(delay)
        real_read(slot, into)
        done.append(slot)

    nvme.read = slow_read  # type: ignore[method-assign]
    return done


def test_get_during_prefetch_waits_and_reads_once(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(8)))  # 0..3 on NVMe
        reads = slowed_reads(mgr, 0.2)
        assert mgr.prefetch(NS, [key(0)]) == (1, 0, 0)
        assert mgr.prefetch(NS, [key(0)]) == (0, 1, 0)  # already on its way: no second task
        await asyncio.sleep(0.05)  # the prefetch's NVMe read is in flight
        got = await read(mgr, [0])
        assert got == [(payload(key(0)), TierKind.DRAM)]  # waited for the promotion, found it in DRAM
        assert len(reads) == 1  # one NVMe read in all
        st = mgr.stats()
        assert (st.prefetch_issued, st.prefetch_completed, st.prefetch_used, st.prefetch_wasted) == (1, 1, 1, 0)

    run(body, config(tmp_path))


def test_unread_prefetches_count_as_wasted(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(8)))  # 0..3 on NVMe
        mgr.prefetch(NS, [key(0), key(1)])
        for _ in range(200):
            if mgr.stats().prefetch_completed == 2:
                break
            await asyncio.sleep(0.01)
        await read(mgr, [1])  # used
        await put(mgr, list(range(20, 26)))  # pushes page 0 out of DRAM unread: wasted
        st = mgr.stats()
        assert (st.prefetch_used, st.prefetch_wasted) == (1, 1)

    run(body, config(tmp_path))


def test_prefetch_cancelled_at_shutdown_leaves_a_consistent_node(tmp_path: Path) -> None:
    cfg = config(tmp_path)

    async def first(mgr: TierManager) -> None:
        await put(mgr, list(range(10)))
        slowed_reads(mgr, 0.2)
        assert mgr.prefetch(NS, [key(i) for i in range(6)])[0] == 6
        await asyncio.sleep(0.05)  # close() cancels the prefetches mid-I/O

    async def second(mgr: TierManager) -> None:
        got = await read(mgr, list(range(10)))
        assert [p for p, _ in got] == [payload(key(i)) for i in range(10)]

    run(first, cfg)
    run(second, cfg)


@pytest.mark.parametrize("chain", [True, False], ids=["chain-declared", "no-hints"])
def test_chain_hints_reach_the_policy_tails_go_first(tmp_path: Path, chain: bool) -> None:
    """prefix-arc evicts only leaves of the chain forest when it knows the chain: the head (which every
    longer prefix needs) stays while tail blocks go down. Without hints it falls back to recency and the
    oldest block, the head, goes first."""

    async def body(mgr: TierManager) -> None:
        txn = mgr.begin_put(PutOpen(NS, LAYOUT, chain=chain))
        try:
            for i in range(6):  # DRAM holds 4: the stream outgrows it and two blocks are demoted
                view = await txn.add_page(key(i), PAGE, 0)
                view[:] = payload(key(i))  # type: ignore[index]
            await txn.commit()
        finally:
            txn.abort()
        tiers = tiers_of(mgr, list(range(6)))
        assert tiers.count(TierKind.NVME) == 2
        assert tiers[0] is (TierKind.DRAM if chain else TierKind.NVME)
        assert mgr.entry(NS, key(3)).parent == ((NS, key(2)) if chain else None)  # type: ignore[union-attr]
        await read(mgr, [0])
        assert mgr.entry(NS, key(0)).reads == 1  # type: ignore[union-attr]

    run(body, config(tmp_path, policy="prefix-arc"))


def test_bad_parent_hash_is_rejected(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        with pytest.raises(InvalidArgument, match="parent_hash"):
            mgr.begin_put(PutOpen(NS, LAYOUT, parent=b"short", chain=True))

    run(body, config(tmp_path))
