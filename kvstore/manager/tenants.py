"""Tenants on the node (DESIGN.md §10): the manager as one tenant reaches it, shares, per-tenant counters.

`TenantView` is the one door every plane (gRPC streams, shm, TCP, UCX) goes through with a caller's
namespace: it validates the namespace as a client's (no control characters, so no client can name a
scope) and scopes it to the caller's tenant (kvstore/tenants.py) before the manager sees it. Below it
the manager knows tenants only as part of the namespace string, which is also what NVMe page headers and
index keys carry, so recovery and the index keep tenancy without anything extra.

Shares (`TenantQuotas`, pure): a tenant may have a cap of slots per tier. Placement asks it which page to
evict: a tenant at its cap evicts its own pages only; a tenant below it evicts first from tenants over
their caps, then from tenants without a cap, then its own, never from another tenant within its cap. A cross-tenant
miss (the page exists, but only in another tenant's scope) is answered exactly as the cold miss it is for
the caller and counted for the caller; the check runs on every miss, found or not, so it costs the same
either way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from kvstore.errors import InvalidArgument, NamespaceNotFound
from kvstore.hashing import HashContractError, validate_namespace
from kvstore.layout import PageLayout
from kvstore.manager.state import Entry, Tier
from kvstore.names import Key, TierKind
from kvstore.policy import EvictionPolicy, first_usable
from kvstore.stats import LookupResult, NodeStats, TenantStats
from kvstore.tenants import DEFAULT_TENANT, scope, split

POOL = ""  # the share group of every tenant without a cap in a tier (tenant names are never empty)
_MAX_REMEMBERED = 1024  # client namespaces a view remembers as valid (beyond, each call validates again)

if TYPE_CHECKING:  # the manager builds its views; views call back into it
    from kvstore.manager.core import TierManager
    from kvstore.manager.put import PutTxn
    from kvstore.manager.reads import ReadLease


@dataclass(slots=True)
class TenantCounters:
    """What one tenant's calls saw (Stats, /metrics)."""

    lookups: int = 0
    lookup_blocks: int = 0
    lookup_matched: int = 0
    get_pages: int = 0  # asked for by Gets that ran to their end
    get_served: int = 0
    cross_tenant_misses: int = 0


class TenantQuotas:
    """Per-tenant caps in slots per tier, and the victim rule that keeps every tenant within its cap.

    Invariant (once pages settle): a tenant's visible pages in a tier exceed its cap only by pages
    another path put there without placement (a shutdown spill, a demotion back onto the page's own
    durable copy), and such a tenant is evicted first. Victims are found through per-group policies
    (`attach`): each tenant with a cap in a tier is a group, everyone else is POOL; so finding a tenant's
    own victim costs the same as finding any victim, however many pages other tenants hold.
    """

    def __init__(self, caps: dict[str, dict[TierKind, int]]) -> None:
        self.caps = caps

    def attach(self, tiers: Iterable[Tier], new_policy: Callable[[], EvictionPolicy]) -> None:
        """Give every tier where some tenant has a cap its per-group policies (before any page is published)."""
        for tier in tiers:
            capped = frozenset(t for t, c in self.caps.items() if tier.kind in c)
            if capped:
                tier.groups, tier.new_policy = {}, new_policy
                tier.group_of = lambda t, c=capped: t if t in c else POOL  # type: ignore[misc]

    def cap(self, tenant: str, kind: TierKind) -> int | None:
        return self.caps.get(tenant, {}).get(kind)

    def full(self, tenant: str, tier: Tier, reserve: int = 0) -> bool:
        """Whether one more page of `tenant` (holding `reserve` staged slots already) would pass its cap."""
        cap = self.cap(tenant, tier.kind)
        return cap is not None and tier.tenant_pages.get(tenant, 0) + reserve >= cap

    def victim(self, tier: Tier, entries: dict[Key, Entry], tenant: str, own_only: bool) -> Key | None:
        """The key to evict from `tier` for a page of `tenant` (None: nothing it may evict): at its cap,
        its own; else first the pages of the tenant furthest over its cap, then of tenants without a cap
        (POOL), then its own; never a page of another tenant within its cap."""
        def evictable(k: Key) -> bool:
            return entries[k].evictable

        if tier.groups is None:  # no caps in this tier: one shared pool
            return first_usable(tier.policy, evictable)

        def first(group: str) -> Key | None:
            p = tier.groups.get(group) if tier.groups is not None else None
            return None if p is None else first_usable(p, evictable)

        mine = tier.group_of(tenant)
        if own_only:
            return first(mine)
        over = sorted(((tier.tenant_pages.get(t, 0) - c[tier.kind], t) for t, c in self.caps.items()
                       if tier.kind in c and tier.tenant_pages.get(t, 0) > c[tier.kind]), reverse=True)  # fmt: skip
        for _, t in over:
            key = first(t)
            if key is not None:
                return key
        key = first(POOL)
        return key if key is not None or mine == POOL else first(mine)


class TenantView:
    """The manager as the callers of one tenant reach it: the same calls, with client namespaces."""

    __slots__ = ("_scoped", "counters", "manager", "tenant")

    def __init__(self, manager: TierManager, tenant: str, counters: TenantCounters) -> None:
        self.manager = manager
        self.tenant = tenant
        self.counters = counters
        self._scoped: dict[str, str] = {}  # valid client namespaces seen -> stored ones (bounded)

    def ns(self, namespace: str) -> str:
        """The stored namespace of a client's `namespace`; InvalidArgument unless it is a valid one."""
        scoped = self._scoped.get(namespace)
        if scoped is not None:
            return scoped
        try:
            validate_namespace(namespace)
        except HashContractError as exc:
            raise InvalidArgument("namespace", str(exc)) from None
        scoped = scope(namespace, self.tenant)
        if len(self._scoped) < _MAX_REMEMBERED:
            self._scoped[namespace] = scoped
        return scoped

    def lookup(self, namespace: str, hashes: list[bytes], prefetch: bool = False) -> LookupResult:
        res = self.manager.lookup(self.ns(namespace), hashes, prefetch)
        c = self.counters
        c.lookups += 1
        c.lookup_blocks += len(hashes)
        c.lookup_matched += res.matched
        if res.matched < len(hashes):
            self._missed(namespace, hashes[res.matched])
        return res

    def begin_put(self, namespace: str, layout: PageLayout, target: TierKind = TierKind.DRAM,
                  parent: bytes | None = None, chain: bool = False) -> PutTxn:  # fmt: skip
        return self.manager.begin_put(self.ns(namespace), layout, target, parent, chain)

    def get(self, namespace: str, hashes: list[bytes], promote: bool = True,
            into: Sequence[memoryview] | None = None) -> AsyncIterator[ReadLease]:  # fmt: skip
        """TierManager.get in this tenant's scope (arguments checked now, before the first page)."""
        try:
            leases = self.manager.get(self.ns(namespace), hashes, promote, into)
        except NamespaceNotFound:  # cold for this tenant: refused, and counted only if another tenant has it
            if hashes:
                self._missed(namespace, hashes[0])
            raise
        return self._counted(leases, namespace, hashes)

    async def _counted(self, leases: AsyncIterator[ReadLease], namespace: str,
                       hashes: list[bytes]) -> AsyncIterator[ReadLease]:  # fmt: skip
        served = 0
        try:
            async for lease in leases:
                served += 1
                yield lease
        finally:
            await leases.aclose()  # type: ignore[attr-defined]
        # Only a Get that ran to its end counts (a caller may stop early, e.g. a full shm window).
        self.counters.get_pages += len(hashes)
        self.counters.get_served += served
        if served < len(hashes):
            self._missed(namespace, hashes[served])

    def _missed(self, namespace: str, h: bytes) -> None:
        """Count a miss on a page that another tenant holds. Every tenant known to the node is checked
        whatever the result, so a cross-tenant miss takes as long as a cold one."""
        table = self.manager.table
        cross = False
        for t in self.manager.tenants.known():
            cross |= t != self.tenant and (scope(namespace, t), h) in table
        if cross:
            self.counters.cross_tenant_misses += 1

    async def delete(self, namespace: str, hashes: list[bytes]) -> tuple[int, int, int]:
        return await self.manager.delete(self.ns(namespace), hashes)

    def pin(self, namespace: str, hashes: list[bytes], ttl_seconds: float = 0.0) -> tuple[int, int]:
        return self.manager.pin(self.ns(namespace), hashes, ttl_seconds)

    def unpin(self, namespace: str, hashes: list[bytes]) -> tuple[int, int]:
        return self.manager.unpin(self.ns(namespace), hashes)

    def prefetch(self, namespace: str, hashes: list[bytes], target: TierKind = TierKind.DRAM) -> tuple[int, int, int]:
        return self.manager.prefetch(self.ns(namespace), hashes, target)

    def layout_of(self, namespace: str) -> PageLayout:
        return self.manager.layout_of(self.ns(namespace))

    def stats(self) -> NodeStats:
        """The node's Stats as this tenant may see them: its own namespaces (as it names them) and its
        own tenant row; the default tenant (the operator's) sees every tenant's row."""
        stats = self.manager.stats()
        stats.namespaces = [(name, layout, n) for ns, layout, n in stats.namespaces
                            for t, name in [split(ns)] if t == self.tenant]  # fmt: skip
        if self.tenant != DEFAULT_TENANT:
            stats.tenants = [t for t in stats.tenants if t.tenant == self.tenant]
        return stats


class TenantLedger:
    """Per-tenant counters and shares of one node; hands out views."""

    def __init__(self, manager: TierManager, quotas: TenantQuotas | None) -> None:
        self.manager = manager
        self.quotas = quotas
        self.counters: dict[str, TenantCounters] = {}
        self._views: dict[str, TenantView] = {}
        self._known: tuple[str, ...] = ()
        self._known_seen = -1

    def view(self, tenant: str) -> TenantView:
        v = self._views.get(tenant)
        if v is None:
            v = self._views[tenant] = TenantView(self.manager, tenant, self.counters.setdefault(tenant, TenantCounters()))
        return v

    def known(self) -> tuple[str, ...]:
        """Every tenant that had pages on this node or made calls since it started, in a stable order.
        Cached: tenants are only ever added (a tier's `tenant_pages` keeps a tenant's key at 0 pages)."""
        tiers = self.manager.table.tiers.values()
        seen = len(self.counters) + sum(len(t.tenant_pages) for t in tiers)
        if seen != self._known_seen:
            names = set(self.counters)
            for tier in tiers:
                names.update(tier.tenant_pages)
            self._known, self._known_seen = tuple(sorted(names)), seen
        return self._known

    def snapshot(self, slot_bytes: int) -> list[TenantStats]:
        out = []
        caps = self.quotas.caps if self.quotas is not None else {}
        tiers = self.manager.table.tiers
        for name in sorted(set(self.known()) | set(caps)):
            c = self.counters.get(name, TenantCounters())
            out.append(TenantStats(
                name, {k: t.tenant_pages.get(name, 0) for k, t in tiers.items() if t.available},
                {k: n * slot_bytes for k, n in caps.get(name, {}).items()},
                **{f.name: getattr(c, f.name) for f in fields(TenantCounters)},
            ))  # fmt: skip
        return out
