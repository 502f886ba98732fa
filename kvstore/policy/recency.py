"""Recency policies: LRU and ARC (Megiddo & Modha, FAST'03). Pure bookkeeping, no I/O."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvstore.policy.base import Key

# --------------------------------------------------------------------------------------------------
# LRU


class LRUPolicy:
    """Least recently used first. O(1) insert, access and remove. Ignores hints."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key, parent: Key | None = None, reads: int = 0) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[Key]:
        # NOTE: iterate a snapshot so the manager may mutate the policy while walking victims.
        return iter(list(self._order))

    def first_candidate(self, usable: Callable[[Key], bool]) -> Key | None:
        """The oldest key for which usable(key) is true, without copying the whole order."""
        for key in self._order:
            if usable(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


# --------------------------------------------------------------------------------------------------
# ARC (Megiddo & Modha, FAST'03)


class ARCPolicy:
    """Adaptive Replacement Cache. T1 holds keys seen once recently, T2 keys seen at least twice;
    the ghost lists B1/B2 remember keys recently evicted from each, and a ghost hit moves the target
    size `p` of T1 towards the list that would have kept it. Invariants: T1, T2 hold exactly the
    resident keys; |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c, where c is the most keys this tier
    has held (a policy is not told its tier's capacity; a full tier stays at its high-water mark).

    NOTE: ARC picks its victim knowing the incoming key (a B2 hit tips the choice towards T1); here
    the victim is chosen before the insert, so the rule is |T1| > p alone. Hints are ignored.
    """

    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._p = 0.0
        self._c = 0

    def on_insert(self, key: Key, parent: Key | None = None, reads: int = 0) -> None:
        if key in self._t1 or key in self._t2:
            self.on_access(key)
            return
        self._c = max(self._c, len(self) + 1)
        if key in self._b1:
            self._p = min(float(self._c), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def on_access(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        while self._b1 and len(self._t1) + len(self._b1) > self._c:
            self._b1.popitem(last=False)
        while self._b2 and len(self) + len(self._b1) + len(self._b2) > 2 * self._c:
            self._b2.popitem(last=False)

    def _lists(self) -> tuple[OrderedDict[Key, None], OrderedDict[Key, None]]:
        """(first, second): the list victims come from first, by the |T1| > p rule."""
        if self._t1 and (len(self._t1) > self._p or not self._t2):
            return self._t1, self._t2
        return self._t2, self._t1

    def candidates(self) -> Iterator[Key]:
        first, second = self._lists()
        return iter([*first, *second])

    def first_candidate(self, usable: Callable[[Key], bool]) -> Key | None:
        first, second = self._lists()
        for lst in (first, second):
            for key in lst:
                if usable(key):
                    return key
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)
