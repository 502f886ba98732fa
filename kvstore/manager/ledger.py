"""Per-tenant counters of one node and the tenants it knows (Stats, /metrics): plain bookkeeping.

The ledger never sees a request: the tenant views (kvstore/manager/views.py) count into it, the manager's
Stats read it. Tenants are only ever added (a tier's `tenant_pages` keeps a tenant's key at 0 pages).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvstore.manager.quotas import TenantQuotas
from kvstore.manager.state import PageTable
from kvstore.stats import TenantStats


@dataclass(slots=True)
class TenantCounters:
    """What one tenant's calls saw (Stats, /metrics)."""

    lookups: int = 0
    lookup_blocks: int = 0
    lookup_matched: int = 0
    get_pages: int = 0  # asked for by Gets that ran to their end
    get_served: int = 0
    cross_tenant_misses: int = 0


class TenantLedger:
    """Per-tenant counters and shares of one node."""

    def __init__(self, table: PageTable, quotas: TenantQuotas | None) -> None:
        self.table = table
        self.quotas = quotas
        self.counters: dict[str, TenantCounters] = {}
        self._known: tuple[str, ...] = ()
        self._known_seen = -1

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

    def snapshot(self, slot_bytes: int) -> list[TenantStats]:
        out = []
        caps = self.quotas.caps if self.quotas is not None else {}
        tiers = self.table.tiers
        for name in sorted(set(self.known()) | set(caps)):
            c = self.counters.get(name, TenantCounters())
            out.append(
                TenantStats(
                    name,
                    {k: t.tenant_pages.get(name, 0) for k, t in tiers.items() if t.available},
                    {k: n * slot_bytes for k, n in caps.get(name, {}).items()},
                    **{f.name: getattr(c, f.name) for f in fields(TenantCounters)},
                )
            )
        return out
