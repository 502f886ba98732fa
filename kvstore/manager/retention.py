"""Retention: sessions, their leases, priorities and modes over the pages their writers named (DESIGN.md §6.5).

Pure bookkeeping over the page table (no I/O, no clocks: callers pass `now`), like quotas.py. A session is a
name its client chose, scoped to its tenant, with a lease (a deadline), a priority (MIN..MAX_PRIORITY) and a
mode. Its pages are the keys its writer named (`apply`): stored here now, or put later, when the placement
listener (`on_change`) sees them arrive. A named page that is stored is *retained* (held) unless its tenant was
at its cap when it arrived; a retained page's entry carries `hold_from` (kvstore/manager/state.py), which the
one evictability test reads, so every policy honours it: the policy orders victims, the manager skips held
pages as it skips pinned ones.

- HOLD: `hold_from` 0: no tier evicts it (it is neither demoted nor dropped); a read or a prefetch may still
  promote it, within its tenant's hold cap in the tier above (`may_promote`).
- DEMOTE ("demote, don't drop"): `hold_from` is the slowest tier's: a faster tier may demote it when it needs the
  room; the slowest never evicts it.
A page named by several sessions (a prefix their conversations share) is retained while any of them retains it,
HOLD when any of them holds it.

Caps (per tenant, `RetainCaps`): its retained pages, every tier and mode, at most `total` (a fraction of its
slots of the slowest tier: where every DEMOTE page may end up); its HOLD pages in each faster tier at most
`hold[tier]` (the same fraction of its slots there). At a cap a call that would pass it first releases the
tenant's sessions of lower priority than its own, lowest first (the oldest first among equals), as few as make
room ("displaced"); when those cannot make room the call is refused (ResourceExhausted naming the cap) and nothing
changes. A page put while its tenant is at its cap is stored but not retained ("unheld"); nothing is displaced
on the Put path.

A call's types and the checks of its fields: retention_types.py.

Invariants (`Retention.check` raises naming the first that does not hold; tests/unit/test_retention.py calls it
after every call):
- `_held[k]` exists iff page k is stored and retained; then its entry's `hold_from` is 0 (HOLD) or the slowest
  tier's (DEMOTE), the strongest mode among its live namers, else it is UNRETAINED;
- per tenant, `total` equals the number of its retained pages, `by_tier[t]` those in tier t, `held_in[t]` its
  HOLD pages in tier t; each session's `held + unheld + pending` equals its named keys;
- `named[k]` lists exactly the live sessions that named k (no empty lists); every live session is in `sessions`
  and has an entry in the expiry heap with its current deadline.
Cost: a lease or priority update is O(1); naming, releasing or ending is O(pages named); placement events are
one dict lookup for a page nobody named.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from kvstore.errors import ResourceExhausted, SessionNotFound
from kvstore.manager.retention_types import (
    MAX_SESSIONS_PER_TENANT,
    RetainCall,
    RetainCaps,
    RetainOutcome,
    Session,
    TenantRetention,
    check_call,
)
from kvstore.manager.state import UNRETAINED, PageTable
from kvstore.names import DEFAULT_PRIORITY, Key, RetainMode, RetainOp, TierKind
from kvstore.scoping import tenant_of
from kvstore.stats import RetentionStats, SessionState, TierRetention

_HEAP_SLACK = 4  # the expiry heap is rebuilt when it holds this many times more entries than live sessions


class Retention:
    """Every live session of every tenant and what they retain (see the module docstring)."""

    def __init__(self, table: PageTable, caps: Callable[[str], RetainCaps], max_named: int) -> None:
        self.table = table
        self.caps = caps  # tenant -> its caps (the manager computes them from the config and the shares)
        self.max_named = max_named  # keys one tenant's sessions may name in all (each session's once)
        self.tenants: dict[str, TenantRetention] = {}
        self.named: dict[Key, list[Session]] = {}
        self._held: dict[Key, RetainMode] = {}
        self._heap: list[tuple[float, int, Session]] = []
        self._seq = 0
        self._live = 0  # live sessions, every tenant's
        # NOTE: which tiers are available is fixed when the node starts
        self.slowest = max(k for k, t in table.tiers.items() if t.available)

    # ------------------------------------------------------------------ the calls

    def apply(self, tenant: str, call: RetainCall, now: float) -> RetainOutcome:
        """One Retain call of `tenant` (keys scoped to it). Raises before changing anything: InvalidArgument
        naming the field, SessionNotFound, ResourceExhausted naming the cap."""
        tr = self.tenants.get(tenant)
        s = tr.sessions.get(call.session) if tr is not None else None
        check_call(call, creating=s is None and call.op is RetainOp.RETAIN)
        if s is None and call.op is not RetainOp.RETAIN:
            raise SessionNotFound(call.session)
        if tr is None:
            tr = self.tenants[tenant] = TenantRetention()
        tr.calls += 1
        if call.op is RetainOp.UPDATE and not call.keys and s is not None and call.mode in (None, s.mode):
            # NOTE: the storm's common case (a lease or priority changed): no page changes state, nothing is
            # displaced (priority only orders who gives way at the next cap), so O(1) and allocation-light.
            if call.priority is not None:
                s.priority = call.priority
            self._lease(s, call, now)
            return RetainOutcome(state=self.view(s, now))
        keys = list(dict.fromkeys(call.keys))  # a hash named twice is one page
        out = RetainOutcome()
        if call.op is RetainOp.END:
            assert s is not None
            out.released = self._drop(s, now)
            tr.ended += 1
            return out
        if call.op is RetainOp.RELEASE:
            assert s is not None
            out.released = sum(self._unname(s, k) for k in keys if k in s.keys)
            self._lease(s, call, now)
            out.state = self.view(s, now)
            return out
        priority = call.priority if call.priority is not None else (s.priority if s else DEFAULT_PRIORITY)
        mode = call.mode if call.mode is not None else (s.mode if s else RetainMode.HOLD)
        if s is None and len(tr.sessions) >= MAX_SESSIONS_PER_TENANT:
            tr.refused += 1
            raise ResourceExhausted(
                f"session: tenant {tenant!r} has {MAX_SESSIONS_PER_TENANT} live sessions on this node, the most it "
                "may have; end some (RETAIN_OP_END) or let their leases run out"
            )
        new = [k for k in keys if s is None or k not in s.keys]
        # Pages it named before that arrived at the cap: named again, retained now if there is room.
        revive = [] if s is None else [k for k in keys if k in s.keys and k not in self._held and k in self.table]
        if tr.named + len(new) > self.max_named:
            tr.refused += 1
            raise ResourceExhausted(
                f"hashes: tenant {tenant!r}'s sessions name {tr.named} pages on this node and this call adds "
                f"{len(new)}; the most they may name is {self.max_named} (the node's slots)"
            )
        displace = self._make_room(tenant, tr, s, new + revive, mode=mode, priority=priority)
        for victim in displace:
            self._drop(victim, now)
            tr.displaced += 1
            out.displaced.append(victim.name)
        if s is None:
            self._seq += 1
            s = Session(tenant, call.session, priority, mode, math.inf, self._seq)
            tr.sessions[s.name] = s
            self._live += 1
        s.priority = priority
        if mode is not s.mode:
            s.mode = mode
            for k in s.keys:
                if k in self._held:
                    self._restate(k)
        self._lease(s, call, now)
        for k in new:
            self._name(s, k)
        for k in revive:
            self._revive(k)
        out.retained = sum(1 for k in keys if k in self._held)
        out.pending = sum(1 for k in keys if self.table.get(k) is None)
        if call.op is RetainOp.RESUME:
            out.prefetch = [k for k in s.keys if k in self.table]
        out.state = self.view(s, now)
        return out

    def note_resumed(self, tenant: str, scheduled: int) -> None:
        tr = self.tenants.get(tenant)
        if tr is not None:
            tr.resumed += scheduled

    def expire(self, now: float) -> int:
        """End every session whose lease has passed; returns how many ended."""
        ended = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, _, s = heapq.heappop(heap)
            tr = self.tenants.get(s.tenant)
            if tr is None or tr.sessions.get(s.name) is not s or s.deadline != deadline:
                continue  # an older lease of a session renewed since, or one already gone
            self._drop(s, now)
            tr.expired += 1
            ended += 1
        return ended

    def reserve_promotion(self, key: Key, kind: TierKind) -> Callable[[], None] | None:
        """May a page move up into tier `kind` (a read or a prefetch promoting it)? A HOLD page only while its
        tenant holds, or is bringing in, fewer than its cap there; None: it may not (it is served where it is).
        Otherwise a function the mover calls once the move is over, whatever its outcome: until then the page
        counts as on its way (promotions of one Get run side by side, each must see the others)."""
        if self._held.get(key) is not RetainMode.HOLD or kind >= self.slowest:
            return _nothing
        tenant = tenant_of(key[0])
        cap = self.caps(tenant).hold.get(kind, 0)
        tr = self.tenants[tenant]
        if tr.held_in.get(kind, 0) + tr.incoming.get(kind, 0) >= cap:
            return None
        _add(tr.incoming, kind, 1)

        def done() -> None:
            _add(tr.incoming, kind, -1)

        return done

    # ------------------------------------------------------------------ placement events

    def on_change(self, namespace: str, h: bytes, now: TierKind | None, before: TierKind | None) -> None:
        """The page table's placement listener: a named page arrived, moved or left. O(1) for any other page."""
        key = (namespace, h)
        namers = self.named.get(key)
        if namers is None:
            return
        mode = self._held.get(key)
        if before is None and now is not None:  # stored here: retained now, unless the tenant is at its cap
            for s in namers:
                s.pending -= 1
            want = self._strongest(namers)
            tenant = tenant_of(namespace)
            tr = self.tenants[tenant]
            caps = self.caps(tenant)
            fits = tr.total < caps.total and (
                want is RetainMode.DEMOTE
                or now >= self.slowest
                or tr.held_in.get(now, 0) + tr.incoming.get(now, 0) < caps.hold.get(now, 0)
            )
            if fits:
                self._hold(key, want, now, namers)
            else:
                for s in namers:
                    s.unheld += 1
                tr.unheld += 1
        elif now is None and before is not None:  # left the node: named still, pending again
            if mode is not None:
                del self._held[key]
                self._count(tenant_of(namespace), before, mode, -1)
                for s in namers:
                    s.held -= 1
                    s.pending += 1
            else:
                for s in namers:
                    s.unheld -= 1
                    s.pending += 1
        elif mode is not None and now is not None and before is not None:  # moved between tiers
            tr = self.tenants[tenant_of(namespace)]
            _add(tr.by_tier, before, -1)
            _add(tr.by_tier, now, 1)
            if mode is RetainMode.HOLD:
                _add(tr.held_in, before, -1)
                _add(tr.held_in, now, 1)

    # ------------------------------------------------------------------ reporting

    def view(self, s: Session, now: float) -> SessionState:
        return SessionState(s.name, s.priority, s.mode, max(0.0, s.deadline - now), s.held, s.pending, s.unheld)

    def snapshot(self, tenant: str | None = None) -> RetentionStats:
        """One tenant's retention with its caps, or (None) the node's: every tenant's summed, no caps."""
        rows = [self.tenants[tenant]] if tenant is not None and tenant in self.tenants else []
        if tenant is None:
            rows = list(self.tenants.values())
        out = RetentionStats()
        by_tier: dict[TierKind, int] = {}
        held_in: dict[TierKind, int] = {}
        for tr in rows:
            out.sessions += len(tr.sessions)
            out.calls += tr.calls
            out.refused += tr.refused
            out.expired += tr.expired
            out.ended += tr.ended
            out.displaced += tr.displaced
            out.unheld += tr.unheld
            out.resumed += tr.resumed
            out.retained_pages += tr.total
            out.pending += sum(s.pending for s in tr.sessions.values())
            for k, n in tr.by_tier.items():
                by_tier[k] = by_tier.get(k, 0) + n
            for k, n in tr.held_in.items():
                held_in[k] = held_in.get(k, 0) + n
        caps = self.caps(tenant) if tenant is not None else None
        for kind, tier in self.table.tiers.items():
            if tier.available:
                hold_cap = caps.hold.get(kind, 0) if caps is not None else 0
                out.tiers.append(TierRetention(kind, by_tier.get(kind, 0), held_in.get(kind, 0), hold_cap))
        out.cap_pages = caps.total if caps is not None else 0
        return out

    def check(self) -> None:
        """AssertionError naming the first of the module docstring's invariants that does not hold (tests and a
        debugging operator call it; O(pages retained + pages named))."""

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(f"retention invariant: {what}")

        for e in self.table:
            mode = self._held.get(e.key)
            if mode is None:
                need(e.hold_from == UNRETAINED, f"{e.key} is not retained but holds from {e.hold_from}")
            else:
                need(e.hold_from == self._hold_from(mode), f"{e.key} holds from {e.hold_from}, not as {mode.name}")
                need(mode is self._strongest(self.named.get(e.key, [])), f"{e.key}: not its namers' strongest mode")
        for k in self._held:
            need(k in self.table and k in self.named, f"{k} is retained but not stored or not named")
        for k, namers in self.named.items():
            need(bool(namers), f"{k} is named by no session")
            for s in namers:
                need(self.tenants[s.tenant].sessions.get(s.name) is s and k in s.keys, f"{k}: stale namer {s.name}")
        deadlines = {(d, id(x)) for d, _, x in self._heap}
        for tenant, tr in self.tenants.items():
            mine = [e for k in self._held if tenant_of(k[0]) == tenant and (e := self.table.get(k)) is not None]
            by_tier, held_in = {}, {}
            for e in mine:
                by_tier[e.tier] = by_tier.get(e.tier, 0) + 1
                if self._held[e.key] is RetainMode.HOLD:
                    held_in[e.tier] = held_in.get(e.tier, 0) + 1
            need(tr.total == len(mine) and tr.by_tier == by_tier and tr.held_in == held_in, f"{tenant}'s counts")
            need(tr.named == sum(len(s.keys) for s in tr.sessions.values()), f"{tenant}'s named keys")
            for s in tr.sessions.values():
                stored = [k for k in s.keys if k in self.table]
                need(s.held == sum(1 for k in stored if k in self._held), f"session {s.name}: held")
                need(s.unheld == len(stored) - s.held and s.pending == len(s.keys) - len(stored), f"{s.name}: counts")
                need((s.deadline, id(s)) in deadlines, f"session {s.name} has no expiry entry at its deadline")
        need(self._live == sum(len(tr.sessions) for tr in self.tenants.values()), "the live session count")

    # ------------------------------------------------------------------ internals

    def _strongest(self, namers: list[Session]) -> RetainMode:
        return RetainMode.HOLD if any(s.mode is RetainMode.HOLD for s in namers) else RetainMode.DEMOTE

    def _hold_from(self, mode: RetainMode) -> int:
        return 0 if mode is RetainMode.HOLD else int(self.slowest)

    def _count(self, tenant: str, tier: TierKind, mode: RetainMode, n: int) -> None:
        tr = self.tenants[tenant]
        tr.total += n
        _add(tr.by_tier, tier, n)
        if mode is RetainMode.HOLD:
            _add(tr.held_in, tier, n)

    def _hold(self, key: Key, mode: RetainMode, tier: TierKind, namers: list[Session]) -> None:
        """A stored page nothing retained becomes retained in `mode` (its namers counted it pending or unheld
        already: the caller moved it out of that count)."""
        self._held[key] = mode
        entry = self.table.get(key)
        assert entry is not None
        entry.hold_from = self._hold_from(mode)
        self._count(tenant_of(key[0]), tier, mode, 1)
        for s in namers:
            s.held += 1

    def _restate(self, key: Key) -> None:
        """A retained page's strongest mode may have changed (a namer changed mode or left): apply it."""
        entry = self.table.get(key)
        old = self._held[key]
        new = self._strongest(self.named[key])
        if entry is None or new is old:
            return
        self._held[key] = new
        entry.hold_from = self._hold_from(new)
        tr = self.tenants[tenant_of(key[0])]
        _add(tr.held_in, entry.tier, 1 if new is RetainMode.HOLD else -1)

    def _name(self, s: Session, key: Key) -> None:
        """Session `s` names page `key` (not named by it before); the caller made room for it."""
        s.keys[key] = None
        self.tenants[s.tenant].named += 1
        namers = self.named.setdefault(key, [])
        namers.append(s)
        entry = self.table.get(key)
        if entry is None:
            s.pending += 1
        elif key in self._held:
            s.held += 1
            self._restate(key)
        else:  # stored, retained by nobody (new, or it arrived at the cap): retained now
            for other in namers[:-1]:
                other.unheld -= 1
            self._hold(key, self._strongest(namers), entry.tier, namers[:-1])
            s.held += 1

    def _revive(self, key: Key) -> None:
        """A named, stored page nobody retains (it arrived at the cap) is retained now; the caller made room."""
        entry = self.table.get(key)
        namers = self.named[key]
        if entry is None or key in self._held:
            return
        for x in namers:
            x.unheld -= 1
        self._hold(key, self._strongest(namers), entry.tier, namers)

    def _unname(self, s: Session, key: Key) -> int:
        """Session `s` no longer names `key`; 1 when the page is retained by nobody now, else 0."""
        del s.keys[key]
        self.tenants[s.tenant].named -= 1
        namers = self.named[key]
        namers.remove(s)
        mode = self._held.get(key)
        entry = self.table.get(key)
        if entry is None:
            s.pending -= 1
        elif mode is None:
            s.unheld -= 1
        else:
            s.held -= 1
        if not namers:
            del self.named[key]
            if mode is not None and entry is not None:
                del self._held[key]
                entry.hold_from = UNRETAINED
                self._count(s.tenant, entry.tier, mode, -1)
                return 1
            return 0
        if mode is not None:
            self._restate(key)
        return 0

    def _drop(self, s: Session, now: float) -> int:
        """End session `s` (ended, expired or displaced): release its pages, forget it; pages released."""
        released = sum(self._unname(s, k) for k in list(s.keys))
        del self.tenants[s.tenant].sessions[s.name]
        self._live -= 1
        s.deadline = -math.inf  # NOTE: its heap entries no longer match it (expire skips them)
        return released

    def _lease(self, s: Session, call: RetainCall, now: float) -> None:
        """Set the lease when the call gives one (a heap entry per lease; stale ones are skipped, and the heap
        is rebuilt when they outnumber the live sessions)."""
        if call.ttl_seconds is None:
            return
        s.deadline = now + call.ttl_seconds
        heapq.heappush(self._heap, (s.deadline, s.seq, s))
        if len(self._heap) > _HEAP_SLACK * (self._live + 256):
            self._heap = [(x.deadline, x.seq, x) for tr in self.tenants.values() for x in tr.sessions.values()]
            heapq.heapify(self._heap)

    def _make_room(
        self,
        tenant: str,
        tr: TenantRetention,
        s: Session | None,
        new: list[Key],
        *,
        mode: RetainMode,
        priority: int,
    ) -> list[Session]:
        """The sessions to displace so that `s` (None: a new one) may name `new` in `mode`: [] when it fits
        already; ResourceExhausted naming the cap when sessions of lower priority cannot make room."""
        slowest = self.slowest
        add_total = 0
        add_hold: dict[TierKind, int] = {}
        for k in new:
            entry = self.table.get(k)
            if entry is None:
                continue
            held = self._held.get(k)
            if held is None:
                add_total += 1
            if mode is RetainMode.HOLD and held is not RetainMode.HOLD and entry.tier < slowest:
                _add(add_hold, entry.tier, 1)
        if s is not None and mode is RetainMode.HOLD and s.mode is RetainMode.DEMOTE:
            for k in s.keys:
                entry = self.table.get(k)
                if self._held.get(k) is RetainMode.DEMOTE and entry is not None and entry.tier < slowest:
                    _add(add_hold, entry.tier, 1)
        caps = self.caps(tenant)
        need_total = tr.total + add_total - caps.total
        need_hold = {
            t: tr.held_in.get(t, 0) + tr.incoming.get(t, 0) + n - caps.hold.get(t, 0) for t, n in add_hold.items()
        }
        if need_total <= 0 and all(n <= 0 for n in need_hold.values()):
            return []  # NOTE: before `mine`, which walks the session's pages: a lease or priority update is O(1)
        mine = set(new) | (set(s.keys) if s is not None else set())
        chosen: list[Session] = []
        gone: set[int] = set()
        others = sorted(
            (x for x in tr.sessions.values() if x is not s and x.priority < priority), key=lambda x: (x.priority, x.seq)
        )
        for victim in others:
            if need_total <= 0 and all(n <= 0 for n in need_hold.values()):
                break
            chosen.append(victim)
            gone.add(id(victim))
            for k in victim.keys:
                held = self._held.get(k)
                entry = self.table.get(k)
                if held is None or entry is None or k in mine:
                    continue
                rest = [x for x in self.named[k] if id(x) not in gone]
                if not rest:
                    need_total -= 1
                weakens = held is RetainMode.HOLD and self._strongest(rest) is not RetainMode.HOLD
                if weakens and entry.tier in need_hold:
                    need_hold[entry.tier] -= 1
        if need_total <= 0 and all(n <= 0 for n in need_hold.values()):
            return chosen
        tr.refused += 1
        if need_total > 0:
            raise ResourceExhausted(
                f"retention cap: tenant {tenant!r} may retain {caps.total} pages on this node ({caps.fraction:g} "
                f"of its {slowest.label} slots); it retains {tr.total}, this call would add {add_total}, and no "
                f"session of priority below {priority} can give way. Release or end sessions, or lower this one's need"
            )
        tier = next(t for t, n in need_hold.items() if n > 0)
        raise ResourceExhausted(
            f"retention cap: tenant {tenant!r} may hold {caps.hold.get(tier, 0)} pages in {tier.label} "
            f"({caps.fraction:g} of its {tier.label} slots); it holds {tr.held_in.get(tier, 0)} there, this call "
            f"would add {add_hold[tier]}, and no session of priority below {priority} can give way. Use "
            "RETAIN_MODE_DEMOTE (demote, don't drop) to keep pages on the slowest tier instead"
        )


def _nothing() -> None:
    return None


def _add(counts: dict[TierKind, int], tier: TierKind, n: int) -> None:
    v = counts.get(tier, 0) + n
    if v:
        counts[tier] = v
    else:
        counts.pop(tier, None)
