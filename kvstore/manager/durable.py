"""Durable copies on the persistent tier (NVMe): shadow slots, recovery after a restart, shutdown spill.

A free slot of the persistent tier may still hold a valid durable copy of a page: its page was promoted
to a faster tier, or evicted from this one. Every such slot is tracked by key:
- a promoted page's own copy (its *shadow*, same generation) lets a later demotion reuse the slot with
  no write, and a restart recovers it;
- all copies of a key are erased durably when the key is deleted or found corrupt, so a deleted page
  never comes back after a restart;
- the tracking of a slot ends when the slot is reused (`forget`), since it is about to be overwritten.
"""

from __future__ import annotations

import logging
import time

from kvstore.manager.io import IoPool
from kvstore.manager.state import Entry, PageTable, Tier
from kvstore.names import Key
from kvstore.pageformat import PageHeader

log = logging.getLogger(__name__)

SPILL_BATCH = 32  # pages made durable together (one fdatasync per segment file per batch)


class DurableCopies:
    """Shadow-slot bookkeeping for the persistent tier, plus recovery and spill, which feed it."""

    def __init__(self, table: PageTable, io: IoPool) -> None:
        self.table = table
        self.io = io
        self.tier: Tier | None = table.persistent
        self._by_slot: dict[int, Key] = {}  # free slot -> key of the valid copy it still holds
        self._by_key: dict[Key, set[int]] = {}

    def note(self, slot: int, key: Key) -> None:
        """A free slot keeps a valid copy of key."""
        self._by_slot[slot] = key
        self._by_key.setdefault(key, set()).add(slot)

    def forget(self, slot: int) -> None:
        """The slot is being reused: its old copy stops counting (it will be overwritten)."""
        key = self._by_slot.pop(slot, None)
        if key is None:
            return
        slots = self._by_key[key]
        slots.discard(slot)
        if not slots:
            del self._by_key[key]
        if (entry := self.table.get(key)) is not None and entry.shadow == slot:
            entry.shadow = None

    def adopt(self, slot: int) -> None:
        """Take a free slot that holds a copy back into use (a clean demotion onto its shadow)."""
        assert self.tier is not None
        self.tier.alloc.claim(slot)
        self.forget(slot)

    async def erase(self, key: Key) -> None:
        """Durably erase every free slot still holding a copy of key."""
        if self.tier is None:
            return
        for slot in sorted(self._by_key.get(key, ())):
            self.forget(slot)
            await self.io.run(self.tier.medium.invalidate, slot)

    # -- restart

    def recover(self, found: list[tuple[int, PageHeader]], max_page_bytes: int) -> int:
        """Publish the newest valid copy of each key the persistent tier holds; returns how many.

        Older copies of a key stay tracked (erasable if the key is deleted). A page larger than this
        node's slots, whose payload length is not its layout's page size, or of a layout other than its
        namespace's first is ignored, with a warning.
        """
        tier = self.tier
        if tier is None:
            return 0
        table = self.table
        best: dict[Key, tuple[int, PageHeader]] = {}
        for slot, hdr in found:
            if hdr.payload_len > max_page_bytes:
                log.warning("NVMe slot %d: page of %d B exceeds max_page_bytes; ignored", slot, hdr.payload_len)
                continue
            if hdr.payload_len != hdr.layout.page_bytes:  # a Put could never have stored it: never serve it
                log.warning(
                    "NVMe slot %d: payload of %d B does not fit its layout's %d B pages; ignored",
                    slot,
                    hdr.payload_len,
                    hdr.layout.page_bytes,
                )
                continue
            k = (hdr.namespace, hdr.hash)
            if k not in best or hdr.generation > best[k][1].generation:
                best[k] = (slot, hdr)
        kept = []
        for slot, hdr in sorted(best.values(), key=lambda sh: sh[1].generation):  # oldest first = LRU order
            bound = table.layouts.setdefault(hdr.namespace, hdr.layout)
            if bound != hdr.layout:
                log.warning("NVMe slot %d: layout differs from namespace %r's; ignored", slot, hdr.namespace)
                continue
            kept.append((slot, hdr))
        tier.alloc.claim_many([s for s, _ in kept])
        kept_slots = {s for s, _ in kept}
        for slot, hdr in found:  # superseded copies stay erasable if their key is deleted
            if slot not in kept_slots and hdr.namespace in table.layouts:
                self.note(slot, (hdr.namespace, hdr.hash))
        for slot, hdr in kept:
            entry = Entry(
                hdr.namespace,
                hdr.hash,
                tier.kind,
                slot,
                hdr.payload_len,
                hdr.bound_checksum(),
                hdr.generation,
                hdr.layout,
            )
            table.publish(entry, tier.kind)
            table.saw_generation(hdr.generation)
        if kept:
            log.info("recovered %d page(s) from NVMe in %d namespace(s)", len(kept), len(table.layouts))
        return len(kept)

    async def spill(self, deadline: float) -> None:
        """Copy the pages of host-memory tiers (most recent first) into free persistent slots, bounded by
        `deadline` (time.monotonic); never evicts a persistent page. Pages whose shadow is intact are
        durable already: their shadows are kept first, so no slot of theirs is handed to another page."""
        dst = self.tier
        if dst is None:
            return
        sources = [t for t in self.table.tiers.values() if t.available and t.medium.host_memory]
        entries: list[Entry] = []
        for src in sources:
            keys = list(src.policy.candidates())[::-1]
            entries += [e for k in keys if (e := self.table.get(k)) is not None and e.tier is src.kind]
        spilled = 0
        for entry in entries:
            if entry.shadow is not None:
                self.adopt(entry.shadow)
                spilled += 1
        to_write = [e for e in entries if e.shadow is None]
        for start in range(0, len(to_write), SPILL_BATCH):
            if time.monotonic() > deadline:
                break
            batch = []
            for entry in to_write[start : start + SPILL_BATCH]:
                if not dst.alloc.can_allocate():
                    break
                slot = dst.alloc.allocate()
                self.forget(slot)
                batch.append((slot, self.table.tiers[entry.tier].medium.view(entry.slot)[: entry.used_len]))
            if not batch:
                break
            written = await self._write_batch(batch)
            spilled += written
            if written < len(batch):
                break  # the disk is full or failing: stop, and let the shutdown finish cleanly
        if entries:
            log.info("spilled %d of %d DRAM page(s) to NVMe for a warm restart", spilled, len(entries))

    async def _write_batch(self, batch: list[tuple[int, memoryview]]) -> int:
        """Write a spill batch; when the batch fails (ENOSPC, EIO), page by page, stopping at the first page
        that fails too. Returns how many were written; the slots of the others are free again (the medium
        erased them: a restart finds no half-written page)."""
        assert self.tier is not None
        medium, alloc = self.tier.medium, self.tier.alloc
        try:
            await self.io.run(medium.write_many, batch)
            return len(batch)
        except OSError as exc:
            log.error("spill batch of %d page(s) failed (%s); retrying page by page", len(batch), exc)
        written, failed = 0, False
        for slot, view in batch:
            if not failed:
                try:
                    await self.io.run(medium.write, slot, view)
                    written += 1
                    continue
                except OSError as exc:
                    log.error("spill stopped after %d more page(s): %s", written, exc)
                    failed = True
            alloc.free(slot)
        return written
