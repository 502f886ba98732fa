"""The DRAM scrubber: resident host-memory pages re-verified in the background, at a bounded rate.

Why (DESIGN.md §8): a page is verified once per read, by the party that receives its bytes, so a DRAM page
read by a client across a network plane is not re-hashed by the node; the client's check covers it end to
end. A page nobody reads would then never be checked again: the scrubber walks every resident DRAM page
in turn, verifies its payload against the checksum taken when it was put, and drops and counts one that
fails (`checksum_failures` of its tier), so damage is found before a reader needs the page.

Invariants: at most `rate` payload bytes per second are hashed (bursts of about SCRUB_BURST_BYTES, then a
sleep that pays for them); a page is hashed with no await between finding it and checking it, so it cannot
be freed or moved underneath; a page being read, pinned or moved is checked like any other (hashing reads
the slot, it changes nothing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kvstore.manager.state import Entry, NodeCounters, PageTable
from kvstore.names import TierKind
from kvstore.pageformat import HEADER_BYTES, payload_checksum

SCRUB_BURST_BYTES = 1 << 20  # bytes hashed between two sleeps (at least one page)
IDLE_SECONDS = 1.0  # wait before walking an empty tier again


class Scrubber:
    """Walks the pages of one host-memory tier, verifying each (see the module docstring)."""

    def __init__(
        self,
        table: PageTable,
        kind: TierKind,
        counters: NodeCounters,
        rate: int,
        corrupt: Callable[[Entry, str], Awaitable[None]],
    ) -> None:
        self.table = table
        self.tier = table.tiers[kind]
        self.counters = counters
        self.rate = rate  # bytes per second; > 0
        self.corrupt = corrupt  # counts and drops a page that failed (Reader.corrupt)

    def check(self, entry: Entry) -> bool:
        """Whether a resident page of this tier still matches its checksum (hashed here, synchronously)."""
        view = self.tier.medium.view(entry.slot + HEADER_BYTES, entry.payload_len)
        try:
            return payload_checksum(view) == entry.payload_checksum()
        finally:
            view.release()

    async def one_pass(self) -> int:
        """Verify every page resident in the tier when the pass starts; returns the bytes hashed."""
        keys = [e.key for e in self.table if e.tier is self.tier.kind]
        done = burst = 0
        for key in keys:
            entry = self.table.get(key)
            if entry is None or entry.tier is not self.tier.kind:
                continue  # gone or moved since the pass began
            ok = self.check(entry)
            done += entry.payload_len
            burst += entry.payload_len
            self.counters.scrubbed_bytes += entry.payload_len
            if not ok:
                await self.corrupt(entry, "scrub")
            if burst >= SCRUB_BURST_BYTES:
                await asyncio.sleep(burst / self.rate)
                burst = 0
        if burst:
            await asyncio.sleep(burst / self.rate)
        return done

    async def run(self) -> None:
        """Scrub forever (cancelled when the manager closes)."""
        while True:
            if not await self.one_pass():
                await asyncio.sleep(IDLE_SECONDS)
