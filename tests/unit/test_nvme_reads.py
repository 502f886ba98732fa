"""Parallel NVMe reads: batched `read_many` calls from a Get's read-ahead, errors that stay with their own
page, and cancellation that waits for every read in flight (real NVMe segment files in a temp dir)."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from kvstore.manager import TierManager, landing
from kvstore.names import TierKind
from kvstore.pageformat import HEADER_BYTES
from kvstore.tiers import nvme
from kvstore.tiers.base import SlotRead
from kvstore.tiers.nvme import QUEUE_DEPTH, NvmeMedium
from tests.unit.test_manager import NS, PAGE, SLOT, config, key, payload, put, read, run, tiers_of


class Probe:
    """Wraps an NVMe tier's requests (one preadv each, of one slot or of a run of adjacent slots): counts
    requests and pages in flight (most at once), the size of each read_many batch and of each request."""

    def __init__(self, tier: NvmeMedium, delay: float = 0.0) -> None:
        self.tier, self.delay = tier, delay
        self.real_preadv, self.real_many = tier._preadv_all, tier.read_many
        self.lock = threading.Lock()
        self.active = self.most = self.pages = self.most_pages = 0
        self.batches: list[int] = []
        self.requests: list[int] = []  # slots per request
        self.fail_slots: set[int] = set()
        self.slow_slots: set[int] = set()  # these take 1 s longer
        tier._preadv_all = self.preadv_all  # type: ignore[method-assign]
        tier.read_many = self.read_many  # type: ignore[method-assign]

    def preadv_all(self, fd: int, parts: list[memoryview], off: int, what: str) -> None:
        first = off // self.tier.chunk_bytes  # the tests' tiers have one segment file
        slots = set(range(first, first + -(-sum(p.nbytes for p in parts) // self.tier.chunk_bytes)))
        with self.lock:
            self.requests.append(len(slots))
            self.active += 1
            self.pages += len(slots)
            self.most = max(self.most, self.active)
            self.most_pages = max(self.most_pages, self.pages)
        try:
            time.sleep(self.delay + (1.0 if slots & self.slow_slots else 0.0))
            if slots & self.fail_slots:
                raise OSError(f"injected read error on slot {min(slots & self.fail_slots)}")
            self.real_preadv(fd, parts, off, what)
        finally:
            with self.lock:
                self.active -= 1
                self.pages -= len(slots)

    def read_many(self, ops: Sequence[SlotRead], done: Callable[[int], None] | None = None) -> None:
        self.batches.append(len(ops))
        self.real_many(ops, done)  # the real fan-out, through our preadv_all


async def put_to_nvme(mgr: TierManager, n: int) -> list[int]:
    """Put pages 0..n-1 (the DRAM tier is small: most are demoted); the ids of those now on NVMe."""
    ids = list(range(n))
    await put(mgr, ids)
    return [i for i, t in zip(ids, tiers_of(mgr, ids), strict=True) if t is TierKind.NVME]


def nvme_of(mgr: TierManager) -> NvmeMedium:
    medium = mgr.medium(TierKind.NVME)
    assert isinstance(medium, NvmeMedium)
    return medium


def test_read_many_keeps_reads_in_flight_and_waits_for_all(tmp_path: Path) -> None:
    tier = NvmeMedium(tmp_path / "nvme", 48 * SLOT, SLOT, 1 << 30)
    try:
        src = mmap.mmap(-1, SLOT)
        slots = list(range(0, 40, 2))  # no two adjacent: a request each
        for i in slots:
            src[:] = bytes([i]) * SLOT
            tier.write(i * SLOT, memoryview(src))  # slot i: the tier is cut into slots of SLOT
        probe = Probe(tier, delay=0.05)
        bufs = {i: mmap.mmap(-1, SLOT) for i in slots}
        t0 = time.perf_counter()
        tier.read_many([(i * SLOT, memoryview(bufs[i])) for i in slots])
        assert time.perf_counter() - t0 < 20 * 0.05  # overlapped, not one after another
        assert probe.requests == [1] * 20 and 1 < probe.most <= QUEUE_DEPTH
        assert all(bufs[i][:4] == bytes([i]) * 4 for i in slots)
        probe.fail_slots = {6}
        with pytest.raises(OSError, match="slot 6"):
            tier.read_many([(i * SLOT, memoryview(bufs[i])) for i in slots[:8]])
        assert probe.active == 0  # raised only after every read of the batch ended
    finally:
        tier.close()


def test_adjacent_slots_are_read_with_one_request_and_land_where_asked(tmp_path: Path) -> None:
    """A run of adjacent slots is one preadv (within RUN_BYTES), scattered over each op's buffers: a
    whole slot, a slot's used part (the rest is skipped), or a header block + payload + tail list."""
    slot = 16 * 4096  # room for a skipped block within the 1/8 of a slot a request may skip
    tier = NvmeMedium(tmp_path / "nvme", 64 * slot, slot, 1 << 30)
    try:
        src = mmap.mmap(-1, slot)
        for i in range(64):
            src[:] = bytes([i]) * slot
            tier.write(i * slot, memoryview(src))
        probe = Probe(tier)
        whole = [mmap.mmap(-1, slot) for _ in range(3)]
        part = mmap.mmap(-1, slot)  # its used part only: the last 4096 bytes of slot 13 are skipped
        head, body = mmap.mmap(-1, 4096), mmap.mmap(-1, slot)
        ops: list[SlotRead] = [
            (10 * slot, memoryview(whole[0])),
            (11 * slot, memoryview(whole[1])),
            (12 * slot, [memoryview(head), memoryview(body)[: slot - 4096]]),
            (13 * slot, memoryview(part)[: slot - 4096]),
            (14 * slot, memoryview(whole[2])),
            (30 * slot, memoryview(mmap.mmap(-1, slot))),  # not adjacent: a request of its own
        ]
        seen: list[int] = []
        tier.read_many(ops, seen.append)
        assert sorted(seen) == list(range(6)) and sorted(probe.requests) == [1, 5]
        assert whole[0][:] == bytes([10]) * slot and whole[1][:] == bytes([11]) * slot
        assert whole[2][:] == bytes([14]) * slot
        assert head[:] == bytes([12]) * 4096 and body[: slot - 4096] == bytes([12]) * (slot - 4096)
        assert part[: slot - 4096] == bytes([13]) * (slot - 4096) and part[slot - 4096 :] == bytes(4096)
        probe.requests.clear()
        bufs = [mmap.mmap(-1, slot) for _ in range(64)]
        tier.read_many([(i * slot, memoryview(bufs[i])) for i in range(64)])
        per_request = nvme.RUN_BYTES // slot
        assert probe.requests == [min(per_request, nvme.RUN_SLOTS, 64 - k) for k in range(0, 64, per_request)]
        assert all(bufs[i][:] == bytes([i]) * slot for i in range(64))
        probe.fail_slots = {12}  # a failed request fails each of its ops; the others complete
        seen.clear()
        with pytest.raises(OSError, match="slot"):
            tier.read_many(ops, seen.append)
        assert sorted(seen) == [5]
    finally:
        tier.close()


def test_a_read_into_an_aligned_destination_skips_the_bounce_copy(tmp_path: Path) -> None:
    """get with `into`: an NVMe page is read straight into an aligned destination (only the header
    block and the last partial block go through a bounce buffer), and verified there."""

    async def body(mgr: TierManager) -> None:
        on_nvme = await put_to_nvme(mgr, 12)
        probe = Probe(nvme_of(mgr))
        dest = mmap.mmap(-1, len(on_nvme) * SLOT)
        into = [memoryview(dest)[i * SLOT : i * SLOT + PAGE] for i in range(len(on_nvme))]
        got = [(lease.tier, len(lease.payload)) async for lease in mgr.get(NS, [key(i) for i in on_nvme],
                                                                        promote=False, into=into)]  # fmt: skip
        assert got == [(TierKind.NVME, PAGE)] * len(on_nvme) and probe.requests
        for i, k in enumerate(on_nvme):
            assert into[i] == payload(key(k))
        # an unaligned destination gets the bounce buffer and the copy: the same bytes
        odd = [memoryview(dest)[i * SLOT + 8 : i * SLOT + 8 + PAGE] for i in range(len(on_nvme))]
        got = [lease.tier async for lease in mgr.get(NS, [key(i) for i in on_nvme], promote=False, into=odd)]
        assert got == [TierKind.NVME] * len(on_nvme)
        assert all(odd[i] == payload(key(k)) for i, k in enumerate(on_nvme))

    run(body, config(tmp_path, dram_pages=4, nvme_pages=40))


def test_a_batched_get_reads_nvme_pages_in_batches(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        on_nvme = await put_to_nvme(mgr, 24)
        assert len(on_nvme) >= 18
        probe = Probe(nvme_of(mgr), delay=0.01)
        got = await read(mgr, on_nvme, promote=False)
        assert [p for p, _ in got] == [payload(key(i)) for i in on_nvme]
        assert {t for _, t in got} == {TierKind.NVME}
        assert max(probe.batches) == QUEUE_DEPTH  # the first fill: a whole queue in one read_many call
        assert sum(probe.batches) == len(on_nvme) and len(probe.batches) < len(on_nvme)  # refills in batches
        assert probe.most_pages > 4  # deeper than the pool's 4 threads could go one read each
        nvme = mgr.stats().tiers[2]
        assert nvme.counters.hits == len(on_nvme)  # counted once per page returned, in order

    run(body, config(tmp_path, dram_pages=4, nvme_pages=40))


def test_a_caller_writing_its_buffer_during_a_read_cannot_get_a_page_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's buffer is its own memory: bytes changed there between the read and the hash are a
    mismatch the node confirms with a read into its own bounce buffer, so the page stays stored,
    counts no checksum failure, and the caller still receives the right bytes."""
    real_finish = landing._finish

    def scribbled(view: memoryview, dest: memoryview, body: int, n: int) -> int:
        dest[:16] = b"caller was here!"  # as another call of the caller into the same buffer would
        return real_finish(view, dest, body, n)

    monkeypatch.setattr(landing, "_finish", scribbled)

    async def body(mgr: TierManager) -> None:
        on_nvme = await put_to_nvme(mgr, 8)
        dest = mmap.mmap(-1, len(on_nvme) * SLOT)
        into = [memoryview(dest)[i * SLOT : i * SLOT + PAGE] for i in range(len(on_nvme))]
        got = [lease.tier async for lease in mgr.get(NS, [key(i) for i in on_nvme], promote=False, into=into)]
        assert got == [TierKind.NVME] * len(on_nvme)
        assert all(into[i] == payload(key(k)) for i, k in enumerate(on_nvme))
        assert mgr.stats().tiers[2].counters.checksum_failures == 0
        assert tiers_of(mgr, on_nvme) == [TierKind.NVME] * len(on_nvme)

    run(body, config(tmp_path, dram_pages=4, nvme_pages=40))


def test_first_pages_are_served_while_the_rest_of_the_batch_is_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nvme, "RUN_BYTES", 2 * SLOT)  # requests of 2 pages: the slow one is not the first's

    async def body(mgr: TierManager) -> None:
        on_nvme = await put_to_nvme(mgr, 16)
        probe = Probe(nvme_of(mgr))
        last = mgr.entry(NS, key(on_nvme[-1]))
        assert last is not None
        probe.slow_slots = {last.slot}
        t0 = time.perf_counter()
        gen = mgr.get(NS, [key(i) for i in on_nvme], promote=False)
        first = await gen.__anext__()
        assert time.perf_counter() - t0 < 0.9  # did not wait for the slow read of its batch
        assert bytes(first.payload) == payload(key(on_nvme[0])) and probe.batches[0] == len(on_nvme)
        rest = [bytes(lease.payload) async for lease in gen]
        assert rest == [payload(key(i)) for i in on_nvme[1:]]

    run(body, config(tmp_path, dram_pages=4, nvme_pages=40))


def test_promoting_reads_are_batched_too(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        on_nvme = await put_to_nvme(mgr, 16)  # 12 pages on NVMe, 4 in DRAM
        probe = Probe(nvme_of(mgr), delay=0.01)
        got = await read(mgr, on_nvme, promote=True)  # into DRAM slots where there is room, else bounced
        assert [p for p, _ in got] == [payload(key(i)) for i in on_nvme]
        assert {t for _, t in got} == {TierKind.NVME} and max(probe.batches) > 1

    run(body, config(tmp_path, dram_pages=4, nvme_pages=40))


def test_a_failed_read_fails_only_its_own_get(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        ids = list(range(16))
        on_nvme = await put_to_nvme(mgr, 16)
        bad, good = on_nvme[0], on_nvme[1:6]
        probe = Probe(nvme_of(mgr))
        entry = mgr.entry(NS, key(bad))
        assert entry is not None
        probe.fail_slots = {entry.slot}
        results = await asyncio.gather(read(mgr, [bad], promote=False), read(mgr, good, promote=False),
                                       return_exceptions=True)  # fmt: skip
        assert isinstance(results[0], OSError) and "injected" in str(results[0])
        assert [p for p, _ in results[1]] == [payload(key(i)) for i in good]  # type: ignore[union-attr]
        assert all(mgr.entry(NS, key(i)).readers == 0 for i in ids)  # type: ignore[union-attr]
        probe.fail_slots = set()
        assert [p for p, _ in await read(mgr, [bad], promote=False)] == [payload(key(bad))]  # still stored

    run(body, config(tmp_path, dram_pages=4, nvme_pages=40))


@pytest.mark.parametrize("promote", [False, True], ids=["bounce-reads", "promoting-reads"])
def test_cancelling_a_get_waits_for_every_read_in_flight(tmp_path: Path, promote: bool) -> None:
    async def body(mgr: TierManager) -> None:
        ids = list(range(24))
        on_nvme = await put_to_nvme(mgr, 24)
        probe = Probe(nvme_of(mgr), delay=0.2)
        task = asyncio.create_task(read(mgr, on_nvme, promote=promote))
        for _ in range(200):  # bounded: wait until a batch of reads is in flight
            if probe.pages > 1:
                break
            await asyncio.sleep(0.005)
        assert probe.pages > 1
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert probe.active == 0  # cancellation returned only after every read it started had ended
        assert all(mgr.entry(NS, key(i)).readers == 0 for i in on_nvme)  # type: ignore[union-attr]
        probe.delay = 0.0
        # Nothing was freed under an I/O: every page still reads back right, and the tiers add up.
        assert [p for p, _ in await read(mgr, ids, promote=False)] == [payload(key(i)) for i in ids]
        await put(mgr, [100, 101])
        for t in mgr.stats().tiers:
            assert t.slots_used == t.pages or t.tier is TierKind.NVME  # NVMe may keep shadows of promoted pages

    run(body, config(tmp_path, dram_pages=4, nvme_pages=40))


def test_header_of_another_page_in_a_slot_is_a_checksum_failure(tmp_path: Path) -> None:
    """A batched read verifies each slot's header names its page (a stale slot is never served)."""

    async def body(mgr: TierManager) -> None:
        on_nvme = await put_to_nvme(mgr, 12)
        a, b = (mgr.entry(NS, key(i)) for i in on_nvme[:2])
        assert a is not None and b is not None
        path_a, off_a = mgr.nvme_slot_location(a.slot)
        path_b, off_b = mgr.nvme_slot_location(b.slot)
        with open(path_b, "rb") as f:
            f.seek(off_b)
            header_b = f.read(HEADER_BYTES)
        with open(path_a, "r+b") as f:  # slot a now claims to hold page b
            f.seek(off_a)
            f.write(header_b)
        assert await read(mgr, on_nvme[:2], promote=False) == []
        assert mgr.stats().tiers[2].counters.checksum_failures == 1

    run(body, config(tmp_path, dram_pages=4, nvme_pages=40))


def test_queue_depth_sizes_the_bounce_pool(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        assert mgr._bounce.keep >= QUEUE_DEPTH + mgr.config.io_threads

    run(body, config(tmp_path, dram_pages=4, nvme_pages=8))
