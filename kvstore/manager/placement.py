"""Placement: free slots on demand, evicting over each tier's pure policy, and waiting for space.

The policy (kvstore/policy) only orders keys; placement asks it for the first victim that is evictable
now (not pinned, not being read, not moving) and whose eviction makes room of the size asked for, and
hands it to `evict` (kvstore/manager/moves.py), which demotes it one tier down or drops it. When nothing
is evictable but space is only held for a moment (other streams' staged pages, reads or moves in
flight), a caller that may wait is parked, bounded by `alloc_wait_seconds`, until `space_changed` wakes
it.

Pages of every size share a tier (kvstore/tiers/slots.py): a chunk holds slots of one size, and room
moves between sizes a chunk at a time. So a victim makes room for a slot of `nbytes` when it is that size
(its slot is the room), or when its whole chunk can be emptied now: every page in it evictable (and,
with shares, one the asking tenant may evict), nothing staged or moving into it. The policy's order
decides both: the first such victim wins. A tenant at its share first gives up pages of its own, of any
size, until the new slot fits its share; the room is then made as for a tenant below it (its own pages
may share chunks with other tenants'). A victim of another size has its chunk emptied (`reclaim`):
its pages are evicted together while the chunk hands out no slot, and the chunk then takes the new
size. The bound: one allocation evicts at most one chunk's pages (a chunk of the largest slot), so a
Put of small pages never evicts large ones beyond the bytes it needs plus one chunk; a tier of one page
size behaves exactly as before (every victim is that size).

Admission (kvstore/policy/admission.py): before a page that is not in the host-memory tier enters it
while it is full (a Put, a promotion on read), `admit` asks that tier's policy whether the page may
take the victim's place, exactly once per reference, and the victim named in the question is the one
`allocate` evicts first (choosing a victim can reorder some policies' keys, so it is not chosen twice).
For a victim of another size, the question names the first page of its chunk in the policy's order.
A policy that refuses the page whatever the victim says so before one is chosen (`refused_outright`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from kvstore.errors import ResourceExhausted
from kvstore.manager.durable import DurableCopies
from kvstore.manager.state import Entry, PageTable, Tier
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

    def victim(self, kind: TierKind, nbytes: int, tenant: str | None = None, own_only: bool = False) -> Entry | None:
        """The page the tier's policy would evict first among those evictable now that make room for a slot
        of `nbytes` (`_Room`); with shares, among those `tenant` may evict (TenantQuotas)."""
        return self._victim(self._room(kind, nbytes, tenant, own_only))

    def _victim(self, room: _Room) -> Entry | None:
        tenant = room.tenant
        if self.quotas is not None and tenant is not None:
            key = self.quotas.victim(room.tier, tenant, room.own_only, room.usable)
        else:
            key = first_usable(room.tier.policy, room.usable)
        return None if key is None else self.table.entries[key]

    def _room(self, kind: TierKind, nbytes: int, tenant: str | None, own_only: bool) -> _Room:
        """The question: which pages of `kind` make room for a slot of `nbytes` for `tenant` (with shares:
        those TenantQuotas.may_evict lets it evict)."""
        quotas, tier = self.quotas, self.table.tiers[kind]
        may = None
        if quotas is not None and tenant is not None:
            may = functools.partial(quotas.may_evict, tier, tenant, own_only)
        return _Room(self.table, tier, nbytes, tenant=tenant, own_only=own_only, may=may)

    def _at_share(self, kind: TierKind, tenant: str | None, reserve: int, nbytes: int) -> bool:
        """Whether a page of `tenant` may only take the place of one of its own (it is at its share)."""
        return (
            self.quotas is not None
            and tenant is not None
            and self.quotas.full(tenant, self.table.tiers[kind], reserve, nbytes)
        )

    def admit(self, kind: TierKind, key: Key, parent: Key | None, nbytes: int) -> tuple[bool, Entry | None]:
        """May `key` (not in tier `kind`, a slot of `nbytes`) enter it now? (True, None) when the tier has
        room of that size; else the tier's policy is asked once: (False, None) when it refuses, (True,
        victim) when it admits the page in place of `victim`, which the caller passes on to `allocate`.
        With nothing evictable the policy only hears of the reference and (True, None) leaves the rest to
        `allocate`, unless it refused the page before any victim was chosen (then (False, None))."""
        tier = self.table.tiers[kind]
        tenant = tenant_of(key[0])
        own_only = self._at_share(kind, tenant, 0, nbytes)
        if tier.alloc.can_allocate(nbytes) and not own_only:
            return True, None
        if refused_outright(tier.policy, key, parent):  # NOTE: whatever the victim: none is chosen
            tier.counters.not_admitted += 1
            return False, None
        victim = self.victim(kind, nbytes, tenant, own_only)
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
        nbytes: int,
        *,
        reserve: int = 0,
        wait: bool = True,
        victim: Entry | None = None,
        tenant: str | None = None,
    ) -> int:
        """A free slot of `nbytes` in `kind` (its offset), evicting (demoting or dropping) victims as needed.

        Raises ResourceExhausted when nothing in the tier can be evicted to make that room. `reserve` is the
        bytes of slots the caller already holds unpublished (named in the error so the limit is visible).
        With `wait`, a tier blocked only by other streams' staged pages or by reads and moves in flight is
        waited on for up to alloc_wait_seconds before giving up. The persistent tier never waits (no stream
        stages there): a demotion into it falls back to dropping the page instead (see Mover.evict); a slot
        there is made ready to write before it is returned (DurableCopies.prepare; OSError when that fails).
        `victim` (from `admit`) is evicted first, when it still makes room. With shares, the slot is for a
        page of `tenant`: at its share it evicts its own pages first (TenantQuotas).
        """
        tier = self.table.tiers[kind]
        if not tier.available:
            raise ResourceExhausted(f"{kind.label} tier is not available on this node")
        tier.alloc.check_size(nbytes)
        loop = asyncio.get_running_loop()
        may_wait = wait and tier is not self.durable.tier
        deadline: float | None = None
        for _ in range(len(tier.policy) + tier.alloc.num_chunks + _MAX_SPACE_WAITS):
            own_only = self._at_share(kind, tenant, reserve, nbytes)
            if tier is self.durable.tier and not tier.alloc.has_free_slot(nbytes):
                pending = self.durable.formatting(nbytes)
                if pending is not None:  # a chunk of this size is being laid out: its slots are near
                    await asyncio.shield(pending)
                    continue
            if tier.alloc.can_allocate(nbytes) and not own_only:
                grant = tier.alloc.allocate(nbytes)
                if tier is self.durable.tier:
                    await self.durable.prepare(grant)
                return grant.offset
            chosen, victim = victim, None
            if chosen is not None and (chosen.tier != kind or self.table.get(chosen.key) is not chosen):
                chosen = None
            room: _Room | None = None
            if not (  # NOTE: admission's victim of this size, as it was a moment ago: no question to ask again
                chosen is not None
                and self.quotas is None
                and chosen.used_len == nbytes
                and chosen.evictable
                and not tier.alloc.held(tier.alloc.chunk_of(chosen.slot))
            ):
                room = self._room(kind, nbytes, tenant, own_only)
                if chosen is None or not room.usable(chosen.key):
                    chosen = self._victim(room)
            if chosen is not None:
                chunk = tier.alloc.chunk_of(chosen.slot)
                if chosen.used_len != nbytes and room is not None and room.emptiable(chunk):
                    await self.reclaim(tier, chunk)
                else:  # its slot is the room; or (at its share) one of the tenant's own pages gives way
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
                    f"tenant {tenant}'s {kind.label} share is full ({reserve} B of its slots held "
                    f"by this request) and every other page of it that would make room for a {nbytes} B slot "
                    "is pinned, being read or moved"
                )
            raise ResourceExhausted(
                f"{kind.label} tier is full ({tier.alloc.capacity_bytes} B, {reserve} B held by this request, "
                f"{tier.in_transit - reserve} B in transit for others) and every page in it that would make "
                f"room for a {nbytes} B slot is pinned, being read or being moved"
            )
        raise ResourceExhausted(f"{kind.label} tier: could not free a slot (contention); retry")

    async def reclaim(self, tier: Tier, chunk: int) -> None:
        """Empty a chunk (its pages evicted side by side) so it can take another slot size: it hands out no
        slot meanwhile. A page that became busy since it was chosen stays (the chunk then stays too; the
        caller looks again)."""
        alloc = tier.alloc

        async def evict(entry: Entry) -> None:
            # NOTE: checked as this task starts, with no await before the eviction marks it moving: a page
            # leased meanwhile is never moved from under its reader.
            if entry.evictable and self.table.get(entry.key) is entry and entry.tier is tier.kind:
                await self.evict(entry)

        alloc.hold(chunk)
        try:
            pages = [e for slot in alloc.slots_in(chunk) if (e := tier.at.get(slot)) is not None]
            results = await asyncio.gather(*(evict(e) for e in pages), return_exceptions=True)
        finally:
            alloc.release(chunk)
            self.space_changed()
        for result in results:
            if isinstance(result, BaseException):
                raise result

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


class _Room:
    """One question of `allocate`/`admit`: which pages of `tier` make room for a slot of `nbytes` now.

    A page does when it is evictable, its chunk hands out slots (not held), it may be evicted (shares), and
    either it is that size (its slot is the room), or its whole chunk can be emptied now (`emptiable`: every
    page in it so, nothing staged or moving into it), or the asking tenant is at its share and the page is
    its own (evicting it brings the tenant under its share; the room is made after that, by the rules of a
    tenant below its share). A chunk's answer is worked out once per question: it costs a look at each of
    its pages."""

    __slots__ = ("_chunks", "may", "nbytes", "own_only", "table", "tenant", "tier")

    def __init__(
        self,
        table: PageTable,
        tier: Tier,
        nbytes: int,
        *,
        tenant: str | None,
        own_only: bool,
        may: Callable[[str], bool] | None,
    ) -> None:
        self.table, self.tier, self.nbytes = table, tier, nbytes
        self.tenant, self.own_only, self.may = tenant, own_only, may  # may: None, anyone's pages
        self._chunks: dict[int, bool] = {}

    def _may(self, e: Entry) -> bool:
        return self.may is None or self.may(tenant_of(e.namespace))

    def emptiable(self, chunk: int) -> bool:
        got = self._chunks.get(chunk)
        if got is None:
            alloc, at = self.tier.alloc, self.tier.at
            got = not alloc.held(chunk) and all(
                (e := at.get(slot)) is not None and e.evictable and self._may(e)  # None: staged, or moving in
                for slot in alloc.slots_in(chunk)
            )
            self._chunks[chunk] = got
        return got

    def usable(self, key: Key) -> bool:
        e = self.table.entries[key]
        if not e.evictable or not self._may(e):
            return False
        chunk = self.tier.alloc.chunk_of(e.slot)
        if self.tier.alloc.held(chunk):
            return False
        return e.used_len == self.nbytes or self.own_only or self.emptiable(chunk)


async def _unwired(entry: Entry) -> None:
    raise RuntimeError("Placement.evict was not wired to a Mover")
