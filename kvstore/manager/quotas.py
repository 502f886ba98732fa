"""Tenant shares (DESIGN.md §10): a cap of bytes per tenant per tier, and the victim rule that keeps them.

Pure placement policy over the page table (no I/O): Placement asks it which page to evict. A tenant at its
cap evicts its own pages only; a tenant below it evicts first from tenants over their caps, then from
tenants without a cap, then its own, never from another tenant within its cap. A tenant's bytes in a tier
are its pages' slots (header and rounding included: kvstore/tiers/slots.py), so a share holds as many
pages as their sizes fit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from kvstore.manager.state import Tier
from kvstore.names import Key, TierKind
from kvstore.policy import EvictionPolicy, first_usable

POOL = ""  # the share group of every tenant without a cap in a tier (tenant names are never empty)


def _group(capped: frozenset[str], tenant: str) -> str:
    """The share group of `tenant` in a tier where `capped` tenants have caps."""
    return tenant if tenant in capped else POOL


class TenantQuotas:
    """Per-tenant caps in bytes per tier, and the victim rule that keeps every tenant within its cap.

    Invariant (once pages settle): a tenant's visible pages' slot bytes in a tier exceed its cap only by pages
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
                tier.use_groups(functools.partial(_group, capped), new_policy)

    def cap(self, tenant: str, kind: TierKind) -> int | None:
        return self.caps.get(tenant, {}).get(kind)

    def full(self, tenant: str, tier: Tier, reserve: int, nbytes: int) -> bool:
        """Whether one more slot of `nbytes` for `tenant` (holding `reserve` bytes of staged slots already)
        would pass its cap."""
        cap = self.cap(tenant, tier.kind)
        return cap is not None and tier.tenant_bytes.get(tenant, 0) + reserve + nbytes > cap

    def may_evict(self, tier: Tier, tenant: str, own_only: bool, other: str) -> bool:
        """Whether the rule below lets a page of `tenant` take the place of a page of `other`: its own
        always; with `own_only` nothing else; otherwise a tenant without a cap here or over its cap."""
        if other == tenant:
            return True
        if own_only:
            return False
        cap = self.cap(other, tier.kind)
        return cap is None or tier.tenant_bytes.get(other, 0) > cap

    def victim(self, tier: Tier, tenant: str, own_only: bool, usable: Callable[[Key], bool]) -> Key | None:
        """The key to evict from `tier` for a page of `tenant` (None: nothing it may evict), among the keys
        `usable` accepts: at its cap, its own; else first the pages of the tenant furthest over its cap,
        then of tenants without a cap (POOL), then its own; never a page of another tenant within its cap."""
        if tier.groups is None:  # no caps in this tier: one shared pool
            return first_usable(tier.policy, usable)

        def first(group: str) -> Key | None:
            p = tier.groups.get(group) if tier.groups is not None else None
            return None if p is None else first_usable(p, usable)

        mine = tier.group_of(tenant)
        if own_only:
            return first(mine)
        over = sorted(
            (
                (tier.tenant_bytes.get(t, 0) - c[tier.kind], t)
                for t, c in self.caps.items()
                if tier.kind in c and tier.tenant_bytes.get(t, 0) > c[tier.kind]
            ),
            reverse=True,
        )
        for _, t in over:
            key = first(t)
            if key is not None:
                return key
        key = first(POOL)
        return key if key is not None or mine == POOL else first(mine)
