"""Reads: leases on pages, verified on every tier read, with read-ahead for batched Gets.

Invariants:
- a leased page's payload stays valid and unchanged until the lease is released: its entry counts a
  reader, so it is never chosen as a victim, moved, or freed meanwhile;
- a page is verified once per read, by the party that receives its bytes (DESIGN.md §8): the reader
  verifies every copy out of a medium that is not host memory (NVMe, HBM: payload checksum and header),
  every copy into a caller's memory on this host (`into`, in the pass that copies) and every read whose
  receiver does not verify; a DRAM page read for a receiver that verifies (a client across a network
  plane) is not re-hashed here: it was verified when put, and the scrubber re-verifies it at a bounded
  rate (kvstore/manager/scrub.py). A mismatch is counted on the tier, the page is dropped with its
  durable copies, and the read is a miss;
- hits and misses are counted per tier in request order, for pages actually returned: a page read
  ahead but never handed to the caller counts nothing;
- reads of a medium that is not host memory (NVMe) go through `IoPool.read`, which hands the ones
  asked for together to one `read_many` call: a Get reads up to the medium's `queue_depth` pages ahead
  and refills that queue in batches, so the device sees a deep queue rather than one read at a time.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from kvstore.manager.fetchrates import FetchRates
from kvstore.manager.landing import read_payload
from kvstore.manager.moves import Mover, header_matches
from kvstore.manager.placement import Placement
from kvstore.manager.state import Entry, NodeCounters, PageTable
from kvstore.names import Key, TierKind
from kvstore.pageformat import HEADER_BYTES, checksum_into, key_digest
from kvstore.scoping import unscope
from kvstore.tiers.dram import BouncePool

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DeviceBytes:
    """Where a leased page's payload lies in accelerator memory: a device address and a length."""

    pointer: int
    nbytes: int


@dataclass(slots=True)
class ReadLease:
    """A page being read: `payload` (host memory) stays valid and unchanged until release() is called.
    `tier` is where the page was found (an NVMe hit stays an NVMe hit even when the read promoted it).

    Where its bytes are: `payload` always (a host view of a DRAM slot, or the verified host copy of a
    read from any other medium); `device` too when the page is held in device memory (HBM), supplied by
    its medium, valid for the lease's life (a leased page is never moved), so a plane that can send
    device memory sends it from there.
    """

    hash: bytes
    tier: TierKind
    checksum: int  # the wire form (pageformat.ChecksumForm.KEYED) for the namespace and key asked for
    payload: memoryview
    _release: Callable[[], None] | None = None
    key: Key = ("", b"")
    held_in: TierKind = TierKind.DRAM  # where the payload is read from now (after any promotion)
    device: DeviceBytes | None = None

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None

    def keep(self) -> None:
        """Never release this lease: the page stays leased (unevictable, its slot never reused). For a
        plane whose transfer from the payload may still be running after it gave up waiting for it."""
        self._release = None

    def detach(self) -> Callable[[], None]:
        """Take over releasing this lease: the Get no longer releases it when it moves on or closes, the
        function returned does (call it once, after the transfer from `payload` finished). For a plane
        that keeps several pages of a Get in flight at once."""
        release, self._release = self._release, None
        return release if release is not None else _nothing


def _nothing() -> None:
    return None


class _GetTimer:
    """Times one Get where its pages are served, for the fetch-time estimate (kvstore/manager/fetchrates.py):
    from the call to its first page, then to its end, which comes after the plane has sent the last page. Only
    a Get that ran to its end (all pages, or a miss) is reported: one cut short by its caller says nothing."""

    __slots__ = ("first_at", "first_tier", "rates", "read", "started")

    def __init__(self, rates: FetchRates) -> None:
        self.rates = rates
        self.started = time.perf_counter()
        self.first_at = 0.0
        self.first_tier = TierKind.DRAM
        self.read: dict[TierKind, int] = {}

    def copying(self, tier: TierKind) -> None:
        """A batch of pages, the first from `tier`, starts to be copied: when it is the Get's first, its copy
        counts as transfer at the tier's rate, not as latency to the first page (which is ready only when the
        whole batch is)."""
        if not self.first_at:
            self.first_at, self.first_tier = time.perf_counter(), tier

    def served(self, lease: ReadLease) -> None:
        if not self.first_at:
            self.first_at, self.first_tier = time.perf_counter(), lease.tier
        self.read[lease.tier] = self.read.get(lease.tier, 0) + len(lease.payload)

    def ended(self) -> None:
        if self.read:
            self.rates.observe(
                self.first_tier, self.first_at - self.started, self.read, time.perf_counter() - self.first_at
            )


class Reader:
    """Serves Gets: one lease per page, in order, reading up to `read_ahead` pages ahead."""

    def __init__(
        self,
        table: PageTable,
        mover: Mover,
        placement: Placement,
        bounce: BouncePool,
        counters: NodeCounters,
        *,
        read_ahead: int,
        promote_to: TierKind,
    ) -> None:
        self.table = table
        self.mover = mover
        self.placement = placement
        self.io = mover.io
        self.bounce = bounce
        self.counters = counters
        self.read_ahead = read_ahead
        self.promote_to = promote_to  # a hit below this tier is promoted into it (when asked to)
        self.rates = FetchRates()  # what this node's Gets took, per tier: Lookup's fetch-time estimate

    def get(
        self,
        keys: list[Key],
        *,
        promote: bool,
        into: Sequence[memoryview] | None = None,
        receiver_verifies: bool = False,
    ) -> AsyncIterator[ReadLease]:
        """Yield a lease per page, in order, stopping at the first missing or corrupt page.

        Each lease is released when the generator advances past it or is closed. Up to `read_ahead`
        following pages are read (I/O, promotion) while the caller streams the current one; reading
        ahead stops at the first page not stored. With `into`, page i is also copied into into[i] in
        the pass that verifies it (`checksum_into`), so the caller's copy costs no extra pass over the
        page; a page that fails verification may have left bytes in its destination, but is never
        yielded (destinations past the last page yielded hold undefined bytes). `receiver_verifies`: the
        party that receives the bytes checks them against the lease's checksum, so DRAM pages are not
        re-hashed here (see the module docstring).
        """
        if into is not None:
            return self._copied(keys, promote, into)
        return self._streamed(keys, promote, None, receiver_verifies)

    async def _copied(self, keys: list[Key], promote: bool, into: Sequence[memoryview]) -> AsyncIterator[ReadLease]:
        """`get` with `into`. Pages resident in host memory that need no promotion are leased a group at a time
        (up to COPY_AHEAD_BYTES) and copied into their destinations as one batch, hashed as they are copied
        (`IoPool.copy_many`: one handoff per part, parts side by side); from the first page that is not such a
        page on (missing, moving, to promote, on another medium), the rest goes the way of every Get."""
        clock = _GetTimer(self.rates)
        whole = False  # ran to its end (every page, or a miss): only then is the Get's time reported
        start = 0
        try:
            while start < len(keys):
                group = self._lease_resident(keys, start, promote, into)
                if not group:
                    rest = self._streamed(keys[start:], promote, into, False, first=start, timer=clock)
                    try:
                        async for lease in rest:
                            yield lease
                    finally:
                        await rest.aclose()  # type: ignore[attr-defined]  # its reads end before this does
                    whole = True
                    return
                start += len(group)
                clock.copying(group[0][0].tier)
                try:
                    sums = await self.io.copy_many(
                        checksum_into, [(lease.payload, dest) for lease, dest, _, _ in group]
                    )
                except BaseException:
                    for lease, _, _, _ in group:
                        lease.release()
                    raise
                for i, (lease, _, expected, entry) in enumerate(group):
                    if isinstance(sums[i], BaseException):  # the copy itself failed (its destination, say)
                        for later, _, _, _ in group[i:]:
                            later.release()
                        raise sums[i]
                    if sums[i] != expected:  # as in read_one: a miss from here on, the page dropped and counted
                        for later, _, _, _ in group[i:]:
                            later.release()
                        self.count_path(None)
                        await self.corrupt(entry, "read")
                        whole = True
                        return
                    self.table.tiers[entry.tier].counters.bytes_out += entry.payload_len
                    self.count_path(lease.tier)
                    clock.served(lease)
                    self.table.tiers[lease.held_in].on_access(lease.key)
                    entry.reads += 1
                    self.counters.prefetch_fate(entry, used=True)
                    try:
                        yield lease
                    except BaseException:
                        for later, _, _, _ in group[i + 1 :]:
                            later.release()
                        raise
                    finally:
                        lease.release()
                # NOTE: a caller that stops early closes this generator at the yield above: the rest were released.
            whole = True
        finally:
            if whole:
                clock.ended()

    def _lease_resident(
        self, keys: list[Key], start: int, promote: bool, into: Sequence[memoryview]
    ) -> list[tuple[ReadLease, memoryview, int, Entry]]:
        """Lease keys[start:] in order while each is a page settled in a host-memory tier that needs no
        promotion, up to COPY_AHEAD_BYTES of them: (lease, its destination, the checksum its payload must
        have, its entry). Synchronous: no page can move or go between the check and its lease."""
        group: list[tuple[ReadLease, memoryview, int, Entry]] = []
        nbytes = 0
        for i in range(start, len(keys)):
            key = keys[i]
            entry = self.table.get(key)
            if entry is None or entry.moving is not None or entry.key != key or nbytes >= COPY_AHEAD_BYTES:
                break
            if promote and entry.tier > self.promote_to:
                break
            tier = self.table.tiers[entry.tier]
            if not tier.medium.host_memory:
                break
            layout = self.table.layouts.get(key[0], entry.layout)
            expected = entry.payload_checksum(key, layout)
            entry.readers += 1
            payload = tier.medium.view(entry.slot + HEADER_BYTES, entry.payload_len)
            group.append((self._lease(entry, key, entry.tier, payload, expected), into[i], expected, entry))
            nbytes += entry.payload_len
        return group

    async def _streamed(
        self,
        keys: list[Key],
        promote: bool,
        into: Sequence[memoryview] | None,
        receiver_verifies: bool,
        *,
        first: int = 0,
        timer: _GetTimer | None = None,
    ) -> AsyncIterator[ReadLease]:
        """`get`, a page at a time, each read by its own task up to `depth` pages ahead (keys[i] copied into
        into[first + i]). Timed by `timer` when given (the rest of a Get begun elsewhere: its owner reports it),
        else by a timer of its own."""
        loop = asyncio.get_running_loop()
        pending: deque[asyncio.Task[ReadLease | None]] = deque()
        nxt = 0

        def read_ahead() -> None:
            nonlocal nxt
            started = 0
            while nxt < len(keys):
                key = keys[nxt]
                depth = self.depth(key)
                if len(pending) >= depth:
                    break
                if not started and depth > self.read_ahead + 1 and len(pending) > depth // 2:
                    break  # a deep queue is refilled half at a time: one read_many call each, not one per page
                dest = into[first + nxt] if into is not None else None
                pending.append(loop.create_task(self.read_one(key, promote, dest, receiver_verifies)))
                started += 1
                nxt = nxt + 1 if key in self.table else len(keys)  # a miss ends the stream

        lease: ReadLease | None = None
        own = timer is None
        clock = _GetTimer(self.rates) if timer is None else timer
        whole = False
        try:
            read_ahead()
            while pending:
                lease = await pending.popleft()
                # Counted here, in request order, so pages read ahead but never returned count nothing.
                self.count_path(lease.tier if lease is not None else None)
                if lease is None:
                    whole = True
                    return
                clock.served(lease)
                self.table.tiers[lease.held_in].on_access(lease.key)
                if (e := self.table.get(lease.key)) is not None:
                    e.reads += 1
                    self.counters.prefetch_fate(e, used=True)
                read_ahead()
                yield lease
                lease.release()
                lease = None
            whole = True
        finally:
            if whole and own:
                clock.ended()
            if lease is not None:
                lease.release()
            for task in pending:
                task.cancel()
            for result in await asyncio.gather(*pending, return_exceptions=True):
                if isinstance(result, ReadLease):
                    result.release()

    def depth(self, key: Key) -> int:
        """Pages a Get keeps in flight while the next one to read is `key`: the read-ahead window, or the
        queue depth of the medium the page is on when that is deeper (NVMe)."""
        shallow = self.read_ahead + 1
        entry = self.table.get(key)
        if entry is None:
            return shallow
        medium = self.table.tiers[entry.tier].medium
        return shallow if medium.host_memory else max(shallow, medium.queue_depth)

    async def read_one(
        self, key: Key, promote: bool, dest: memoryview | None = None, receiver_verifies: bool = False
    ) -> ReadLease | None:
        """Lease one page, promoting it first when asked; None when missing or corrupt. With `dest`, the
        payload is copied there in the pass that verifies it. Counts bytes and checksum failures; hits
        and misses are counted by the caller, in request order."""
        entry = await self.mover.settled(key)
        if entry is None:
            return None
        if entry.key != key:  # a record filed under another key (a broken table): never served as this one
            self.table.tiers[entry.tier].counters.checksum_failures += 1
            log.error("page %s is filed under %s: not served (a miss)", entry.hash.hex(), key[1].hex())
            return None
        found = entry.tier  # hits are credited where the page was found, before any promotion
        if promote and entry.tier > self.promote_to:
            await self.mover.promote(entry, self.promote_to)
            entry = await self.mover.settled(key)
            if entry is None:
                return None
        tier = self.table.tiers[entry.tier]
        # What its payload must hash to as the page asked for: the key requested, in the namespace's layout
        # (never the entry's own fields: a page filed under another key, tenant or layout fails here).
        layout = self.table.layouts.get(key[0], entry.layout)
        expected = entry.payload_checksum(key, layout)
        entry.readers += 1
        bounce: mmap.mmap | None = None
        view: memoryview | None = None
        try:
            if tier.medium.host_memory:
                payload = tier.medium.view(entry.slot + HEADER_BYTES, entry.payload_len)
                # NOTE: one pass per byte. A receiver that verifies covers this slot end to end; the copy
                # into a caller's memory verifies as it copies; anything else is verified here.
                if dest is not None:  # a copy into a caller's memory, hashed as it goes (IoPool.copy_many)
                    (copied,) = await self.io.copy_many(checksum_into, [(payload, dest)])
                    if isinstance(copied, BaseException):
                        raise copied
                    ok = copied == expected
                elif not receiver_verifies:
                    ok = checksum_into(payload, None) == expected
                else:
                    ok = True
            else:
                bounce = self.bounce.take()
                view = memoryview(bounce)[: entry.used_len]
                # Lands in dest directly where it can, hashed in the I/O thread (landing.py).
                payload, checksum = await read_payload(
                    self.io, tier.medium, entry, view, dest=dest, copy_verify=checksum_into, expected=expected
                )
                ok = header_matches(entry, view) and checksum == expected
        except BaseException:
            entry.readers -= 1
            raise
        if not ok:
            entry.readers -= 1
            self._close(payload, view, bounce)
            await self.corrupt(entry, "read")
            return None
        tier.counters.bytes_out += entry.payload_len
        return self._lease(entry, key, found, payload, expected, view=view, bounce=bounce)

    def _lease(
        self,
        entry: Entry,
        key: Key,
        found: TierKind,
        payload: memoryview,
        expected: int,
        *,
        view: memoryview | None = None,
        bounce: mmap.mmap | None = None,
    ) -> ReadLease:
        """The lease on `entry` (its reader counted already) read as `key`, its payload at `payload`."""

        def release() -> None:
            entry.readers -= 1
            if entry.readers == 0:
                self.placement.space_changed()
            self._close(payload, view, bounce)

        ptr = self.table.tiers[entry.tier].medium.device_pointer(entry.slot)
        device = None if ptr is None else DeviceBytes(ptr + HEADER_BYTES, entry.payload_len)
        wire = expected ^ key_digest(unscope(key[0]), key[1])  # the client's form: it binds namespace and key
        return ReadLease(entry.hash, found, wire, payload, release, key, entry.tier, device)

    async def corrupt(self, entry: Entry, found_by: str) -> None:
        """A page's bytes failed their checksum: count it on its tier, drop it with its durable copies."""
        tier = self.table.tiers[entry.tier]
        tier.counters.checksum_failures += 1
        log.error(
            "checksum mismatch (%s): page %s in %s slot %d dropped",
            found_by,
            entry.hash.hex(),
            tier.kind.label,
            entry.slot,
        )
        await self.mover.drop(entry, erase=True)

    async def verify(self, key: Key) -> bool | None:
        """Verify one page where it is, without leasing it to anyone (no hit, no bytes out, no promotion):
        True when intact, False when it failed (and was dropped), None when it is not stored."""
        entry = await self.mover.settled(key)
        if entry is None:
            return None
        lease = await self.read_one(key, promote=False)
        if lease is None:
            return False
        lease.release()
        self.table.tiers[entry.tier].counters.bytes_out -= entry.payload_len  # a check, not a read
        return True

    def _close(self, payload: memoryview, view: memoryview | None, bounce: mmap.mmap | None) -> None:
        """Release a read's views, then return its bounce buffer (it must have no views left)."""
        payload.release()
        if view is not None:
            view.release()
        if bounce is not None:
            self.bounce.give(bounce)

    def count_path(self, found: TierKind | None) -> None:
        """A requested page missed every available tier faster than where it was found."""
        for kind, tier in self.table.tiers.items():
            if not tier.available:
                continue
            if found is not None and kind == found:
                tier.counters.hits += 1
                return
            tier.counters.misses += 1


# A Get copying host-memory pages into its caller's memory (the same-host plane) leases up to this many bytes of
# pages ahead, so their copies go to the I/O pool as one batch (IoPool.copy), cut into parts side by side.
COPY_AHEAD_BYTES = 64 << 20
