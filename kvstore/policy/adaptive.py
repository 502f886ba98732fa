"""The adaptive default (DESIGN.md §6.1): prefix-LRU's victims behind an admission threshold that moves
online between "admit all", "admit on second sight" (with or without the pages that left the tier counting
as seen) and "admit only if more frequent than the victim" (TinyLFU), chosen by four miniature simulations
of the tier, one per threshold, on a sample of the keys.

Why several: which pages deserve a place in a full tier depends on the traffic. Where reuse follows a first
sighting soon (document QA follow-ups, a chat's next turn) every page should enter; where most pages are
seen once and the reused ones come back later than recency keeps them (production chat) a page should
enter on its second sight; where a few long prefixes are reused by a stream of one-off suffixes (agent
loops, batch few-shot jobs) only a page referenced more often than its victim should. Second sight comes
in two forms because a page that left the tier is worth different things: a conversation's history evicted
while its user thinks comes back at the next turn and again after it (RECALL lets it back at once; second
sight refuses it once more), while an agent loop's working set, larger than the tier, comes back in a cycle
that readmitting every evicted page turns into thrashing (SECOND keeps what the tier holds).

The ladder. The thresholds read one reference history (kvstore/policy/history.py: exact recent counts),
one ghost list (admission.SecondSight: the keys refused lately, kept as a second-sight tier would keep it
whatever the threshold, so a move to SECOND starts warm) and one list of the keys that left the tier lately
(EVICTED_FACTOR x capacity of them, kept at every threshold, so a move to RECALL starts warm):
    ALL        admit.
    RECALL     admit a key the ghost remembers or that left the tier lately, and only if its chain parent
               is in the tier.
    SECOND     admit a key the ghost remembers, and only if its chain parent is in the tier.
    FREQUENT   admit a key whose count (this reference included) exceeds the victim's, and only if
               its chain parent is in the tier (TinyLFU's test, Einziger et al. 2017).
(A block whose parent is missing cannot be matched by a longest-prefix lookup: admitting it would push
out a useful page for nothing.)

The shadows. Four LRU lists replay a stable-hash sample of rate 2**-k of the tier's keys in caches 2**k
times smaller (miniature simulation, Waldspurger et al., ATC'17), one per threshold, each with its own
ghost (RECALL's also with its own list of the keys it evicted); a sampled key's parent there is the last
sampled key of its chain. Each counts its prefix hits. A reference all four hit, or all four miss, is
skipped; on the others each score decays by 1 - 1/(MEMORY x shadow capacity) and rises by its shadow's hit,
so the memory is short and the threshold follows a traffic that changes. While the tier fills its
high-water mark doubles and the sample thins (k grows, each sample a subset of the last): the shadows keep
the keys of the new sample and the scores their evidence.

Moves. The tier moves to the best score only on a significant lead over its current threshold: more than
SWITCH and MIN_LEAD hits, and more than Z standard deviations of the difference of two counts (Z_FREQUENT
for a move to FREQUENT, which small sampled shadows overrate); among the thresholds within Z deviations of
the best it takes the first of PREFER (the least strict), so noise never makes it stricter. The fill is not
counted (`moves` start at the first admit(): before it nothing is evicted): at the first admit() the tier
takes the least strict threshold within START_Z deviations of the best, and for the next LEARN x capacity
references a move needs only Z_LEARN deviations and MIN_LEAD_LEARN hits. A move from ALL to a stricter
threshold undoes what ALL did, as far as it can without I/O: the pages ALL let into the full tier and not
referenced since become the first victims (PrefixLRUPolicy.demote), and the pages ALL pushed out go to the
second-sight ghost, so a stricter threshold lets them back on their next sighting.

Invariants:
- the victims are prefix-LRU's at every threshold: a move changes only admit() and that victim order, and
  costs no page;
- bounded cost: a shadow holds SHADOW_MIN..2 x SHADOW_MIN keys (the whole tier below that); per reference,
  4 x 2**-k shadow updates and one history update; per eviction one update of the list of keys that left;
  the probation list holds at most 2 x capacity + 64 keys;
- pure and deterministic (stable hashing, no clocks): a simulation and a node that see the same keys make
  the same decisions.

Measured: the constants were chosen on the workload suite's seed 0 and checked on held-out draws; where the
default stands against its target (DESIGN.md §6.4) is in benchmarks/RESULTS.md ("Policies"), and what was
tried and not kept in benchmarks/RESULTS-archive.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import xxhash

from kvstore.policy.admission import Admitted, SecondSight
from kvstore.policy.base import Key
from kvstore.policy.history import History
from kvstore.policy.prefix import PrefixLRUPolicy
from kvstore.policy.sketch import stable_hash

ALL, SECOND, FREQUENT, RECALL = 0, 1, 2, 3
LEVELS = ("all", "second-sight", "frequency", "recall")  # names of the thresholds, for reports
GHOST_FACTOR = 4.0  # the second-sight ghost remembers this many refused keys per key of capacity
EVICTED_FACTOR = 4.0  # RECALL's memory of the keys that left the tier, per key of capacity


def sample_hash(key: Key) -> int:
    """A stable 64-bit hash for sampling: the manager's (namespace, 32-byte digest) keys by their
    digest (already uniform; one C call), anything else by stable_hash."""
    if type(key) is tuple and len(key) == 2 and type(key[1]) is bytes:
        return xxhash.xxh3_64_intdigest(key[1])
    return stable_hash(key)


def _outright(level: int, missing: bool, seen: bool, left: bool) -> bool:
    """Whether the threshold `level` refuses a key whatever the victim: never at ALL; at the others
    when its chain parent is `missing` from the tier; at SECOND also when the ghost has not `seen` it
    (refused before); at RECALL when it was neither seen nor `left` the tier lately."""
    if level == ALL:
        return False
    if missing:
        return True
    return (level == SECOND and not seen) or (level == RECALL and not (seen or left))


class ThresholdRule:
    """What the thresholds read (an AdmissionRule for Admitted; AdaptivePolicy decides itself): the
    reference history (counts, for FREQUENT), the second-sight ghost (refused keys, for SECOND and
    RECALL) and the keys that left the tier (for RECALL), sized from the tier's capacity."""

    name = "threshold"

    def __init__(self) -> None:
        self.history = History()
        self.ghost = SecondSight(GHOST_FACTOR)
        self.left = SecondSight(EVICTED_FACTOR)
        self.level = ALL

    def ensure_capacity(self, capacity: int) -> None:
        self.history.ensure_capacity(capacity)
        self.ghost.ensure_capacity(capacity)
        self.left.ensure_capacity(capacity)

    def record(self, key: Key) -> None:
        self.history.reference(key)

    def admits(self, key: Key, victim: Key) -> bool:
        level = self.level
        return level == ALL or (level != FREQUENT and not _outright(level, False, key in self.ghost.ghost,
                                                                     key in self.left.ghost))  # fmt: skip

    def refused(self, key: Key) -> None:
        pass

    def admitted(self, key: Key) -> None:
        pass


class ShadowCache:
    """A miniature LRU simulation of the tier at one threshold, on the references it is fed.
    Invariants: at most `capacity` keys in `lru` (oldest first); `ghost` (used at SECOND and RECALL)
    holds only keys this shadow refused (at most GHOST_FACTOR x capacity); `left` (used at RECALL) only
    keys it evicted (at most EVICTED_FACTOR x capacity); `prefix_hits` counts the fed references found
    resident with no miss before them in their request."""

    def __init__(self, capacity: int, level: int, run: set[Key], history: History) -> None:
        self.capacity = capacity
        self.level = level
        self.run = run  # the owner's: the sampled keys of the chain being referenced (held while it runs)
        self.history = history  # the owner's reference counts (for FREQUENT)
        self.lru: OrderedDict[Key, None] = OrderedDict()
        self.ghost = SecondSight(GHOST_FACTOR)
        self.left = SecondSight(EVICTED_FACTOR)
        self.prefix_hits = 0
        self._missed = False
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self.ghost.ensure_capacity(capacity)
        self.left.ensure_capacity(capacity)

    def resample(self, mask: int, capacity: int) -> None:
        """Keep only the keys of a sparser sample (those whose sample_hash has the `mask` bits at 0, a
        subset of the current sample) at the new `capacity`: what this shadow would hold had it been
        fed that sample all along, near enough; its evidence survives the tier's growth."""
        self.lru = OrderedDict((k, None) for k in self.lru if not sample_hash(k) & mask)
        while len(self.lru) > capacity:
            self.lru.popitem(last=False)
        self.ghost, self.left = (_sparser(memory, mask, capacity) for memory in (self.ghost, self.left))
        self.capacity = capacity

    def reference(self, key: Key, parent: Key | None, before: int) -> bool:
        """Key is referenced after `parent` in its chain (None: the chain's first key here), while the
        keys of `run` are held; `before` is its history count without this reference. True for a
        prefix hit (the key is here and so was every key of its chain before it)."""
        if parent is None:
            self._missed = False
        lru = self.lru
        if key in lru:
            lru.move_to_end(key)
            if self._missed:
                return False
            self.prefix_hits += 1
            return True
        self._missed = True
        if len(lru) < self.capacity:
            lru[key] = None
        elif self.level == ALL:
            # NOTE: the keys of `run` were all referenced since its first one, so they are the youngest
            # in `lru`: the oldest key is the victim unless it is in `run`, and then every key is (O(1)).
            victim = next(iter(lru))
            if victim not in self.run:
                del lru[victim]
                lru[key] = None
        else:
            self._filtered(key, parent, before)
        return False

    def _filtered(self, key: Key, parent: Key | None, before: int) -> None:
        """A miss in the full shadow at SECOND or FREQUENT: key enters (its victim leaves) if admitted."""
        lru, level = self.lru, self.level
        # NOTE: the admission test before the victim: most references a filter sees are refused.
        missing = parent is not None and parent not in lru
        if level == FREQUENT:
            if missing:
                return
        else:
            ghost = self.ghost
            # NOTE: _outright(level, missing, seen, left) written out: this runs on most sampled misses.
            if missing or (key not in ghost.ghost and (level == SECOND or key not in self.left.ghost)):
                ghost.refused(key)
                return
            ghost.admitted(key)
        victim = next(iter(lru))  # NOTE: see reference(): the victim unless every key is in `run`
        if victim in self.run or (level == FREQUENT and before + 1 <= self.history.count(victim)):
            return
        del lru[victim]
        lru[key] = None
        if level == RECALL:
            self.left.refused(victim)


def _sparser(memory: SecondSight, mask: int, capacity: int) -> SecondSight:
    """The keys of `memory` in a sparser sample (sample_hash with the `mask` bits at 0), in order, in a
    memory sized for `capacity`."""
    out = SecondSight(memory.ghost_factor)
    out.ensure_capacity(capacity)
    for key in memory.ghost:
        if not sample_hash(key) & mask:
            out.refused(key)
    return out


class AdaptivePolicy(Admitted):
    """prefix-LRU behind the threshold the shadows choose (see the module docstring). Config name
    "adaptive", the node's default.

    Invariants: as Admitted (every event forwarded to one PrefixLRUPolicy: the victim order never
    depends on the threshold); the four shadows have the same capacity, `high / 2**k` rounded, and
    see the same sampled references; the threshold is re-decided after every contested sampled
    reference; `scores[i]` is in [0, MEMORY x shadow capacity].
    """

    SHADOW_MIN = 128  # keys per shadow before sampling starts (a shadow holds SHADOW_MIN..2x that)
    MEMORY = 4  # the scores' memory: MEMORY x shadow capacity contested references (decay 1 - 1/that; see above)
    SWITCH = 0.05  # a move needs a lead of 5% of the current threshold's score ...
    MIN_LEAD = 8.0  # ... and this many hits (no move on the first few references) ...
    Z = 3.0  # ... and this many standard deviations of the difference (noise never moves it)
    Z_FREQUENT = 5.0  # ... 5 for a move to TinyLFU's test: the shadows overrate it (measured)
    PREFER = (ALL, RECALL, SECOND, FREQUENT)  # among thresholds within Z deviations of the best, the first
    START = ALL  # the threshold a new tier starts with (measured: the best start on the suite)
    # The first choice, when the tier fills, has no incumbent to protect (see the module docstring):
    START_Z = 1.0  # when the tier fills: the least strict threshold within START_Z deviations of the best
    LEARN = 8.0  # then for LEARN x capacity references a move needs only ...
    Z_LEARN = 2.0  # ... Z_LEARN deviations (for every threshold) ...
    MIN_LEAD_LEARN = 4.0  # ... and this many hits, no SWITCH margin

    def __init__(self) -> None:
        self.rule = ThresholdRule()
        super().__init__(PrefixLRUPolicy(), self.rule)
        self.policy: PrefixLRUPolicy
        self._history_reference = self.rule.history.reference  # NOTE: bound once: called on every reference
        self._left_refused = self.rule.left.refused  # NOTE: bound once: called on every eviction
        # NOTE: prefix-LRU's own node table (key -> node, its parent hint in node.parent) stands in for
        # Admitted's `_resident`: the same keys, one dict update per insert and remove instead of two.
        self._nodes = self.policy._nodes
        self._resident = self._nodes  # type: ignore[assignment]  # Admitted reads membership only
        self.name = "adaptive"
        self.rule.level = self.START
        self.switches = 0  # times the threshold changed (for reports and tests)
        self.moves = [0] * len(LEVELS)  # sampled references spent at each threshold
        self.scores = [0.0] * len(LEVELS)  # decayed prefix hits of each shadow, contested references
        self._k = -1  # sampling: a key is sampled iff its sample_hash has its k low bits at 0
        self._full = False  # admit() was asked: the tier has been full (admission matters from then on)
        self._learn_left = 0  # references left in the learning phase (0: before the tier fills, and after)
        self._entering: Key | None = None  # the key admit() let in at ALL, until its on_insert
        self._displaced: Key | None = None  # the victim named for it, until its on_remove
        # NOTE: the pages ALL let into the full tier, in order, with their recency stamp then: a page
        # still here with that stamp was not referenced since (no bookkeeping on accesses).
        self._probation: dict[Key, float | None] = {}
        self._mask = 0
        self._decay = 0.0
        self._shadows: list[ShadowCache] = []
        self._shadow_refs: tuple[Callable[[Key, Key | None, int], bool], ...] = ()
        self._chain_prev: Key | None = None  # the key of the last reference
        self._chain_sampled: Key | None = None  # the last sampled key of the chain being referenced
        self._run: set[Key] = set()  # the sampled keys of that chain (held while it runs)

    @property
    def level(self) -> int:
        return self.rule.level

    def _admits(self, key: Key, victim: Key | None, parent: Key | None) -> bool:
        rule = self.rule
        missing = parent is not None and parent not in self._nodes
        # NOTE: the ghost hears every question as a second-sight tier would answer it.
        seen = key in rule.ghost.ghost
        if missing or not seen:
            rule.ghost.refused(key)
        else:
            rule.ghost.admitted(key)
        if victim is None:
            return False
        level = rule.level
        if _outright(level, missing, seen, level == RECALL and key in rule.left.ghost):
            return False
        if level != FREQUENT:
            return True
        h = rule.history
        return h.count(key) + 1 > h.count(victim)

    def admit(self, key: Key, victim: Key | None, parent: Key | None = None) -> bool:
        if not self._full:
            self._filled()
        # NOTE: Admitted.admit without telling the rule (ThresholdRule ignores it): this is the hot path.
        self._just_inserted = None
        ok = self._admits(key, victim, parent)
        if not ok:
            self._reference(key, parent)
        elif self.rule.level == ALL:
            self._entering, self._displaced = key, victim
        return ok

    def refuses(self, key: Key, parent: Key | None = None) -> bool:
        """True (the reference counted, as admit() counts a refusal) when admit() would refuse `key`
        whatever the victim: at SECOND an unseen key, at SECOND or FREQUENT a key whose chain parent
        is gone. Most references a strict threshold sees are refused this way, and choosing a victim
        for each costs more than the rest of the question. At ALL, and before the tier first fills,
        always False (admit() decides, and starts the learning phase)."""
        level = self.rule.level
        if level == ALL or not self._full:
            return False
        rule = self.rule
        missing = parent is not None and parent not in self._nodes
        if not _outright(level, missing, key in rule.ghost.ghost, level == RECALL and key in rule.left.ghost):
            return False
        # NOTE: admit() without a victim refuses and counts the reference: the one refusal path.
        return not self.admit(key, None, parent)

    def _filled(self) -> None:
        """The first admit(): the tier is full and admission matters from now on. Nothing the shadows
        saw before made a difference, so the start threshold is the evidence's best with no incumbent
        to protect, and the learning phase begins."""
        self._full = True
        self._learn_left = max(1, round(self.LEARN * self._high))
        best = self._near_best(self.START_Z)
        if best != self.rule.level:
            self.rule.level = best
            self.switches += 1

    def on_insert(self, key: Key, parent: Key | None = None, reads: int = 0) -> None:
        # NOTE: Admitted.on_insert over prefix-LRU's node table (see __init__): this is the hot path.
        entering, self._entering = self._entering, None
        nodes = self._nodes
        if key in nodes:
            self.on_access(key)
            return
        if len(nodes) >= self._high:
            self._high = len(nodes) + 1
            self._grew(self._high)
        self._reference(key, parent)
        self._just_inserted = key
        self.policy.on_insert(key, parent=parent, reads=reads)
        if key == entering:
            probation = self._probation
            probation.pop(key, None)
            probation[key] = self.policy.stamp(key)
            if len(probation) > 2 * self._high + 64:
                self._probation = self._on_probation()

    def _on_probation(self) -> dict[Key, float | None]:
        """The pages of `_probation` still here and not referenced since they entered, in order."""
        stamp = self.policy.stamp
        return {k: v for k, v in self._probation.items() if stamp(k) == v}

    def on_access(self, key: Key) -> None:
        # NOTE: Admitted.on_access over prefix-LRU's node table: this is the hot path.
        if self._just_inserted != key:
            node = self._nodes.get(key)
            if node is not None:
                self._reference(key, node.parent)
        self._just_inserted = None
        self.policy.on_access(key)

    def on_remove(self, key: Key) -> None:
        if key == self._displaced:
            # NOTE: a page ALL pushed out was seen: a stricter threshold lets it back on its next sighting
            # (RECALL reads the ghost too, so it need not be listed as having left).
            self._displaced = None
            self.rule.ghost.refused(key)
        else:
            # NOTE: at every threshold, so that a move to RECALL starts warm (one FIFO update per eviction).
            self._left_refused(key)
        self._just_inserted = None
        self.policy.on_remove(key)

    def first_candidate(self, usable: Callable[[Key], bool]) -> Key | None:
        return self.policy.first_candidate(usable)

    def _grew(self, high: int) -> None:
        super()._grew(high)
        k = 0
        while high >> (k + 1) >= self.SHADOW_MIN:
            k += 1
        cap = max(1, round(high / (1 << k)))
        if not self._shadows:
            self._k, self._mask = k, (1 << k) - 1
            history = self.rule.history
            self._shadows = [ShadowCache(cap, level, self._run, history) for level in range(len(LEVELS))]
            self._shadow_refs = tuple(s.reference for s in self._shadows)
        elif k != self._k:
            # NOTE: the tier's high-water mark doubled (it is still filling): the shadows keep the
            # sparser sample's keys and the scores their evidence (see the module docstring).
            self._k, self._mask = k, (1 << k) - 1
            for s in self._shadows:
                s.resample(self._mask, cap)
        else:
            for s in self._shadows:
                s.resize(cap)
        self._decay = 1.0 - 1.0 / (self.MEMORY * cap)

    def _reference(self, key: Key, parent: Key | None) -> None:
        if self._learn_left:
            self._learn_left -= 1
        before = self._history_reference(key)
        if parent is None or parent != self._chain_prev:
            self._chain_sampled = None  # a new chain (a new request)
        self._chain_prev = key
        if not self._shadows:
            return
        if self._k and sample_hash(key) & self._mask:
            return
        # NOTE: a sampled key's parent in the shadows is the chain's last sampled key before it, so
        # the sampled keys of a chain form a chain there too and the prefix rules apply.
        sparent, self._chain_sampled = self._chain_sampled, key
        if sparent is None:
            self._run.clear()  # NOTE: cleared, not replaced: the shadows hold this set
        self._run.add(key)
        level = self.rule.level
        if self._full:
            self.moves[level] += 1
        r0, r1, r2, r3 = self._shadow_refs  # NOTE: unrolled over the four thresholds: this is the hot path
        h0 = r0(key, sparent, before)
        h1 = r1(key, sparent, before)
        h2 = r2(key, sparent, before)
        h3 = r3(key, sparent, before)
        if h0 == h1 == h2 == h3:
            return  # NOTE: a reference every shadow hits (or misses) says nothing about the thresholds
        decay, score = self._decay, self.scores
        score[0] = score[0] * decay + h0
        score[1] = score[1] * decay + h1
        score[2] = score[2] * decay + h2
        score[3] = score[3] * decay + h3
        self._decide(level)

    def _near_best(self, z: float) -> int:
        """The first threshold of PREFER (the least strict) whose score is within `z` standard deviations
        of the best score (the difference of two counts: z x sqrt(a + b))."""
        score = self.scores
        top, z2 = max(score), z * z
        return next(j for j in self.PREFER if (top - score[j]) ** 2 <= z2 * (top + score[j]))

    def _decide(self, level: int) -> None:
        """Move to the best-scoring threshold if its lead over `level` (the current one) is significant."""
        score = self.scores
        top = max(score)
        if score[level] == top:
            return
        learning = self._learn_left > 0
        z = self.Z_LEARN if learning else self.Z
        best = self._near_best(z)
        lead = score[best] - score[level]
        z2 = self.Z_FREQUENT * self.Z_FREQUENT if best == FREQUENT and not learning else z * z
        switch, min_lead = (0.0, self.MIN_LEAD_LEARN) if learning else (self.SWITCH, self.MIN_LEAD)
        if (
            best != level
            and lead > score[level] * switch + min_lead
            and lead * lead > z2 * (score[best] + score[level])
        ):
            if level == ALL and self._probation:
                # NOTE: the pages ALL let in that were not referenced since would not be here under the
                # stricter threshold: they go first (as if refused), not the pages they displaced.
                self.policy.demote(list(self._on_probation()))
                self._probation = {}
            self.rule.level = best
            self.switches += 1
