"""The duel (an earlier default, kept as a candidate): prefix-arc's victims, with TinyLFU admission
switched on and off online by dueling two shadow simulations (set dueling for a fully associative
cache). The adaptive default (adaptive.py) generalises it to three thresholds.

Why. Admission is the strongest lever on some shapes and the worst choice on others (benchmarks/
RESULTS.md, "Policies"): where a few long prefixes are reused by a stream of one-off suffixes (agent
loops, batch few-shot jobs) refusing first sightings keeps the shared prefixes and wins up to 25% of
hits; where reuse comes soon after a first sighting (document QA follow-ups, the Mooncake trace) the
same filter loses 40-60%. No fixed choice, and no per-deployment setting, holds up on both.

How. Two shadow caches replay the references this tier sees, one with the admission filter and one
without, both with prefix-arc's victims and the same sketch. A saturating counter (set dueling's
PSEL, Qureshi et al., ISCA'07) adds one for each reference only the filtered shadow hits and takes
one for each only the plain shadow hits; admission is on while it is clearly positive (hysteresis
of PSEL_SWITCH, so noise in a quiet period does not flip it) and the saturation at PSEL_LIMIT bounds
how much old evidence a changed workload has to outweigh. Only admit() changes with the verdict: the
victim order is prefix-arc's all along, so a switch moves no page.

Cost is bounded. Up to SHADOW_MAX keys a shadow is as large as the tier and sees every reference;
beyond, the shadows sample keys by a stable hash at rate 2**-k and shrink by the same factor
(miniature simulation, Waldspurger et al., ATC'17), so they never hold more than SHADOW_MAX keys
each. A sampled shadow cannot see a key's parent (it is not sampled with it); for the parent rule of
admission it asks the real tier instead.

Everything is pure and deterministic (stable hashing, no clocks): a simulation and a node that see
the same keys make the same decisions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvstore.policy.admission import Admitted, TinyLFU
from kvstore.policy.base import EvictionPolicy, Key, first_usable
from kvstore.policy.prefix import PrefixARCPolicy
from kvstore.policy.sketch import stable_hash


class ShadowCache:
    """A miniature simulation of one candidate on the references it is fed: same victim order as
    the real tier, with or without the admission filter. Invariants: at most `capacity` resident
    keys; `policy` holds exactly them; `hits` counts the fed references found resident (decayed by
    the owner).

    The keys of the chain being referenced right now are never victims (the engine pins a request's
    blocks while it runs): a chain is the run of references each naming the previous one as parent.
    """

    def __init__(self, capacity: int, admission: bool, factory: Callable[[], EvictionPolicy]) -> None:
        self.capacity = capacity
        self.admission = admission
        self.policy = factory()
        self.resident: set[Key] = set()
        self.hits = 0.0
        self._prev: Key | None = None
        self._run: set[Key] = set()

    def reference(self, key: Key, parent: Key | None, rule: TinyLFU, parent_elsewhere: bool | None) -> None:
        """Key is referenced (not yet recorded in `rule`'s sketch). `parent_elsewhere`, for a sampled
        shadow that cannot see parents: whether the parent is missing from the real tier."""
        if parent is None or parent != self._prev:
            self._run = set()
        self._prev = key
        self._run.add(key)
        if key in self.resident:
            self.hits += 1
            self.policy.on_access(key)
            return
        if len(self.resident) >= self.capacity:
            run = self._run
            victim = first_usable(self.policy, lambda k: k not in run)
            if victim is None:
                return
            if self.admission:
                missing = (
                    parent_elsewhere
                    if parent_elsewhere is not None
                    else parent is not None and parent not in self.resident
                )
                if missing or not rule.admits(key, victim):
                    return
            self.policy.on_remove(victim)
            self.resident.discard(victim)
        self.resident.add(key)
        self.policy.on_insert(key, parent=parent)  # type: ignore[call-arg]


class DuelPolicy(Admitted):
    """prefix-arc behind a TinyLFU admission filter that is on only while a shadow with the filter
    out-hits a shadow without it (see the module docstring). Config name "duel" (the node's default
    before "adaptive" replaced it).

    Invariants: as Admitted (the victim order is PrefixARCPolicy's, every event forwarded); both
    shadows have the same capacity, `high / 2**k` rounded, and see the same sampled references;
    `admission_on` is re-decided after every sampled reference.
    """

    SHADOW_MAX = 2048  # keys per shadow before sampling starts: bounds the policy's extra memory
    PSEL_LIMIT = 128  # the duel counter saturates at +-PSEL_LIMIT: how much past evidence counts
    PSEL_SWITCH = 16  # hysteresis: admission turns on at +PSEL_SWITCH, off at -PSEL_SWITCH

    def __init__(self, policy: EvictionPolicy | None = None) -> None:
        super().__init__(policy if policy is not None else PrefixARCPolicy())
        self.name = "duel"
        self.admission_on = False
        self.switches = 0  # times the verdict changed (for reports and tests)
        self._k = -1  # sampling: a key is sampled iff its stable hash has k low bits (of 24) at 0
        self._psel = 0  # hits the filtered shadow made and the plain one did not, minus the converse
        self._shadows: tuple[ShadowCache, ShadowCache] | None = None

    def _shadow_policy(self) -> EvictionPolicy:
        return type(self.policy)()

    def _grew(self, high: int) -> None:
        super()._grew(high)
        k = max(0, math.ceil(math.log2(high / self.SHADOW_MAX))) if high > self.SHADOW_MAX else 0
        cap = max(1, round(high / (1 << k)))
        if k != self._k or self._shadows is None:
            # NOTE: a new sampling rate starts the shadows over; that happens only while the tier
            # first fills (its high-water mark doubles), when nothing is refused anyway.
            self._k = k
            self._shadows = (ShadowCache(cap, False, self._shadow_policy), ShadowCache(cap, True, self._shadow_policy))
        else:
            for s in self._shadows:
                s.capacity = cap

    def _admits(self, key: Key, victim: Key | None, parent: Key | None) -> bool:
        return victim is not None and (not self.admission_on or super()._admits(key, victim, parent))

    def _reference(self, key: Key, parent: Key | None) -> None:
        shadows = self._shadows
        if shadows is not None and (self._k == 0 or (stable_hash(key) >> 40) & ((1 << self._k) - 1) == 0):
            elsewhere = None if self._k == 0 else (parent is not None and parent not in self._resident)
            shadow_parent = parent if self._k == 0 else None
            plain, filtered = shadows
            before = filtered.hits - plain.hits
            for s in shadows:
                s.reference(key, shadow_parent, self.filter, elsewhere)
            # NOTE: only references one shadow hits and the other misses move the counter.
            self._psel = max(-self.PSEL_LIMIT, min(self.PSEL_LIMIT, self._psel + filtered.hits - plain.hits - before))
            on = self._psel >= self.PSEL_SWITCH if not self.admission_on else self._psel > -self.PSEL_SWITCH
            if on != self.admission_on:
                self.admission_on = on
                self.switches += 1
        super()._reference(key, parent)
