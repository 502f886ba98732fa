"""A frequency sketch for admission (TinyLFU, Einziger, Friedman & Manes, ACM ToS 2017): how often
was a key referenced recently, in bounded memory, whatever the number of distinct keys.

Count-min with conservative update: DEPTH rows of saturating counters (0..MAX_COUNT), a key maps to
one counter per row and its estimate is the smallest of them; an increment raises only the counters
equal to that minimum (never an over-estimate beyond what plain count-min gives, usually less).
Aging: after `sample_size` increments every counter is halved, so the sketch follows a changing
popularity (the "reset" of TinyLFU; a window of about sample_size references). A doorkeeper (a
Bloom filter cleared at each reset) takes a key's first reference, so keys seen once never touch the
counters: the rest of the sketch is spent on keys that came back.

Sizing follows the tier, which a policy is not told: `ensure_capacity(c)` is called with the most
keys the tier has held. The width is a power of two >= WIDTH_FACTOR * c; growing doubles the width
and copies each counter to both of its new places, so every estimate is unchanged by the growth.

Hashing is stable across processes (`stable_hash`, xxh3 over a canonical encoding, never Python's
salted hash()), so a simulation and a node that see the same keys make the same decisions.
"""

from __future__ import annotations

from collections.abc import Hashable

import xxhash

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints that spreads every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def stable_hash(key: Hashable) -> int:
    """A 64-bit hash of an int, str, bytes or a tuple of those, equal in every process.
    Raises TypeError for any other key type (the manager's keys are (namespace, hash) tuples)."""
    if isinstance(key, bool):
        raise TypeError(f"cannot hash key of type bool: {key!r}")
    if isinstance(key, int):
        h = 0
        while True:  # 64 bits at a time, so ints of any size (and negative ones) hash
            h = _mix64(h ^ (key & _MASK64))
            key >>= 64
            if key in (0, -1):
                return h if key == 0 else _mix64(~h & _MASK64)
    if isinstance(key, bytes):
        return xxhash.xxh3_64_intdigest(key)
    if isinstance(key, str):
        return xxhash.xxh3_64_intdigest(key.encode(), seed=1)
    if isinstance(key, tuple):
        h = 0x243F6A8885A308D3 ^ len(key)
        for part in key:
            h = _mix64(h ^ stable_hash(part))
        return h
    raise TypeError(f"cannot hash key of type {type(key).__name__}: {key!r}")


class FrequencySketch:
    """Recent reference counts of keys, estimated in DEPTH * width bytes plus a width-bit doorkeeper.

    Invariants: estimate(k) >= the number of increments of k since the last reset, halved at each
    reset and capped at MAX_COUNT + 1 (never under-counts within a sample, up to the cap); memory
    depends only on the capacity it was sized for, never on the number of distinct keys.
    """

    DEPTH = 4
    MAX_COUNT = 15  # 4-bit counters, as in TinyLFU: enough to rank keys, and halving ages them fast
    WIDTH_FACTOR = 4  # counters per row for each key the tier holds: few collisions among residents
    SAMPLE_FACTOR = 10  # references between resets, per key of capacity (TinyLFU's W = 10 * C)
    MIN_WIDTH = 64

    def __init__(self, capacity: int = 0, *, doorkeeper: bool = True) -> None:
        self.width = self.MIN_WIDTH
        self._rows = [bytearray(self.width) for _ in range(self.DEPTH)]
        self._door: bytearray | None = bytearray(self.width // 8) if doorkeeper else None
        self.capacity = 0
        self.sample_size = self.SAMPLE_FACTOR * self.MIN_WIDTH // self.WIDTH_FACTOR
        self.additions = 0  # increments since the last reset
        self.resets = 0
        self.ensure_capacity(capacity)

    # -- sizing -------------------------------------------------------------------------------------

    def ensure_capacity(self, capacity: int) -> None:
        """Size for a tier of `capacity` keys (never shrinks); estimates are unchanged by growth."""
        if capacity <= self.capacity:
            return
        self.capacity = capacity
        self.sample_size = max(self.sample_size, self.SAMPLE_FACTOR * capacity)
        while self.width < self.WIDTH_FACTOR * capacity:
            # NOTE: index = hash & (width - 1); doubling adds one bit, so a key's new place j has
            # j & (old width - 1) as its old place: copying row + row keeps every estimate.
            self._rows = [row + row for row in self._rows]
            if self._door is not None:
                self._door = self._door + self._door
            self.width *= 2

    @property
    def nbytes(self) -> int:
        return self.DEPTH * self.width + (len(self._door) if self._door is not None else 0)

    # -- counting -----------------------------------------------------------------------------------

    def _slots(self, h: int) -> tuple[int, int, int, int]:
        # NOTE: double hashing (Kirsch & Mitzenmacher): DEPTH indexes from two 32-bit halves.
        m = self.width - 1
        a, b = h & 0xFFFFFFFF, (h >> 32) | 1
        return a & m, (a + b) & m, (a + 2 * b) & m, (a + 3 * b) & m

    def _door_bits(self, h: int) -> tuple[int, int]:
        d, m = _mix64(h ^ 0x5851F42D4C957F2D), self.width - 1  # independent of the rows' indexes
        return d & m, (d >> 32) & m

    def _door_has(self, h: int) -> bool:
        door = self._door
        assert door is not None
        i, j = self._door_bits(h)
        return bool(door[i >> 3] >> (i & 7) & 1 and door[j >> 3] >> (j & 7) & 1)

    def _door_add(self, h: int) -> bool:
        """Put h in the doorkeeper; True if it was there already."""
        door = self._door
        assert door is not None
        i, j = self._door_bits(h)
        had = bool(door[i >> 3] >> (i & 7) & 1 and door[j >> 3] >> (j & 7) & 1)
        door[i >> 3] |= 1 << (i & 7)
        door[j >> 3] |= 1 << (j & 7)
        return had

    def increment(self, key: Hashable) -> None:
        """Count one reference to key."""
        h = stable_hash(key)
        self.additions += 1
        if self._door is None or self._door_add(h):
            rows, slots = self._rows, self._slots(h)
            low = min(rows[d][s] for d, s in enumerate(slots))
            if low < self.MAX_COUNT:
                for d, s in enumerate(slots):
                    if rows[d][s] == low:  # conservative update: only the counters at the minimum
                        rows[d][s] = low + 1
        if self.additions >= self.sample_size:
            self.reset()

    def estimate(self, key: Hashable) -> int:
        """References to key in the current sample (an over-estimate only through collisions)."""
        h = stable_hash(key)
        rows = self._rows
        n = min(rows[d][s] for d, s in enumerate(self._slots(h)))
        if self._door is not None and self._door_has(h):
            n += 1
        return n

    def reset(self) -> None:
        """Age: halve every counter and clear the doorkeeper (TinyLFU's reset)."""
        self._rows = [bytearray(v >> 1 for v in row) for row in self._rows]
        if self._door is not None:
            self._door = bytearray(len(self._door))
        self.additions //= 2
        self.resets += 1
