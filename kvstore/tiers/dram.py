"""DRAM tier: one preallocated anonymous mmap cut into chunks (of slots of one size each)."""

from __future__ import annotations

import contextlib
import logging
import mmap

from kvstore.names import TierKind
from kvstore.pointers import buffer_address
from kvstore.tiers.base import Medium

log = logging.getLogger(__name__)


class DramMedium(Medium):
    """`num_chunks` chunks of `chunk_bytes` in one mapping; offset o is byte o of the mapping.

    Invariant: the mapping is page aligned and every slot offset and size is a multiple of 4096
    (kvstore/tiers/slots.py), so every slot start is O_DIRECT aligned and can be the buffer of an NVMe read
    or write without a bounce copy. When CUDA is present the slab is registered (pinned) so host<->device
    copies run at full PCIe speed.
    """

    kind = TierKind.DRAM
    host_memory = True

    def __init__(self, capacity_bytes: int, chunk_bytes: int) -> None:
        if chunk_bytes <= 0 or chunk_bytes % 4096:
            raise ValueError("chunk_bytes must be a positive multiple of 4096")
        self.chunk_bytes = chunk_bytes
        self.num_chunks = capacity_bytes // chunk_bytes
        self.chunk_classes = {}
        size = max(self.num_chunks * chunk_bytes, mmap.PAGESIZE)
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._map)
        self._size = self.num_chunks * chunk_bytes
        self.pinned = False
        self.detail = "anonymous mmap slab"
        if huge_pages(self._map):
            self.detail += ", transparent huge pages"

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Writable view of `nbytes` at `offset` (a slot, or part of one: its header block, its payload)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self._size:  # NOTE: inline, not check_range: hot
            self.check_range(offset, nbytes)  # raises, naming the range
        return self._view[offset : offset + nbytes]

    def read(self, offset: int, into: memoryview) -> None:
        into[:] = self.view(offset, len(into))

    def write(self, offset: int, src: memoryview) -> None:
        self.view(offset, len(src))[:] = src

    def try_pin(self) -> None:
        """Page-lock the slab with CUDA when available (best effort; logged, never fatal)."""
        try:
            import cupy

            if not cupy.cuda.is_available() or self.num_chunks == 0:
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


def huge_pages(m: mmap.mmap) -> bool:
    """Ask for transparent huge pages under `m` (best effort: False where the kernel or Python cannot).
    NOTE: a page copied or hashed out of a slot touches one TLB entry per 2 MiB instead of per 4 KiB: measured
    on a 2-vCPU EPYC VM (2026-11-29), XXH3 over a slab page ran 30-35 GB/s with huge pages against 20 with 4 KiB
    pages, and the copy into a caller's memory 5-25% faster."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or len(m) < (2 << 20):
        return False
    try:
        m.madvise(advice)
    except OSError:
        return False
    return True
