"""The medium interface: what every tier implements, and all the manager may ask of one.

A medium is a fixed array of `num_slots` equal slots of `slot_bytes`, addressed by index. It moves
bytes in and out of slots and knows nothing of keys, policy or placement (kvstore/manager does that).
A new medium (a remote tier, CXL memory, a GPU-direct path) is one new subclass: the manager moves
bytes between any two media through this interface and never switches on which media they are.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence

from kvstore.names import TierKind
from kvstore.pageformat import PageHeader

__all__ = ["Absent", "Into", "Medium", "SlotIO", "SlotRead", "TierKind"]

SlotIO = tuple[int, memoryview]  # (slot, host buffer) of one transfer in a batch
Into = memoryview | Sequence[memoryview]  # where a read lands: one buffer, or a scatter list (`scatter_reads`)
SlotRead = tuple[int, Into]  # (slot, destination) of one read in a batch


class Medium(abc.ABC):
    """One storage medium cut into equal slots.

    Invariants every implementation keeps:
    - slot i is its own region; slots never overlap, and a transfer touches only the slot it names;
    - `read(slot, into)` copies `len(into)` bytes from the start of the slot into host memory, and
      `write(slot, src)` copies `src` to the start of the slot; both return only once the copy is complete
      and, for a `persistent` medium, durable (a restarted node may find it);
    - transfer lengths are multiples of 4096 and host buffers are 4 KiB aligned (DRAM slots and the
      manager's bounce buffers are), so a medium may use O_DIRECT or DMA without a bounce copy;
    - methods other than `view` may block: the manager calls them from its I/O pool, never on its event
      loop, and never runs two transfers on one slot at once.
    """

    kind: TierKind
    slot_bytes: int
    num_slots: int
    available: bool = True  # usable on this host; an unavailable medium has no slots
    persistent: bool = False  # survives a restart: `scan` finds its pages, `invalidate` erases them
    host_memory: bool = False  # slots are host memory: `view` gives them without a copy
    detail: str = ""  # one line for operators (kvctl stats): what backs it, or why it is unavailable
    queue_depth: int = 1  # reads `read_many` keeps in flight at once: a batched Get reads this far ahead
    # `read`/`read_many` also take a list of buffers for one slot, filled in order with one transfer
    # (each part 4 KiB aligned, a multiple of 4096 long): a page's payload lands straight in its final
    # place (a caller's buffer) and only the header block in a bounce buffer.
    scatter_reads: bool = False
    scan_failures: int = 0  # slots whose header failed its check in the last `scan` (checksum failures)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes if self.available else 0

    def view(self, slot: int) -> memoryview:
        """A writable view of a whole slot, for `host_memory` media only (zero-copy reads, and where Put
        streams land); other media move bytes only through read/write."""
        raise TypeError(f"{self.kind.label} slots are not host memory; use read/write")

    def device_pointer(self, slot: int) -> int | None:
        """The device address of a slot's first byte, for media in accelerator memory (HBM), so a data
        plane that can send device memory sends it from there; None for every other medium."""
        return None

    def slot_location(self, slot: int) -> tuple[str, int] | None:
        """(file path, byte offset) of a slot, for file-backed media (NVMe): for tools and fault tests that
        reach a page's bytes on disk; None for every other medium."""
        return None

    @abc.abstractmethod
    def read(self, slot: int, into: memoryview) -> None:
        """Copy len(into) bytes from the start of `slot` into host memory."""

    @abc.abstractmethod
    def write(self, slot: int, src: memoryview) -> None:
        """Copy `src` to the start of `slot`; durable on return for a persistent medium."""

    def read_many(self, ops: Sequence[SlotRead], done: Callable[[int], None] | None = None) -> None:
        """Several reads; a medium that can keep I/Os in flight overrides this. All are complete on return.
        `done(i)`, when given, is called (from whichever thread did it) as soon as ops[i] completed, so a
        caller can use the first pages while the rest are in flight; every `done` call has returned
        before `read_many` does (a caller may rely on what `done` did once it returns). A destination
        is one buffer, or a list of buffers only for a medium with `scatter_reads`."""
        for i, (slot, into) in enumerate(ops):
            self.read(slot, into)
            if done is not None:
                done(i)

    def write_many(self, ops: Sequence[SlotIO]) -> None:
        """Several writes (all complete, and durable where persistent, on return); a medium overrides this
        to overlap them or to make them durable together."""
        for slot, src in ops:
            self.write(slot, src)

    def invalidate(self, slot: int) -> None:
        """Make sure a restart never finds a page in `slot` (durably, on a persistent medium)."""
        return None  # a volatile medium forgets everything on restart anyway

    def scan(self) -> Iterator[tuple[int, PageHeader]]:
        """(slot, header) of every slot holding a valid page header: what a restart recovers. Slots holding
        a header that fails its check are skipped and counted in `scan_failures`."""
        return iter(())

    def close(self) -> None:
        """Release the medium's resources; nothing may be called afterwards."""
        return None  # nothing to release by default


class Absent(Medium):
    """A tier this node does not have (no NVMe path configured, say): no slots, and the reason."""

    def __init__(self, kind: TierKind, slot_bytes: int, reason: str) -> None:
        self.kind = kind
        self.slot_bytes = slot_bytes
        self.num_slots = 0
        self.available = False
        self.detail = reason

    def read(self, slot: int, into: memoryview) -> None:
        raise IndexError(f"{self.kind.label} tier is absent: {self.detail}")

    def write(self, slot: int, src: memoryview) -> None:
        raise IndexError(f"{self.kind.label} tier is absent: {self.detail}")
