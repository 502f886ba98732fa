"""Config names of the policies, and the factory the TierManager calls."""

from __future__ import annotations

from collections.abc import Callable

from kvstore.policy.adaptive import AdaptivePolicy
from kvstore.policy.admission import Admitted
from kvstore.policy.base import EvictionPolicy
from kvstore.policy.frequency import S3FIFOPolicy
from kvstore.policy.prefix import PrefixARCPolicy, PrefixLRUPolicy
from kvstore.policy.recency import ARCPolicy, LRUPolicy


def _tinylfu() -> EvictionPolicy:
    policy = Admitted(PrefixARCPolicy())
    policy.name = "tinylfu"
    return policy


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "prefix-lru": PrefixLRUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "prefix-arc": PrefixARCPolicy,
    "tinylfu": _tinylfu,  # prefix-arc behind TinyLFU admission, always on
    "adaptive": AdaptivePolicy,  # prefix-arc, admission switched by dueling shadows
}


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by its config name; raises ValueError naming the known ones."""
    try:
        return POLICIES[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
