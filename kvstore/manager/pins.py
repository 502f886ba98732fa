"""Pins: pages a caller asked to keep in place, untimed (a count on the entry, until Unpin) or for a time (a
lease: a deadline on the entry, dropped by `expire` once it passed). The manager's Pin, Unpin and its sweeper
call these (core.py); the one evictability test (`Entry.evictable`, state.py) honours both kinds.

Invariants: a pinned page is never chosen as a victim nor moved; an Unpin releases one pin per hash, an
untimed one first, else the soonest-expiring lease; a lease whose deadline passed is gone at the next sweep
(`expire`, O(expired) over a heap of deadlines); whenever pins are released, writers waiting for room are told
(`Placement.space_changed`). Arguments are checked before any page is pinned.
"""

from __future__ import annotations

import heapq
import math
import time

from kvstore.errors import InvalidArgument
from kvstore.manager.placement import Placement
from kvstore.manager.state import PageTable, check_hashes
from kvstore.names import Key
from kvstore.wire import MAX_HASHES


class Pins:
    """The pin leases of one node's pages (the untimed pins are counts on the entries themselves)."""

    def __init__(self, table: PageTable, placement: Placement) -> None:
        self.table, self.placement = table, placement
        self._leases: list[tuple[float, Key]] = []  # (deadline, key): a heap, soonest first

    def pin(self, namespace: str, hashes: list[bytes], ttl_seconds: float = 0.0) -> tuple[int, int]:
        """Pin pages in place (for `ttl_seconds`; 0: until unpinned); returns (pinned, not_found)."""
        self.table.layout_of(namespace)
        check_hashes(hashes, "hashes", MAX_HASHES)
        if not (math.isfinite(ttl_seconds) and ttl_seconds >= 0):  # NaN compares false both ways
            raise InvalidArgument("ttl_seconds", f"must be a finite number >= 0, got {ttl_seconds}")
        pinned = not_found = 0
        deadline = time.monotonic() + ttl_seconds
        for h in hashes:
            entry = self.table.get((namespace, h))
            if entry is None:
                not_found += 1
                continue
            if ttl_seconds > 0:
                entry.pin_deadlines.append(deadline)
                heapq.heappush(self._leases, (deadline, entry.key))
            else:
                entry.pins += 1
            pinned += 1
        return pinned, not_found

    def unpin(self, namespace: str, hashes: list[bytes]) -> tuple[int, int]:
        """Release one pin per hash (an untimed pin first, else the soonest-expiring lease)."""
        self.table.layout_of(namespace)
        check_hashes(hashes, "hashes", MAX_HASHES)
        unpinned = not_pinned = 0
        for h in hashes:
            entry = self.table.get((namespace, h))
            if entry is not None and entry.pins > 0:
                entry.pins -= 1
                unpinned += 1
            elif entry is not None and entry.pin_deadlines:
                entry.pin_deadlines.remove(min(entry.pin_deadlines))
                unpinned += 1
            else:
                not_pinned += 1
        self.placement.space_changed()
        return unpinned, not_pinned

    def expire(self, now: float) -> int:
        """Drop pin leases whose deadline passed; returns how many expired."""
        expired = 0
        while self._leases and self._leases[0][0] <= now:
            deadline, key = heapq.heappop(self._leases)
            entry = self.table.get(key)
            if entry is not None and deadline in entry.pin_deadlines:
                entry.pin_deadlines.remove(deadline)
                expired += 1
        if expired:
            self.placement.space_changed()
        return expired
