"""Trace replay (devkit/sim.py): hand-computed hit rates, Belady's optimality against brute force,
tiered promotion/demotion accounting, trace parsing, and how the simulation asks admit()."""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import pytest

from devkit.sim import (
    RetentionHint,
    TieredBlockCache,
    TierSpec,
    TraceRecord,
    belady_block_hits,
    parse_tiers,
    replay,
    replay_policy,
)
from devkit.workloads import generate
from kvstore.policy import POLICIES


def test_block_and_prefix_hits_by_hand() -> None:
    # LRU, 4 blocks. r1 misses everything; r2 hits its prefix 1,2; r3 misses 5 but finds 2 and 3
    # cached: block hits (the cache has them) that are not prefix hits (the engine recomputes them).
    # Storing 5 must evict; the LRU key 3 is pinned by r3 itself, so 1 goes.
    cache = TieredBlockCache(4, "lru")
    res = replay([[1, 2, 3], [1, 2, 4], [5, 2, 3]], cache)
    assert (res.requests, res.blocks, res.block_hits, res.prefix_hits) == (3, 9, 4, 2)
    assert res.block_hit_rate == pytest.approx(4 / 9) and res.prefix_hit_rate == pytest.approx(2 / 9)
    assert cache.tier_of(1) is None and all(cache.tier_of(b) == 0 for b in (2, 3, 4, 5))
    assert cache.counters.inserted == 5 and cache.counters.dropped == 1


def test_hits_on_a_first_reuse_are_told_apart() -> None:
    # LRU, 2 blocks: [1] misses; [1] hits its first reuse; [1] hits a later one; [2] misses (1 stays);
    # [2] hits its first reuse. Belady on the same stream makes the same hits; unprobed caches say None.
    requests = [[1], [1], [1], [2], [2]]
    res = replay(requests, TieredBlockCache(2, "lru"))
    assert (res.block_hits, res.first_reuse_hits) == (3, 2) and res.first_reuse_hit_rate == pytest.approx(2 / 5)
    assert belady_block_hits(requests, 1).first_reuse_hits == 2
    # second sight refuses a first sighting once the tier is full: no hit on a first reuse there
    full_then = [[10], [11], *requests]
    assert replay(full_then, TieredBlockCache(2, "second-sight")).first_reuse_hits == 0


def test_a_lease_holds_a_session_until_it_expires_or_ends() -> None:
    # LRU, 2 blocks. [1] then a lease on it for 3 requests; [2] [3] would push 1 out, but it is held:
    # 2 goes instead, and [1] hits. Without the lease [1] misses.
    hints = [RetentionHint(0, lease=3), None, None, None]
    requests = [[1], [2], [3], [1]]
    assert replay(requests, TieredBlockCache(2, "lru")).block_hits == 0
    cache = TieredBlockCache(2, "lru", retain_share=0.5)
    assert replay(requests, cache, hints).block_hits == 1 and cache.counters.leased == 1
    # expired at request 0 + 3: [4] [5] at requests 3, 4 push 1 out again
    cache = TieredBlockCache(2, "lru")
    assert replay([[1], [2], [3], [4], [5], [1]], cache, [*hints, None, None]).block_hits == 0
    assert cache.retained() == 0
    # the session ended: the lease is released at once
    cache = TieredBlockCache(2, "lru")
    replay([[1], [2]], cache, [RetentionHint(0, lease=100), RetentionHint(0, ended=True)])
    assert cache.retained() == 0
    # the cap: half of 2 blocks = 1 held per tier; a lease on [7, 8] holds 7 only, counts 8 refused; a
    # second session's lease on a block already held costs nothing
    cache = TieredBlockCache(2, "lru")
    replay([[7, 8], [7]], cache, [RetentionHint(0, lease=9), RetentionHint(1, lease=9)])
    assert cache.retained() == 1 and (cache.counters.leased, cache.counters.lease_refused) == (2, 1)
    with pytest.raises(ValueError, match="retain_share"):
        TieredBlockCache(2, "lru", retain_share=1.5)


def test_a_session_resumes_its_held_blocks_to_the_top_tier() -> None:
    # DRAM 2 (second sight) over NVMe 4; at most 1 held block in DRAM, 2 in NVMe.
    #   0: session 0's [1, 2] fill DRAM; 1 is held, 2 stored but not held (DRAM's hold cap)
    #   1: session 1's [3, 4] are first sightings: refused, written through to NVMe, both held there
    #   2: session 0 ends: 1 released
    #   3: session 1 comes back: resumed before its lookup, 3 is promoted to DRAM without admission
    #      (pushing a DRAM block down), 4 stays (DRAM's hold cap): 3 is served from DRAM, 4 from NVMe.
    tiers = (TierSpec("dram", 2), TierSpec("nvme", 4))
    requests = [[1, 2], [3, 4], [1, 2], [3, 4]]
    hints = [RetentionHint(0, lease=100), RetentionHint(1, lease=100), RetentionHint(0, ended=True)]
    cache = TieredBlockCache(tiers, "second-sight", retain_share=0.5)
    res = replay(requests, cache, [*hints, RetentionHint(1, lease=100)])
    assert cache.counters.lease_refused == 1 and cache.retained() == 2
    assert res.tier_block_hits == [2 + 1, 1] and cache.tier_of(3) == 0 and cache.tier_of(4) == 1
    # without hints 3 and 4 stay in NVMe (second sight refuses their first sighting, then their promotion)
    res = replay(requests, TieredBlockCache(tiers, "second-sight"))
    assert res.tier_block_hits[1] == 2


def test_tiered_promotion_demotion_accounting() -> None:
    # hbm holds 1 block, dram 2, LRU in each. Traced by hand:
    #   [1] [2] [3]  misses; each newcomer pushes hbm's block down: hbm {3}, dram {1, 2}
    #   [4]          miss; 3 is demoted, so dram's LRU block 1 is dropped: hbm {4}, dram {2, 3}
    #   [1, 2]       1 misses; 2 is a dram hit after a miss (a block hit, not a prefix hit).
    #                Storing 1 demotes 4; dram's LRU block 2 is pinned by the request, so 3 is
    #                dropped. 2 stays in dram: hbm's only block (1) is pinned. hbm {1}, dram {2, 4}
    #   [4]          dram hit (block and prefix): promoted, swapping places with 1: hbm {4}, dram {2, 1}
    cache = TieredBlockCache(parse_tiers("hbm:1,dram:2"), "lru")
    res = replay([[1], [2], [3], [4], [1, 2], [4]], cache)
    assert (res.blocks, res.block_hits, res.prefix_hits) == (7, 2, 1)
    assert res.tier_names == ("hbm", "dram")
    assert res.tier_block_hits == [0, 2] and res.tier_prefix_hits == [0, 1]
    assert res.tier_rates() == {"hbm": (0.0, 0.0), "dram": (2 / 7, 1 / 7)}
    c = cache.counters
    assert (c.inserted, c.promoted, c.demoted, c.dropped, c.not_stored) == (5, 1, 5, 2, 0)
    assert [cache.tier_of(b) for b in (1, 2, 3, 4)] == [1, 1, None, 0]
    assert (cache.size(0), cache.size(1), len(cache)) == (1, 2, 3)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_tiers_are_exclusive_and_bounded(name: str) -> None:
    tiers = parse_tiers("hbm:3,dram:5,nvme:9")
    cache = TieredBlockCache(tiers, name)
    requests = generate("tenants", 150, seed=3)
    res = replay(requests, cache)
    for t, spec in enumerate(tiers):
        assert cache.size(t) <= spec.capacity
        assert len(cache.policies[t]) == cache.size(t)
        assert {cache.tier_of(k) for k in cache.policies[t].candidates()} == ({t} if cache.size(t) else set())
    assert sum(res.tier_block_hits) == res.block_hits
    assert sum(res.tier_prefix_hits) == res.prefix_hits <= res.block_hits  # type: ignore[operator]


def test_tiered_lru_equals_one_lru_of_the_total_size() -> None:
    # Exclusive tiers with demotion on eviction and promotion on a hit keep one global LRU order
    # (exactly so while no pinned block stands in the way: one block per request here).
    rnd = random.Random(4)
    requests = [[int(rnd.paretovariate(0.8)) % 400] for _ in range(3000)]
    tiered, _ = replay_policy(requests, parse_tiers("hbm:20,dram:30,nvme:50"), "lru")
    single, _ = replay_policy(requests, 100, "lru")
    assert (tiered.block_hits, tiered.prefix_hits) == (single.block_hits, single.prefix_hits)


def test_request_longer_than_the_cache_stores_what_fits() -> None:
    cache = TieredBlockCache(3, "prefix-arc")
    replay([list(range(10))], cache)  # every block is pinned while the request runs
    assert len(cache) == 3 and cache.counters.not_stored == 7
    assert cache.lookup(list(range(10))) == 3


def test_replay_through_a_lookup_put_only_cache() -> None:
    class PrefixOnly:
        """A cache that only answers lookup/put, as a node reached over gRPC would."""

        def __init__(self) -> None:
            self.stored: set[int] = set()

        def lookup(self, blocks: Sequence[int]) -> int:
            n = 0
            while n < len(blocks) and blocks[n] in self.stored:
                n += 1
            return n

        def put(self, blocks: Sequence[int]) -> None:
            self.stored.update(blocks)

    res = replay([[1, 2], [1, 2, 3], [9, 3]], PrefixOnly())
    assert res.block_hits is None and res.block_hit_rate is None
    assert res.first_reuse_hits is None and res.first_reuse_hit_rate is None
    assert (res.blocks, res.prefix_hits) == (7, 2)


def _brute_force_hits(stream: Sequence[int], capacity: int) -> int:
    """Most hits over every eviction choice, bypass included (exhaustive, memoised on the cache set)."""

    @functools.cache
    def best(i: int, cached: frozenset[int]) -> int:
        if i == len(stream):
            return 0
        b = stream[i]
        if b in cached:
            return 1 + best(i + 1, cached)
        if len(cached) < capacity:
            return max(best(i + 1, cached | {b}), best(i + 1, cached))
        options = [best(i + 1, cached)]  # bypass
        options += [best(i + 1, (cached - {v}) | {b}) for v in cached]
        return max(options)

    return best(0, frozenset())


def test_belady_is_optimal_on_small_traces() -> None:
    rnd = random.Random(7)
    for _ in range(40):
        requests = [rnd.sample(range(7), rnd.randint(1, 3)) for _ in range(rnd.randint(3, 8))]
        stream = [b for r in requests for b in r]
        for capacity in (1, 2, 3):
            opt = belady_block_hits(requests, capacity)
            assert opt.block_hits == _brute_force_hits(stream, capacity), (requests, capacity)
            assert opt.blocks == len(stream)
            # ... and an upper bound for every policy on the same trace
            for name in POLICIES:
                res, _ = replay_policy(requests, capacity, name)
                assert res.block_hits <= opt.block_hits  # type: ignore[operator]


def test_belady_on_a_hand_case() -> None:
    # capacity 2, stream a b c a b: keep a, bypass c (used never again), then a and b hit.
    res = belady_block_hits([["a", "b"], ["c"], ["a", "b"]], 2)
    assert (res.block_hits, res.prefix_hits, res.blocks) == (2, 2, 5)
    assert res.first_reuse_hits == 2  # both hits are second references
    with pytest.raises(ValueError):
        belady_block_hits([["a"]], 0)


def test_trace_record_and_tier_parsing() -> None:
    rec = TraceRecord.from_json({"timestamp": 40, "input_length": 1024, "output_length": 3, "hash_ids": [5, 6]})
    assert rec == TraceRecord(40.0, 1024, 3, (5, 6))
    with pytest.raises(ValueError, match="hash_ids"):
        TraceRecord.from_json({"timestamp": 0})
    with pytest.raises(ValueError, match="malformed"):
        TraceRecord.from_json({"timestamp": 0, "hash_ids": ["x"]})
    assert parse_tiers("hbm:10, dram:20") == (TierSpec("hbm", 10), TierSpec("dram", 20))
    assert parse_tiers("64") == (TierSpec("cache", 64),)
    for bad in ("hbm", "hbm:x", "hbm:1,hbm:2", "hbm:0"):
        with pytest.raises(ValueError):
            parse_tiers(bad)


class _Picky:
    """A policy that admits only even keys, and logs what it is asked."""

    name = "picky"

    def __init__(self) -> None:
        self.keys: dict[int, None] = {}
        self.asked: list[tuple[int, int | None, int | None]] = []

    def on_insert(self, key: int, parent: int | None = None, reads: int = 0) -> None:
        self.keys[key] = None

    def on_access(self, key: int) -> None:
        pass

    def on_remove(self, key: int) -> None:
        del self.keys[key]

    def candidates(self):  # type: ignore[no-untyped-def]
        return iter(list(self.keys))

    def admit(self, key: int, victim: int | None, parent: int | None) -> bool:
        self.asked.append((key, victim, parent))
        return key % 2 == 0

    def __len__(self) -> int:
        return len(self.keys)


def test_admit_is_asked_only_of_a_full_tier_with_its_victim() -> None:
    cache = TieredBlockCache(2, _Picky, hints=False)
    res = replay([[1, 2], [3, 4], [6], [1, 2]], cache)
    picky = cache.policies[0]
    assert isinstance(picky, _Picky)
    # [1, 2] fill the cache unasked. 3: full, victim 1 (FIFO order), refused; 4: victim 1, admitted
    # (1 evicted). 6: victim 2, admitted. [1, 2]: 1 refused (victim 4); 2, evicted for 6, is a miss
    # too: victim 4, admitted. Without hints the parent is never passed.
    assert picky.asked == [(3, 1, None), (4, 1, None), (6, 2, None), (1, 4, None), (2, 4, None)]
    assert cache.counters.not_admitted == 2 and sorted(picky.keys) == [2, 6]
    assert (res.block_hits, res.prefix_hits) == (0, 0)


def test_admit_hears_of_a_reference_even_when_every_block_is_pinned() -> None:
    cache = TieredBlockCache(2, _Picky, hints=True)
    replay([[2, 4, 6]], cache)  # 6 finds 2 and 4 pinned by its own request: asked with no victim
    picky = cache.policies[0]
    assert picky.asked == [(6, None, 4)]  # type: ignore[attr-defined]
    assert cache.counters.not_stored == 1 and cache.counters.not_admitted == 0
