"""Moves between tiers (demotion, promotion), eviction, and dropping pages: the only code that changes
where a page lives once it is visible.

Invariants:
- while a move runs, `entry.moving` is set: readers wait for it (`settled`), and the page is neither
  chosen as a victim nor deleted; the source slot stays intact until the switch;
- a page copied into host memory from a medium that is not (NVMe, HBM) is verified there, header and
  payload, before the switch; a copy that fails is a checksum failure of the source tier, and the page
  is dropped with its durable copies;
- leaving the persistent tier keeps the old slot as the page's shadow (DurableCopies), so a clean
  demotion back writes nothing;
- a demotion whose write fails (disk full, I/O error) leaves nothing visible in the lower tier (the
  medium erases the slot); the victim is dropped instead and the node keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvstore.errors import ResourceExhausted, Unavailable
from kvstore.manager.durable import DurableCopies
from kvstore.manager.io import IoPool
from kvstore.manager.placement import Placement
from kvstore.manager.state import Entry, NodeCounters, PageTable, Tier
from kvstore.names import Key, TierKind
from kvstore.pageformat import FORMAT_VERSION, HEADER_BYTES, HeaderError, PageHeader, payload_checksum
from kvstore.scoping import tenant_of
from kvstore.tiers.dram import BouncePool

log = logging.getLogger(__name__)

_MAX_SETTLE_ROUNDS = 64  # a page that keeps moving this often is reported Unavailable instead
# After a failed write into a tier (a full or failing disk), evictions drop instead of demoting there for
# this long: a full disk then costs one failed write per second, not one per eviction.
_WRITE_FAILURE_PAUSE = 1.0


class Mover:
    """Demotes, promotes, evicts and drops pages; runs on the event loop, its I/O in the pool."""

    def __init__(
        self,
        table: PageTable,
        placement: Placement,
        durable: DurableCopies,
        *,
        io: IoPool,
        bounce: BouncePool,
        counters: NodeCounters,
    ) -> None:
        self.table = table
        self.placement = placement
        self.durable = durable
        self.io = io
        self.bounce = bounce
        self.counters = counters
        self._write_failed: dict[TierKind, float] = {}  # tier -> when a write into it last failed
        # Whether a page may be promoted into a tier (retention's hold caps: Retention.reserve_promotion, wired by
        # the manager): None, it stays where it is and is served from there; else called once the move is over.
        self.reserve_promotion: Callable[[Key, TierKind], Callable[[], None] | None] = _anywhere

    def _failing(self, kind: TierKind) -> bool:
        """A write into `kind` failed in the last _WRITE_FAILURE_PAUSE seconds: demote nothing there yet."""
        failed = self._write_failed.get(kind)
        return failed is not None and time.monotonic() - failed < _WRITE_FAILURE_PAUSE

    async def settled(self, key: Key) -> Entry | None:
        """The entry for key once no move is in flight for it (waits for moves; bounded)."""
        for _ in range(_MAX_SETTLE_ROUNDS):
            entry = self.table.get(key)
            if entry is None or entry.moving is None:
                return entry
            await asyncio.shield(entry.moving)
        raise Unavailable("page kept moving between tiers; retry")

    async def evict(self, entry: Entry) -> None:
        """Move a victim one tier down, or drop it when there is no slower tier with room."""
        src = self.table.tiers[entry.tier]
        src.counters.evictions += 1
        self.counters.prefetch_fate(entry, used=False)
        lower = self.table.below(entry.tier)
        if lower is not None and not self._failing(lower.kind):
            try:
                await self.move(entry, lower.kind, demotion=True)
                return
            except ResourceExhausted:
                pass  # the lower tier is full of unevictable pages: fall through to dropping
            except OSError as exc:
                # ENOSPC, EIO: the medium erased the slot it could not finish (never a half-written page),
                # and this tier keeps serving: the victim is dropped, and demotions there pause a moment.
                self._write_failed[lower.kind] = time.monotonic()
                log.error(
                    "demoting %s to %s failed (%s): page dropped; demotions to %s pause %.0fs",
                    entry.hash.hex(),
                    lower.kind.label,
                    exc,
                    lower.kind.label,
                    _WRITE_FAILURE_PAUSE,
                )
        src.counters.dropped += 1
        await self.drop(entry, erase=False)

    async def promote(self, entry: Entry, kind: TierKind, admission: bool = True) -> bool:
        """Move a settled page up into tier `kind` if there is room to make there without waiting;
        False when it stays where it is (then it is served from there). Into a full host-memory tier
        the page must first be admitted by that tier's policy (Placement.admit), unless `admission`
        is False (an explicit Prefetch: the engine said it is about to read the page)."""
        if entry.moving is not None or entry.tier <= kind:
            return False
        done = self.reserve_promotion(entry.key, kind)
        if done is None:
            return False
        try:
            victim = None
            if admission and self.table.tiers[kind].medium.host_memory:
                admitted, victim = self.placement.admit(kind, entry.key, entry.parent, entry.used_len)
                if not admitted:
                    return False
            try:
                await self.move(entry, kind, demotion=False, victim=victim)
            except ResourceExhausted:
                log.debug("no %s room to promote %s; serving from %s", kind.label, entry.hash.hex(), entry.tier.label)
                return False
            return True
        finally:
            done()

    async def move(self, entry: Entry, dst_kind: TierKind, demotion: bool, victim: Entry | None = None) -> None:
        """Copy a page to a slot in dst_kind, verify where needed, then switch and free the source.

        A promotion never waits for space (the page is served from where it is instead); a demotion
        may (see Placement.allocate). `victim`: the page admission chose to make room (evicted first).
        """
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry.moving = fut
        src, dst = self.table.tiers[entry.tier], self.table.tiers[dst_kind]
        src_slot = entry.slot
        dst_slot: int | None = None
        try:
            if dst is self.durable.tier and entry.shadow is not None:
                # Clean demotion: the durable copy from before its promotion is still intact.
                dst_slot = entry.shadow
                self.durable.adopt(dst_slot, entry.used_len)
            else:
                dst_slot = await self.placement.allocate(
                    dst_kind, entry.used_len, wait=demotion, victim=victim, tenant=tenant_of(entry.namespace)
                )  # its share
                await self.copy(entry, src, src_slot, dst, dst_slot)
                verify = dst.medium.host_memory and not src.medium.host_memory
                if verify and not verify_copy(entry, dst.medium.view(dst_slot, entry.used_len)):
                    src.counters.checksum_failures += 1
                    dst.alloc.free(dst_slot)
                    dst_slot = None
                    log.error("checksum mismatch moving %s out of %s; page dropped", entry.hash.hex(), src.kind.label)
                    entry.moving = None
                    await self.drop(entry, erase=True)
                    return
                if verify:
                    upgrade_header(entry, dst.medium.view(dst_slot, HEADER_BYTES))
            self.table.unpublish(entry)
            src.alloc.free(src_slot)
            if src is self.durable.tier:
                self.durable.note(src_slot, entry.key, entry.used_len)
                entry.shadow = src_slot
            entry.tier, entry.slot = dst_kind, dst_slot
            dst_slot = None
            self.table.publish(entry, dst_kind, previous=src.kind)
            src.counters.bytes_out += entry.payload_len
            dst.counters.bytes_in += entry.payload_len
            if demotion:
                dst.counters.demotions += 1
            else:
                dst.counters.promotions += 1
        finally:
            if dst_slot is not None:
                dst.alloc.free(dst_slot)
            if entry.moving is fut:
                entry.moving = None
            if not fut.done():
                fut.set_result(None)
            self.placement.space_changed()

    async def copy(self, entry: Entry, src: Tier, src_slot: int, dst: Tier, dst_slot: int) -> None:
        """A page's slot (its size is the same in every tier), from one medium to another: one aligned copy,
        straight when either side is host memory, else through a bounce buffer."""
        n = entry.used_len
        if src.medium.host_memory:
            await self.io.run(dst.medium.write, dst_slot, src.medium.view(src_slot, n))
        elif dst.medium.host_memory:
            await self.io.read(src.medium, src_slot, dst.medium.view(dst_slot, n))  # batched with its peers
        else:
            buf = self.bounce.take()
            view = memoryview(buf)[:n]
            try:
                await self.io.read(src.medium, src_slot, view)
                await self.io.run(dst.medium.write, dst_slot, view)
            finally:
                view.release()
                self.bounce.give(buf)

    async def drop(self, entry: Entry, erase: bool) -> None:
        """Remove a page from the node. erase=True also erases durable copies (delete, corruption)."""
        if self.table.get(entry.key) is not entry:
            return
        tier = self.table.tiers[entry.tier]
        self.counters.prefetch_fate(entry, used=False)
        self.table.remove(entry)
        entry.shadow = None
        if erase:
            if tier.medium.persistent:
                await self.io.run(tier.medium.invalidate, entry.slot, entry.used_len)
            await self.durable.erase(entry.key)
        tier.alloc.free(entry.slot)
        if tier is self.durable.tier and not erase:
            self.durable.note(entry.slot, entry.key, entry.used_len)
        self.placement.space_changed()


def _anywhere(key: Key, kind: TierKind) -> Callable[[], None] | None:
    return _nothing


def _nothing() -> None:
    return None


def verify_copy(entry: Entry, view: memoryview) -> bool:
    """A slot copied out of a medium: its header must name this page, its payload match the checksum bound
    to the page's identity."""
    if not header_matches(entry, view):
        return False
    return payload_checksum(view[HEADER_BYTES : HEADER_BYTES + entry.payload_len]) == entry.payload_checksum()


def upgrade_header(entry: Entry, view: memoryview) -> None:
    """Rewrite a host-memory slot's header in the current format when a move brought an older one (pageformat:
    a page written by an older build is written anew in format 3 by the next write of it to NVMe)."""
    if PageHeader.unpack(view[:HEADER_BYTES]).version < FORMAT_VERSION:
        hdr = PageHeader(entry.namespace, entry.hash, entry.layout, entry.payload_len, entry.checksum, entry.generation)
        view[:HEADER_BYTES] = hdr.pack()


def header_matches(entry: Entry, view: memoryview) -> bool:
    """The header block of a slot copied out of a medium names this page (not a stale or torn one)."""
    try:
        hdr = PageHeader.unpack(view[:HEADER_BYTES])
    except HeaderError:
        return False
    return (hdr.namespace, hdr.hash, hdr.generation) == (entry.namespace, entry.hash, entry.generation)
