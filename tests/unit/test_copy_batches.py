"""Copies into a caller's memory done in batches (IoPool.copy_many) and the Get that leases resident pages a group
at a time (Reader.get with destinations): results in order, failures per page, cancellation that waits for the
threads, verification in the copying pass, and every lease released however the Get ends. Also the put side's
one-pass copy (the slot hashed as it is written), checksums a writer declares after the bytes, and the writer's
checksums hashed side by side."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import mmap
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from kvstore.client.planes import shm as client_shm
from kvstore.config import NodeConfig
from kvstore.errors import DataLoss, ProtocolError
from kvstore.layout import DType, PageLayout
from kvstore.manager import TierManager
from kvstore.manager.io import IoPool, cut, slices
from kvstore.manager.put import DeclaredLater
from kvstore.memtune import usable_cores
from kvstore.names import TierKind
from kvstore.pageformat import (
    HEADER_BYTES,
    ChecksumForm,
    checksum_into,
    copy_checksum_dest,
    payload_checksum,
    wire_checksum,
)
from kvstore.wire import PutOpen

LAYOUT = PageLayout(DType.UINT8, 1, 1, 1 << 19, 1)  # 512 KiB pages: a batch of 4 is past INLINE_COPY_BYTES
PAGE = LAYOUT.page_bytes
SLOT = HEADER_BYTES + PAGE
NS = "test/copies"


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def page(i: int) -> bytes:
    return hashlib.sha256(key(i)).digest() * (PAGE // 32)


def run(
    fn: Callable[[TierManager], Awaitable[None]], tmp_path: Path, dram_pages: int = 16, nvme_pages: int = 0
) -> None:
    cfg = NodeConfig(dram_bytes=dram_pages * SLOT, nvme_path=str(tmp_path / "nvme") if nvme_pages else None,
                     nvme_bytes=nvme_pages * SLOT, max_page_bytes=PAGE)  # fmt: skip

    async def main() -> None:
        mgr = TierManager(cfg)
        await mgr.start()
        try:
            await fn(mgr)
        finally:
            await mgr.close()

    asyncio.run(asyncio.wait_for(main(), 60))


async def put(mgr: TierManager, ids: list[int]) -> None:
    txn = mgr.begin_put(PutOpen(NS, LAYOUT))
    for i in ids:
        view = await txn.add_page(key(i), PAGE, 0)
        if view is not None:
            view[:] = page(i)
            view.release()
    await txn.commit()


def destinations(n: int) -> tuple[mmap.mmap, list[memoryview]]:
    m = mmap.mmap(-1, n * PAGE)
    view = memoryview(m)
    return m, [view[i * PAGE : (i + 1) * PAGE] for i in range(n)]


def pairs(n: int, size: int) -> tuple[list[bytes], list[bytearray], list[tuple[memoryview, memoryview]]]:
    srcs = [os.urandom(size) for _ in range(n)]
    dsts = [bytearray(size) for _ in range(n)]
    return srcs, dsts, [(memoryview(s), memoryview(d)) for s, d in zip(srcs, dsts, strict=True)]


def test_cut_and_slices_keep_order_and_cover_everything() -> None:
    assert cut(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert cut([1], 4) == [[1]]
    views = [(memoryview(bytes(n)), memoryview(bytes(n))) for n in (3, 3, 5, 1, 9)]
    runs = slices(views, 6)
    assert [[len(s) for s, _ in r] for r in runs] == [[3, 3], [5, 1], [9]]


def test_a_small_batch_is_copied_in_order_and_a_failure_fails_its_own_page() -> None:
    async def main() -> None:
        pool = IoPool(2)
        try:
            srcs, dsts, batch = pairs(3, 1000)
            batch.insert(1, (memoryview(bytes(2000)), memoryview(bytearray(10))))  # cannot hold it
            out = await pool.copy_many(checksum_into, batch)
            assert [out[0], out[2], out[3]] == [payload_checksum(s) for s in srcs]
            assert isinstance(out[1], ValueError)
            assert [bytes(d) for d in dsts] == srcs
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_large_batch_is_cut_into_parts_side_by_side() -> None:
    """The loop copies the first part and pool threads the others, results in order."""

    async def main() -> None:
        pool = IoPool(4)
        pool.parts = 3
        try:
            srcs, dsts, batch = pairs(9, 1 << 20)
            where: dict[int, int] = {}  # source address -> the thread that copied it

            def copy(src: memoryview, dest: memoryview) -> int:
                where[id(src)] = threading.get_ident()
                return checksum_into(src, dest)

            out = await pool.copy_many(copy, batch)
            assert out == [payload_checksum(s) for s in srcs]
            assert [bytes(d) for d in dsts] == srcs
            by = [where[id(src)] for src, _ in batch]
            assert by[:3] == [threading.get_ident()] * 3  # the loop took the first part
            assert threading.get_ident() not in by[3:]  # pool threads took the others (one handoff each)
            assert len(set(by[3:6])) == len(set(by[6:])) == 1
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_cancelled_batch_returns_only_once_the_threads_copies_ended() -> None:

    async def main() -> None:
        pool = IoPool(2)
        pool.parts = 2
        try:
            _, _, batch = pairs(2, 8 << 20)
            ended: list[bool] = []

            def slow(src: memoryview, dest: memoryview) -> int:
                if threading.current_thread() is not threading.main_thread():
                    time.sleep(0.3)
                    ended.append(True)
                return checksum_into(src, dest)

            task = asyncio.create_task(pool.copy_many(slow, batch))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert ended == [True]  # the cancellation waited for the thread's copy
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_get_into_destinations_copies_verifies_and_releases(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(8)))
        _m, into = destinations(9)
        hashes = [key(i) for i in range(8)] + [key(99)]  # the last one is not stored
        got = [(lease.hash, lease.tier) async for lease in mgr.get(NS, hashes, promote=False, into=into)]
        assert got == [(key(i), TierKind.DRAM) for i in range(8)]
        assert [bytes(v) for v in into[:8]] == [page(i) for i in range(8)]
        assert all(mgr.entry(NS, key(i)).readers == 0 for i in range(8))  # type: ignore[union-attr]
        dram = mgr.stats().tiers[1].counters
        assert dram.hits == 8 and dram.bytes_out == 8 * PAGE
        for v in into:
            v.release()

    run(body, tmp_path)


def test_a_get_closed_early_releases_every_lease_of_its_group(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(8)))
        _m, into = destinations(8)
        gen = mgr.get(NS, [key(i) for i in range(8)], promote=False, into=into)
        first = await gen.__anext__()
        assert first.hash == key(0)
        await gen.aclose()  # the caller hangs up after one page
        assert all(mgr.entry(NS, key(i)).readers == 0 for i in range(8))  # type: ignore[union-attr]
        assert mgr.stats().tiers[1].counters.hits == 1  # only the page handed out counts
        for v in into:
            v.release()

    run(body, tmp_path)


def test_a_damaged_page_in_a_group_ends_the_prefix_and_is_dropped(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(6)))
        entry = mgr.entry(NS, key(3))
        assert entry is not None
        slot = mgr.medium(TierKind.DRAM).view(entry.slot, entry.used_len)
        slot[HEADER_BYTES + 100] ^= 0xFF  # bit rot in DRAM
        slot.release()
        _m, into = destinations(6)
        got = [lease.hash async for lease in mgr.get(NS, [key(i) for i in range(6)], promote=False, into=into)]
        assert got == [key(i) for i in range(3)]
        assert mgr.entry(NS, key(3)) is None  # dropped
        assert mgr.stats().tiers[1].counters.checksum_failures == 1
        assert all(mgr.entry(NS, key(i)).readers == 0 for i in (0, 1, 2, 4, 5))  # type: ignore[union-attr]
        for v in into:
            v.release()

    run(body, tmp_path)


def test_a_copied_get_feeds_the_fetch_estimate_and_one_closed_early_does_not(tmp_path: Path) -> None:
    """A Get with destinations is timed like every Get (Lookup's fetch estimate), its batch's copy counted as
    transfer; one its caller closed early says nothing about the rate."""

    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(8)))
        hashes = [key(i) for i in range(8)]
        _m, into = destinations(8)
        gen = mgr.get(NS, hashes, promote=False, into=into)
        await gen.__anext__()
        await gen.aclose()
        assert not any(f.measured for f in mgr.lookup(NS, hashes).fetch)
        assert len([lease async for lease in mgr.get(NS, hashes, promote=False, into=into)]) == 8
        (dram,) = mgr.lookup(NS, hashes).fetch
        assert dram.tier == TierKind.DRAM and dram.measured and dram.bytes == 8 * PAGE
        for v in into:
            v.release()

    run(body, tmp_path)


def test_a_get_into_destinations_over_dram_and_nvme_pages(tmp_path: Path) -> None:
    """Resident pages go as a group; from the first page on NVMe the rest goes page by page, and lands too."""

    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(10)))  # 4 DRAM slots: the first pages were demoted to NVMe
        order = [6, 7, 8, 9, 0, 1, 6, 2]
        tiers = [mgr.entry(NS, key(i)).tier for i in order]  # type: ignore[union-attr]
        assert TierKind.NVME in tiers and tiers[0] == TierKind.DRAM
        _m, into = destinations(len(order))
        got = [lease.hash async for lease in mgr.get(NS, [key(i) for i in order], promote=False, into=into)]
        assert got == [key(i) for i in order]
        assert [bytes(v) for v in into] == [page(i) for i in order]
        for v in into:
            v.release()

    run(body, tmp_path, dram_pages=4, nvme_pages=32)


def test_copy_checksum_dest_hashes_what_landed() -> None:
    src = memoryview(os.urandom(3 * (1 << 18) + 5))
    dest = memoryview(bytearray(len(src)))
    assert copy_checksum_dest(src, dest) == payload_checksum(dest) == payload_checksum(src)
    with pytest.raises(ValueError, match="destination"):
        copy_checksum_dest(src, memoryview(bytearray(len(src) + 1)))


def test_a_put_whose_filled_checksum_disagrees_with_the_writer_is_data_loss(tmp_path: Path) -> None:
    """A plane that hashed the slot as it filled it hands that checksum over; it is checked like any other."""

    async def body(mgr: TierManager) -> None:
        op = PutOpen(NS, LAYOUT, checksums=ChecksumForm.KEYED)
        txn = mgr.begin_put(op)
        view = await txn.add_page(key(1), PAGE, wire_checksum(NS, key(1), page(1)))
        assert view is not None
        view[:] = page(2)  # not what the writer declared
        txn.filled(copy_checksum_dest(memoryview(page(2)), view))
        view.release()
        with pytest.raises(DataLoss):
            await txn.commit()
        assert mgr.entry(NS, key(1)) is None
        txn = mgr.begin_put(op)
        view = await txn.add_page(key(1), PAGE, wire_checksum(NS, key(1), page(1)))
        assert view is not None
        txn.filled(copy_checksum_dest(memoryview(page(1)), view))
        view.release()
        assert await txn.commit() == (1, 0)

    run(body, tmp_path)


@pytest.mark.parametrize("declared", ["matching", "one wrong", "never came"])
def test_checksums_declared_after_the_bytes_publish_nothing_before_they_came_and_matched(
    tmp_path: Path, declared: str
) -> None:
    """A Put whose checksums come after its pages' bytes (the same-host plane's PUT_SUMS), in a stream larger
    than the staging tier (its first group would be published mid-stream): no page is visible before the
    checksums came; all are stored when they match; one wrong, or none coming, stores nothing."""

    async def body(mgr: TierManager) -> None:
        n = 6  # DRAM holds 4: the stream outgrows it
        txn = mgr.begin_put(PutOpen(NS, LAYOUT, checksums=ChecksumForm.KEYED))
        sums: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()

        async def stream() -> tuple[int, int]:
            for i in range(n):
                view = await txn.add_page(key(i), PAGE, DeclaredLater(sums, i))
                assert view is not None
                txn.filled(copy_checksum_dest(memoryview(page(i)), view))
                view.release()
            return await txn.commit()

        task = asyncio.create_task(stream())
        for _ in range(20):  # bounded: the stream reaches its first group's publish and waits there
            await asyncio.sleep(0.01)
        assert not task.done()
        assert all(mgr.entry(NS, key(i)) is None for i in range(n))  # copied and hashed, none visible
        right = [wire_checksum(NS, key(i), page(i)) for i in range(n)]
        if declared == "matching":
            sums.set_result(right)
            assert await task == (n, 0)
            assert mgr.entry(NS, key(n - 1)) is not None
            return
        if declared == "one wrong":
            sums.set_result([*right[:1], wire_checksum(NS, key(1), page(9)), *right[2:]])
        else:
            sums.set_exception(ProtocolError("no SUMS came"))
        with pytest.raises(DataLoss if declared == "one wrong" else ProtocolError):
            await task
        assert all(mgr.entry(NS, key(i)) is None for i in range(n))
        txn = mgr.begin_put(PutOpen(NS, LAYOUT))  # every staged slot was given back: the tier takes 4 pages
        for i in range(4):
            view = await txn.add_page(key(i), PAGE, 0)
            assert view is not None
            view[:] = page(i)
            view.release()
        assert await txn.commit() == (4, 0)

    run(body, tmp_path, dram_pages=4)


@pytest.mark.parametrize("cores", [1, 2, 8])
def test_a_writers_checksums_are_the_same_hashed_side_by_side(cores: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_shm, "usable_cores", lambda: cores)
    pages = [os.urandom(1 << 20) for _ in range(6)]
    hashes = [key(i) for i in range(6)]
    sums = client_shm.declared_checksums(NS, hashes, [len(p) for p in pages], pages)
    assert sums == [wire_checksum(NS, h, p) for h, p in zip(hashes, pages, strict=True)]


def test_usable_cores_are_this_process_affinity() -> None:
    assert usable_cores() >= 1
    with contextlib.suppress(AttributeError):
        assert usable_cores() == len(os.sched_getaffinity(0))
