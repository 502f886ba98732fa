"""Placement: free slots on demand, evicting over each tier's pure policy, and waiting for space.

The policy (kvstore/policy) only orders keys; placement asks it for the first victim that is evictable
now (not pinned, not being read, not moving) and hands it to `evict` (kvstore/manager/moves.py), which
demotes it one tier down or drops it. When nothing is evictable but space is only held for a moment
(other streams' staged pages, reads or moves in flight), a caller that may wait is parked, bounded by
`alloc_wait_seconds`, until `space_changed` wakes it.

Admission (kvstore/policy/admission.py): before a page that is not in the host-memory tier enters it
while it is full (a Put, a promotion on read), `admit` asks that tier's policy whether the page may
take the victim's place, exactly once per reference, and the victim named in the question is the one
`allocate` evicts first (choosing a victim can reorder some policies' keys, so it is not chosen twice).
A policy that refuses the page whatever the victim says so before one is chosen (`refused_outright`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from kvstore.errors import ResourceExhausted
from kvstore.manager.durable import DurableCopies
from kvstore.manager.state import Entry, PageTable
from kvstore.names import Key, TierKind
from kvstore.policy import first_usable, refused_outright, should_admit
from kvstore.scoping import tenant_of

if TYPE_CHECKING:
    from kvstore.manager.quotas import TenantQuotas

_MAX_SPACE_WAITS = 10_000  # bounds the allocation loop; waits are also bounded by alloc_wait_seconds

Evict = Callable[[Entry], Awaitable[None]]


class Placement:
    """Allocation of slots with eviction. Runs on the event loop only (no locks)."""

    def __init__(
        self, table: PageTable, durable: DurableCopies, alloc_wait_seconds: float, quotas: TenantQuotas | None = None
    ) -> None:
        self.table = table
        self.durable = durable
        self.alloc_wait_seconds = alloc_wait_seconds
        self.quotas = quotas  # tenants' shares per tier (kvstore/manager/quotas.py); None: one shared pool
        self.evict: Evict = _unwired  # Mover.evict: eviction is a move (the manager wires it)
        self._waiters: list[asyncio.Future[None]] = []

    def victim(self, kind: TierKind, tenant: str | None = None, own_only: bool = False) -> Entry | None:
        """The page the tier's policy would evict first among those evictable now (with shares: among
        those `tenant` may evict, see TenantQuotas.victim)."""
        entries = self.table.entries
        tier = self.table.tiers[kind]
        if self.quotas is not None and tenant is not None:
            key = self.quotas.victim(tier, entries, tenant, own_only)
        else:
            key = first_usable(tier.policy, lambda k: entries[k].evictable)
        return None if key is None else entries[key]

    def _at_share(self, kind: TierKind, tenant: str | None, reserve: int) -> bool:
        """Whether a page of `tenant` may only take the place of one of its own (it is at its share)."""
        return (
            self.quotas is not None and tenant is not None and self.quotas.full(tenant, self.table.tiers[kind], reserve)
        )

    def admit(self, kind: TierKind, key: Key, parent: Key | None) -> tuple[bool, Entry | None]:
        """May `key` (not in tier `kind`) enter it now? (True, None) when the tier has a free slot; else
        the tier's policy is asked once: (False, None) when it refuses, (True, victim) when it admits
        the page in place of `victim`, which the caller passes on to `allocate`. With nothing evictable
        the policy only hears of the reference and (True, None) leaves the rest to `allocate`, unless
        it refused the page before any victim was chosen (then (False, None))."""
        tier = self.table.tiers[kind]
        tenant = tenant_of(key[0])
        own_only = self._at_share(kind, tenant, 0)
        if tier.alloc.can_allocate() and not own_only:
            return True, None
        if refused_outright(tier.policy, key, parent):  # NOTE: whatever the victim: none is chosen
            tier.counters.not_admitted += 1
            return False, None
        victim = self.victim(kind, tenant, own_only)
        admitted = should_admit(tier.policy, key, None if victim is None else victim.key, parent)
        if victim is None:
            return True, None
        if not admitted:
            tier.counters.not_admitted += 1
            return False, None
        return True, victim

    async def allocate(
        self,
        kind: TierKind,
        reserve: int = 0,
        wait: bool = True,
        victim: Entry | None = None,
        tenant: str | None = None,
    ) -> int:
        """A free slot in `kind`, evicting (demoting or dropping) victims as needed.

        Raises ResourceExhausted when nothing in the tier can be evicted. `reserve` is the number of slots
        the caller already holds unpublished (named in the error so the limit is visible). With `wait`, a
        tier blocked only by other streams' staged pages or by reads and moves in flight is waited on for
        up to alloc_wait_seconds before giving up. The persistent tier never waits (no stream stages there):
        a demotion into it falls back to dropping the page instead (see Mover.evict). `victim` (from
        `admit`) is evicted first, when it is still in the tier and evictable. With shares, the slot is for
        a page of `tenant`: at its share it evicts its own pages first (TenantQuotas).
        """
        tier = self.table.tiers[kind]
        if not tier.available:
            raise ResourceExhausted(f"{kind.label} tier is not available on this node")
        loop = asyncio.get_running_loop()
        may_wait = wait and tier is not self.durable.tier
        deadline: float | None = None
        for _ in range(tier.alloc.num_slots + _MAX_SPACE_WAITS):
            own_only = self._at_share(kind, tenant, reserve)
            if tier.alloc.can_allocate() and not own_only:
                slot = tier.alloc.allocate()
                if tier is self.durable.tier:
                    self.durable.forget(slot)
                return slot
            chosen, victim = victim, None
            if (
                chosen is None
                or chosen.tier != kind
                or not chosen.evictable
                or self.table.get(chosen.key) is not chosen
            ):
                chosen = self.victim(kind, tenant, own_only)
            if chosen is not None:
                await self.evict(chosen)
                continue
            busy = tier.in_transit > reserve or any(
                (e := self.table.entries[k]).readers or e.moving for k in tier.policy.candidates()
            )
            if may_wait and busy:
                deadline = deadline if deadline is not None else loop.time() + self.alloc_wait_seconds
                if loop.time() < deadline:
                    await self.wait_for_space(deadline - loop.time())
                    continue
            if own_only:
                raise ResourceExhausted(
                    f"tenant {tenant}'s {kind.label} share is full ({reserve} of its slots held "
                    "by this request) and every other page of it is pinned, being read or moved"
                )
            raise ResourceExhausted(
                f"{kind.label} tier is full ({tier.alloc.num_slots} slots, {reserve} held by this request, "
                f"{tier.in_transit - reserve} in transit for others) and every page in it is pinned, "
                "being read or being moved"
            )
        raise ResourceExhausted(f"{kind.label} tier: could not free a slot (contention); retry")

    async def wait_for_space(self, timeout: float) -> None:
        """Sleep until something may have become free or evictable, or timeout."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancellation on 3.11
                await fut
        except TimeoutError:
            pass
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def space_changed(self) -> None:
        """Wake every allocation waiting for a slot (they re-check; cheap when nobody waits)."""
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)


async def _unwired(entry: Entry) -> None:
    raise RuntimeError("Placement.evict was not wired to a Mover")
