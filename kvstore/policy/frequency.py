"""Frequency policies: S3-FIFO (Yang et al., SOSP'23). Pure bookkeeping, no I/O."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvstore.policy.base import Key

# --------------------------------------------------------------------------------------------------
# S3-FIFO (Yang et al., SOSP'23)


class S3FIFOPolicy:
    """S3-FIFO: a small FIFO S for new keys, a main FIFO M, a ghost FIFO G of keys evicted from S.
    A key is inserted into S (into M if G remembers it); an access raises its 2-bit counter. The
    victim comes from S while S holds at least SMALL_FRACTION of the keys: S's head moves to M if it
    was accessed, else it is the victim. Otherwise M's head is the victim if its counter is 0, else
    its counter drops by one and it goes to M's tail. Invariants: S and M hold exactly the resident
    keys; |G| <= |M|'s share of the high-water mark. Hints are ignored.

    NOTE: `first_candidate` performs those moves (S -> M, M head -> tail) as it looks: they only
    reorder resident keys. `candidates()` runs the same procedure on a copy, so its first usable key
    is what `first_candidate` returns (up to the |S| test, which a skipped pinned key shifts).
    """

    name = "s3fifo"
    SMALL_FRACTION = 0.1  # NOTE: the paper's value; S is a probation window for one-hit wonders
    MAX_FREQ = 3  # 2-bit counter, as in the paper

    def __init__(self) -> None:
        self._s: OrderedDict[Key, None] = OrderedDict()
        self._m: OrderedDict[Key, None] = OrderedDict()
        self._g: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._c = 0

    def on_insert(self, key: Key, parent: Key | None = None, reads: int = 0) -> None:
        if key in self._freq:
            self.on_access(key)
            return
        self._freq[key] = 0
        if key in self._g:
            del self._g[key]
            self._m[key] = None
        else:
            self._s[key] = None
        self._c = max(self._c, len(self._freq))

    def on_access(self, key: Key) -> None:
        f = self._freq.get(key)
        if f is not None:
            self._freq[key] = min(f + 1, self.MAX_FREQ)

    def on_remove(self, key: Key) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._s:
            del self._s[key]
            self._g[key] = None
            while len(self._g) > max(1, self._c - int(self._c * self.SMALL_FRACTION)):
                self._g.popitem(last=False)
        else:
            del self._m[key]

    @staticmethod
    def _walk(
        s: OrderedDict[Key, None],
        m: OrderedDict[Key, None],
        freq: dict[Key, int],
        small_min: float,
        usable: Callable[[Key], bool],
    ) -> Key | None:
        """The S3-FIFO eviction procedure, passing over keys usable() rejects; moves keys as it goes.
        Terminates: every pass either returns, moves a key from S to M (at most |S| times) or lowers
        a counter (at most 3 per key)."""
        skipped: set[Key] = set()
        while True:
            if len(s) >= small_min:
                head = _first(s, skipped, usable, freq)
                if head is not None and freq[head] > 0:
                    del s[head]
                    freq[head] = 0
                    m[head] = None
                    continue
                if head is not None:
                    return head
            head = _first(m, skipped, usable, freq)
            if head is not None and freq[head] > 0:
                freq[head] -= 1
                m.move_to_end(head)
                continue
            if head is not None:
                return head
            # Every key of M is unusable: S's usable keys, in order, whatever their counters.
            return next((k for k in s if k not in skipped and usable(k)), None)

    def first_candidate(self, usable: Callable[[Key], bool]) -> Key | None:
        return self._walk(self._s, self._m, self._freq, self._c * self.SMALL_FRACTION, usable)

    def candidates(self) -> Iterator[Key]:
        s, m, freq = OrderedDict(self._s), OrderedDict(self._m), dict(self._freq)
        small_min = self._c * self.SMALL_FRACTION
        order: list[Key] = []
        while s or m:
            key = self._walk(s, m, freq, small_min, lambda _k: True)
            if key is None:  # pragma: no cover - the walk always finds one while keys remain
                break
            order.append(key)
            s.pop(key, None)
            m.pop(key, None)
        return iter(order)

    def __len__(self) -> int:
        return len(self._freq)


def _first(
    fifo: OrderedDict[Key, None], skipped: set[Key], usable: Callable[[Key], bool], freq: dict[Key, int]
) -> Key | None:
    """The first key of `fifo` not skipped that is either accessed (to be moved) or usable; an
    unaccessed unusable key is added to `skipped` on the way."""
    for key in fifo:
        if key in skipped:
            continue
        if freq[key] > 0 or usable(key):
            return key
        skipped.add(key)
    return None
