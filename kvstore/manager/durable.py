"""Durable copies on the persistent tier (NVMe): shadow slots, recovery after a restart, shutdown spill.

A free slot of the persistent tier may still hold a valid durable copy of a page: its page was promoted
to a faster tier, or evicted from this one. Every such slot is tracked by key:
- a promoted page's own copy (its *shadow*, same generation) lets a later demotion reuse the slot with
  no write, and a restart recovers it;
- all copies of a key are erased durably when the key is deleted or found corrupt, so a deleted page
  never comes back after a restart;
- the tracking of a slot ends when the slot is reused (`forget`), since it is about to be overwritten,
  and the tracking of every slot of a chunk when the chunk is laid out for another slot size (`prepare`):
  its old header positions are erased, and an offset of the old layout may lie inside a new page, where
  erasing it later would damage that page.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvstore.manager.io import IoPool
from kvstore.manager.state import Entry, PageTable, Tier
from kvstore.names import Key
from kvstore.pageformat import PageHeader, slot_bytes_for
from kvstore.tiers.slots import Grant

log = logging.getLogger(__name__)

SPILL_BATCH = 32  # pages made durable together (one fdatasync per segment file per batch)


class DurableCopies:
    """Shadow-slot bookkeeping for the persistent tier, plus recovery and spill, which feed it."""

    def __init__(self, table: PageTable, io: IoPool) -> None:
        self.table = table
        self.io = io
        self.tier: Tier | None = table.persistent
        self._by_slot: dict[int, tuple[Key, int]] = {}  # free slot -> (key, slot size) of the copy it holds
        self._by_key: dict[Key, set[int]] = {}
        self._by_chunk: dict[int, set[int]] = {}
        self._formats: dict[int, asyncio.Future[None]] = {}  # slot size -> a chunk being laid out for it

    def note(self, slot: int, key: Key, nbytes: int) -> None:
        """A free slot of `nbytes` keeps a valid copy of key."""
        assert self.tier is not None
        self._by_slot[slot] = (key, nbytes)
        self._by_key.setdefault(key, set()).add(slot)
        self._by_chunk.setdefault(self.tier.alloc.chunk_of(slot), set()).add(slot)

    def forget(self, slot: int) -> None:
        """The slot is being reused: its old copy stops counting (it will be overwritten)."""
        got = self._by_slot.pop(slot, None)
        if got is None:
            return
        key = got[0]
        slots = self._by_key[key]
        slots.discard(slot)
        if not slots:
            del self._by_key[key]
        assert self.tier is not None
        chunk = self.tier.alloc.chunk_of(slot)
        self._by_chunk[chunk].discard(slot)
        if not self._by_chunk[chunk]:
            del self._by_chunk[chunk]
        if (entry := self.table.get(key)) is not None and entry.shadow == slot:
            entry.shadow = None

    def adopt(self, slot: int, nbytes: int) -> None:
        """Take a free slot that holds a copy back into use (a clean demotion onto its shadow)."""
        assert self.tier is not None
        self.tier.alloc.claim(slot, nbytes)
        self.forget(slot)

    async def prepare(self, grant: Grant) -> None:
        """Ready a slot just allocated in the persistent tier for writing: its old copy stops counting, and
        when its chunk was taken for another slot size (`grant.reformat`) every copy in the chunk does and
        the medium lays the chunk out anew (`Medium.format`) before anything is written into it; meanwhile
        the chunk hands out no other slot. On failure (ENOSPC, EIO) the slot is freed and the error raised."""
        tier = self.tier
        assert tier is not None
        if not grant.reformat:
            self.forget(grant.offset)
            return
        alloc = tier.alloc
        chunk = alloc.chunk_of(grant.offset)
        for slot in list(self._by_chunk.get(chunk, ())):
            self.forget(slot)
        if not tier.medium.needs_format(grant.nbytes):
            return  # NOTE: no I/O (a chunk of one slot): the page written at its start lays it out
        alloc.hold(chunk)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._formats.setdefault(grant.nbytes, done)
        try:
            await self.io.run(tier.medium.format, chunk * alloc.chunk_bytes, grant.nbytes)
        except BaseException:
            alloc.free(grant.offset)
            raise
        finally:
            alloc.release(chunk)
            if self._formats.get(grant.nbytes) is done:
                del self._formats[grant.nbytes]
            done.set_result(None)

    def formatting(self, nbytes: int) -> asyncio.Future[None] | None:
        """A chunk being laid out for slots of `nbytes` right now (done when it is), or None. An allocation of
        that size waits for it rather than take another free chunk: the chunk it awaits has room."""
        return self._formats.get(nbytes)

    async def erase(self, key: Key) -> None:
        """Durably erase every free slot still holding a copy of key."""
        if self.tier is None:
            return
        for slot in sorted(self._by_key.get(key, ())):
            nbytes = self._by_slot[slot][1]
            self.forget(slot)
            await self.io.run(self.tier.medium.invalidate, slot, nbytes)

    # -- restart

    def recover(self, found: list[tuple[int, PageHeader]], max_page_bytes: int, chunk_classes: dict[int, int]) -> int:
        """Publish the newest valid copy of each key the persistent tier holds, and rebuild its allocator:
        the slot of every page published, and the slot size every other chunk is laid out for
        (`chunk_classes`, from the scan); returns how many pages.

        Older copies of a key stay tracked (erasable if the key is deleted). A page larger than this
        node's largest page, whose payload length is not its layout's page size, or of a layout other than
        its namespace's first is ignored, with a warning.
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
        for slot, hdr in kept:
            tier.alloc.claim(slot, slot_bytes_for(hdr.payload_len))
        for chunk, cls in chunk_classes.items():  # free chunks: taken for the same size again, no reformat
            tier.alloc.know(chunk, cls)
        kept_slots = {s for s, _ in kept}
        for slot, hdr in found:  # superseded copies stay erasable if their key is deleted
            if slot not in kept_slots and hdr.namespace in table.layouts:
                self.note(slot, (hdr.namespace, hdr.hash), slot_bytes_for(hdr.payload_len))
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
                self.adopt(entry.shadow, entry.used_len)
                spilled += 1
        to_write = [e for e in entries if e.shadow is None]
        failed = False
        for start in range(0, len(to_write), SPILL_BATCH):
            if time.monotonic() > deadline or failed:
                break
            batch = []
            for entry in to_write[start : start + SPILL_BATCH]:
                if not dst.alloc.can_allocate(entry.used_len):
                    continue  # no room of its size; a page of another size may still fit
                grant = dst.alloc.allocate(entry.used_len)
                try:
                    await self.prepare(grant)
                except OSError as exc:  # the slot is free again (prepare)
                    log.error("spill: laying out an NVMe chunk failed (%s)", exc)
                    failed = True
                    break
                view = self.table.tiers[entry.tier].medium.view(entry.slot, entry.used_len)
                batch.append((grant.offset, view))
            if batch:
                written = await self._write_batch(batch)
                spilled += written
                # the disk is full or failing: stop, and let the shutdown finish cleanly
                failed = failed or written < len(batch)
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
