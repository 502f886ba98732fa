"""Reference history: how often each recently referenced key was referenced, in bounded memory.

The adaptive policy's FREQUENT threshold reads it (kvstore/policy/adaptive.py): "referenced more
often than the victim" compares two counts (TinyLFU's test, Einziger et al. 2017, with exact counts
instead of a sketch). "Seen before" (second sight) is the ghost list of refused keys instead
(admission.SecondSight), which remembers only what the tier turned away.

Bounded by recency, aged by halving. The history keeps the `limit` keys referenced most recently
(a key's reference moves it to the young end; the oldest is forgotten when a new one comes in), so
its memory is `limit` entries whatever the number of distinct keys. Every `window` references each
count is halved, rounding up (TinyLFU's reset, except that a key seen once stays seen: only recency
forgets), so counts follow a changing popularity. The owner sizes both from its tier's capacity
(`ensure_capacity`, never shrinking).

Why exact counts and not the count-min sketch (kvstore/policy/sketch.py): a sketch needs a stable
hash of every key (about 1 us in Python) and four counter updates per reference; a dict update is a
tenth of that. The price is memory: one dict entry per remembered key (about 100 bytes beside the
key, which the tier holds anyway) against a few bytes per key, negligible beside pages of KV data.

Pure and deterministic: no hashing, only the order of events.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.policy.base import Key


class History:
    """Recent reference counts. Invariants: `len(self) <= limit`; count(k) >= 1 exactly for the keys
    remembered; a count is the number of references since the key was last forgotten (at most
    MAX_COUNT), halved (rounded up) at each aging; `references` counts those since the last aging,
    < window."""

    HISTORY_FACTOR = 10  # keys remembered per key of capacity: the tier's own and 9x as many others
    WINDOW_FACTOR = 10  # references between agings per key of capacity (TinyLFU's W = 10 x C)
    MAX_COUNT = 255

    def __init__(self) -> None:
        self.entries: OrderedDict[Key, int] = OrderedDict()  # key -> count, least recently referenced first
        self.limit = self.HISTORY_FACTOR
        self.window = self.WINDOW_FACTOR
        self.references = 0
        self.agings = 0

    def ensure_capacity(self, capacity: int) -> None:
        """Size for a tier of `capacity` keys (never shrinks)."""
        self.limit = max(self.limit, self.HISTORY_FACTOR * capacity)
        self.window = max(self.window, self.WINDOW_FACTOR * capacity)

    def reference(self, key: Key) -> int:
        """Count one reference to key; returns its count before this one (0: not remembered)."""
        entries = self.entries
        before = entries.get(key, 0)
        if before:
            entries.move_to_end(key)
            if before < self.MAX_COUNT:
                entries[key] = before + 1
        else:
            entries[key] = 1
            if len(entries) > self.limit:
                entries.popitem(last=False)
        self.references += 1
        if self.references >= self.window:
            self.age()
        return before

    def count(self, key: Key) -> int:
        return self.entries.get(key, 0)

    def age(self) -> None:
        """Halve every count, rounding up (the recency order is kept)."""
        # NOTE: in place, and only the counts above 1 (a 1 stays 1; most keys are seen once): no copy of
        # 10 x capacity entries on every aging.
        entries = self.entries
        for k in [k for k, v in entries.items() if v > 1]:
            entries[k] = (entries[k] + 1) >> 1
        self.references = 0
        self.agings += 1

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)
