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
_HALF = bytes(v >> 1 for v in range(256))  # a translate table that halves every counter


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints that spreads every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


_TUPLE_SEED = 0x243F6A8885A308D3
_NAMESPACE_PART: dict[str, int] = {}  # str -> the tuple hash's state after that first part (see stable_hash)
_NAMESPACE_PART_MAX = 4096  # bounds that memo: namespaces are few, but nothing here trusts that


def stable_hash(key: Hashable) -> int:
    """A 64-bit hash of an int, str, bytes or a tuple of those, equal in every process.
    Raises TypeError for any other key type (the manager's keys are (namespace, hash) tuples)."""
    if type(key) is tuple and len(key) == 2 and type(key[0]) is str and type(key[1]) is bytes:
        # NOTE: the manager's (namespace, hash) keys, on every event of a policy that hashes: the
        # general formula below, with the namespace's part remembered. Same value, a third the time.
        ns = key[0]
        h = _NAMESPACE_PART.get(ns)
        if h is None:
            h = _mix64(_TUPLE_SEED ^ 2 ^ xxhash.xxh3_64_intdigest(ns.encode(), seed=1))
            if len(_NAMESPACE_PART) < _NAMESPACE_PART_MAX:
                _NAMESPACE_PART[ns] = h
        return _mix64(h ^ xxhash.xxh3_64_intdigest(key[1]))
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
        h = _TUPLE_SEED ^ len(key)
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

    def _slots(self, h: int) -> tuple[int, int, int, int, int, int]:
        """The counter of each row, then the doorkeeper's two bits, for the key hashed to h.
        NOTE: double hashing (Kirsch & Mitzenmacher): the rows' indexes from the two 32-bit halves;
        the doorkeeper's from a remix, independent of them."""
        m = self.width - 1
        a, b = h & 0xFFFFFFFF, (h >> 32) | 1
        d = _mix64(h ^ 0x5851F42D4C957F2D)
        return a & m, (a + b) & m, (a + 2 * b) & m, (a + 3 * b) & m, d & m, (d >> 32) & m

    def increment(self, key: Hashable) -> None:
        """Count one reference to key."""
        self.increment_hash(stable_hash(key))

    def increment_hash(self, h: int) -> None:
        """Count one reference to the key whose stable_hash is h."""
        # NOTE: unrolled over DEPTH = 4 rows: this runs on every reference a tier sees.
        i0, i1, i2, i3, d0, d1 = self._slots(h)
        self.additions += 1
        door = self._door
        if door is not None:
            had = door[d0 >> 3] >> (d0 & 7) & 1 and door[d1 >> 3] >> (d1 & 7) & 1
            if not had:
                door[d0 >> 3] |= 1 << (d0 & 7)
                door[d1 >> 3] |= 1 << (d1 & 7)
        if door is None or had:
            r0, r1, r2, r3 = self._rows
            c0, c1, c2, c3 = r0[i0], r1[i1], r2[i2], r3[i3]
            low = min(c0, c1, c2, c3)
            if low < self.MAX_COUNT:  # conservative update: only the counters at the minimum
                if c0 == low:
                    r0[i0] = low + 1
                if c1 == low:
                    r1[i1] = low + 1
                if c2 == low:
                    r2[i2] = low + 1
                if c3 == low:
                    r3[i3] = low + 1
        if self.additions >= self.sample_size:
            self.reset()

    def estimate(self, key: Hashable) -> int:
        """References to key in the current sample (an over-estimate only through collisions)."""
        return self.estimate_hash(stable_hash(key))

    def estimate_hash(self, h: int) -> int:
        """estimate() of the key whose stable_hash is h."""
        i0, i1, i2, i3, d0, d1 = self._slots(h)
        r0, r1, r2, r3 = self._rows
        n = min(r0[i0], r1[i1], r2[i2], r3[i3])
        door = self._door
        if door is not None and door[d0 >> 3] >> (d0 & 7) & 1 and door[d1 >> 3] >> (d1 & 7) & 1:
            n += 1
        return n

    def reset(self) -> None:
        """Age: halve every counter and clear the doorkeeper (TinyLFU's reset)."""
        self._rows = [bytearray(row.translate(_HALF)) for row in self._rows]
        if self._door is not None:
            self._door = bytearray(len(self._door))
        self.additions //= 2
        self.resets += 1
