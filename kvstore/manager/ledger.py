"""Per-tenant counters of one node and the tenants it knows (Stats, /metrics): plain bookkeeping.

The ledger never sees a request: the tenant views (kvstore/manager/views.py) count into it, the manager's
Stats read it. Tenants are only ever added (a tier's `tenant_pages` keeps a tenant's key at 0 pages).

Cross-tenant misses (a miss on a page only another tenant holds) are an operator's figure: a tenant that
could read its own count would learn, one guess at a time, what another tenant caches (DESIGN.md §10). So a
miss is only *noted* on the request path (one append, the same whatever the cache holds) and checked
later, off the path (`settle`: every second by the manager's housekeeping, and before every snapshot).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields

from kvstore.manager.quotas import TenantQuotas
from kvstore.manager.state import PageTable
from kvstore.scoping import scope
from kvstore.stats import RetentionStats, TenantStats

MAX_NOTED_MISSES = 4096  # misses waiting for their cross-tenant check; a full queue is settled at once


@dataclass(slots=True)
class TenantCounters:
    """What one tenant's calls saw (Stats, /metrics)."""

    lookups: int = 0
    lookup_blocks: int = 0
    lookup_matched: int = 0
    get_pages: int = 0  # asked for by Gets that ran to their end
    get_served: int = 0
    cross_tenant_misses: int = 0  # the operator's figure only (see the module docstring)


class TenantLedger:
    """Per-tenant counters and shares of one node."""

    def __init__(self, table: PageTable, quotas: TenantQuotas | None) -> None:
        self.table = table
        self.quotas = quotas
        self.counters: dict[str, TenantCounters] = {}
        self._known: tuple[str, ...] = ()
        self._known_seen = -1
        # Misses to check: (client namespace, hash, tenant, the table's generation when it missed).
        self._noted: deque[tuple[str, bytes, str, int]] = deque()

    def note_miss(self, namespace: str, h: bytes, tenant: str) -> None:
        """A miss of `tenant` on (its client `namespace`, `h`), checked later against the other tenants'
        pages (`settle`). Constant work here, whatever the cache holds: nothing on the request path
        depends on another tenant's pages."""
        self._noted.append((namespace, h, tenant, self.table.generation))
        if len(self._noted) >= MAX_NOTED_MISSES:
            self.settle()

    def settle(self) -> int:
        """Check every noted miss: one on a page another tenant held when it missed (the page is still
        there, published before the miss: its generation is older) counts as that tenant's cross-tenant
        miss. A page gone by now is not counted. Returns how many counted."""
        table, noted, counted = self.table, self._noted, 0
        if not noted:
            return 0
        known = self.known()
        while noted:
            namespace, h, tenant, generation = noted.popleft()
            for t in known:
                entry = table.get((scope(namespace, t), h)) if t != tenant else None
                if entry is not None and entry.generation < generation:
                    self.counters_of(tenant).cross_tenant_misses += 1
                    counted += 1
                    break
        return counted

    def counters_of(self, tenant: str) -> TenantCounters:
        """The counters a tenant's calls add to (created on first use: the tenant is known from then on)."""
        return self.counters.setdefault(tenant, TenantCounters())

    def known(self) -> tuple[str, ...]:
        """Every tenant that had pages on this node or made calls since it started, in a stable order.
        Cached: tenants are only ever added (a tier's `tenant_pages` keeps a tenant's key at 0 pages)."""
        tiers = self.table.tiers.values()
        seen = len(self.counters) + sum(len(t.tenant_pages) for t in tiers)
        if seen != self._known_seen:
            names = set(self.counters)
            for tier in tiers:
                names.update(tier.tenant_pages)
            self._known, self._known_seen = tuple(sorted(names)), seen
        return self._known

    def snapshot(self, retention: Callable[[str], RetentionStats] | None = None) -> list[TenantStats]:
        """Every tenant's row, as the operator sees them (kvstore/manager/views.py narrows it for a tenant);
        `retention(tenant)`: its retention and caps (kvstore/manager/retention.py)."""
        self.settle()
        out = []
        caps = self.quotas.caps if self.quotas is not None else {}
        tiers = self.table.tiers
        for name in sorted(set(self.known()) | set(caps)):
            c = self.counters.get(name, TenantCounters())
            out.append(
                TenantStats(
                    name,
                    {k: t.tenant_pages.get(name, 0) for k, t in tiers.items() if t.available},
                    dict(caps.get(name, {})),
                    **{f.name: getattr(c, f.name) for f in fields(TenantCounters)},
                    retention=retention(name) if retention is not None else RetentionStats(),
                )
            )
        return out
