"""TierManager: where each page lives, and every move between tiers (DESIGN.md §5, §6).

The manager decides; the tiers (kvstore/tiers) only move bytes. All bookkeeping runs on one asyncio
event loop, so it needs no locks; blocking I/O (NVMe reads, writes, fdatasync, CUDA copies) runs in a
bounded thread pool.

Invariants:
- A visible page is in exactly one tier (exclusive tiers: capacities add up).
- A page is visible (lookup/get can see it) only once its bytes and header are complete in its slot,
  and, on NVMe, durable.
- A page being read (`readers > 0`), pinned, or being moved is never chosen as a victim, and its slot
  is never freed or overwritten.
- A slot holds at most one page; staged (not yet committed) pages own their slots but are invisible.
- Every read verifies the payload checksum; a mismatch is counted, the page is dropped, and the read
  is a miss.
- A free NVMe slot may still hold a valid durable copy of a page (its page was promoted to DRAM, or
  evicted from NVMe). The manager tracks every such slot by key: a promoted page's own copy (its
  *shadow*, same generation) lets a later demotion reuse the slot with no write, and a restart recovers
  it; all of them are erased durably when their key is deleted or found corrupt, so a deleted page never
  comes back after a restart. The tracking ends when the slot is reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import mmap
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvstore.config import NodeConfig
from kvstore.errors import (
    DataLoss,
    InvalidArgument,
    LayoutMismatch,
    NamespaceNotFound,
    ResourceExhausted,
    Unavailable,
)
from kvstore.hashing import HASH_BYTES, HashContractError, validate_namespace
from kvstore.layout import PageLayout
from kvstore.pageformat import HEADER_BYTES, HeaderError, PageHeader, align_up, payload_checksum
from kvstore.policy import EvictionPolicy, first_usable, make_policy
from kvstore.stats import IndexStatus, LookupResult, NodeStats, TierCounters, TierStats, copy_counters
from kvstore.tiers.base import TierKind
from kvstore.tiers.dram import BouncePool, DramTier
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.slots import SlotAllocator

log = logging.getLogger(__name__)

Key = tuple[str, bytes]
_PIN_SWEEP_SECONDS = 1.0
_MAX_CANCEL_DEFERRALS = 10_000  # repeated cancels while waiting out an in-flight I/O (bounded loop)
_MAX_SPACE_WAITS = 10_000  # bounds the allocation loop; waits are also bounded by alloc_wait_seconds


@dataclass(slots=True, eq=False)
class Entry:
    """One visible page. `tier`/`slot` change only inside a move, while `moving` is set."""

    namespace: str
    hash: bytes
    tier: TierKind
    slot: int
    payload_len: int
    checksum: int
    generation: int
    layout: PageLayout
    pins: int = 0
    pin_deadlines: list[float] = field(default_factory=list)
    readers: int = 0
    moving: asyncio.Future[None] | None = None
    shadow: int | None = None  # free NVMe slot still holding this page's durable copy
    prefetched: bool = False  # promoted by a prefetch and not read since (used / wasted accounting)
    parent: Key | None = None  # previous block of its chain, when the writer said (policy hint)
    reads: int = 0  # reads since stored, in any tier (policy hint; travels with the page)

    @property
    def key(self) -> Key:
        return (self.namespace, self.hash)

    @property
    def pinned(self) -> bool:
        return self.pins > 0 or bool(self.pin_deadlines)

    @property
    def evictable(self) -> bool:
        return not self.pinned and self.readers == 0 and self.moving is None

    @property
    def used_len(self) -> int:
        """Bytes of the slot that carry data: header block plus payload rounded to 4 KiB."""
        return HEADER_BYTES + align_up(self.payload_len)


@dataclass(slots=True)
class ReadLease:
    """A page being read: `payload` stays valid and unchanged until release() is called. `tier` is
    where the page was found (an NVMe hit stays an NVMe hit even when the read promoted it)."""

    hash: bytes
    tier: TierKind
    checksum: int
    payload: memoryview
    _release: object = None
    key: Key = ("", b"")
    held_in: TierKind = TierKind.DRAM  # where the payload is read from now (after any promotion)

    def release(self) -> None:
        if self._release is not None:
            self._release()  # type: ignore[operator]
            self._release = None


class _Tier:
    """A medium plus its allocator, policy and counters (manager-private)."""

    def __init__(self, kind: TierKind, medium: DramTier | NvmeTier | HbmTier | None, num_slots: int,
                 slot_bytes: int, policy: EvictionPolicy, available: bool, detail: str) -> None:  # fmt: skip
        self.kind = kind
        self.medium = medium
        self.alloc = SlotAllocator(num_slots)
        self.slot_bytes = slot_bytes
        self.policy = policy
        self.available = available and num_slots > 0
        self.detail = detail
        self.counters = TierCounters()
        self.pages = 0
        self.used_bytes = 0


class PutTxn:
    """One Put stream. Pages are staged in DRAM slots the caller fills through `add_page`'s view;
    `commit` verifies and publishes them at once; `abort` (or a failed commit) frees what is staged.

    Atomicity: nothing is visible before commit, as long as the stream's pages fit in the DRAM tier
    together. A stream that outgrows DRAM (no free or evictable slot left besides its own staged ones)
    is committed in groups: the staged, verified pages are published and the stream goes on. Each page is always
    atomic: a page is either complete and verified or absent.
    """

    def __init__(self, mgr: TierManager, namespace: str, layout: PageLayout, target: TierKind,
                 parent: bytes | None = None, chain: bool = False) -> None:  # fmt: skip
        self._mgr = mgr
        self.namespace = namespace
        self.layout = layout
        self.target = target
        self._chain = chain
        self._prev: bytes | None = parent  # the chain's block before the next page
        self._staged: list[tuple[bytes, int, int, bytes | None]] = []  # (hash, slot, declared checksum, parent)
        self._seen: set[bytes] = set()
        self.stored = 0
        self.already_present = 0
        self.done = False

    async def add_page(self, h: bytes, payload_len: int, checksum: int) -> memoryview | None:
        """Reserve a slot for the next page and return the writable view its payload goes into, or
        None when the page is already stored (the caller discards its chunks). The previous page's
        view must be completely written before this is called."""
        mgr = self._mgr
        _check_hash(h, "page.hash")
        if payload_len != self.layout.page_bytes:
            raise InvalidArgument(
                "page.payload_bytes",
                f"{payload_len} bytes does not match the layout's page size {self.layout.page_bytes} "
                f"({self.layout.describe()})",
            )
        if len(self._seen) + self.already_present >= mgr.config.max_pages_per_request:
            raise InvalidArgument("pages", f"more than {mgr.config.max_pages_per_request} pages in one stream")
        parent = self._prev if self._chain else None
        self._prev = h
        if (self.namespace, h) in mgr._entries or h in self._seen:
            self.already_present += 1
            return None
        try:
            slot = await mgr._allocate(TierKind.DRAM, reserve=len(self._staged), wait=not self._staged)
        except ResourceExhausted:
            if not self._staged:
                raise
            self._publish_staged()  # the stream outgrew DRAM: commit what it staged so far
            slot = await mgr._allocate(TierKind.DRAM)
        self._seen.add(h)
        self._staged.append((h, slot, checksum, parent))
        start = HEADER_BYTES
        return mgr._dram_medium.slot(slot)[start : start + payload_len]

    async def commit(self) -> tuple[int, int]:
        """Verify every staged page and publish them; returns (stored, already_present)."""
        if self.done:
            raise RuntimeError("transaction already finished")
        self._publish_staged()
        self.done = True
        mgr = self._mgr
        if self.target is TierKind.HBM and mgr._tiers[TierKind.HBM].available:
            mgr.prefetch(self.namespace, list(self._seen), TierKind.HBM)
        return self.stored, self.already_present

    def _publish_staged(self) -> None:
        """Verify all staged pages (any failure aborts the transaction), then publish them."""
        mgr = self._mgr
        plen = self.layout.page_bytes
        try:
            mgr._check_layout(self.namespace, self.layout)
            sums = []
            for h, slot, declared, _ in self._staged:
                view = mgr._dram_medium.slot(slot)
                actual = payload_checksum(view[HEADER_BYTES : HEADER_BYTES + plen])
                if declared and declared != actual:
                    raise DataLoss(f"page {h.hex()}: payload checksum {actual:#x} != declared {declared:#x}")
                sums.append(actual)
        except BaseException:
            self.abort()
            raise
        mgr._layouts.setdefault(self.namespace, self.layout)
        dram = mgr._tiers[TierKind.DRAM]
        for (h, slot, _, parent), csum in zip(self._staged, sums, strict=True):
            if (self.namespace, h) in mgr._entries:  # another stream committed it meanwhile
                dram.alloc.free(slot)
                self.already_present += 1
                continue
            gen = mgr._next_generation()
            mgr._dram_medium.slot(slot)[:HEADER_BYTES] = PageHeader(self.namespace, h, self.layout, plen, csum, gen).pack()
            entry = Entry(self.namespace, h, TierKind.DRAM, slot, plen, csum, gen, self.layout)
            entry.parent = (self.namespace, parent) if parent is not None else None
            mgr._publish(entry, TierKind.DRAM)
            dram.counters.bytes_in += plen
            self.stored += 1
        self._staged.clear()
        mgr._space_changed()

    def abort(self) -> None:
        """Free every staged slot; idempotent."""
        if self.done:
            return
        self.done = True
        mgr = self._mgr
        dram = mgr._tiers[TierKind.DRAM].alloc
        for _, slot, _, _ in self._staged:
            dram.free(slot)
        self._staged.clear()
        mgr._put_rejected += 1
        mgr._space_changed()


class TierManager:
    """Owns every page on the node: placement, demotion, promotion, pins and in-flight reads."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self._started = time.monotonic()
        sb = config.slot_bytes
        self._io = ThreadPoolExecutor(max_workers=config.io_threads, thread_name_prefix="kvstore-io")
        self._dram_medium = DramTier(config.dram_bytes, sb)
        self._bounce = BouncePool(sb, keep=config.io_threads + config.read_ahead_pages + 1)
        hbm = HbmTier(config.hbm_bytes, sb)
        if hbm.available:
            self._dram_medium.try_pin()
        nvme = NvmeTier(config.nvme_path, config.nvme_bytes, sb, config.nvme_segment_bytes) if config.nvme_bytes else None
        self._nvme_medium = nvme
        self._hbm_medium = hbm
        self._tiers: dict[TierKind, _Tier] = {
            TierKind.HBM: _Tier(TierKind.HBM, hbm, hbm.num_slots, sb, make_policy(config.policy),
                                hbm.available, hbm.detail),
            TierKind.DRAM: _Tier(TierKind.DRAM, self._dram_medium, self._dram_medium.num_slots, sb,
                                 make_policy(config.policy), True, self._dram_medium.detail),
            TierKind.NVME: _Tier(TierKind.NVME, nvme, nvme.num_slots if nvme else 0, sb,
                                 make_policy(config.policy), nvme is not None,
                                 nvme.detail if nvme else "no --nvme-path / --nvme-bytes configured"),
        }  # fmt: skip
        self._entries: dict[Key, Entry] = {}
        self._layouts: dict[str, PageLayout] = {}
        self._ns_pages: dict[str, int] = {}
        self._durable: dict[int, Key] = {}  # free NVMe slot -> key of the valid copy it still holds
        self._durable_by_key: dict[Key, set[int]] = {}
        self._generation = 1
        self._ttl_pins: list[tuple[float, Key]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._space_waiters: list[asyncio.Future[None]] = []
        self._closing = False
        # Called on every placement change: (namespace, hash, tier or None when the page left the node).
        self.on_change: Callable[[str, bytes, TierKind | None], None] | None = None
        self.index_status: Callable[[], IndexStatus] | None = None  # IndexPublisher.status when publishing
        self._lookups = self._lookup_blocks = self._lookup_matched = 0
        self._prefetch_issued = self._prefetch_completed = 0
        self._prefetch_used = self._prefetch_wasted = 0
        self._prefetching: set[Key] = set()  # pages with a prefetch in flight (one task per page)
        # NOTE: bounds concurrent prefetch I/O so a large Prefetch cannot starve Gets of I/O threads.
        self._prefetch_slots = asyncio.Semaphore(max(1, config.io_threads // 2))
        self._put_rejected = 0
        self.recovered_pages = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Recover NVMe pages from a previous run, then start housekeeping."""
        if self._nvme_medium is not None:
            found = await self._run_io(lambda: list(self._nvme_medium.scan()))
            self._recover(found)
        self._spawn(self._pin_sweeper())

    def _recover(self, found: list[tuple[int, PageHeader]]) -> None:
        best: dict[Key, tuple[int, PageHeader]] = {}
        for slot, hdr in found:
            if hdr.payload_len > self.config.max_page_bytes:
                log.warning("NVMe slot %d: page of %d B exceeds max_page_bytes; ignored", slot, hdr.payload_len)
                continue
            k = (hdr.namespace, hdr.hash)
            if k not in best or hdr.generation > best[k][1].generation:
                best[k] = (slot, hdr)
        nvme = self._tiers[TierKind.NVME]
        ordered = sorted(best.values(), key=lambda sh: sh[1].generation)  # oldest first = LRU order
        kept = []
        for slot, hdr in ordered:
            bound = self._layouts.setdefault(hdr.namespace, hdr.layout)
            if bound != hdr.layout:
                log.warning("NVMe slot %d: layout differs from namespace %r's; ignored", slot, hdr.namespace)
                continue
            kept.append((slot, hdr))
        nvme.alloc.claim_many([s for s, _ in kept])
        kept_slots = {s for s, _ in kept}
        for slot, hdr in found:  # superseded copies stay erasable if their key is deleted
            if slot not in kept_slots and hdr.namespace in self._layouts:
                self._note_durable(slot, (hdr.namespace, hdr.hash))
        for slot, hdr in kept:
            entry = Entry(hdr.namespace, hdr.hash, TierKind.NVME, slot, hdr.payload_len, hdr.checksum,
                          hdr.generation, hdr.layout)  # fmt: skip
            self._publish(entry, TierKind.NVME)
            self._generation = max(self._generation, hdr.generation + 1)
        self.recovered_pages = len(kept)
        if kept:
            log.info("recovered %d page(s) from NVMe in %d namespace(s)", len(kept), len(self._layouts))

    async def close(self) -> None:
        """Spill DRAM pages to free NVMe slots (bounded in time) so a restart is warm, then release."""
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.config.spill_on_shutdown and self._nvme_medium is not None:
            await self._spill(time.monotonic() + self.config.spill_seconds)
        self._io.shutdown(wait=True)
        self._bounce.close()
        if self._nvme_medium is not None:
            self._nvme_medium.close()
        self._hbm_medium.close()

    async def _spill(self, deadline: float) -> None:
        """Write DRAM pages (most recent first) into free NVMe slots; never evicts NVMe pages."""
        dram, nvme = self._tiers[TierKind.DRAM], self._tiers[TierKind.NVME]
        keys = list(dram.policy.candidates())[::-1]
        entries = [e for k in keys if (e := self._entries.get(k)) is not None and e.tier is TierKind.DRAM]
        to_write = [e for e in entries if e.shadow is None]
        # First keep every intact shadow: those pages are durable already, and their slots must not
        # be handed to another page below.
        spilled = 0
        for entry in entries:
            if entry.shadow is not None:
                nvme.alloc.claim(entry.shadow)
                self._forget_durable(entry.shadow)
                spilled += 1
        for entry in to_write:
            if time.monotonic() > deadline or not nvme.alloc.can_allocate():
                break
            slot = nvme.alloc.allocate()
            self._forget_durable(slot)
            view = self._dram_medium.slot(entry.slot)[: entry.used_len]
            await self._run_io(self._nvme_medium.write_slot, slot, view)
            spilled += 1
        if keys:
            log.info("spilled %d of %d DRAM page(s) to NVMe for a warm restart", spilled, len(entries))

    # ------------------------------------------------------------------ queries

    def lookup(self, namespace: str, hashes: list[bytes], prefetch: bool = False) -> LookupResult:
        """Longest stored prefix of a hash chain. Touches no recency and moves nothing (unless
        prefetch is asked for, which promotes the matched NVMe pages in the background)."""
        _check_namespace(namespace)
        self._check_count(hashes, "hashes", limit=65536)
        tiers: list[TierKind] = []
        for i, h in enumerate(hashes):
            _check_hash(h, f"hashes[{i}]")
        for h in hashes:
            entry = self._entries.get((namespace, h))
            if entry is None:
                break
            tiers.append(entry.tier)
        self._lookups += 1
        self._lookup_blocks += len(hashes)
        self._lookup_matched += len(tiers)
        if prefetch and tiers:
            self.prefetch(namespace, hashes[: len(tiers)], TierKind.DRAM)
        return LookupResult(len(tiers), tiers, namespace in self._layouts)

    def begin_put(self, namespace: str, layout: PageLayout, target: TierKind = TierKind.DRAM,
                  parent: bytes | None = None, chain: bool = False) -> PutTxn:  # fmt: skip
        """Open a Put transaction. With `chain`, page i's chain parent is page i-1 and the first page's
        is `parent` (policy hints: prefix-aware policies evict a chain's tail before its head)."""
        if self._closing:
            raise Unavailable("node is shutting down")
        _check_namespace(namespace)
        if layout.page_bytes > self.config.max_page_bytes:
            raise InvalidArgument(
                "open.layout",
                f"page size {layout.page_bytes} B exceeds this node's max_page_bytes {self.config.max_page_bytes} B",
            )
        self._check_layout(namespace, layout)
        if parent is not None:
            _check_hash(parent, "open.parent_hash")
        if self._tiers[TierKind.DRAM].alloc.num_slots == 0:
            raise ResourceExhausted("this node has no DRAM slots (dram_bytes smaller than one slot)")
        return PutTxn(self, namespace, layout, target, parent, chain)

    def layout_of(self, namespace: str) -> PageLayout:
        _check_namespace(namespace)
        try:
            return self._layouts[namespace]
        except KeyError:
            raise NamespaceNotFound(namespace) from None

    async def get(self, namespace: str, hashes: list[bytes], promote: bool = True) -> AsyncIterator[ReadLease]:
        """Yield a lease per page, in order, stopping at the first missing or corrupt page.

        Each lease is released when the generator advances past it or is closed. Up to
        `read_ahead_pages` following pages are read (NVMe I/O, promotion) while the caller streams the
        current one; reading ahead stops at the first page not stored.
        """
        self.layout_of(namespace)
        self._check_count(hashes, "hashes", limit=self.config.max_pages_per_request)
        for i, h in enumerate(hashes):
            _check_hash(h, f"hashes[{i}]")
        keys = [(namespace, h) for h in hashes]
        loop = asyncio.get_running_loop()
        pending: deque[asyncio.Task[ReadLease | None]] = deque()
        nxt = 0

        def read_ahead() -> None:
            nonlocal nxt
            while nxt < len(keys) and len(pending) <= self.config.read_ahead_pages:
                key = keys[nxt]
                pending.append(loop.create_task(self._read_one(key, promote)))
                nxt = nxt + 1 if key in self._entries else len(keys)  # a miss ends the stream

        lease: ReadLease | None = None
        try:
            read_ahead()
            while pending:
                lease = await pending.popleft()
                # Counted here, in request order, so pages read ahead but never returned count nothing.
                self._count_lookup_path(lease.tier if lease is not None else None)
                if lease is None:
                    return
                self._tiers[lease.held_in].policy.on_access(lease.key)
                if (e := self._entries.get(lease.key)) is not None:
                    e.reads += 1
                    self._note_prefetch_fate(e, used=True)
                read_ahead()
                yield lease
                lease.release()
                lease = None
        finally:
            if lease is not None:
                lease.release()
            for task in pending:
                task.cancel()
            for result in await asyncio.gather(*pending, return_exceptions=True):
                if isinstance(result, ReadLease):
                    result.release()

    async def _read_one(self, key: Key, promote: bool) -> ReadLease | None:
        """Lease one page, promoting it first when asked; None when missing or corrupt. Counts bytes
        and checksum failures; hits and misses are counted by the caller, in request order."""
        entry = await self._settled(key)
        if entry is None:
            return None
        found = entry.tier  # hits are credited where the page was found, before any promotion
        if entry.tier is TierKind.NVME and promote:
            await self._promote_to_dram(entry)
            entry = await self._settled(key)
            if entry is None:
                return None
        tier = self._tiers[entry.tier]
        entry.readers += 1
        bounce: mmap.mmap | None = None
        view: memoryview | None = None
        try:
            if entry.tier is TierKind.DRAM:
                payload = self._dram_medium.slot(entry.slot)[HEADER_BYTES : HEADER_BYTES + entry.payload_len]
                ok = payload_checksum(payload) == entry.checksum
            else:
                bounce = self._bounce.take()
                view = memoryview(bounce)[: entry.used_len]
                if entry.tier is TierKind.NVME:
                    await self._run_io(self._nvme_medium.read_slot, entry.slot, view)
                else:
                    await self._run_io(self._hbm_medium.read_to_host, entry.slot, view)
                payload = view[HEADER_BYTES : HEADER_BYTES + entry.payload_len]
                ok = self._verify_slot_copy(entry, view)
        except BaseException:
            entry.readers -= 1
            raise
        if not ok:
            entry.readers -= 1
            self._close_bounce(payload, view, bounce)
            tier.counters.checksum_failures += 1
            log.error("checksum mismatch: page %s in %s slot %d dropped", entry.hash.hex(), tier.kind.label, entry.slot)
            await self._drop(entry, erase=True)
            return None
        tier.counters.bytes_out += entry.payload_len

        def release(entry: Entry = entry) -> None:
            entry.readers -= 1
            if entry.readers == 0:
                self._space_changed()
            self._close_bounce(payload, view, bounce)

        return ReadLease(entry.hash, found, entry.checksum, payload, release, key, entry.tier)

    def _close_bounce(self, payload: memoryview, view: memoryview | None, bounce: mmap.mmap | None) -> None:
        """Release a read's views, then return its bounce buffer (it must have no views left)."""
        payload.release()
        if view is not None:
            view.release()
        if bounce is not None:
            self._bounce.give(bounce)

    def _verify_slot_copy(self, entry: Entry, view: memoryview) -> bool:
        """A slot copied out of NVMe/HBM: header must name this page, payload must match its checksum."""
        try:
            hdr = PageHeader.unpack(view[:HEADER_BYTES])
        except HeaderError:
            return False
        if (hdr.namespace, hdr.hash, hdr.generation) != (entry.namespace, entry.hash, entry.generation):
            return False
        return payload_checksum(view[HEADER_BYTES : HEADER_BYTES + entry.payload_len]) == entry.checksum

    def _count_lookup_path(self, found: TierKind | None) -> None:
        """A requested page missed every available tier faster than where it was found."""
        for kind, tier in self._tiers.items():
            if not tier.available:
                continue
            if found is not None and kind == found:
                tier.counters.hits += 1
                return
            tier.counters.misses += 1

    async def _settled(self, key: Key) -> Entry | None:
        """The entry for key once no move is in flight for it (waits for moves; bounded)."""
        for _ in range(64):
            entry = self._entries.get(key)
            if entry is None or entry.moving is None:
                return entry
            await asyncio.shield(entry.moving)
        raise Unavailable("page kept moving between tiers; retry")

    # ------------------------------------------------------------------ mutations

    async def delete(self, namespace: str, hashes: list[bytes]) -> tuple[int, int, int]:
        """Remove pages; returns (deleted, not_found, busy)."""
        self.layout_of(namespace)
        self._check_count(hashes, "hashes", limit=65536)
        for i, h in enumerate(hashes):
            _check_hash(h, f"hashes[{i}]")
        deleted = not_found = busy = 0
        for h in hashes:
            entry = self._entries.get((namespace, h))
            if entry is None:
                not_found += 1
                await self._erase_durable((namespace, h))
            elif not entry.evictable:
                busy += 1
            else:
                await self._drop(entry, erase=True)
                deleted += 1
        return deleted, not_found, busy

    def pin(self, namespace: str, hashes: list[bytes], ttl_seconds: float = 0.0) -> tuple[int, int]:
        """Pin pages in place; returns (pinned, not_found)."""
        self.layout_of(namespace)
        self._check_count(hashes, "hashes", limit=65536)
        if ttl_seconds < 0:
            raise InvalidArgument("ttl_seconds", "must be >= 0")
        for i, h in enumerate(hashes):
            _check_hash(h, f"hashes[{i}]")
        pinned = not_found = 0
        deadline = time.monotonic() + ttl_seconds
        for h in hashes:
            entry = self._entries.get((namespace, h))
            if entry is None:
                not_found += 1
                continue
            if ttl_seconds > 0:
                entry.pin_deadlines.append(deadline)
                heapq.heappush(self._ttl_pins, (deadline, entry.key))
            else:
                entry.pins += 1
            pinned += 1
        return pinned, not_found

    def unpin(self, namespace: str, hashes: list[bytes]) -> tuple[int, int]:
        """Release one pin per hash (an untimed pin first, else the soonest-expiring lease)."""
        self.layout_of(namespace)
        self._check_count(hashes, "hashes", limit=65536)
        for i, h in enumerate(hashes):
            _check_hash(h, f"hashes[{i}]")
        unpinned = not_pinned = 0
        for h in hashes:
            entry = self._entries.get((namespace, h))
            if entry is not None and entry.pins > 0:
                entry.pins -= 1
                unpinned += 1
            elif entry is not None and entry.pin_deadlines:
                entry.pin_deadlines.remove(min(entry.pin_deadlines))
                unpinned += 1
            else:
                not_pinned += 1
        self._space_changed()
        return unpinned, not_pinned

    async def _pin_sweeper(self) -> None:
        while True:
            await asyncio.sleep(_PIN_SWEEP_SECONDS)
            self.expire_pins(time.monotonic())

    def expire_pins(self, now: float) -> int:
        """Drop pin leases whose deadline passed; returns how many expired."""
        expired = 0
        while self._ttl_pins and self._ttl_pins[0][0] <= now:
            deadline, key = heapq.heappop(self._ttl_pins)
            entry = self._entries.get(key)
            if entry is not None and deadline in entry.pin_deadlines:
                entry.pin_deadlines.remove(deadline)
                expired += 1
        if expired:
            self._space_changed()
        return expired

    def prefetch(self, namespace: str, hashes: list[bytes], target: TierKind = TierKind.DRAM) -> tuple[int, int, int]:
        """Start background promotions toward `target`; returns (scheduled, already_resident, missing)."""
        self.layout_of(namespace)
        self._check_count(hashes, "hashes", limit=65536)
        for i, h in enumerate(hashes):
            _check_hash(h, f"hashes[{i}]")
        if target is TierKind.HBM and not self._tiers[TierKind.HBM].available:
            target = TierKind.DRAM
        scheduled = resident = missing = 0
        for h in hashes:
            key = (namespace, h)
            entry = self._entries.get(key)
            if entry is None:
                missing += 1
            elif entry.tier <= target or key in self._prefetching:
                resident += 1  # there already, or on its way
            else:
                scheduled += 1
                self._prefetch_issued += 1
                self._prefetching.add(key)
                self._spawn(self._prefetch_one(key, target))
        return scheduled, resident, missing

    async def _prefetch_one(self, key: Key, target: TierKind) -> None:
        """Promote one page toward target. A Get that arrives meanwhile waits for the move (entry.moving)
        instead of reading the page a second time; a page promoted here counts as used when a Get reads
        it, and as wasted when it leaves the tier (or the node) unread."""
        try:
            async with self._prefetch_slots:
                entry = await self._settled(key)
                if entry is not None and entry.tier is TierKind.NVME:
                    await self._promote_to_dram(entry)
                entry = await self._settled(key)
                if entry is not None and target is TierKind.HBM and entry.tier is TierKind.DRAM:
                    await self._promote_dram_to_hbm(entry)
                entry = self._entries.get(key)
                if entry is not None and entry.tier <= target:
                    entry.prefetched = True
                    self._prefetch_completed += 1
        except (ResourceExhausted, Unavailable) as exc:
            log.debug("prefetch of %s skipped: %s", key[1].hex(), exc)
        finally:
            self._prefetching.discard(key)

    def _note_prefetch_fate(self, entry: Entry, used: bool) -> None:
        if entry.prefetched:
            entry.prefetched = False
            if used:
                self._prefetch_used += 1
            else:
                self._prefetch_wasted += 1

    # ------------------------------------------------------------------ moves

    async def _allocate(self, kind: TierKind, reserve: int = 0, wait: bool = True) -> int:
        """A free slot in `kind`, evicting (demoting or dropping) victims as needed.

        Raises ResourceExhausted when nothing in the tier can be evicted. `reserve` is the number of
        slots the caller already holds unpublished (named in the error so the limit is visible). With
        `wait`, a tier blocked only by other streams' staged pages or by reads and moves in flight is
        waited on for up to alloc_wait_seconds before giving up.
        """
        tier = self._tiers[kind]
        if not tier.available:
            raise ResourceExhausted(f"{kind.label} tier is not available on this node")
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        for _ in range(tier.alloc.num_slots + _MAX_SPACE_WAITS):
            if tier.alloc.can_allocate():
                slot = tier.alloc.allocate()
                if kind is TierKind.NVME:
                    self._forget_durable(slot)
                return slot
            victim_key = first_usable(tier.policy, lambda k: self._entries[k].evictable)
            if victim_key is not None:
                await self._evict(self._entries[victim_key])
                continue
            # Nothing evictable now. If other streams hold staged (or pages are being read or moved),
            # space will come back when they finish: wait for it, bounded, instead of failing.
            in_transit = tier.alloc.used_count - tier.pages  # staged by streams or inbound moves
            busy = in_transit > reserve or any(
                (e := self._entries[k]).readers or e.moving for k in tier.policy.candidates()
            )
            if wait and busy and kind is not TierKind.NVME:
                deadline = deadline if deadline is not None else loop.time() + self.config.alloc_wait_seconds
                if loop.time() < deadline:
                    await self._wait_for_space(deadline - loop.time())
                    continue
            raise ResourceExhausted(
                f"{kind.label} tier is full ({tier.alloc.num_slots} slots, {reserve} held by this request, "
                f"{tier.alloc.used_count - tier.pages - reserve} in transit for others) and every page in it is pinned, "
                "being read or being moved"
            )
        raise ResourceExhausted(f"{kind.label} tier: could not free a slot (contention); retry")

    async def _wait_for_space(self, timeout: float) -> None:
        """Sleep until something may have become free or evictable, or timeout."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._space_waiters.append(fut)
        try:
            async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancellation on 3.11
                await fut
        except TimeoutError:
            pass
        finally:
            if fut in self._space_waiters:
                self._space_waiters.remove(fut)

    def _space_changed(self) -> None:
        """Wake every allocation waiting for a slot (they re-check; cheap when nobody waits)."""
        if self._space_waiters:
            waiters, self._space_waiters = self._space_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    async def _evict(self, entry: Entry) -> None:
        """Move a victim one tier down, or drop it when there is no slower tier with room."""
        src = self._tiers[entry.tier]
        src.counters.evictions += 1
        self._note_prefetch_fate(entry, used=False)
        if entry.tier is TierKind.HBM:
            await self._move(entry, TierKind.DRAM, demotion=True)
            return
        if entry.tier is TierKind.DRAM and self._tiers[TierKind.NVME].available:
            try:
                await self._move(entry, TierKind.NVME, demotion=True)
                return
            except ResourceExhausted:
                pass  # NVMe full of unevictable pages: fall through to dropping
        src.counters.dropped += 1
        await self._drop(entry, erase=False)

    async def _promote_to_dram(self, entry: Entry) -> None:
        """NVMe -> DRAM. If DRAM has nothing evictable the page stays on NVMe (served from there)."""
        if entry.tier is not TierKind.NVME or entry.moving is not None:
            return
        try:
            await self._move(entry, TierKind.DRAM, demotion=False)
        except ResourceExhausted:
            log.debug("no DRAM room to promote %s; serving from NVMe", entry.hash.hex())

    async def _promote_dram_to_hbm(self, entry: Entry) -> None:
        if entry.tier is TierKind.DRAM and entry.moving is None:
            await self._move(entry, TierKind.HBM, demotion=False)

    async def _move(self, entry: Entry, dst_kind: TierKind, demotion: bool) -> None:
        """Copy a page to a slot in dst_kind, verify where needed, then switch and free the source.

        While the copy runs, `entry.moving` makes readers wait and keeps the page from being chosen as
        a victim or deleted; the source slot stays intact until the switch.
        """
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry.moving = fut
        src_kind, src_slot = entry.tier, entry.slot
        dst = self._tiers[dst_kind]
        dst_slot: int | None = None
        try:
            if dst_kind is TierKind.NVME and entry.shadow is not None:
                # Clean demotion: the durable copy from before its promotion is still intact.
                dst_slot = entry.shadow
                dst.alloc.claim(dst_slot)
                self._forget_durable(dst_slot)
            else:
                # A promotion never waits for space: the page is served from where it is instead.
                dst_slot = await self._allocate(dst_kind, wait=demotion)
                await self._copy(entry, src_kind, src_slot, dst_kind, dst_slot)
            promoted_from_nvme = dst_kind is TierKind.DRAM and src_kind is TierKind.NVME
            if promoted_from_nvme and not self._verify_slot_copy(entry, self._dram_medium.slot(dst_slot)[: entry.used_len]):
                self._tiers[src_kind].counters.checksum_failures += 1
                dst.alloc.free(dst_slot)
                dst_slot = None
                log.error("checksum mismatch promoting %s from NVMe; page dropped", entry.hash.hex())
                entry.moving = None
                await self._drop(entry, erase=True)
                return
            self._unpublish(entry)
            self._tiers[src_kind].alloc.free(src_slot)
            if src_kind is TierKind.NVME:
                self._note_durable(src_slot, entry.key)
                entry.shadow = src_slot
            entry.tier, entry.slot = dst_kind, dst_slot
            dst_slot = None
            self._publish(entry, dst_kind)
            self._tiers[src_kind].counters.bytes_out += entry.payload_len
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
            self._space_changed()

    async def _copy(self, entry: Entry, src: TierKind, src_slot: int, dst: TierKind, dst_slot: int) -> None:
        n = entry.used_len
        if src is TierKind.DRAM and dst is TierKind.NVME:
            await self._run_io(self._nvme_medium.write_slot, dst_slot, self._dram_medium.slot(src_slot)[:n])
        elif src is TierKind.NVME and dst is TierKind.DRAM:
            await self._run_io(self._nvme_medium.read_slot, src_slot, self._dram_medium.slot(dst_slot)[:n])
        elif src is TierKind.DRAM and dst is TierKind.HBM:
            await self._run_io(self._hbm_medium.write_from_host, dst_slot, self._dram_medium.slot(src_slot)[:n])
        elif src is TierKind.HBM and dst is TierKind.DRAM:
            await self._run_io(self._hbm_medium.read_to_host, src_slot, self._dram_medium.slot(dst_slot)[:n])
        else:
            raise AssertionError(f"no direct path {src.label} -> {dst.label}")

    async def _drop(self, entry: Entry, erase: bool) -> None:
        """Remove a page from the node. erase=True also erases durable copies (delete, corruption)."""
        if self._entries.get(entry.key) is not entry:
            return
        self._note_prefetch_fate(entry, used=False)
        self._unpublish(entry)
        del self._entries[entry.key]
        self._ns_pages[entry.namespace] -= 1
        if self.on_change is not None:
            self.on_change(entry.namespace, entry.hash, None)
        entry.shadow = None
        if erase:
            if entry.tier is TierKind.NVME:
                await self._run_io(self._nvme_medium.invalidate, entry.slot)
            await self._erase_durable(entry.key)
        self._tiers[entry.tier].alloc.free(entry.slot)
        if entry.tier is TierKind.NVME and not erase:
            self._note_durable(entry.slot, entry.key)
        self._space_changed()

    def _publish(self, entry: Entry, kind: TierKind) -> None:
        tier = self._tiers[kind]
        if entry.key not in self._entries:
            self._entries[entry.key] = entry
            self._ns_pages[entry.namespace] = self._ns_pages.get(entry.namespace, 0) + 1
        tier.policy.on_insert(entry.key, parent=entry.parent, reads=entry.reads)  # type: ignore[call-arg]
        tier.pages += 1
        tier.used_bytes += entry.payload_len
        if self.on_change is not None:
            self.on_change(entry.namespace, entry.hash, kind)

    def _unpublish(self, entry: Entry) -> None:
        tier = self._tiers[entry.tier]
        tier.policy.on_remove(entry.key)
        tier.pages -= 1
        tier.used_bytes -= entry.payload_len

    def _note_durable(self, nvme_slot: int, key: Key) -> None:
        self._durable[nvme_slot] = key
        self._durable_by_key.setdefault(key, set()).add(nvme_slot)

    def _forget_durable(self, nvme_slot: int) -> None:
        """The slot is being reused: its old copy stops counting (it will be overwritten)."""
        key = self._durable.pop(nvme_slot, None)
        if key is None:
            return
        slots = self._durable_by_key[key]
        slots.discard(nvme_slot)
        if not slots:
            del self._durable_by_key[key]
        if (entry := self._entries.get(key)) is not None and entry.shadow == nvme_slot:
            entry.shadow = None

    async def _erase_durable(self, key: Key) -> None:
        """Durably erase every free NVMe slot still holding a copy of key."""
        for slot in sorted(self._durable_by_key.get(key, ())):
            self._forget_durable(slot)
            await self._run_io(self._nvme_medium.invalidate, slot)

    # ------------------------------------------------------------------ helpers

    def _check_layout(self, namespace: str, layout: PageLayout) -> None:
        bound = self._layouts.get(namespace)
        if bound is not None and bound != layout:
            raise LayoutMismatch(
                f"open.layout: namespace {namespace!r} holds pages of layout {bound.describe()}; "
                f"this Put sends {layout.describe()}"
            )

    def _check_count(self, hashes: list[bytes], field_name: str, limit: int) -> None:
        if len(hashes) > limit:
            raise InvalidArgument(field_name, f"{len(hashes)} hashes in one request; the limit is {limit}")

    def _next_generation(self) -> int:
        gen = self._generation
        self._generation += 1
        return gen

    def _spawn(self, coro: object) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_io(self, fn: object, *args: object) -> object:
        """Run blocking I/O in the pool. Cancellation waits for the I/O to finish before it propagates.

        NOTE: the worker thread reads or writes our buffers (DRAM slots, bounce buffers). If a
        cancelled caller's cleanup freed a slot while the thread still wrote into it, the slot could be
        handed to a Put and overwritten after its bytes arrived, before its checksum is taken.
        """
        fut = asyncio.get_running_loop().run_in_executor(self._io, fn, *args)  # type: ignore[arg-type]
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            for _ in range(_MAX_CANCEL_DEFERRALS):
                if fut.done():
                    break
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([fut])
            raise

    def holdings(self) -> list[tuple[str, bytes, TierKind]]:
        """Every visible page as (namespace, hash, tier): a snapshot for a full index publish."""
        return [(e.namespace, e.hash, e.tier) for e in self._entries.values()]

    def occupancy(self) -> dict[str, int]:
        """Pages and slots per tier, flat (published in the index's node info)."""
        out: dict[str, int] = {}
        for kind, t in self._tiers.items():
            out[f"pages_{kind.label}"] = t.pages
            out[f"slots_used_{kind.label}"] = t.alloc.used_count
            out[f"slots_total_{kind.label}"] = t.alloc.num_slots if t.available else 0
        return out

    def entry(self, namespace: str, h: bytes) -> Entry | None:
        """The entry of a page, for tests and tools (read-only use)."""
        return self._entries.get((namespace, h))

    def nvme_slot_location(self, slot: int) -> tuple[str, int]:
        if self._nvme_medium is None:
            raise RuntimeError("no NVMe tier")
        path, off = self._nvme_medium.slot_location(slot)
        return str(path), off

    def stats(self) -> NodeStats:
        tiers = []
        for kind, t in self._tiers.items():
            tiers.append(TierStats(
                tier=kind, available=t.available, detail=t.detail,
                capacity_bytes=t.alloc.num_slots * t.slot_bytes if t.available else 0,
                used_bytes=t.used_bytes, slot_bytes=t.slot_bytes,
                slots_total=t.alloc.num_slots if t.available else 0, slots_used=t.alloc.used_count,
                pages=t.pages, counters=copy_counters(t.counters),
            ))  # fmt: skip
        namespaces = [(ns, layout, self._ns_pages.get(ns, 0)) for ns, layout in sorted(self._layouts.items())]
        return NodeStats(
            node_id=self.config.node_id,
            uptime_seconds=time.monotonic() - self._started,
            max_page_bytes=self.config.max_page_bytes,
            tiers=tiers,
            namespaces=namespaces,
            lookups=self._lookups,
            lookup_blocks=self._lookup_blocks,
            lookup_matched=self._lookup_matched,
            prefetch_issued=self._prefetch_issued,
            prefetch_completed=self._prefetch_completed,
            prefetch_used=self._prefetch_used,
            prefetch_wasted=self._prefetch_wasted,
            pinned_pages=sum(1 for e in self._entries.values() if e.pinned),
            put_rejected=self._put_rejected,
            index=self.index_status() if self.index_status is not None else None,
        )


def _check_namespace(namespace: str) -> None:
    try:
        validate_namespace(namespace)
    except HashContractError as exc:
        raise InvalidArgument("namespace", str(exc)) from None


def _check_hash(h: bytes, field_name: str) -> None:
    if len(h) != HASH_BYTES:
        raise InvalidArgument(field_name, f"a block hash is {HASH_BYTES} bytes, got {len(h)}")

