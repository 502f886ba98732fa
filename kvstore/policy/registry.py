"""Config names of the policies, and the factory the TierManager calls."""

from __future__ import annotations

from collections.abc import Callable

from kvstore.policy.adaptive import AdaptivePolicy
from kvstore.policy.admission import Admitted, SecondSight
from kvstore.policy.base import EvictionPolicy
from kvstore.policy.duel import DuelPolicy
from kvstore.policy.frequency import S3FIFOPolicy
from kvstore.policy.prefix import PrefixARCPolicy, PrefixLRUPolicy
from kvstore.policy.recency import ARCPolicy, LRUPolicy


def _tinylfu() -> EvictionPolicy:
    policy = Admitted(PrefixARCPolicy())
    policy.name = "tinylfu"
    return policy


def _second_sight() -> EvictionPolicy:
    policy = Admitted(LRUPolicy(), SecondSight(4.0), parent_rule=False)
    policy.name = "second-sight"
    return policy


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "prefix-lru": PrefixLRUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "prefix-arc": PrefixARCPolicy,
    "tinylfu": _tinylfu,  # prefix-arc behind TinyLFU admission, always on
    "second-sight": _second_sight,  # LRU admitting a block on its second sight (ghost of 4x the tier)
    "duel": DuelPolicy,  # prefix-arc, TinyLFU admission switched on and off by two shadows (an earlier default)
    "adaptive": AdaptivePolicy,  # prefix-LRU behind all / recall / second-sight / TinyLFU, chosen by four shadows
}


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by its config name; raises ValueError naming the known ones."""
    try:
        return POLICIES[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
