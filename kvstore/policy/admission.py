"""Admission: which pages deserve a place in a full tier at all (TinyLFU), in front of any policy.

`Admitted(policy)` is `policy` (any policy of this package: it orders the victims, unchanged) with an
`admit(key, victim, parent)` answer added. The TierManager asks it when a page that is not in the
tier (a new page, or one moving up from a lower tier) would enter it while it is full, naming the
victim the policy chose for it:

    True    the manager evicts `victim` as usual, then inserts `key` (on_insert).
    False   the tier is left as it is: a new page is written through to the next tier down (NVMe),
            or not stored when there is none; a page moving up stays where it is and is read there.

The rule (TinyLFU, Einziger et al. 2017): `key` enters only if it was referenced more often than
`victim` in the recent past, as the frequency sketch counts (a tie keeps the victim), and only if
its chain parent is in this tier (a block whose parent is missing cannot be matched by a
longest-prefix lookup; admitting it would push out a useful page for nothing).

References. The sketch counts every reference to a page the tier sees once: an on_insert, an
on_access, or an admit() that says no. An on_access right after the on_insert of the same key (no
other call in between) is the same reference: it is how the manager records a promotion (it
publishes the page in the tier, then counts the read that moved it). The manager therefore calls
nothing extra for admission: admit() where a full tier takes a page, the usual events otherwise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

from kvstore.policy.base import EvictionPolicy, Key, first_usable
from kvstore.policy.sketch import FrequencySketch


class AdmissionRule(Protocol):
    """What Admitted asks of an admission rule. `admits` is a query (no side effects); `record` hears
    every reference to a key (before `admits` is asked about that reference); `refused`/`admitted`
    hear the wrapper's answer (whatever the reason: the chain-parent rule refuses too)."""

    name: str

    def ensure_capacity(self, capacity: int) -> None: ...
    def record(self, key: Key) -> None: ...
    def admits(self, key: Key, victim: Key) -> bool: ...
    def refused(self, key: Key) -> None: ...
    def admitted(self, key: Key) -> None: ...


class TinyLFU:
    """The admission rule over a FrequencySketch: `admits(key, victim)` says whether key (referenced
    now, not yet recorded) is worth more than victim. Pure; sized by `ensure_capacity`."""

    name = "tinylfu"

    def __init__(self, *, doorkeeper: bool = True) -> None:
        self.sketch = FrequencySketch(doorkeeper=doorkeeper)

    def ensure_capacity(self, capacity: int) -> None:
        self.sketch.ensure_capacity(capacity)

    def record(self, key: Key) -> None:
        self.sketch.increment(key)

    def admits(self, key: Key, victim: Key) -> bool:
        # NOTE: +1 is the reference being made now (recorded by the caller whatever the answer);
        # a tie keeps the victim: churning equals out only costs writes.
        return self.sketch.estimate(key) + 1 > self.sketch.estimate(victim)

    def refused(self, key: Key) -> None:
        pass

    def admitted(self, key: Key) -> None:
        pass


class SecondSight:
    """Admission on second sight: a key enters a full tier only if it was refused before and is still
    remembered. The memory is a ghost list (a FIFO of refused keys, no data) of at most
    `ghost_factor` x capacity keys; a key leaves it when it is admitted or pushed out by newer
    refusals. So a block seen once (most blocks of chat traffic: uploads, one-off questions) never
    displaces a resident, and one that comes back within the ghost's reach enters on its second sight.

    Invariants: `len(ghost) <= max(1, ghost_factor * capacity)`; a key is in the ghost only after a
    refusal of it and before its admission. Deterministic: no hashing, the order of events alone.
    """

    name = "second-sight"

    def __init__(self, ghost_factor: float = 4.0) -> None:
        if not ghost_factor > 0:
            raise ValueError(f"ghost_factor must be > 0, got {ghost_factor}")
        self.ghost_factor = ghost_factor
        self.ghost: OrderedDict[Key, None] = OrderedDict()
        self._limit = 1

    def ensure_capacity(self, capacity: int) -> None:
        self._limit = max(self._limit, round(self.ghost_factor * capacity))

    def record(self, key: Key) -> None:
        pass

    def admits(self, key: Key, victim: Key) -> bool:
        return key in self.ghost

    def refused(self, key: Key) -> None:
        ghost = self.ghost
        if key in ghost:
            ghost.move_to_end(key)
        else:
            ghost[key] = None
            if len(ghost) > self._limit:  # NOTE: one at most: the limit never shrinks
                ghost.popitem(last=False)

    def admitted(self, key: Key) -> None:
        self.ghost.pop(key, None)


class Admitted:
    """`policy` behind an admission rule, TinyLFU unless `rule` says otherwise (see the module
    docstring for admit()'s contract). With `parent_rule`, a block whose chain parent is not in this
    tier is refused whatever the rule says.

    Invariants: as `policy` (same keys, same victim order: every event is forwarded unchanged);
    `_resident` maps exactly the keys inserted and not removed to their parent hint; the rule is sized
    for the most keys this tier has held (a full tier stays at its high-water mark). `policy` must
    accept the `parent`/`reads` hints on on_insert (every policy of this package does).
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        rule: AdmissionRule | None = None,
        *,
        parent_rule: bool = True,
        doorkeeper: bool = True,
    ) -> None:
        self.policy = policy
        self.filter: AdmissionRule = rule if rule is not None else TinyLFU(doorkeeper=doorkeeper)
        self.parent_rule = parent_rule
        self.name = f"{policy.name}+{self.filter.name}"
        self._resident: dict[Key, Key | None] = {}
        self._high = 0  # the most keys this tier has held
        self._just_inserted: Key | None = None  # see the module docstring: insert + access = one reference

    # -- events -------------------------------------------------------------------------------------

    def on_insert(self, key: Key, parent: Key | None = None, reads: int = 0) -> None:
        if key in self._resident:
            self.on_access(key)
            return
        self._resident[key] = parent
        if len(self._resident) > self._high:
            self._high = len(self._resident)
            self._grew(self._high)
        self._reference(key, parent)
        self._just_inserted = key
        self.policy.on_insert(key, parent=parent, reads=reads)  # type: ignore[call-arg]

    def on_access(self, key: Key) -> None:
        if key in self._resident and self._just_inserted != key:
            self._reference(key, self._resident[key])
        self._just_inserted = None
        self.policy.on_access(key)

    def on_remove(self, key: Key) -> None:
        self._just_inserted = None
        self._resident.pop(key, None)
        self.policy.on_remove(key)

    def admit(self, key: Key, victim: Key | None, parent: Key | None = None) -> bool:
        """May `key` take `victim`'s place in this full tier? Counts the reference when it says no."""
        self._just_inserted = None
        ok = self._admits(key, victim, parent)
        if ok:
            self.filter.admitted(key)
        else:
            self.filter.refused(key)
            self._reference(key, parent)
        return ok

    # -- hooks (AdaptivePolicy overrides them) ------------------------------------------------------

    def _admits(self, key: Key, victim: Key | None, parent: Key | None) -> bool:
        if victim is None:
            return False
        if self.parent_rule and parent is not None and parent not in self._resident:
            return False
        return self.filter.admits(key, victim)

    def _reference(self, key: Key, parent: Key | None) -> None:
        """One reference to key (hit, miss or refusal); `parent` when the caller knows it."""
        self.filter.record(key)

    def _grew(self, high: int) -> None:
        self.filter.ensure_capacity(high)

    # -- victims ------------------------------------------------------------------------------------

    def candidates(self) -> Iterator[Key]:
        return self.policy.candidates()

    def first_candidate(self, usable: Callable[[Key], bool]) -> Key | None:
        return first_usable(self.policy, usable)

    def __contains__(self, key: Key) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self.policy)
