"""Eviction policies: pure bookkeeping over opaque keys, no I/O (DESIGN.md §6).

The manager keeps one policy instance per tier and tells it what happens (insert, access, remove);
the policy answers one question: in which order should victims be considered. The manager skips
candidates it cannot evict (pinned, being read, being moved), so a policy never needs to know about
pins. Policies are replayable on traces without a node (benchmarks/trace_replay.py, later issue).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    """What the TierManager needs from a policy. Invariant: `len(policy)` equals the number of keys
    inserted and not yet removed; `candidates()` yields each of them exactly once."""

    name: str

    def on_insert(self, key: Hashable) -> None: ...
    def on_access(self, key: Hashable) -> None: ...
    def on_remove(self, key: Hashable) -> None: ...
    def candidates(self) -> Iterator[Hashable]: ...
    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first. O(1) insert, access and remove."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def on_insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        # NOTE: iterate a snapshot so the manager may mutate the policy while walking victims.
        return iter(list(self._order))

    def first_candidate(self, usable: Callable[[Hashable], bool]) -> Hashable | None:
        """The oldest key for which usable(key) is true, without copying the whole order."""
        for key in self._order:
            if usable(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by its config name; raises ValueError naming the known ones."""
    try:
        return POLICIES[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None


def first_usable(policy: EvictionPolicy, usable: Callable[[Hashable], bool]) -> Hashable | None:
    """First candidate accepted by usable(), using a policy's fast path when it has one."""
    fast = getattr(policy, "first_candidate", None)
    if fast is not None:
        return fast(usable)
    return next((k for k in policy.candidates() if usable(k)), None)
