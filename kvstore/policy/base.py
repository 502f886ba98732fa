"""What every eviction policy offers the TierManager, and the two helpers the manager calls.

Pure: no I/O, no clocks, no randomness that is not seeded; a policy is replayable on traces.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Protocol

Key = Hashable


class EvictionPolicy(Protocol):
    """What the TierManager needs from a policy. Invariant: `len(policy)` equals the number of keys
    inserted and not yet removed; `candidates()` yields each of them exactly once."""

    name: str

    def on_insert(self, key: Key) -> None: ...
    def on_access(self, key: Key) -> None: ...
    def on_remove(self, key: Key) -> None: ...
    def candidates(self) -> Iterator[Key]: ...
    def __len__(self) -> int: ...


def first_usable(policy: EvictionPolicy, usable: Callable[[Key], bool]) -> Key | None:
    """First candidate accepted by usable(), using a policy's fast path when it has one."""
    fast = getattr(policy, "first_candidate", None)
    if fast is not None:
        return fast(usable)
    return next((k for k in policy.candidates() if usable(k)), None)


def should_admit(policy: EvictionPolicy, key: Key, victim: Key | None, parent: Key | None = None) -> bool:
    """Whether `key` may take `victim`'s place in the full tier `policy` orders (see the package
    docstring, "Admission"). True for a policy without `admit`: every policy admits by default."""
    fn = getattr(policy, "admit", None)
    return True if fn is None else bool(fn(key, victim, parent))


def refused_outright(policy: EvictionPolicy, key: Key, parent: Key | None = None) -> bool:
    """Whether `policy` refuses `key` entry to its full tier whatever the victim would be (the
    optional `refuses(key, parent)`, see the package docstring): asked before the victim is chosen, so
    such a refusal costs no victim query. True: the reference is counted and admit() must not be asked
    for it. False for a policy without `refuses`."""
    fn = getattr(policy, "refuses", None)
    return fn is not None and bool(fn(key, parent))
