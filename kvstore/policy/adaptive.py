"""The adaptive default: prefix-arc's victims behind an admission threshold that moves online between
"admit all", "admit on second sight" and "admit only if more frequent than the victim" (TinyLFU),
chosen by three miniature simulations of the tier, one per threshold, on a sample of the keys.

Why three. Which pages deserve a place in a full tier depends on the traffic (benchmarks/RESULTS.md,
issues 14 and 22): where reuse comes soon after a first sighting (document QA follow-ups, a chat's
next turn within minutes) every page should enter; where most pages are seen once and the reused
ones come back later than recency keeps them (production chat: uploads and one-off questions in
front of long conversations, the Mooncake conversation trace) a page should enter on its second
sight, so the one-offs never push out the conversations; where a few long prefixes are reused by a
stream of one-off suffixes (agent loops, batch few-shot jobs) a page should enter only if it was
referenced more often than the page it would replace. No fixed threshold is within 30% of the best
on all three; the threshold follows the traffic.

The ladder. Every threshold reads one reference history (kvstore/policy/history.py: exact counts of
the keys referenced recently, at most HISTORY_FACTOR x capacity of them, halved every
WINDOW_FACTOR x capacity references):
    ALL        admit.
    SECOND     admit a key the history remembers (seen before, in the tier or not: a ghost list of
               keys, no data), and only if its chain parent is in the tier.
    FREQUENT   admit a key whose count (this reference included) exceeds the victim's, and only if
               its chain parent is in the tier (TinyLFU's test, Einziger et al. 2017).
The chain-parent rule: a block whose parent is missing cannot be matched by a longest-prefix
lookup; admitting it would push out a useful page for nothing.

How it moves. Three shadow caches replay a stable-hash sample of the tier's keys (miniature
simulation, Waldspurger et al., ATC'17: the references to a sample of rate 2**-k of the keys, in a
cache 2**k times smaller, behave like the full cache), each at one threshold, with prefix-arc's
victims; a sampled key's parent there is the last sampled key of its chain, so sampled chains stay
chains. Each shadow counts its prefix hits (a hit after a miss in the same request saves nothing).
A reference all three shadows hit, or all three miss, says nothing about the thresholds and is
skipped (a very hot key, such as a system prompt's first block in a sample, would otherwise drown
the differences); on the others each shadow's score is decayed by 1 - 1/(MEMORY x shadow capacity)
and raised by its hit (the recent hits, like LeCaR's expert weights or ARC's ghost hits, but
counted against the shadows' full counterfactual instead of guessed from a ghost list). The tier
moves to the threshold with the best score once that beats the current one's by SWITCH (5%) and
MIN_LEAD hits: near ties never move it (a move costs a transition, a near tie gains nothing), and
the decay bounds how much old evidence a changed workload has to outweigh. Only admit() changes
with the threshold: the victim order is prefix-arc's all along, so a move costs no page.

Cost is bounded. A shadow holds between SHADOW_MIN and 2 x SHADOW_MIN keys (the whole tier below
that, seeing every reference), so the shadows cost 3 x 2 x SHADOW_MIN keys and, per reference,
3 x 2**-k shadow updates; the history is one dict update per reference. For the parent rule a
shadow asks its own keys (the sampled parent).

Everything is pure and deterministic (stable hashing, no clocks): a simulation and a node that see
the same keys make the same decisions.
"""

from __future__ import annotations

from collections.abc import Callable

import xxhash

from kvstore.policy.admission import Admitted, SecondSight
from kvstore.policy.base import Key, first_usable
from kvstore.policy.history import History
from kvstore.policy.prefix import PrefixARCPolicy
from kvstore.policy.sketch import stable_hash

ALL, SECOND, FREQUENT = 0, 1, 2
LEVELS = ("all", "second-sight", "frequency")  # names of the thresholds, for reports
ORDERS = ("arc", "lru")  # prefix-arc's victims, or the same policy's by recency alone (prefix-LRU's)
# NOTE: (threshold, merged) pairs the shadows compare. Second sight and frequency are only tried with
# recency victims: behind a filter ARC's protected class only holds stale keys longer (measured).
ARMS = ((ALL, False), (ALL, True), (SECOND, True), (FREQUENT, True))


def sample_hash(key: Key) -> int:
    """A stable 64-bit hash for sampling: the manager's (namespace, 32-byte digest) keys by their
    digest (already uniform; one C call), anything else by stable_hash."""
    if type(key) is tuple and len(key) == 2 and type(key[1]) is bytes:
        return xxhash.xxh3_64_intdigest(key[1])
    return stable_hash(key)


class ThresholdRule:
    """What the thresholds read (an AdmissionRule for Admitted; AdaptivePolicy decides itself): the
    reference history (counts, for FREQUENT) and the second-sight ghost (refused keys, for SECOND),
    sized from the tier's capacity."""

    name = "threshold"

    def __init__(self) -> None:
        self.history = History()
        self.ghost = SecondSight(GHOST_FACTOR)
        self.level = ALL

    def ensure_capacity(self, capacity: int) -> None:
        self.history.ensure_capacity(capacity)
        self.ghost.ensure_capacity(capacity)

    def record(self, key: Key) -> None:
        self.history.reference(key)

    def admits(self, key: Key, victim: Key) -> bool:
        return self.level == ALL or (self.level == SECOND and key in self.ghost.ghost)

    def refused(self, key: Key) -> None:
        pass

    def admitted(self, key: Key) -> None:
        pass


GHOST_FACTOR = 4.0  # the second-sight ghost remembers this many refused keys per key of capacity


class ShadowCache:
    """A miniature simulation of the tier at one threshold and victim order, on the references it is
    fed. Invariants: at most `capacity` resident keys; `policy` holds exactly them; `ghost` holds only
    keys this shadow refused (at most GHOST_FACTOR x capacity); `hits` counts the fed references
    found resident, `prefix_hits` those of them with no miss before them in their request.
    """

    def __init__(self, capacity: int, level: int, merged: bool) -> None:
        self.capacity = capacity
        self.level = level
        self.policy = PrefixARCPolicy()
        self.policy.merged = merged
        self.ghost = SecondSight(GHOST_FACTOR)
        self.ghost.ensure_capacity(capacity)
        self.resident: set[Key] = set()
        self.hits = 0
        self.prefix_hits = 0
        self._missed = False

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self.ghost.ensure_capacity(capacity)

    def reference(self, key: Key, parent: Key | None, usable: Callable[[Key], bool], before: int,
                  history: History) -> bool:  # fmt: skip
        """Key is referenced after `parent` in its chain (None: the chain's first key here), while the
        keys usable() rejects are held; `before` is its history count without this reference. True
        for a prefix hit (the key is here and so was every key of its chain before it)."""
        if parent is None:
            self._missed = False
        if key in self.resident:
            self.hits += 1
            self.policy.on_access(key)
            if self._missed:
                return False
            self.prefix_hits += 1
            return True
        self._missed = True
        if len(self.resident) < self.capacity or self._make_room(key, parent, usable, before, history):
            self.resident.add(key)
            self.policy.on_insert(key, parent=parent)
        return False

    def _make_room(self, key: Key, parent: Key | None, usable: Callable[[Key], bool], before: int,
                   history: History) -> bool:  # fmt: skip
        """In the full shadow: whether key is admitted (its victim then evicted)."""
        level = self.level
        if level != ALL:
            # NOTE: the admission test before the victim search where it needs no victim: most
            # references a filter sees are refused.
            missing = parent is not None and parent not in self.resident
            if level == SECOND:
                if missing or key not in self.ghost.ghost:
                    self.ghost.refused(key)
                    return False
                self.ghost.admitted(key)
            elif missing:
                return False
        victim = first_usable(self.policy, usable)
        if victim is None or (level == FREQUENT and before + 1 <= history.count(victim)):
            return False
        self.policy.on_remove(victim)
        self.resident.discard(victim)
        return True


class AdaptivePolicy(Admitted):
    """prefix-arc behind the threshold and victim order the shadows choose (see the module
    docstring). Config name "adaptive", the node's default.

    Invariants: as Admitted (every event forwarded to one PrefixARCPolicy, whose `merged` flag is
    the victim order); the six shadows have the same capacity, `high / 2**k` rounded, and see the
    same sampled references; the arm is re-decided after every contested sampled reference;
    `scores[i]` is in [0, MEMORY x shadow capacity]; the ghost is kept as a second-sight tier would
    keep it whatever the threshold, so SECOND starts warm.
    """

    SHADOW_MIN = 128  # keys per shadow before sampling starts (a shadow holds SHADOW_MIN..2x that)
    MEMORY = 64  # the scores' memory: MEMORY x shadow capacity contested references (decay 1 - 1/that)
    SWITCH = 0.05  # hysteresis: another arm moves in when its score beats the current one's by 5%
    MIN_LEAD = 8.0  # ... and by this many hits (no move on the first few references)
    START = 0  # the arm a new tier starts in

    def __init__(self) -> None:
        self.rule = ThresholdRule()
        self.arcs = PrefixARCPolicy()
        super().__init__(self.arcs, self.rule)
        self.name = "adaptive"
        self.arm = self.START
        self.rule.level, self.arcs.merged = ARMS[self.arm]
        self.switches = 0  # times the arm changed (for reports and tests)
        self.moves = [0] * len(ARMS)  # sampled references spent in each arm
        self.scores = [0.0] * len(ARMS)  # decayed prefix hits of each arm's shadow, contested references
        self._k = -1  # sampling: a key is sampled iff its sample_hash has its k low bits at 0
        self._mask = 0
        self._decay = 0.0
        self._shadows: list[ShadowCache] = []
        self._chain_prev: Key | None = None  # the key of the last reference
        self._chain_sampled: Key | None = None  # the last sampled key of the chain being referenced
        self._run: set[Key] = set()  # the sampled keys of that chain (held while it runs)
        self._usable: Callable[[Key], bool] = lambda k: True

    @property
    def level(self) -> int:
        return self.rule.level

    @property
    def merged(self) -> bool:
        return self.arcs.merged

    def _admits(self, key: Key, victim: Key | None, parent: Key | None) -> bool:
        rule = self.rule
        missing = parent is not None and parent not in self._resident
        # NOTE: the ghost hears every question as a second-sight tier would answer it.
        seen = key in rule.ghost.ghost
        if missing or not seen:
            rule.ghost.refused(key)
        else:
            rule.ghost.admitted(key)
        if victim is None:
            return False
        level = rule.level
        if level == ALL:
            return True
        if missing:
            return False
        if level == SECOND:
            return seen
        h = rule.history
        return h.count(key) + 1 > h.count(victim)

    def _grew(self, high: int) -> None:
        super()._grew(high)
        k = 0
        while high >> (k + 1) >= self.SHADOW_MIN:
            k += 1
        cap = max(1, round(high / (1 << k)))
        if k != self._k:
            # NOTE: a new sampling rate starts the shadows over; that happens only while the tier
            # first fills (its high-water mark doubles), when nothing is refused anyway.
            self._k, self._mask = k, (1 << k) - 1
            self.scores = [0.0] * len(ARMS)
            self._shadows = [ShadowCache(cap, level, merged) for level, merged in ARMS]
        else:
            for s in self._shadows:
                s.resize(cap)
        self._decay = 1.0 - 1.0 / (self.MEMORY * cap)

    def _reference(self, key: Key, parent: Key | None) -> None:
        history = self.rule.history
        before = history.reference(key)
        if parent is None or parent != self._chain_prev:
            self._chain_sampled = None  # a new chain (a new request)
        self._chain_prev = key
        if not self._shadows or (self._k and sample_hash(key) & self._mask):
            return
        # NOTE: a sampled key's parent in the shadows is the chain's last sampled key before it, so
        # the sampled keys of a chain form a chain there too and the prefix rules apply.
        sparent, self._chain_sampled = self._chain_sampled, key
        if sparent is None:
            run = self._run = {key}
            self._usable = lambda k: k not in run
        else:
            self._run.add(key)
        usable = self._usable
        hits = [s.reference(key, sparent, usable, before, history) for s in self._shadows]
        arm = self.arm
        self.moves[arm] += 1
        if all(hits) or not any(hits):
            return  # NOTE: a reference every shadow hits (or misses) says nothing about the arms
        decay, score = self._decay, self.scores
        for i, hit in enumerate(hits):
            score[i] = score[i] * decay + hit
        best = max(range(len(ARMS)), key=score.__getitem__)
        if best != arm and score[best] > score[arm] * (1 + self.SWITCH) + self.MIN_LEAD:
            self.arm = best
            self.rule.level, self.arcs.merged = ARMS[best]
            self.switches += 1
