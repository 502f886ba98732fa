"""DRAM tier: one preallocated anonymous mmap cut into fixed-size slots."""

from __future__ import annotations

import contextlib
import logging
import mmap

from kvstore.names import TierKind
from kvstore.pointers import buffer_address
from kvstore.tiers.base import Medium

log = logging.getLogger(__name__)


class DramTier(Medium):
    """`num_slots` slots of `slot_bytes` in one mapping; slot i starts at i * slot_bytes.

    Invariant: the mapping is page aligned and slot_bytes is a multiple of 4096, so every slot start is
    O_DIRECT aligned and can be the buffer of an NVMe read or write without a bounce copy. When CUDA is
    present the slab is registered (pinned) so host<->device copies run at full PCIe speed.
    """

    kind = TierKind.DRAM
    host_memory = True

    def __init__(self, capacity_bytes: int, slot_bytes: int) -> None:
        if slot_bytes <= 0 or slot_bytes % 4096:
            raise ValueError("slot_bytes must be a positive multiple of 4096")
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        size = max(self.num_slots * slot_bytes, mmap.PAGESIZE)
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._map)
        self.pinned = False
        self.detail = "anonymous mmap slab"

    def view(self, slot: int) -> memoryview:
        """Writable view of a whole slot (header block + payload area)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"DRAM slot {slot} out of range")
        start = slot * self.slot_bytes
        return self._view[start : start + self.slot_bytes]

    def read(self, slot: int, into: memoryview) -> None:
        into[:] = self.view(slot)[: len(into)]

    def write(self, slot: int, src: memoryview) -> None:
        self.view(slot)[: len(src)] = src

    def try_pin(self) -> None:
        """Page-lock the slab with CUDA when available (best effort; logged, never fatal)."""
        try:
            import cupy

            if not cupy.cuda.is_available() or self.num_slots == 0:
                return
            cupy.cuda.runtime.hostRegister(buffer_address(self._map), len(self._map), 0)
            self.pinned = True
            self.detail = "anonymous mmap slab, CUDA-pinned"
        except Exception as exc:
            log.info("DRAM slab not pinned: %s", exc)

    def close(self) -> None:
        self._view.release()
        # A slot view may outlive the node's last request for a moment (the frame of a cancelled task):
        # then the mapping is unmapped with its last view instead of now.
        with contextlib.suppress(BufferError):
            self._map.close()


class BouncePool:
    """Reusable page-aligned host buffers of one size, for reads that cannot land in a DRAM slot
    (NVMe or HBM pages served without promotion). Reuse matters: a fresh mapping costs a page fault
    and a zeroed page per 4 KiB on first touch. Keeps at most `keep` idle buffers."""

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self.keep = keep
        self._idle: list[mmap.mmap] = []

    def take(self) -> mmap.mmap:
        return self._idle.pop() if self._idle else mmap.mmap(-1, self.size)

    def give(self, buf: mmap.mmap) -> None:
        """Return a buffer; every view of it must have been released."""
        if len(self._idle) < self.keep:
            self._idle.append(buf)
            return
        # A finished I/O work item may still hold a view for a moment; GC closes the buffer later.
        with contextlib.suppress(BufferError):
            buf.close()

    def close(self) -> None:
        for buf in self._idle:
            # A finished I/O work item may still hold a view for a moment (as in `give`): GC closes it later.
            with contextlib.suppress(BufferError):
                buf.close()
        self._idle.clear()
