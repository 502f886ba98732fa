"""Prefetch: background promotions toward a faster tier while the caller is still busy.

One task per page, bounded concurrency (so a large Prefetch cannot starve Gets of I/O threads). A Get
arriving meanwhile waits for the move (entry.moving) instead of reading the page a second time. A page
promoted here counts as used when a Get reads it, and as wasted when it leaves the tier (or the node)
unread (NodeCounters.prefetch_fate).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from kvstore.errors import ResourceExhausted, Unavailable
from kvstore.manager.moves import Mover
from kvstore.manager.state import NodeCounters, PageTable
from kvstore.names import Key, TierKind

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None]], None]


class Prefetcher:
    """Schedules promotions; at most one in flight per page."""

    def __init__(self, table: PageTable, mover: Mover, counters: NodeCounters, spawn: Spawn, concurrency: int) -> None:
        self.table = table
        self.mover = mover
        self.counters = counters
        self.spawn = spawn
        self._in_flight: set[Key] = set()
        self._slots = asyncio.Semaphore(max(1, concurrency))

    def prefetch(self, keys: list[Key], target: TierKind) -> tuple[int, int, int]:
        """Start background promotions toward `target` (or the next available tier below it); returns
        (scheduled, already_resident, missing)."""
        tier = self.table.tiers[target]
        if not tier.available:
            target = below.kind if (below := self.table.below(target)) is not None else target
        scheduled = resident = missing = 0
        for key in keys:
            entry = self.table.get(key)
            if entry is None:
                missing += 1
            elif entry.tier <= target or key in self._in_flight:
                resident += 1  # there already, or on its way
            else:
                scheduled += 1
                self.counters.prefetch_issued += 1
                self._in_flight.add(key)
                self.spawn(self._one(key, target))
        return scheduled, resident, missing

    async def _one(self, key: Key, target: TierKind) -> None:
        """Promote one page a tier at a time until it is in `target`, or cannot go further up."""
        try:
            async with self._slots:
                for _ in range(len(self.table.tiers)):
                    entry = await self.mover.settled(key)
                    if entry is None or entry.tier <= target:
                        break
                    step = self.table.above(entry.tier)
                    if (
                        step is None
                        or step.kind < target
                        or not await self.mover.promote(entry, step.kind, admission=False)
                    ):
                        break
                entry = self.table.get(key)
                if entry is not None and entry.tier <= target:
                    entry.prefetched = True
                    self.counters.prefetch_completed += 1
        except (ResourceExhausted, Unavailable) as exc:
            log.debug("prefetch of %s skipped: %s", key[1].hex(), exc)
        finally:
            self._in_flight.discard(key)
