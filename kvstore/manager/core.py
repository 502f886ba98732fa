"""TierManager: the node's one entry point to its pages (DESIGN.md §5, §6).

It wires the parts (kvstore/manager/*) and answers every request; the parts decide where pages go and
the media (kvstore/tiers) only move bytes. All bookkeeping runs on one asyncio event loop, so nothing
needs locks; blocking I/O (NVMe, CUDA copies) runs in a bounded thread pool (IoPool).

Invariants (each part's docstring states its own):
- a visible page is in exactly one tier (exclusive tiers: capacities add up) — PageTable;
- a page is visible only once its bytes and header are complete in its slot, and, on NVMe, durable —
  PutTxn, Mover;
- a page being read, pinned, or moved is never chosen as a victim, and its slot is never freed or
  overwritten — Placement, Reader, Mover;
- every read verifies the payload checksum; a mismatch is counted, the page is dropped, the read is a
  miss — Reader, Mover;
- a deleted page never comes back after a restart — DurableCopies.

Pins and their leases are pins.py (`Pins`), the Stats snapshot snapshot.py (`node_stats`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from kvstore.config import NodeConfig
from kvstore.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvstore.layout import PageLayout
from kvstore.manager.durable import DurableCopies
from kvstore.manager.io import IoPool
from kvstore.manager.ledger import TenantLedger
from kvstore.manager.moves import Mover
from kvstore.manager.pins import Pins
from kvstore.manager.placement import Placement
from kvstore.manager.prefetch import Prefetcher
from kvstore.manager.put import PutTxn, Staging, WriteThrough
from kvstore.manager.quotas import TenantQuotas
from kvstore.manager.reads import Reader, ReadLease
from kvstore.manager.retention import RetainCall, RetainCaps, Retention
from kvstore.manager.scrub import Scrubber
from kvstore.manager.snapshot import node_stats
from kvstore.manager.state import (
    ChangeListener,
    Entry,
    NodeCounters,
    PageTable,
    Tier,
    check_hash,
    check_hashes,
    check_namespace,
)
from kvstore.names import Key, TierKind
from kvstore.pageformat import slot_bytes_for
from kvstore.policy import make_policy
from kvstore.stats import (
    IndexStatus,
    KvEventsStatus,
    LookupResult,
    NodeStats,
    ReportResult,
    RetainResult,
    TierFetch,
)
from kvstore.tiers.base import Absent, Medium
from kvstore.tiers.dram import BouncePool, DramMedium
from kvstore.tiers.hbm import HbmMedium
from kvstore.tiers.nvme import NvmeMedium
from kvstore.wire import MAX_HASHES, PutOpen

log = logging.getLogger(__name__)

_PIN_SWEEP_SECONDS = 1.0


def build_media(config: NodeConfig) -> list[Medium]:
    """The node's media, from its config: HBM (when CUDA is here), the DRAM slab, NVMe segment files; each
    cut into chunks of the largest slot (`config.slot_bytes`), which hold pages of any size up to it."""
    chunk = config.slot_bytes
    dram = DramMedium(config.dram_bytes, chunk)
    hbm = HbmMedium(config.hbm_bytes, chunk)
    if hbm.available:
        dram.try_pin()
    if config.nvme_bytes:
        nvme: Medium = NvmeMedium(config.nvme_path, config.nvme_bytes, chunk, config.nvme_segment_bytes)
    else:
        nvme = Absent(TierKind.NVME, chunk, "no --nvme-path / --nvme-bytes configured")
    return [hbm, dram, nvme]


class TierManager:
    """Owns every page on the node: placement, demotion, promotion, pins and in-flight reads."""

    def __init__(
        self,
        config: NodeConfig,
        media: list[Medium] | None = None,
        shares: dict[str, dict[TierKind, int]] | None = None,
    ) -> None:
        """`shares`: tenant -> tier -> most bytes its pages' slots may hold there (kvstore/manager/quotas.py)."""
        self.config = config
        self._started = time.monotonic()
        self.io = IoPool(config.io_threads)
        media = build_media(config) if media is None else media
        self.table = PageTable([Tier(m, make_policy(config.policy)) for m in media])
        staging = next((t for t in self.table.tiers.values() if t.medium.host_memory), None)
        if staging is None:
            raise ValueError("a node needs a host-memory tier (DRAM) for Put streams to land in")
        self.counters = NodeCounters()
        # Buffers for every read a Get can have in flight (up to the deepest medium's queue) and the pool's.
        depth = max([config.read_ahead_pages + 1, *(m.queue_depth for m in media if not m.host_memory)])
        self._bounce = BouncePool(config.slot_bytes, keep=config.io_threads + depth + 1)
        self.durable = DurableCopies(self.table, self.io)
        quotas = TenantQuotas(shares) if shares else None
        if quotas is not None:
            quotas.attach(self.table.tiers.values(), lambda: make_policy(config.policy))
        self.placement = Placement(self.table, self.durable, config.alloc_wait_seconds, quotas)
        self.tenants = TenantLedger(self.table, quotas)
        self.mover = Mover(
            self.table, self.placement, self.durable, io=self.io, bounce=self._bounce, counters=self.counters
        )
        self.placement.evict = self.mover.evict
        self.reader = Reader(
            self.table,
            self.mover,
            self.placement,
            self._bounce,
            self.counters,
            read_ahead=config.read_ahead_pages,
            promote_to=staging.kind,
        )
        self.scrubber = (
            Scrubber(self.table, staging.kind, self.counters, config.scrub_bytes_per_second, self.reader.corrupt)
            if config.scrub_bytes_per_second
            else None
        )
        # NOTE: half the I/O threads at most, so a large Prefetch cannot starve Gets of I/O threads.
        self.prefetcher = Prefetcher(self.table, self.mover, self.counters, self._spawn, config.io_threads // 2)
        durable_kind = self.durable.tier.kind if self.durable.tier is not None else None
        through = WriteThrough(self.table, self.placement, self.io, self._bounce, durable_kind)
        self.staging = Staging(
            self.table,
            self.placement,
            self.counters,
            kind=staging.kind,
            max_pages=config.max_pages_per_request,
            after_commit=self._after_commit,
            through=through,
        )
        # Retention (DESIGN.md §6.5): sessions' holds, honoured by the one evictability test (Entry.hold_from), so
        # every policy keeps them; fed every placement change; its hold caps gate promotions.
        self._caps: dict[str, RetainCaps] = {}
        # NOTE: keys named may outnumber the pages the node could hold of the largest size (small pages, pending
        # ones), so the bound counts the smallest slot's.
        smallest = slot_bytes_for(1)
        slots = sum(t.alloc.capacity_bytes // smallest for t in self.table.tiers.values() if t.available)
        self.retention = Retention(self.table, self.retain_caps, max(MAX_HASHES, slots))
        self.table.listeners.append(self.retention.on_change)
        self.mover.reserve_promotion = self.retention.reserve_promotion
        self.pins = Pins(self.table, self.placement)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self.index_status: Callable[[], IndexStatus] | None = None  # IndexPublisher.status when publishing
        self.kv_events_status: Callable[[], KvEventsStatus] | None = None  # the KV-event publisher's, when on
        self.recovered_pages = 0

    def listen(self, listener: ChangeListener) -> None:
        """Call `listener` on every placement change: (namespace, hash, tier now or None when the page left
        the node, tier before or None when it is new here)."""
        self.table.listeners.append(listener)

    def unlisten(self, listener: ChangeListener) -> None:
        if listener in self.table.listeners:
            self.table.listeners.remove(listener)

    def medium(self, kind: TierKind) -> Medium:
        """The medium of a tier (for tools and fault-injection tests)."""
        return self.table.tiers[kind].medium

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Recover pages of the persistent tier from a previous run, then start housekeeping."""
        if self.durable.tier is not None:
            medium = self.durable.tier.medium
            found = await self.io.run(lambda: list(medium.scan()))
            self.durable.tier.counters.checksum_failures += medium.scan_failures
            self.recovered_pages = self.durable.recover(found, self.config.max_page_bytes, medium.chunk_classes)
        self._spawn(self._pin_sweeper())
        if self.scrubber is not None:
            self._spawn(self.scrubber.run())

    async def close(self) -> None:
        """Spill DRAM pages to free NVMe slots (bounded in time) so a restart is warm, then release."""
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.config.spill_on_shutdown:
            try:
                await self.durable.spill(time.monotonic() + self.config.spill_seconds)
            except Exception:  # a failed spill must not turn a clean shutdown into a crash
                log.exception("shutdown spill failed; DRAM pages not spilled are lost")
        self.io.shutdown()
        self._bounce.close()
        for tier in self.table.tiers.values():
            tier.medium.close()

    # ------------------------------------------------------------------ queries

    def lookup(self, namespace: str, hashes: list[bytes], prefetch: bool = False) -> LookupResult:
        """Longest stored prefix of a hash chain. Touches no recency and moves nothing (unless
        prefetch is asked for, which promotes the matched pages in the background)."""
        check_namespace(namespace)
        check_hashes(hashes, "hashes", MAX_HASHES)
        tiers: list[TierKind] = []
        per_tier: dict[TierKind, list[int]] = {}  # tier -> [pages, payload bytes] of the matched prefix
        for h in hashes:
            entry = self.table.get((namespace, h))
            if entry is None:
                break
            tiers.append(entry.tier)
            n = per_tier.get(entry.tier)
            if n is None:
                n = per_tier[entry.tier] = [0, 0]
            n[0] += 1
            n[1] += entry.payload_len
        c = self.counters
        c.lookups += 1
        c.lookup_blocks += len(hashes)
        c.lookup_matched += len(tiers)
        if prefetch and tiers:
            self.prefetcher.prefetch([(namespace, h) for h in hashes[: len(tiers)]], self.staging.tier.kind)
        fetch = self.fetch_estimate(per_tier)
        return LookupResult(
            len(tiers), tiers, namespace in self.table.layouts, fetch, sum(f.expected_ms for f in fetch)
        )

    def fetch_estimate(self, per_tier: dict[TierKind, list[int]]) -> list[TierFetch]:
        """The node's fetch-time estimate for pages per tier ([pages, bytes]), fastest first (DESIGN.md §6.6)."""
        rates = self.reader.rates
        return [rates.estimate(k, n[0], n[1]) for k, n in sorted(per_tier.items())]

    def begin_put(self, op: PutOpen) -> PutTxn:
        """Open a Put transaction in `op.namespace` (the stored, tenant-scoped one). With `op.chain`, page
        i's chain parent is page i-1 and the first page's is `op.parent` (policy hints: prefix-aware
        policies evict a chain's tail before its head). `op.target_tier` (the one place every plane's target
        is handled): None or DRAM, the staging tier; NVMe, written through to the persistent tier, never
        taking a DRAM slot (InvalidArgument on a node without one); HBM, staged, then promoted where the
        node has a GPU (`_after_commit`)."""
        if self._closing:
            raise Unavailable("node is shutting down")
        if op.target_tier is TierKind.NVME and self.staging.through_kind is not TierKind.NVME:
            raise InvalidArgument(
                "open.target_tier",
                "TIER_NVME: this node has no NVMe tier (started without --nvme-path/--nvme-bytes); "
                "put to DRAM (TIER_UNSPECIFIED) or to a node with NVMe",
            )
        check_namespace(op.namespace)
        layout = op.layout
        if layout.page_bytes > self.config.max_page_bytes:
            raise InvalidArgument(
                "open.layout",
                f"page size {layout.page_bytes} B exceeds this node's max_page_bytes {self.config.max_page_bytes} B",
            )
        self.table.check_layout(op.namespace, layout)
        self.table.learn_parts(op.namespace, layout)
        if op.parent is not None:
            check_hash(op.parent, "open.parent_hash")
        if self.staging.tier.alloc.num_chunks == 0:
            raise ResourceExhausted(
                "this node has no DRAM slots (dram_bytes smaller than one chunk: a 4 KiB header + max_page_bytes)"
            )
        return PutTxn(self.staging, op)

    def _after_commit(self, keys: list[Key], target: TierKind) -> None:
        """A writer that asked for a tier faster than staging (HBM) gets its pages promoted there."""
        if target < self.staging.tier.kind and self.table.tiers[target].available:
            self.prefetcher.prefetch(keys, target)

    def layout_of(self, namespace: str) -> PageLayout:
        return self.table.layout_of(namespace)

    def get(
        self,
        namespace: str,
        hashes: list[bytes],
        *,
        promote: bool = True,
        into: Sequence[memoryview] | None = None,
        receiver_verifies: bool = False,
        expect: PageLayout | None = None,
    ) -> AsyncIterator[ReadLease]:
        """Yield a lease per page, in order, stopping at the first missing or corrupt page (Reader.get).
        With `into` (one writable view per hash, each a page long), page i is copied into into[i] as it is
        verified. `receiver_verifies`: whoever receives the bytes checks them (a client across a network
        plane), so DRAM pages are not re-hashed (DESIGN.md §8). `expect`: the layout the caller will read its
        pages as (a bundle's parts): LayoutMismatch naming the part when the namespace holds another. Arguments
        are checked before the first page is read."""
        self.layout_of(namespace)
        if expect is not None:
            self.table.check_read_layout(namespace, expect)
            self.table.learn_parts(namespace, expect)
        check_hashes(hashes, "hashes", self.config.max_pages_per_request)
        if into is not None and len(into) != len(hashes):
            raise InvalidArgument("into", f"{len(into)} destinations for {len(hashes)} hashes")
        return self.reader.get(
            [(namespace, h) for h in hashes], promote=promote, into=into, receiver_verifies=receiver_verifies
        )

    async def report_corrupt(
        self, namespace: str, hashes: list[bytes], allow: Callable[[int], int] | None = None
    ) -> ReportResult:
        """Clients received these pages with bytes that failed their checksum: verify this node's copy of
        each; a copy that fails is dropped and counted, one that passes stays (the damage was on the way).
        A hash named twice is one page (verified once, counted once). `allow(n)` says how many of the n
        distinct pages the reporting caller may have verified (its rate; None: all); the rest are counted,
        not read. Pages not stored count as neither dropped nor intact."""
        self.layout_of(namespace)
        check_hashes(hashes, "hashes", MAX_HASHES)
        distinct = list(dict.fromkeys(hashes))  # NOTE: first-seen order: the client's order of reading
        checked = len(distinct) if allow is None else max(0, min(len(distinct), allow(len(distinct))))
        dropped = intact = 0
        for h in distinct[:checked]:
            ok = await self.reader.verify((namespace, h))
            if ok is False:
                dropped += 1
            elif ok:
                intact += 1
        c = self.counters
        c.corrupt_reports += len(distinct)
        c.corrupt_confirmed += dropped
        c.corrupt_unconfirmed += len(distinct) - dropped
        c.corrupt_unchecked += len(distinct) - checked
        return ReportResult(dropped, intact, len(distinct) - checked)

    # ------------------------------------------------------------------ mutations

    async def delete(self, namespace: str, hashes: list[bytes]) -> tuple[int, int, int]:
        """Remove pages; returns (deleted, not_found, busy)."""
        self.layout_of(namespace)
        check_hashes(hashes, "hashes", MAX_HASHES)
        deleted = not_found = busy = 0
        for h in hashes:
            entry = self.table.get((namespace, h))
            if entry is None:
                not_found += 1
                await self.durable.erase((namespace, h))
            elif not entry.evictable or entry.retained:  # a session's retained page stays until released
                busy += 1
            else:
                await self.mover.drop(entry, erase=True)
                deleted += 1
        return deleted, not_found, busy

    def pin(self, namespace: str, hashes: list[bytes], ttl_seconds: float = 0.0) -> tuple[int, int]:
        """Pin pages in place; returns (pinned, not_found) (pins.py)."""
        return self.pins.pin(namespace, hashes, ttl_seconds)

    def unpin(self, namespace: str, hashes: list[bytes]) -> tuple[int, int]:
        """Release one pin per hash (an untimed pin first, else the soonest-expiring lease; pins.py)."""
        return self.pins.unpin(namespace, hashes)

    def retain_caps(self, tenant: str) -> RetainCaps:
        """A tenant's retention caps (DESIGN.md §6.5): `retain_fraction` of its bytes of the slowest tier (its
        share where it has one, else the tier's), and of each faster tier for what it holds there (HOLD), counted
        in pages of the node's largest slot (`config.slot_bytes`).

        NOTE: pages of the largest slot, not bytes: so a tenant never retains more than the fraction of its bytes
        whatever its pages' sizes; one whose pages are smaller retains fewer bytes than the fraction allows."""
        caps = self._caps.get(tenant)
        if caps is not None:
            return caps
        f = self.config.retain_fraction
        quotas = self.placement.quotas
        available = [k for k, t in self.table.tiers.items() if t.available]

        def slots(kind: TierKind) -> int:
            share = quotas.cap(tenant, kind) if quotas is not None else None
            nbytes = self.table.tiers[kind].alloc.capacity_bytes if share is None else share
            return nbytes // self.config.slot_bytes

        slowest = max(available)
        caps = RetainCaps(int(f * slots(slowest)), {k: int(f * slots(k)) for k in available if k < slowest}, f)
        if len(self._caps) < 4096:  # NOTE: tenants come from the tenants file and the token files: few
            self._caps[tenant] = caps
        return caps

    def retain(self, tenant: str, call: RetainCall) -> RetainResult:
        """One Retain call of `tenant`, its keys scoped to it (kvstore/manager/retention.py). Synchronous and
        O(pages it names): it never waits for I/O; a RESUME's promotions run in the background (the Prefetcher's
        bounded concurrency)."""
        if self._closing:
            raise Unavailable("node is shutting down")
        for i, (ns, h) in enumerate(call.keys):
            if i == 0:
                check_namespace(ns)
            check_hash(h, f"hashes[{i}]")
        out = self.retention.apply(tenant, call, time.monotonic())
        scheduled = 0
        if out.prefetch:
            scheduled, _, _ = self.prefetcher.prefetch(out.prefetch, self.staging.tier.kind)
            self.retention.note_resumed(tenant, scheduled)
        if out.released or out.displaced:
            self.placement.space_changed()  # pages evictable again: writers waiting for room re-check
        return RetainResult(out.retained, out.pending, out.released, scheduled, out.state, out.displaced)

    async def _pin_sweeper(self) -> None:
        while True:
            await asyncio.sleep(_PIN_SWEEP_SECONDS)
            now = time.monotonic()
            self.expire_pins(now)
            if self.retention.expire(now):
                self.placement.space_changed()
            self.tenants.settle()  # cross-tenant checks of the misses noted meanwhile, off the request path

    def expire_pins(self, now: float) -> int:
        """Drop pin leases whose deadline passed; returns how many expired."""
        return self.pins.expire(now)

    def prefetch(self, namespace: str, hashes: list[bytes], target: TierKind = TierKind.DRAM) -> tuple[int, int, int]:
        """Start background promotions toward `target`; returns (scheduled, already_resident, missing)."""
        self.layout_of(namespace)
        check_hashes(hashes, "hashes", MAX_HASHES)
        return self.prefetcher.prefetch([(namespace, h) for h in hashes], target)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ reporting

    def holdings(self) -> list[tuple[str, bytes, TierKind]]:
        return self.table.holdings()

    def occupancy(self) -> dict[str, int]:
        return self.table.occupancy()

    def entry(self, namespace: str, h: bytes) -> Entry | None:
        """The entry of a page, for tests and tools (read-only use)."""
        return self.table.get((namespace, h))

    def nvme_slot_location(self, slot: int) -> tuple[str, int]:
        """(file, offset) of an NVMe slot, for tools and fault tests (Medium.slot_location)."""
        where = self.table.tiers[TierKind.NVME].medium.slot_location(slot)
        if where is None:
            raise RuntimeError("no NVMe tier")
        return where

    def stats(self) -> NodeStats:
        """The node's Stats snapshot (snapshot.py)."""
        return node_stats(
            self.table,
            config=self.config,
            counters=self.counters,
            started=self._started,
            tenants=self.tenants,
            retention=self.retention,
            index_status=self.index_status,
            kv_events_status=self.kv_events_status,
        )
