"""The node's page table: which page is where, per-tier occupancy, namespaces and their layouts.

Pure bookkeeping over small records (no I/O, no waiting), shared by every other manager module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument, LayoutMismatch, NamespaceNotFound
from kvstore.hashing import HASH_BYTES, validate_namespace
from kvstore.layout import PageLayout, bundle_difference
from kvstore.names import Key, TierKind
from kvstore.pageformat import identity_digest, slot_bytes_for
from kvstore.policy import EvictionPolicy
from kvstore.scoping import tenant_of, unscope
from kvstore.stats import TierCounters
from kvstore.tiers.base import Medium
from kvstore.tiers.slots import SizeClassAllocator

# (namespace, hash, tier now or None: gone from the node, tier before or None: new on the node)
ChangeListener = Callable[[str, bytes, TierKind | None, TierKind | None], None]

# Entry.hold_from of a page no session retains: no tier refuses to evict it (kvstore/manager/retention.py).
UNRETAINED = 1 << 30


@dataclass(slots=True, eq=False)
class Entry:
    """One visible page. `tier`/`slot` change only inside a move, while `moving` is set; `slot` is the byte
    offset of its slot in its tier's medium, a slot of `used_len` bytes (header block plus payload rounded to
    4 KiB: the same in every tier; kvstore/tiers/slots.py)."""

    namespace: str
    hash: bytes
    tier: TierKind
    slot: int
    payload_len: int
    checksum: int  # stored form: bound to (namespace, hash, layout) (pageformat, DESIGN.md §8)
    generation: int
    layout: PageLayout
    pins: int = 0
    pin_deadlines: list[float] = field(default_factory=list)
    readers: int = 0
    moving: asyncio.Future[None] | None = None
    shadow: int | None = None  # free slot of the persistent tier still holding this page's durable copy
    prefetched: bool = False  # promoted by a prefetch and not read since (used / wasted accounting)
    parent: Key | None = None  # previous block of its chain, when the writer said (policy hint)
    reads: int = 0  # reads since stored, in any tier (policy hint; travels with the page)
    # Retention (kvstore/manager/retention.py, which alone sets it): eviction leaves this page in any tier whose
    # value is >= hold_from: 0 for a held page (every tier), the slowest tier's for a "demote, don't drop" one.
    hold_from: int = UNRETAINED
    used_len: int = field(init=False, repr=False)  # its slot's size, in every tier (`__post_init__`)

    def __post_init__(self) -> None:
        # NOTE: kept, not computed on each use: placement asks it of every candidate victim.
        self.used_len = slot_bytes_for(self.payload_len)

    @property
    def key(self) -> Key:
        return (self.namespace, self.hash)

    def payload_checksum(self, key: Key | None = None, layout: PageLayout | None = None) -> int:
        """The XXH3-64 its payload must have to be this page as `key` in `layout` (by default its own identity):
        `checksum` is stored bound to the identity (pageformat), so a page read as anything else fails."""
        ns, h = self.key if key is None else key
        return self.checksum ^ identity_digest(ns, h, self.layout if layout is None else layout)

    @property
    def pinned(self) -> bool:
        return self.pins > 0 or bool(self.pin_deadlines)

    @property
    def retained(self) -> bool:
        """A session retains this page (held, or kept from being dropped)."""
        return self.hold_from != UNRETAINED

    @property
    def evictable(self) -> bool:
        return self.tier < self.hold_from and not self.pinned and self.readers == 0 and self.moving is None


@dataclass(slots=True)
class NodeCounters:
    """Node-wide counters for Stats (per-tier ones live in each Tier's TierCounters)."""

    lookups: int = 0
    lookup_blocks: int = 0
    lookup_matched: int = 0
    prefetch_issued: int = 0
    prefetch_completed: int = 0
    prefetch_used: int = 0  # prefetched pages a Get then read
    prefetch_wasted: int = 0  # prefetched pages that left their tier (or the node) unread
    put_rejected: int = 0  # Put transactions aborted
    corrupt_reports: int = 0  # pages clients reported failing their checksum on arrival (distinct per report)
    corrupt_confirmed: int = 0  # of those, pages whose copy here failed too (dropped)
    corrupt_unconfirmed: int = 0  # the others: intact here, not held here, or unchecked
    corrupt_unchecked: int = 0  # of the unconfirmed, pages not verified: past the reporting caller's rate
    scrubbed_bytes: int = 0  # DRAM payload bytes the scrubber verified

    def prefetch_fate(self, entry: Entry, used: bool) -> None:
        """A prefetched page was read (used) or is leaving its tier unread (wasted); counted once."""
        if entry.prefetched:
            entry.prefetched = False
            if used:
                self.prefetch_used += 1
            else:
                self.prefetch_wasted += 1


class Tier:
    """A medium with its slot allocator, eviction policy and counters.

    Invariants: `alloc.used_count >= pages` and `alloc.used_bytes >= held_bytes` (the slots of the visible
    pages); the difference is slots held by pages not visible here (staged by Put streams, or the
    destination of a move in flight). `at[offset]` is the visible page whose slot starts there, for
    every visible page of the tier (what emptying a chunk evicts: kvstore/manager/placement.py).
    """

    def __init__(self, medium: Medium, policy: EvictionPolicy) -> None:
        self.kind = medium.kind
        self.medium = medium
        self.alloc = SizeClassAllocator(medium.num_chunks if medium.available else 0, medium.chunk_bytes)
        self.policy = policy
        self.available = medium.available and self.alloc.num_chunks > 0
        self.counters = TierCounters()
        self.pages = 0
        self.used_bytes = 0  # payload bytes of the visible pages
        self.held_bytes = 0  # slot bytes of the visible pages (header and rounding included)
        self.at: dict[int, Entry] = {}
        self.tenant_pages: dict[str, int] = {}  # visible pages per tenant (quotas, Stats)
        self.tenant_bytes: dict[str, int] = {}  # slot bytes of them per tenant (what shares count)
        # With tenant shares in this tier (use_groups): one more policy per share group (a tenant
        # with a share, or POOL for the rest), fed the same events, so a group's victim is found directly.
        self.groups: dict[str, EvictionPolicy] | None = None
        self.group_of: Callable[[str], str] = _same
        self.new_policy: Callable[[], EvictionPolicy] | None = None

    def use_groups(self, group_of: Callable[[str], str], new_policy: Callable[[], EvictionPolicy]) -> None:
        """Keep one more policy per share group (`group_of(tenant)`), made by `new_policy` on first use.
        Called before any page is published (kvstore/manager/quotas.py)."""
        self.groups, self.group_of, self.new_policy = {}, group_of, new_policy

    def group_policy(self, namespace: str) -> EvictionPolicy | None:
        """The share group's policy of a page of `namespace` (None: no shares in this tier)."""
        if self.groups is None:
            return None
        g = self.group_of(tenant_of(namespace))
        p = self.groups.get(g)
        if p is None:
            assert self.new_policy is not None
            p = self.groups[g] = self.new_policy()
        return p

    def on_access(self, key: Key) -> None:
        """A page of this tier was read (policy event)."""
        self.policy.on_access(key)
        gp = self.group_policy(key[0])
        if gp is not None:
            gp.on_access(key)

    @property
    def in_transit(self) -> int:
        """Slot bytes held by pages not (yet) visible in this tier."""
        return self.alloc.used_bytes - self.held_bytes

    @property
    def slots_total(self) -> int:
        """Slots of this tier now: those of the chunks holding a class, plus one per free chunk (a slot of
        the largest size; it takes more of smaller ones). Equals the chunks when every page is the largest."""
        return self.alloc.slots_assigned + self.alloc.free_chunks


def _same(tenant: str) -> str:
    return tenant


class PageTable:
    """Every visible page of the node and the tier it is in.

    Invariants:
    - an entry in the table is counted in exactly one tier, its `tier`: that tier's policy holds its key,
      its `pages`/`used_bytes`/`held_bytes` include it and `at[entry.slot]` is it (exclusive tiers:
      capacities add up);
    - `ns_pages[ns]` is the number of entries of namespace ns (a tier's `tenant_pages[t]`, of tenant t's
      entries in it); a namespace's layout, its encoding included, is bound by its first
      page and never changes while the node runs;
    - every listener in `listeners` hears of every placement change (the index and KV-event publishers),
      in order, and listeners never change the table.
    Tiers are ordered fastest first (`TierKind` order); `below`/`above` skip unavailable tiers.
    """

    def __init__(self, tiers: list[Tier]) -> None:
        self.tiers: dict[TierKind, Tier] = {t.kind: t for t in sorted(tiers, key=lambda t: t.kind)}
        self.entries: dict[Key, Entry] = {}
        self.layouts: dict[str, PageLayout] = {}
        self.ns_pages: dict[str, int] = {}
        self.listeners: list[ChangeListener] = []
        self._generation = 1

    # -- tiers

    def below(self, kind: TierKind) -> Tier | None:
        """The next available tier slower than `kind` (where its evicted pages go)."""
        return next((t for k, t in self.tiers.items() if k > kind and t.available), None)

    def above(self, kind: TierKind) -> Tier | None:
        """The next available tier faster than `kind` (one promotion step)."""
        return next((t for k, t in reversed(self.tiers.items()) if k < kind and t.available), None)

    @property
    def persistent(self) -> Tier | None:
        """The tier whose medium survives restarts, when the node has one."""
        return next((t for t in self.tiers.values() if t.available and t.medium.persistent), None)

    # -- entries

    def get(self, key: Key) -> Entry | None:
        return self.entries.get(key)

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries.values())

    def publish(self, entry: Entry, kind: TierKind, previous: TierKind | None = None) -> None:
        """Make entry visible in tier `kind` (adding it to the table if new). The caller has already set
        entry.tier/slot to a slot of that tier holding the complete page; `previous`: the tier it moved from."""
        tier = self.tiers[kind]
        if entry.key not in self.entries:
            self.entries[entry.key] = entry
            self.ns_pages[entry.namespace] = self.ns_pages.get(entry.namespace, 0) + 1
        tier.policy.on_insert(entry.key, parent=entry.parent, reads=entry.reads)  # type: ignore[call-arg]
        gp = tier.group_policy(entry.namespace)
        if gp is not None:
            gp.on_insert(entry.key, parent=entry.parent, reads=entry.reads)  # type: ignore[call-arg]
        tier.pages += 1
        tier.used_bytes += entry.payload_len
        tier.held_bytes += entry.used_len
        tier.at[entry.slot] = entry
        t = tenant_of(entry.namespace)
        tier.tenant_pages[t] = tier.tenant_pages.get(t, 0) + 1
        tier.tenant_bytes[t] = tier.tenant_bytes.get(t, 0) + entry.used_len
        for listener in self.listeners:
            listener(entry.namespace, entry.hash, kind, previous)

    def unpublish(self, entry: Entry) -> None:
        """Take entry out of its tier's accounting (it stays in the table: a move publishes it again)."""
        tier = self.tiers[entry.tier]
        tier.policy.on_remove(entry.key)
        gp = tier.group_policy(entry.namespace)
        if gp is not None:
            gp.on_remove(entry.key)
        tier.pages -= 1
        tier.used_bytes -= entry.payload_len
        tier.held_bytes -= entry.used_len
        del tier.at[entry.slot]
        t = tenant_of(entry.namespace)
        tier.tenant_pages[t] -= 1
        tier.tenant_bytes[t] -= entry.used_len

    def remove(self, entry: Entry) -> None:
        """Entry leaves the node (its slot is the caller's to free)."""
        self.unpublish(entry)
        del self.entries[entry.key]
        self.ns_pages[entry.namespace] -= 1
        for listener in self.listeners:
            listener(entry.namespace, entry.hash, None, entry.tier)

    @property
    def generation(self) -> int:
        """The generation the next published page gets: every page published so far has a smaller one."""
        return self._generation

    def next_generation(self) -> int:
        gen = self._generation
        self._generation += 1
        return gen

    def saw_generation(self, generation: int) -> None:
        """A recovered page carried this generation: later ones must be newer."""
        self._generation = max(self._generation, generation + 1)

    # -- namespaces

    def check_layout(self, namespace: str, layout: PageLayout) -> None:
        """A Put's layout against its namespace's: any difference is LayoutMismatch (FAILED_PRECONDITION: the
        Put is well-formed, the namespace's state refuses it), another encoding named as such (a namespace
        holds one encoding)."""
        bound = self.layouts.get(namespace)
        if bound is not None and bound.encoding != layout.encoding:
            raise LayoutMismatch(
                f"open.layout.encoding: namespace {unscope(namespace)!r} holds {bound.encoding.label} pages; "
                f"this Put sends {layout.encoding.label} pages (a namespace holds one encoding)"
            )
        if bound is not None and bound.is_bundle and bound.has_parts and layout.has_parts:
            differs = bundle_difference(bound, layout)
            if differs is not None:  # NOTE: named part by part, the packed digests would only say "differs"
                raise LayoutMismatch(f"open.layout.{differs} (namespace {unscope(namespace)!r})")
        if bound is not None and bound != layout:
            raise LayoutMismatch(
                f"open.layout: namespace {unscope(namespace)!r} holds pages of layout {bound.describe()}; "
                f"this Put sends {layout.describe()}"
            )

    def check_read_layout(self, namespace: str, layout: PageLayout) -> None:
        """A Get's expected layout (what the caller will split its pages by) against its namespace's: the same
        rule as a Put's, worded for a read; a namespace this node never held is NamespaceNotFound."""
        bound = self.layout_of(namespace)
        if bound.is_bundle and bound.has_parts and layout.has_parts:
            differs = bundle_difference(bound, layout)
            if differs is not None:
                raise LayoutMismatch(f"layout.{differs} (namespace {unscope(namespace)!r})")
        if bound != layout:
            raise LayoutMismatch(
                f"layout: namespace {unscope(namespace)!r} holds pages of layout {bound.describe()}; "
                f"this Get expects {layout.describe()}"
            )

    def learn_parts(self, namespace: str, layout: PageLayout) -> None:
        """Keep a bundle's part names once a call named them (a namespace recovered from NVMe headers knows only
        its bundle's packed fields). Call after the layout was checked equal."""
        bound = self.layouts.get(namespace)
        if bound is not None and bound.is_bundle and not bound.has_parts and layout.has_parts and bound == layout:
            self.layouts[namespace] = layout

    def layout_of(self, namespace: str) -> PageLayout:
        check_namespace(namespace)
        try:
            return self.layouts[namespace]
        except KeyError:
            raise NamespaceNotFound(unscope(namespace)) from None

    # -- snapshots

    def holdings(self) -> list[tuple[str, bytes, TierKind]]:
        """Every visible page as (namespace, hash, tier): a snapshot for a full index publish."""
        return [(e.namespace, e.hash, e.tier) for e in self.entries.values()]

    def occupancy(self) -> dict[str, int]:
        """Pages and slots per tier, flat (published in the index's node info)."""
        out: dict[str, int] = {}
        for kind, t in self.tiers.items():
            out[f"pages_{kind.label}"] = t.pages
            out[f"slots_used_{kind.label}"] = t.alloc.used_count
            out[f"slots_total_{kind.label}"] = t.slots_total if t.available else 0
        return out


def check_namespace(namespace: str) -> None:
    """InvalidArgument unless `namespace` is a valid client namespace, or one scoped to a tenant
    (kvstore/scoping.py) whose client part is."""
    validate_namespace(unscope(namespace))  # HashContractError: an InvalidArgument naming the field


def check_hash(h: bytes, field_name: str) -> None:
    if len(h) != HASH_BYTES:
        raise InvalidArgument(field_name, f"a block hash is {HASH_BYTES} bytes, got {len(h)}")


def check_hashes(hashes: list[bytes], field_name: str, limit: int) -> None:
    """At most `limit` hashes, each 32 bytes; errors name `field_name[i]`."""
    if len(hashes) > limit:
        raise InvalidArgument(field_name, f"{len(hashes)} hashes in one request; the limit is {limit}")
    for i, h in enumerate(hashes):
        check_hash(h, f"{field_name}[{i}]")
