"""Eviction policies (kvstore/policy/): interface invariants of every registered policy (also as a
property under random event streams), the prefix-aware rule (tails before heads), behaviour without
hints, and PrefixARC's adaptation. Admission and the adaptive policy: tests/unit/test_admission.py."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devkit.sim import TieredBlockCache, replay
from kvstore.policy import (
    POLICIES,
    ARCPolicy,
    LRUPolicy,
    PrefixARCPolicy,
    PrefixLRUPolicy,
    PrefixTreePolicy,
    S3FIFOPolicy,
    first_usable,
    make_policy,
    should_admit,
)

# NOTE: policies whose candidates() order is exactly the order first_candidate(usable) searches
# (S3-FIFO moves keys while it searches; its fast path is checked separately).
STATIC_ORDER = sorted(set(POLICIES) - {"s3fifo"})


def _check(policy, resident: set[Hashable], rnd: random.Random) -> None:
    order = list(policy.candidates())
    assert len(order) == len(set(order)) == len(policy) == len(resident)
    assert set(order) == resident
    usable_set = {k for k in resident if rnd.random() < 0.7}
    usable: Callable[[Hashable], bool] = usable_set.__contains__
    if policy.name in STATIC_ORDER:
        assert first_usable(policy, usable) == next((k for k in order if usable(k)), None)
    else:
        got = first_usable(policy, usable)
        assert (got is None) == (not usable_set)
        assert got is None or got in usable_set
    # the module function without the fast path agrees with the candidates order
    assert next((k for k in policy.candidates() if usable(k)), None) == next(
        (k for k in list(policy.candidates()) if usable(k)), None
    )


def _random_ops(name: str, seed: int, hints: bool, steps: int = 400) -> None:
    rnd = random.Random(seed)
    policy = make_policy(name)
    resident: set[Hashable] = set()
    parent_of: dict[Hashable, Hashable | None] = {}
    for step in range(steps):
        op = rnd.random()
        if op < 0.5 or not resident:
            # a new key, extending a random chain (or starting one), or re-inserting a removed key
            key: Hashable = ("ns", rnd.randrange(60))
            if key in resident:
                policy.on_access(key)
                continue
            if key not in parent_of:
                parent_of[key] = rnd.choice([None, *sorted(parent_of, key=str)[-5:]])
            if hints:
                policy.on_insert(key, parent=parent_of[key], reads=rnd.randrange(2))  # type: ignore[call-arg]
            else:
                policy.on_insert(key)
            resident.add(key)
        elif op < 0.75:
            policy.on_access(rnd.choice(sorted(resident, key=str)))
        elif op < 0.9:
            victim = first_usable(policy, lambda _k: True)
            assert victim in resident
            policy.on_remove(victim)
            resident.discard(victim)
        else:
            key = rnd.choice(sorted(resident, key=str))
            policy.on_remove(key)
            resident.discard(key)
        policy.on_remove(("never", step))  # removing an absent key is a no-op
        policy.on_access(("never", step))
        if step % 7 == 0:
            _check(policy, resident, rnd)
    _check(policy, resident, rnd)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("hints", [True, False])
def test_interface_invariants(name: str, hints: bool) -> None:
    for seed in range(3):
        _random_ops(name, seed, hints)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_make_policy_and_admit(name: str) -> None:
    policy = make_policy(name.upper())
    assert policy.name == name
    # every policy admits a key against a victim it never heard of (second sight: on the second ask)
    assert should_admit(policy, "k", "v") or (name == "second-sight" and should_admit(policy, "k", "v"))
    assert len(policy) == 0 and list(policy.candidates()) == [] and first_usable(policy, lambda _k: True) is None
    policy.on_insert("a")  # the manager's call form, no hints
    policy.on_insert("a")  # inserting a resident key again counts as an access
    assert len(policy) == 1 and first_usable(policy, lambda _k: True) == "a"
    assert first_usable(policy, lambda _k: False) is None


_EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "access", "remove", "evict", "admit"]), st.integers(0, 24), st.integers(0, 24)
    ),
    max_size=150,
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=40, deadline=None)
@given(events=_EVENTS)
def test_every_inserted_key_is_a_candidate_exactly_once(name: str, events: list[tuple[str, int, int]]) -> None:
    """Under any stream of events: every key inserted and not removed is a candidate exactly once,
    victims are resident and usable, and admit() (asked of a key that is not resident) changes
    nothing about what is resident."""
    policy = make_policy(name)
    resident: set[int] = set()
    for op, key, other in events:
        if op == "insert":
            policy.on_insert(key, parent=other if other < key else None, reads=other % 2)  # type: ignore[call-arg]
            resident.add(key)
        elif op == "access":
            policy.on_access(key)
        elif op == "remove":
            policy.on_remove(key)
            resident.discard(key)
        elif op == "evict":
            victim = first_usable(policy, lambda k, pinned=key: k != pinned)
            assert (victim is None) == (not resident - {key})
            if victim is not None:
                assert victim in resident and victim != key
                policy.on_remove(victim)
                resident.discard(victim)
        elif key not in resident:
            victim = first_usable(policy, lambda _k: True)
            assert isinstance(should_admit(policy, key, victim, other if other < key else None), bool)
        order = list(policy.candidates())
        assert len(order) == len(set(order)) == len(policy) == len(resident)
        assert set(order) == resident


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="prefix-arc"):
        make_policy("belady")


def _insert_chain(policy, keys: list[str], hints: bool = True) -> None:
    parent = None
    for k in keys:
        if hints:
            policy.on_insert(k, parent=parent)
        else:
            policy.on_insert(k)
        parent = k


@pytest.mark.parametrize("cls", [PrefixLRUPolicy, PrefixARCPolicy])
def test_prefix_aware_evicts_tails_before_heads(cls: type[PrefixTreePolicy]) -> None:
    p = cls()
    _insert_chain(p, ["a0", "a1", "a2", "a3"])
    _insert_chain(p, ["b0", "b1"])
    for k in ["a0", "a1", "a2", "a3"]:  # chain a is used again: newest, and FREQUENT in prefix-arc
        p.on_access(k)
    # Under plain LRU b0 would go first; here only leaves are candidates, and b is older than a.
    victims = []
    while len(p):
        v = first_usable(p, lambda _k: True)
        assert v is not None
        victims.append(v)
        p.on_remove(v)
    assert victims == ["b1", "b0", "a3", "a2", "a1", "a0"]


def test_prefix_lru_head_used_recently_still_outlives_its_tail() -> None:
    p = PrefixLRUPolicy()
    _insert_chain(p, ["h", "t1", "t2"])
    _insert_chain(p, ["x"])
    p.on_access("h")  # the head is now the most recent key, its tail the oldest
    assert list(p.candidates())[:2] == ["t2", "x"]  # leaves first, by recency; h waits for its tail
    p.on_remove("t2")
    assert first_usable(p, lambda _k: True) == "t1"


def test_pinned_leaf_protects_its_ancestors() -> None:
    p = PrefixLRUPolicy()
    _insert_chain(p, ["a0", "a1", "a2"])
    _insert_chain(p, ["b0", "b1"])
    # a2 is pinned: its ancestors are not leaves, so the victim is chain b's leaf, not a1.
    assert first_usable(p, lambda k: k != "a2") == "b1"
    # every leaf pinned: an internal key is better than failing, oldest first
    assert first_usable(p, lambda k: k not in {"a2", "b1"}) == "a0"
    # the fast path and the snapshot agree on it
    assert next(k for k in p.candidates() if k not in {"a2", "b1"}) == "a0"


def test_prefix_lru_demote_puts_keys_first_in_their_order_until_used() -> None:
    p = PrefixLRUPolicy()
    for k in "abcde":
        p.on_insert(k)
    p.demote(["d", "b", "gone"])  # a key not resident is ignored
    assert list(p.candidates()) == ["d", "b", "a", "c", "e"]
    assert first_usable(p, lambda k: k != "d") == "b"
    p.on_access("d")  # used again: back to its place by recency
    assert list(p.candidates()) == ["b", "a", "c", "e", "d"]
    p.demote(["e"])  # a later demotion goes before the earlier ones
    assert list(p.candidates())[:2] == ["e", "b"]


def test_prefix_lru_internal_fallback_is_the_oldest_usable() -> None:
    p = PrefixLRUPolicy()
    _insert_chain(p, ["a0", "a1", "a2"])
    _insert_chain(p, ["b0", "b1"])
    p.on_access("a0")  # a0 is now the youngest internal key
    assert first_usable(p, lambda k: k not in {"a2", "b1"}) == "a1"
    assert first_usable(p, lambda k: k not in {"a2", "b1", "a1"}) == "b0"
    assert first_usable(p, lambda k: k not in {"a2", "b1", "a1", "b0"}) == "a0"
    assert first_usable(p, lambda k: False) is None


def test_parent_inserted_after_child_is_not_a_leaf() -> None:
    # A chain can enter a tier out of order (a demoted head after its tail): links still hold.
    p = PrefixLRUPolicy()
    p.on_insert("child", parent="head")
    p.on_insert("other")
    p.on_insert("head")
    assert list(p.candidates())[:2] == ["child", "other"]
    assert list(p.candidates())[-1] == "head"


def test_prefix_lru_without_hints_is_lru() -> None:
    rnd = random.Random(5)
    a, b = LRUPolicy(), PrefixLRUPolicy()
    keys = [f"k{i}" for i in range(30)]
    resident: set[str] = set()
    for _ in range(300):
        k = rnd.choice(keys)
        remove = rnd.random() < 0.3
        for p in (a, b):
            if k not in resident:
                p.on_insert(k)
            elif remove:
                p.on_remove(k)
            else:
                p.on_access(k)
        if k not in resident:
            resident.add(k)
        elif remove:
            resident.discard(k)
        assert list(a.candidates()) == list(b.candidates())


def test_prefix_arc_without_hints_chooses_arcs_victims() -> None:
    rnd = random.Random(11)
    arc, parc = ARCPolicy(), PrefixARCPolicy()
    resident: set[str] = set()
    capacity = 12
    for _ in range(2000):
        k = f"k{int(rnd.paretovariate(1.2)) % 60}"
        if k in resident:
            arc.on_access(k)
            parc.on_access(k)
            continue
        if len(resident) >= capacity:
            va, vp = first_usable(arc, lambda _k: True), first_usable(parc, lambda _k: True)
            assert va == vp
            arc.on_remove(va)
            parc.on_remove(vp)
            resident.discard(va)  # type: ignore[arg-type]
        arc.on_insert(k)
        parc.on_insert(k)
        resident.add(k)
    assert list(arc.candidates()) == list(parc.candidates())


def test_prefix_arc_protects_reused_chains_from_a_scan() -> None:
    hot = [[f"sys{i}" for i in range(4)] + [f"q{j}"] for j in range(3)]  # a system prompt, 3 questions
    scan = [[f"doc{j}-{i}" for i in range(6)] for j in range(20)]  # one-off long prompts
    for name, expect_hit in (("lru", False), ("prefix-arc", True)):
        cache = TieredBlockCache(10, name)
        replay([*hot, *scan], cache)
        # the system prompt was used three times before the scan; only the adaptive policy kept it
        assert (cache.lookup(hot[0]) >= 4) is expect_hit, name


def test_prefix_arc_ghost_hit_adapts_target() -> None:
    p = PrefixARCPolicy()
    for k in "abcd":
        p.on_insert(k)
    assert p._p == 0.0
    p.on_remove("a")  # evicted from RECENT -> ghost B1
    p.on_insert("a")  # would have hit with a larger RECENT: p grows, a is FREQUENT now
    assert p._p == 1.0
    assert list(p.candidates())[:3] == ["b", "c", "d"]  # RECENT (3 keys > p) gives victims first
    p.on_access("b")  # b re-referenced: FREQUENT
    p.on_remove("b")  # from FREQUENT -> ghost B2
    p.on_insert("b")
    assert p._p == 0.0


def test_prefix_arc_reads_hint_marks_frequent() -> None:
    p = PrefixARCPolicy()
    p.on_insert("promoted", reads=1)  # a page that was read in another tier before moving here
    p.on_insert("new")
    assert first_usable(p, lambda _k: True) == "new"


def test_ghost_remembers_parent_when_hint_is_missing() -> None:
    p = PrefixARCPolicy()
    _insert_chain(p, ["h", "t"])
    p.on_remove("t")
    p.on_remove("h")
    p.on_insert("h")
    p.on_insert("t")  # no parent given: the ghost's parent is used
    assert list(p.candidates()) == ["t", "h"]


def test_heap_stays_bounded_under_many_accesses() -> None:
    p = PrefixLRUPolicy()
    for i in range(50):
        p.on_insert(i)
    for _ in range(5000):
        p.on_access(7)
    assert len(p._heaps[0]) <= 2 * len(p) + PrefixTreePolicy.COMPACT_SLACK + 1
    assert first_usable(p, lambda _k: True) == 0


def test_s3fifo_promotes_accessed_small_keys() -> None:
    p = S3FIFOPolicy()
    for k in range(20):
        p.on_insert(k)
    p.on_access(0)
    assert first_usable(p, lambda _k: True) == 1  # 0 was accessed: moved to M instead of evicted
    order = list(p.candidates())
    assert order[0] == 1 and order.index(0) > order.index(18)  # 0 now waits in M behind S's keys
