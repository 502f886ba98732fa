"""Admission (kvstore/policy/sketch.py, admission.py, adaptive.py): the frequency sketch's counts,
aging and memory bound, stable hashing, the TinyLFU admit() contract, write-through in a tiered
simulation, and the adaptive policy's switch."""

from __future__ import annotations

import heapq
import math
import os
import random
import subprocess
import sys

import pytest

from devkit.sim import TieredBlockCache, TierSpec, parse_tiers, replay
from kvstore.policy import (
    AdaptivePolicy,
    Admitted,
    FrequencySketch,
    History,
    LRUPolicy,
    PrefixARCPolicy,
    PrefixLRUPolicy,
    SecondSight,
    make_policy,
    refused_outright,
    stable_hash,
)
from kvstore.policy.adaptive import ALL, LEVELS, RECALL, SECOND

# ------------------------------------------------------------------------------------------ sketch


def test_sketch_counts_through_the_doorkeeper_and_saturates() -> None:
    s = FrequencySketch(64)
    assert s.estimate("k") == 0
    s.increment("k")  # the first reference only marks the doorkeeper
    assert s.estimate("k") == 1
    for n in range(2, 10):
        s.increment("k")
        assert s.estimate("k") == n
    for _ in range(40):
        s.increment("k")
    assert s.estimate("k") == FrequencySketch.MAX_COUNT + 1  # 4-bit counters, plus the doorkeeper
    assert s.estimate("other") == 0


def test_sketch_never_undercounts_within_a_sample() -> None:
    s = FrequencySketch(256)
    truth = {k: (k % 7) + 1 for k in range(300)}  # 300 keys in a sketch sized for 256: collisions happen
    for rnd in range(8):
        for k, n in truth.items():
            if rnd < n:
                s.increment(k)
    assert s.resets == 0
    over = [s.estimate(k) - n for k, n in truth.items()]
    assert min(over) >= 0  # count-min: collisions can only add
    assert sum(over) / len(over) < 0.5  # ... and conservative update keeps that rare


def test_sketch_ages_by_halving() -> None:
    s = FrequencySketch(10)
    for _ in range(9):
        s.increment("hot")
    assert s.estimate("hot") == 9
    before = s.additions
    filler = 0
    while s.resets == 0:
        s.increment(("filler", filler))
        filler += 1
    assert before + filler == s.sample_size  # a reset every sample_size references
    assert s.estimate("hot") == 8 // 2  # counters halve, the doorkeeper is cleared
    assert s.additions == s.sample_size // 2


def test_sketch_memory_is_bounded_by_capacity_not_keys() -> None:
    s = FrequencySketch(1000)
    size = s.nbytes
    for k in range(50_000):
        s.increment(k)
    assert s.nbytes == size == FrequencySketch.DEPTH * s.width + s.width // 8
    assert s.width == 4096  # the power of two >= WIDTH_FACTOR * capacity


def test_sketch_growth_keeps_every_estimate() -> None:
    s = FrequencySketch(16)
    for k in range(200):
        for _ in range(k % 5):
            s.increment(k)
    before = {k: s.estimate(k) for k in range(200)}
    s.ensure_capacity(5000)
    assert s.width >= 20000
    assert {k: s.estimate(k) for k in range(200)} == before
    s.ensure_capacity(10)  # never shrinks
    assert s.width >= 20000


def test_stable_hash_is_the_same_in_every_process() -> None:
    keys = [0, 7, -3, 2**80, "ns", b"\x00" * 32, ("ns", b"\x01" * 32), (1, (2, "x"))]
    here = [stable_hash(k) for k in keys]
    assert len(set(here)) == len(keys) and all(0 <= h < 2**64 for h in here)
    code = f"from kvstore.policy import stable_hash; print([stable_hash(k) for k in {keys!r}])"
    for seed in ("1", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, timeout=60)  # fmt: skip
        assert out.stdout.strip() == str(here)
    with pytest.raises(TypeError, match="float"):
        stable_hash(1.5)


# -------------------------------------------------------------------------------------- admission


def _admitted() -> Admitted:
    return Admitted(PrefixARCPolicy())


def test_admit_prefers_the_more_frequent_key() -> None:
    p = _admitted()
    for k in ("hot", "cold"):
        p.on_insert(k)
    for _ in range(3):
        p.on_access("hot")
    assert not p.admit("new", "hot")  # seen once (now) against four references
    assert not p.admit("new2", "cold")  # once (now) against once: a tie keeps the victim
    assert p.admit("new2", "cold")  # the refusal counted: twice against once


def test_admit_contract() -> None:
    p = _admitted()
    p.on_insert("a")
    p.on_insert("b", parent="a")
    for _ in range(3):
        p.on_access("a")
    # a newcomer seen for the first time does not displace a block referenced as often or more
    assert not p.admit("x", "b")
    # the refusal counted the reference: the second sighting wins against a once-seen victim
    assert p.admit("x", "b")
    # a block whose chain parent is not in this tier is refused whatever its count
    for _ in range(5):
        p.admit("orphan", "b", parent="gone")
    assert not p.admit("orphan", "b", parent="gone")
    assert p.admit("child", "b", parent="a") is False  # first sighting vs "b" (once): a tie
    # nothing evictable: the answer is no, and the reference is still counted
    before = p.filter.sketch.estimate("pinned-out")
    assert not p.admit("pinned-out", None)
    assert p.filter.sketch.estimate("pinned-out") == before + 1
    assert len(p) == 2 and "a" in p and "x" not in p  # admit() never changes what is resident


def test_promotion_counts_one_reference() -> None:
    # The manager records a promotion as on_insert then on_access of the same key: one reference.
    p = _admitted()
    p.on_insert("k", reads=1)
    p.on_access("k")
    assert p.filter.sketch.estimate("k") == 1
    p.on_access("k")  # a later read is a new reference
    assert p.filter.sketch.estimate("k") == 2


def test_not_admitted_means_not_stored_in_one_tier() -> None:
    cache = TieredBlockCache(4, "tinylfu")
    hot = [[1, 2, 3, 4]]
    replay(hot * 3, cache)  # four blocks referenced three times fill the cache
    res = replay([[10, 11, 12]], cache)  # one-off blocks: refused, not stored
    # 10 loses to the victim (3 references); 11 and 12 follow a parent that is not cached
    assert res.block_hits == 0 and cache.counters.not_admitted == 3
    assert all(cache.tier_of(b) == 0 for b in (1, 2, 3, 4)) and len(cache) == 4


def test_not_admitted_is_written_through_to_the_next_tier() -> None:
    cache = TieredBlockCache(parse_tiers("dram:4,nvme:100"), "tinylfu")
    replay([[1, 2, 3, 4]] * 3, cache)
    replay([[10, 11, 12]], cache)
    assert [cache.tier_of(b) for b in (10, 11, 12)] == [1, 1, 1]  # refused by DRAM, stored on NVMe
    assert [cache.tier_of(b) for b in (1, 2, 3, 4)] == [0, 0, 0, 0]
    assert cache.counters.not_admitted == 3 and cache.counters.inserted == 7
    res = replay([[10, 11, 12]], cache)  # a second sighting: served from NVMe (a hit), promoted or not
    assert res.block_hits == 3


def test_policies_without_admit_store_everything() -> None:
    for name in ("lru", "prefix-arc"):
        cache = TieredBlockCache(4, name)
        replay([[1, 2, 3, 4]] * 3 + [[10, 11, 12]], cache)
        assert cache.counters.not_admitted == 0 and {cache.tier_of(b) for b in (10, 11, 12)} == {0}


def test_admission_off_asks_nothing() -> None:
    cache = TieredBlockCache((TierSpec("cache", 4),), "tinylfu", admission=False)
    replay([[1, 2, 3, 4]] * 3 + [[10, 11, 12]], cache)
    assert cache.counters.not_admitted == 0 and cache.tier_of(12) == 0


# ---------------------------------------------------------------------------------- second sight


def test_second_sight_admits_a_key_it_refused_before() -> None:
    p = Admitted(LRUPolicy(), SecondSight(2.0), parent_rule=False)
    for k in "ab":
        p.on_insert(k)
    assert not p.admit("x", "a")  # first sight: refused, remembered
    assert p.admit("x", "a")  # second sight: admitted, forgotten
    assert not p.admit("x", "a")  # (not inserted here: the next ask is a first sight again)
    assert len(p) == 2 and "x" not in p  # admit() never changes what is resident


def test_second_sight_ghost_is_bounded_by_its_factor() -> None:
    rule = SecondSight(2.0)
    p = Admitted(LRUPolicy(), rule, parent_rule=False)
    for k in range(3):
        p.on_insert(k)
    for k in range(100, 120):
        assert not p.admit(k, 0)
    assert len(rule.ghost) == 6 == 2 * 3  # the ghost keeps the 6 most recent refusals
    assert p.admit(119, 0) and not p.admit(100, 0)  # the newest is remembered, the oldest is not
    with pytest.raises(ValueError, match="ghost_factor"):
        SecondSight(0)


def test_second_sight_lru_is_the_registered_candidate() -> None:
    cache = TieredBlockCache(4, "second-sight")
    replay([[1, 2, 3, 4]], cache)  # fills the cache: no question asked
    res = replay([[10, 11], [10, 11], [10, 11]], cache)
    # the first sighting is refused, the second admitted (victims: LRU), the third hits
    assert cache.counters.not_admitted == 2 and res.block_hits == 2
    assert [cache.tier_of(b) for b in (10, 11)] == [0, 0] and len(cache) == 4


# --------------------------------------------------------------------------------------- history


def test_history_counts_ages_and_forgets_by_recency() -> None:
    h = History()
    h.ensure_capacity(1)  # 10 keys, aged every 10 references
    assert h.reference("a") == 0
    assert h.reference("a") == 1
    for k in range(7):
        h.reference(k)
    assert h.count("a") == 2 and h.references == 9
    h.reference("b")  # the tenth reference: every count halves, rounding up (seen stays seen)
    assert h.agings == 1 and h.count("a") == 1 and h.count(0) == 1 and h.references == 0
    for k in range(100, 110):
        h.reference(k)
    assert len(h) == 10 and "a" not in h and h.count("a") == 0


# --------------------------------------------------------------------------------------- adaptive


def _loop_and_scan(n: int) -> list[list[int]]:
    """A loop over 16 one-block prompts interleaved with one-off prompts: admission's case (a cache of
    12 keeps none of the loop by recency, and 12 of its 16 keys when one-offs are refused)."""
    return [[i % 16] if i % 2 else [10_000 + i] for i in range(n)]


def _quick_second_use(n: int) -> list[list[int]]:
    """Each prompt asked twice, one other prompt between, never again: recency's case (a filter
    refuses the first ask, so the second misses too)."""
    prompts = [[5000 + 3 * i, 5001 + 3 * i, 5002 + 3 * i] for i in range(n)]
    out = []
    for i, prompt in enumerate(prompts):
        out.append(prompt)
        if i >= 1:
            out.append(prompts[i - 1])
    return out


def _late_returns(n: int) -> list[list[int]]:
    """Conversations of two blocks that come back twice, six steps apart, between one-off
    requests: second sight's case. Admitting all, the one-offs push a conversation out before it
    comes back; admitting on second sight, it enters on its second visit and hits on its third."""
    out: list[list[int]] = []
    for i in range(n):
        out.append([50_000 + i])  # a one-off
        for back in (0, 6, 12):
            if i >= back and (i - back) % 3 == 0:
                c = (i - back) // 3
                out.append([20_000 + 2 * c, 20_001 + 2 * c])
    return out


def _rates(requests: list[list[int]], names: tuple[str, ...]) -> tuple[dict[str, float], AdaptivePolicy]:
    """Prefix hit rates of `names` and adaptive in a cache of 12; the adaptive policy."""
    results, policy = {}, None
    for name in (*names, "adaptive"):
        cache = TieredBlockCache(12, name)
        results[name] = replay(requests, cache).prefix_hit_rate
        policy = cache.policies[0]
    assert isinstance(policy, AdaptivePolicy)
    return results, policy


def test_adaptive_counts_where_frequency_pays() -> None:
    results, policy = _rates(_loop_and_scan(2000), ("prefix-arc", "tinylfu"))
    assert policy.level != ALL
    assert results["tinylfu"] > results["prefix-arc"] + 0.1
    assert results["adaptive"] >= 0.95 * results["tinylfu"]


def test_adaptive_admits_all_where_admission_costs() -> None:
    results, policy = _rates(_quick_second_use(600), ("prefix-lru", "tinylfu", "second-sight"))
    assert policy.level == ALL and policy.switches == 0
    assert results["prefix-lru"] > max(results["tinylfu"], results["second-sight"]) + 0.1
    assert results["adaptive"] >= 0.95 * results["prefix-lru"]


def test_adaptive_admits_on_second_sight_where_conversations_return_late() -> None:
    results, policy = _rates(_late_returns(1500), ("prefix-arc", "tinylfu", "second-sight"))
    assert policy.level in (SECOND, RECALL)  # both admit on second sight; here they tie (nothing returns a third time)
    assert results["second-sight"] > results["prefix-arc"] + 0.05
    assert results["adaptive"] >= max(results.values()) * 0.95


def _returning_conversations(n: int, seed: int = 1) -> list[list[int]]:
    """Conversations that come back turn after turn (another turn with probability 0.85, a block more
    each time) after lognormal think times, among one-off prompts of eight blocks: the conversation
    workload's case for RECALL. A tier of 200 cannot hold every open conversation, so some are evicted
    while their users think; admitting on second sight alone, such a history misses twice when it comes
    back (refused, then admitted), remembering what left the tier, once."""
    rnd = random.Random(seed)
    due: list[tuple[int, int, list[int]]] = []
    out: list[list[int]] = []
    fresh = iter(range(10**6, 10**9))
    for i in range(n):
        if due and due[0][0] <= i:
            _, cid, history = heapq.heappop(due)
            history = [*history, next(fresh)]
        elif rnd.random() < 0.3:
            cid, history = i, [next(fresh) for _ in range(8)]
        else:
            out.append([next(fresh) for _ in range(8)])
            continue
        out.append(history)
        if rnd.random() < 0.85:
            heapq.heappush(due, (i + max(1, round(30 * math.exp(1.2 * rnd.gauss(0.0, 1.0)))), cid, history))
    return out


def test_adaptive_recalls_what_left_where_conversations_return_after_eviction() -> None:
    requests = _returning_conversations(3000)
    results = {}
    for name in ("lru", "second-sight", "adaptive"):
        cache = TieredBlockCache(200, name)
        results[name] = replay(requests, cache).prefix_hit_rate
    policy = cache.policies[0]
    assert isinstance(policy, AdaptivePolicy)
    assert policy.level == RECALL and max(policy.moves) == policy.moves[RECALL]
    assert results["adaptive"] > 1.03 * results["second-sight"] > 1.03 * results["lru"]


def test_adaptive_recall_admits_a_page_that_left_and_second_sight_does_not() -> None:
    policy = _full_adaptive(8)
    assert policy.admit("new", 0)  # the first question: full from now on, at ALL
    policy.on_remove(0)
    policy.on_insert("new")
    policy.on_remove(5)  # evicted (or deleted): it left the tier without admit-all naming it
    policy.rule.level = SECOND
    assert refused_outright(policy, 5)  # second sight: never refused, so not seen
    policy.rule.ghost.admitted(5)  # NOTE: forget that refusal: the same question again at RECALL
    policy.rule.level = RECALL
    assert not refused_outright(policy, 5)  # it left the tier lately: admit() decides
    assert policy.admit(5, 1)
    assert refused_outright(policy, "never-here")  # neither refused before nor evicted
    assert refused_outright(policy, 6, parent="gone")  # the chain-parent rule holds at RECALL too


def test_adaptive_follows_a_change_of_workload() -> None:
    cache = TieredBlockCache(12, "adaptive")
    policy = cache.policies[0]
    assert isinstance(policy, AdaptivePolicy)
    replay(_loop_and_scan(2000), cache)
    assert policy.level != ALL
    # back within 100 prompts of the new traffic: the scores' memory is short (a memory of 64 shadow
    # capacities, round 3's, still held second sight here)
    replay(_quick_second_use(100), cache)
    assert policy.level == ALL and policy.switches >= 2


def test_adaptive_victims_are_prefix_lrus() -> None:
    # Whatever admission does, the victim order is prefix-LRU's: same events, same candidates.
    a, b = AdaptivePolicy(), PrefixLRUPolicy()
    for i in range(50):
        for p in (a, b):
            p.on_insert(i, parent=i - 1 if i % 5 else None)
            if i % 3 == 0:
                p.on_access(i // 2)
    assert list(a.candidates()) == list(b.candidates())


def _full_adaptive(capacity: int) -> AdaptivePolicy:
    """An adaptive policy over a tier of `capacity` one-block chains 0..capacity-1, just filled."""
    policy = AdaptivePolicy()
    for k in range(capacity):
        policy.on_insert(k)
    return policy


def test_adaptive_learns_nothing_while_the_tier_fills() -> None:
    policy = _full_adaptive(300)
    for k in range(300):
        policy.on_access(k)
    assert policy.moves == [0] * len(LEVELS) and not policy._full  # no admit() asked: admission did not matter yet
    victim = next(policy.candidates())
    assert policy.admit("new", victim) and policy._full  # the first question: the tier is full
    policy.on_remove(victim)
    policy.on_insert("new")
    for k in range(300, 400):
        policy.admit(k, next(policy.candidates()))
    assert sum(policy.moves) > 0


def test_adaptive_remembers_what_admit_all_displaced() -> None:
    policy = _full_adaptive(8)
    assert policy.level == ALL and policy.admit("new", 0)
    policy.on_remove(0)
    policy.on_insert("new")
    # the displaced page was seen: under second sight it may come back on its next sighting
    assert 0 in policy.rule.ghost.ghost


def test_adaptive_move_to_a_stricter_threshold_evicts_what_admit_all_let_in_first() -> None:
    policy = _full_adaptive(8)
    for new, victim in (("n1", 0), ("n2", 1), ("n3", 2)):
        assert policy.admit(new, victim)
        policy.on_remove(victim)
        policy.on_insert(new)
    policy.on_access("n2")  # used since it entered: it stays by recency
    policy.scores = [0.0, 100.0, 0.0, 0.0]  # the shadows say second sight, by far
    policy._decide(ALL)
    assert policy.level == SECOND
    # n1 and n3 would not be here under second sight: they go before the pages they pushed toward the end
    assert list(policy.candidates())[:3] == ["n1", "n3", 3]


class _SmallShadows(AdaptivePolicy):
    SHADOW_MIN = 8


def test_adaptive_shadows_are_bounded_and_sampled() -> None:
    cache = TieredBlockCache(200, _SmallShadows)
    replay(_loop_and_scan(3000), cache)
    policy = cache.policies[0]
    assert isinstance(policy, _SmallShadows)
    assert policy._k == 4 and policy._shadows is not None  # 200 keys / 2**4 = 12.5: 8 <= 12 < 16
    for shadow in policy._shadows:
        assert len(shadow.lru) <= shadow.capacity == 12
    assert sum(policy.moves) < 3000  # only the sampled references reach the shadows


def test_adaptive_is_deterministic() -> None:
    requests = _loop_and_scan(1000) + _quick_second_use(300)
    runs = []
    for _ in range(2):
        cache = TieredBlockCache(12, make_policy("adaptive").__class__)
        res = replay(requests, cache)
        policy = cache.policies[0]
        assert isinstance(policy, AdaptivePolicy)
        runs.append((res.prefix_hits, res.block_hits, cache.counters, policy.switches, policy.moves))
    assert runs[0] == runs[1]


class _NoShortcut(AdaptivePolicy):
    """The default without its early refusal: every question is asked through admit(victim)."""

    refuses = None  # type: ignore[assignment]  # refused_outright treats a None attribute as absent


def test_adaptive_early_refusal_decides_as_admit_would() -> None:
    # refuses() answers before a victim is chosen; the same traffic through admit() alone must make
    # the same decisions (hits, thresholds, moves) and the early answer must have been used.
    requests = _loop_and_scan(800) + _late_returns(600) + _quick_second_use(300)
    runs, early = [], 0
    for cls in (AdaptivePolicy, _NoShortcut):
        cache = TieredBlockCache(12, cls)
        policy = cache.policies[0]
        assert isinstance(policy, AdaptivePolicy)
        if cls is AdaptivePolicy:
            counted = policy.refuses

            def counting(key: object, parent: object = None, counted=counted) -> bool:
                nonlocal early
                no = counted(key, parent)
                early += no
                return no

            policy.refuses = counting  # type: ignore[method-assign]
        res = replay(requests, cache)
        runs.append((res.prefix_hits, res.block_hits, cache.counters.not_admitted, policy.switches, policy.moves))
    assert runs[0] == runs[1]
    assert early > 100


def test_refused_outright_contract() -> None:
    policy = AdaptivePolicy()
    for i in range(4):
        policy.on_insert(i)
    assert not refused_outright(policy, "new")  # the tier was never full: admit() decides
    assert policy.admit("new", 0)  # the first question: full from now on, at ALL
    policy.on_remove(0)
    policy.on_insert("new")
    assert not refused_outright(policy, "other")  # ALL refuses nothing outright
    policy.rule.level = SECOND
    assert refused_outright(policy, "other")  # unseen at SECOND: refused whatever the victim
    assert not refused_outright(policy, "other")  # now remembered: admit() decides
    assert policy.admit("other", 1)
    assert refused_outright(policy, "orphan", parent="gone")  # a missing chain parent
    assert not refused_outright(PrefixLRUPolicy(), "k")  # a policy without refuses() refuses nothing
