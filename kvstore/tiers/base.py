"""The medium interface: what every tier implements, and all the manager may ask of one.

A medium is `num_chunks` chunks of `chunk_bytes` each, one byte range addressed by offset. Which slots a
chunk holds (one size class per chunk: kvstore/tiers/slots.py) is the manager's bookkeeping; the medium
moves bytes at the offsets it is given and knows nothing of keys, policy or placement (kvstore/manager
does that). Only a persistent medium learns a chunk's class (`format`, `invalidate`), because recovery
must find the page headers in it again. A new medium (a remote tier, CXL memory, a GPU-direct path) is
one new subclass: the manager moves bytes between any two media through this interface and never
switches on which media they are.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence

from kvstore.names import TierKind
from kvstore.pageformat import PageHeader

__all__ = ["Absent", "Into", "Medium", "SlotIO", "SlotRead", "TierKind"]

SlotIO = tuple[int, memoryview]  # (slot offset, host buffer) of one transfer in a batch
Into = memoryview | Sequence[memoryview]  # where a read lands: one buffer, or a scatter list (`scatter_reads`)
SlotRead = tuple[int, Into]  # (slot offset, destination) of one read in a batch


class Medium(abc.ABC):
    """One storage medium: `num_chunks` chunks of `chunk_bytes`, addressed by byte offset.

    Invariants every implementation keeps:
    - a transfer touches only the bytes it names: `read(offset, into)` copies `len(into)` bytes from
      `offset` into host memory, and `write(offset, src)` copies `src` to `offset`; both return only once
      the copy is complete and, for a `persistent` medium, durable (a restarted node may find it);
    - offsets, transfer lengths and host buffers are multiples of 4096 / 4 KiB aligned (slots are, and
      DRAM slots and the manager's bounce buffers are aligned), so a medium may use O_DIRECT or DMA
      without a bounce copy;
    - methods other than `view` may block: the manager calls them from its I/O pool, never on its event
      loop, and never runs two transfers on one slot at once.
    """

    kind: TierKind
    chunk_bytes: int  # the largest slot; a chunk holds slots of one size (kvstore/tiers/slots.py)
    num_chunks: int
    available: bool = True  # usable on this host; an unavailable medium has no chunks
    persistent: bool = False  # survives a restart: `scan` finds its pages, `invalidate` erases them
    host_memory: bool = False  # slots are host memory: `view` gives them without a copy
    detail: str = ""  # one line for operators (kvctl stats): what backs it, or why it is unavailable
    queue_depth: int = 1  # reads `read_many` keeps in flight at once: a batched Get reads this far ahead
    # `read`/`read_many` also take a list of buffers for one slot, filled in order with one transfer
    # (each part 4 KiB aligned, a multiple of 4096 long): a page's payload lands straight in its final
    # place (a caller's buffer) and only the header block in a bounce buffer.
    scatter_reads: bool = False
    scan_failures: int = 0  # header blocks that failed their check in the last `scan` (checksum failures)
    # After `scan`: chunk index -> the slot size its bytes are laid out for (from the page header or chunk
    # marker at its start), for every chunk that holds one; recovery rebuilds the allocator from it.
    chunk_classes: dict[int, int]

    @property
    def capacity_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes if self.available else 0

    def check_range(self, offset: int, nbytes: int) -> None:
        """IndexError unless [offset, offset + nbytes) lies inside the medium."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.num_chunks * self.chunk_bytes:
            raise IndexError(f"{self.kind.label} range [{offset}, +{nbytes}) is outside the medium")

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A writable view of `nbytes` at `offset`, for `host_memory` media only (zero-copy reads, and where
        Put streams land); other media move bytes only through read/write."""
        raise TypeError(f"{self.kind.label} slots are not host memory; use read/write")

    def device_pointer(self, offset: int) -> int | None:
        """The device address of the byte at `offset`, for media in accelerator memory (HBM), so a data
        plane that can send device memory sends it from there; None for every other medium."""
        return None

    def slot_location(self, offset: int) -> tuple[str, int] | None:
        """(file path, byte offset) of a slot, for file-backed media (NVMe): for tools and fault tests that
        reach a page's bytes on disk; None for every other medium."""
        return None

    @abc.abstractmethod
    def read(self, offset: int, into: memoryview) -> None:
        """Copy len(into) bytes from `offset` into host memory."""

    @abc.abstractmethod
    def write(self, offset: int, src: memoryview) -> None:
        """Copy `src` to `offset`; durable on return for a persistent medium."""

    def read_many(self, ops: Sequence[SlotRead], done: Callable[[int], None] | None = None) -> None:
        """Several reads; a medium that can keep I/Os in flight overrides this. All are complete on return.
        `done(i)`, when given, is called (from whichever thread did it) as soon as ops[i] completed, so a
        caller can use the first pages while the rest are in flight; every `done` call has returned
        before `read_many` does (a caller may rely on what `done` did once it returns). A destination
        is one buffer, or a list of buffers only for a medium with `scatter_reads`."""
        for i, (offset, into) in enumerate(ops):
            self.read(offset, into)
            if done is not None:
                done(i)

    def write_many(self, ops: Sequence[SlotIO]) -> None:
        """Several writes (all complete, and durable where persistent, on return); a medium overrides this
        to overlap them or to make them durable together. Each write is one whole slot (its length is
        the slot's size), so a persistent medium knows the class of the chunk it writes into."""
        for offset, src in ops:
            self.write(offset, src)

    def needs_format(self, slot_bytes: int) -> bool:
        """Whether a chunk taken for slots of `slot_bytes` from another size must be laid out (`format`) before a
        slot of it is written. Never on a volatile medium."""
        return False

    def format(self, chunk_offset: int, slot_bytes: int) -> None:
        """A free chunk is about to hold slots of `slot_bytes` after holding another size (or bytes of
        unknown layout): on a persistent medium, durably erase every header position of the new size in it
        and mark the chunk's class, so a restart reads no old bytes as a page header (`Grant.reformat`).
        Nothing to do on a volatile medium."""
        return None

    def invalidate(self, offset: int, slot_bytes: int) -> None:
        """Make sure a restart never finds a page in the slot of `slot_bytes` at `offset` (durably, on a
        persistent medium; the chunk keeps its class)."""
        return None  # a volatile medium forgets everything on restart anyway

    def scan(self) -> Iterator[tuple[int, PageHeader]]:
        """(offset, header) of every slot holding a valid page header: what a restart recovers; fills
        `chunk_classes`. Header blocks that fail their check are skipped and counted in `scan_failures`."""
        self.chunk_classes = {}
        return iter(())

    def close(self) -> None:
        """Release the medium's resources; nothing may be called afterwards."""
        return None  # nothing to release by default


class Absent(Medium):
    """A tier this node does not have (no NVMe path configured, say): no slots, and the reason."""

    def __init__(self, kind: TierKind, chunk_bytes: int, reason: str) -> None:
        self.kind = kind
        self.chunk_bytes = chunk_bytes
        self.num_chunks = 0
        self.chunk_classes = {}
        self.available = False
        self.detail = reason

    def read(self, offset: int, into: memoryview) -> None:
        raise IndexError(f"{self.kind.label} tier is absent: {self.detail}")

    def write(self, offset: int, src: memoryview) -> None:
        raise IndexError(f"{self.kind.label} tier is absent: {self.detail}")
