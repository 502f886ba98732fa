"""Slots of every page size in one medium: size classes over equal chunks (pure bookkeeping, no I/O).

A medium's space is `num_chunks` chunks of `chunk_bytes` each (the largest slot the node takes: a 4 KiB
header block plus `max_page_bytes`, rounded to 4 KiB). A chunk is either free or holds slots of one size,
its *class*: a page's slot is its own size, `slot_bytes_for(payload)` (header plus payload rounded to
4 KiB), and a chunk of class `s` holds `chunk_bytes // s` of them, back to back from its start. So a
64 KiB page takes 68 KiB and a 2 MiB page a whole chunk of a node started with `--max-page-bytes 2MiB`,
side by side in one budget (DESIGN.md §5.3).

Why chunks of one class (a slab allocator) and not free extents of any length:
- recovery (NVMe) must find every page header without ever reading a client's payload as one. In a chunk
  of class `s` the headers are at `j * s` and nowhere else, and the class is written by the node at the
  chunk's start (a page header says its length; a free first slot holds a chunk marker:
  kvstore/tiers/nvme_meta.py), so the grid comes from bytes only the node writes;
- fragmentation is bounded without compaction: a chunk wastes less than one of its slots at its end
  (`chunk_bytes % s`), so a page costs at most (n + 1) / n of its slot where n slots fit a chunk (pages
  of up to an eighth of the largest: at most 12.5 % more; pages of more than half of it: a chunk each);
  free room is either free slots of a class (any page of that size takes them) or whole free chunks (any
  class takes them); a chunk whose last slot is freed is free again, whatever its class was;
- room moves between classes a chunk at a time: to give a class a chunk, the manager empties one
  (kvstore/manager/placement.py), so eviction frees at most one chunk more than the bytes asked for.

Query/command pairs: `can_allocate(n)` / `allocate(n)`; `is_allocated` / `free`; `slots_in` / `hold`.
"""

from __future__ import annotations

from typing import NamedTuple

ALIGN = 4096  # every slot starts and ends on an O_DIRECT boundary


class Grant(NamedTuple):
    """A slot handed out: `offset` in the medium, `nbytes` long (its class). `reformat`: the slot's chunk was
    free and is taken for a class other than the one it last held (or held bytes of unknown layout), so a
    persistent medium must erase the chunk's old header positions before a slot of it is written
    (`Medium.format`); False when the chunk already holds this class, or held it last."""

    offset: int
    nbytes: int
    reformat: bool


class SizeClassAllocator:
    """Slots of any size (a multiple of 4096 up to `chunk_bytes`) in `num_chunks` equal chunks.

    Invariants:
    - chunk i spans [i * chunk_bytes, (i + 1) * chunk_bytes); it is free (class 0) or of one class s, and
      then its slots are [i * chunk_bytes + j * s, + s) for j < chunk_bytes // s: slots never overlap, and
      every slot's offset and size are multiples of 4096;
    - every slot is free or allocated, never both; a chunk of a class has at least one allocated slot: the
      free of its last one makes the chunk free (it remembers the class, see `Grant.reformat`);
    - `used_bytes` is the sum of the allocated slots' sizes, `used_count` their number;
    - a held chunk (`hold`: being emptied for another class) hands out no slot until `release`;
    - a slot comes from a chunk of its class with room (the lowest free slot of it), else from a free chunk,
      one that held the same class first; among chunks, the one most recently offered (freed), as a free list
      of equal slots does (recently freed memory is warm), and chunk 0 first on a fresh medium: pages fill a
      file front to back, and adjacent pages of a batch are often adjacent on the medium.
    Freeing a slot that is not allocated, or claiming one that is not free, raises instead of corrupting.
    """

    __slots__ = (
        "_avail_free",
        "_avail_slots",
        "_class",
        "_count",
        "_free",
        "_held",
        "_last",
        "_n_free",
        "_partial",
        "_slots",
        "_used",
        "chunk_bytes",
        "num_chunks",
        "slots_assigned",
        "used_bytes",
        "used_count",
    )

    def __init__(self, num_chunks: int, chunk_bytes: int) -> None:
        if num_chunks < 0:
            raise ValueError("num_chunks must be >= 0")
        if chunk_bytes <= 0 or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, got {chunk_bytes}")
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        self._class = [0] * num_chunks  # slot size of each chunk; 0: free
        self._last = [0] * num_chunks  # the class a free chunk's bytes are laid out for; 0: unknown
        self._used = [0] * num_chunks  # bitmask of allocated slots per chunk
        self._count = [0] * num_chunks  # allocated slots per chunk
        self._slots = [0] * num_chunks  # slots per chunk (chunk_bytes // class); 0 while free
        self._held: set[int] = set()
        # Stacks with membership (an index is pushed once; popped when found stale): chunks of a class with a
        # free slot, and free chunks by the class they held last (0: none known).
        self._partial: dict[int, _Stack] = {}
        self._free: dict[int, _Stack] = {0: _Stack(range(num_chunks - 1, -1, -1))}  # chunk 0 on top
        self._n_free = num_chunks
        # What can be handed out now, kept as counts so the queries are O(1): free chunks not held, and per
        # size the free slots of its chunks not held.
        self._avail_free = num_chunks
        self._avail_slots: dict[int, int] = {}
        self.used_bytes = 0
        self.used_count = 0
        self.slots_assigned = 0  # slots of the chunks that hold a class (allocated or not)

    # -- queries

    @property
    def capacity_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    @property
    def free_chunks(self) -> int:
        """Chunks of no class (held ones included)."""
        return self._n_free

    @property
    def free_slots(self) -> int:
        """Unallocated slots in chunks that hold a class (room for pages of those sizes only)."""
        return self.slots_assigned - self.used_count

    def check_size(self, nbytes: int) -> None:
        if nbytes <= 0 or nbytes % ALIGN or nbytes > self.chunk_bytes:
            raise ValueError(f"slot size {nbytes} is not a multiple of {ALIGN} in (0, {self.chunk_bytes}]")

    def can_allocate(self, nbytes: int) -> bool:
        """Whether `allocate(nbytes)` would succeed now (a free slot of that class, or a free chunk). O(1)."""
        if nbytes <= 0 or nbytes % ALIGN or nbytes > self.chunk_bytes:
            self.check_size(nbytes)  # raises, naming the size
        return self._avail_free > 0 or self._avail_slots.get(nbytes, 0) > 0

    def has_free_slot(self, nbytes: int) -> bool:
        """Whether a chunk already of size `nbytes` has a free slot (no free chunk needed). O(1)."""
        self.check_size(nbytes)
        return self._avail_slots.get(nbytes, 0) > 0

    def chunk_of(self, offset: int) -> int:
        return offset // self.chunk_bytes

    def class_of(self, chunk: int) -> int:
        """The slot size chunk `chunk` holds; 0 when it is free."""
        return self._class[chunk]

    def is_allocated(self, offset: int) -> bool:
        chunk, j = self._locate(offset)
        return j >= 0 and bool(self._used[chunk] >> j & 1)

    def slots_in(self, chunk: int) -> list[int]:
        """Offsets of the allocated slots of a chunk, in order."""
        s, base, mask = self._class[chunk], chunk * self.chunk_bytes, self._used[chunk]
        return [base + j * s for j in range(self._slots[chunk]) if mask >> j & 1]

    def held(self, chunk: int) -> bool:
        return chunk in self._held

    # -- commands

    def allocate(self, nbytes: int) -> Grant:
        """A free slot of size `nbytes`; MemoryError when there is none (check `can_allocate` first)."""
        # NOTE: written out rather than through helpers: it runs for every page a node stores or moves.
        if nbytes <= 0 or nbytes % ALIGN or nbytes > self.chunk_bytes:
            self.check_size(nbytes)  # raises, naming the size
        chunk = self._partial_chunk(nbytes) if self._avail_slots.get(nbytes, 0) else None
        reformat = False
        if chunk is None:
            chunk = self._free_chunk(nbytes) if self._avail_free else None
            if chunk is None:
                raise MemoryError(f"no free slot of {nbytes} B and no free chunk")
            reformat = self._last[chunk] != nbytes
            self._assign(chunk, nbytes)
        mask = self._used[chunk]
        j = (~mask & (mask + 1)).bit_length() - 1  # the lowest free slot
        if chunk not in self._held:
            self._avail_slots[nbytes] -= 1  # the size has its count: _assign made it
        self._used[chunk] = mask | 1 << j
        self._count[chunk] += 1
        self.used_count += 1
        self.used_bytes += nbytes
        return Grant(chunk * self.chunk_bytes + j * nbytes, nbytes, reformat)

    def free(self, offset: int) -> None:
        """Free an allocated slot; the chunk becomes free with its last slot."""
        chunk = offset // self.chunk_bytes
        s = self._class[chunk] if 0 <= chunk < self.num_chunks else 0
        rel = offset - chunk * self.chunk_bytes
        if not s or rel % s or not self._used[chunk] >> rel // s & 1:
            raise ValueError(f"slot at offset {offset} is not allocated")
        n = self._slots[chunk]
        count = self._count[chunk] = self._count[chunk] - 1
        self._used[chunk] &= ~(1 << rel // s)
        self.used_count -= 1
        self.used_bytes -= s
        held = chunk in self._held
        if count == 0:  # the chunk is free: its other free slots leave the size with it
            if not held:
                self._avail_slots[s] += 1 - n
                self._avail_free += 1
            self.slots_assigned -= n
            self._class[chunk] = self._slots[chunk] = 0
            self._last[chunk] = s
            self._n_free += 1
            if not held:
                _stack(self._free, s).push(chunk)
        elif not held:
            self._avail_slots[s] += 1
            if count == n - 1:  # it was full: it has room again
                _stack(self._partial, s).push(chunk)

    def claim(self, offset: int, nbytes: int) -> None:
        """Mark a specific free slot of size `nbytes` allocated (recovery re-adopting durable pages, a clean
        demotion onto a page's own durable copy): its chunk must be free or of that class."""
        self.check_size(nbytes)
        chunk = offset // self.chunk_bytes
        if not 0 <= chunk < self.num_chunks or (offset - chunk * self.chunk_bytes) % nbytes:
            raise ValueError(f"offset {offset} is not a slot of {nbytes} B")
        j = (offset - chunk * self.chunk_bytes) // nbytes
        if j >= self.chunk_bytes // nbytes:
            raise ValueError(f"offset {offset} is not a slot of {nbytes} B")
        if self._class[chunk] == 0:
            self._assign(chunk, nbytes)
        elif self._class[chunk] != nbytes:
            raise ValueError(f"slot at offset {offset} is in a chunk of {self._class[chunk]} B slots, not {nbytes} B")
        if self._used[chunk] >> j & 1:
            raise ValueError(f"slot at offset {offset} is not free")
        self._take(chunk, j)

    def know(self, chunk: int, nbytes: int) -> None:
        """A free chunk's bytes are laid out for class `nbytes` (recovery read its marker): taking it for that
        class again needs no reformat."""
        self.check_size(nbytes)
        if self._class[chunk] == 0:
            self._last[chunk] = nbytes
            self._offer_free(chunk)

    def hold(self, chunk: int) -> None:
        """Hand out no slot of this chunk until `release` (it is being emptied for another class)."""
        if chunk in self._held:
            return
        self._held.add(chunk)
        s = self._class[chunk]
        if s:
            self._add_avail(s, self._count[chunk] - self._slots[chunk])
        else:
            self._avail_free -= 1

    def release(self, chunk: int) -> None:
        """End a `hold`: the chunk's free room (or the whole chunk, if it was emptied) is offered again."""
        if chunk not in self._held:
            return
        self._held.discard(chunk)
        s = self._class[chunk]
        if s:
            self._add_avail(s, self._slots[chunk] - self._count[chunk])
        else:
            self._avail_free += 1
        if self._class[chunk] == 0:
            self._offer_free(chunk)
        elif self._count[chunk] < self._slots[chunk]:
            _stack(self._partial, self._class[chunk]).push(chunk)

    # -- internals

    def _locate(self, offset: int) -> tuple[int, int]:
        """(chunk, slot index) of an offset; index -1 when it is no slot start of an assigned chunk."""
        chunk = offset // self.chunk_bytes if offset >= 0 else -1
        if not 0 <= chunk < self.num_chunks or self._class[chunk] == 0:
            return max(chunk, 0), -1
        rel = offset - chunk * self.chunk_bytes
        s = self._class[chunk]
        if rel % s or rel // s >= self._slots[chunk]:
            return chunk, -1
        return chunk, rel // s

    def _assign(self, chunk: int, nbytes: int) -> None:
        self._class[chunk] = nbytes
        self._slots[chunk] = self.chunk_bytes // nbytes
        self._n_free -= 1
        self.slots_assigned += self._slots[chunk]
        if chunk not in self._held:
            self._avail_free -= 1
            self._add_avail(nbytes, self._slots[chunk])
            if self._slots[chunk] > 1:  # NOTE: a chunk of one slot is full with the take that follows
                _stack(self._partial, nbytes).push(chunk)

    def _add_avail(self, nbytes: int, k: int) -> None:
        self._avail_slots[nbytes] = self._avail_slots.get(nbytes, 0) + k

    def _take(self, chunk: int, j: int) -> None:
        if chunk not in self._held:
            self._avail_slots[self._class[chunk]] -= 1  # NOTE: the size has its count: _assign made it
        self._used[chunk] |= 1 << j
        self._count[chunk] += 1
        self.used_count += 1
        self.used_bytes += self._class[chunk]

    def _offer_free(self, chunk: int) -> None:
        if chunk not in self._held:
            _stack(self._free, self._last[chunk]).push(chunk)

    def _partial_chunk(self, nbytes: int) -> int | None:
        """The top chunk of size `nbytes` with a free slot, not held (stale entries dropped on the way)."""
        st = self._partial.get(nbytes)
        if st is None:
            return None
        items, cls, count, slots, held = st.items, self._class, self._count, self._slots, self._held
        while items:  # NOTE: inlined, not a predicate per entry: this runs on every allocation
            c = items[-1]
            if cls[c] == nbytes and count[c] < slots[c] and c not in held:
                return c
            st.drop_top()
        return None

    def _free_chunk(self, nbytes: int) -> int | None:
        """The top free chunk not held: one that last held size `nbytes` first, then one of no known layout,
        then any (a chunk of another size: laid out anew)."""
        chunk = self._top_free(nbytes)
        if chunk is None:
            chunk = self._top_free(0)
        for last in list(self._free) if chunk is None else ():  # few sizes: the loop is short
            chunk = self._top_free(last)
            if chunk is not None:
                break
        return chunk

    def _top_free(self, last: int) -> int | None:
        """The top chunk of the free stack of chunks that last held size `last`, not held."""
        st = self._free.get(last)
        if st is None:
            return None
        items, cls, lasts, held = st.items, self._class, self._last, self._held
        while items:
            c = items[-1]
            if cls[c] == 0 and lasts[c] == last and c not in held:
                return c
            st.drop_top()
        return None


def _stack(stacks: dict[int, _Stack], key: int) -> _Stack:
    st = stacks.get(key)
    if st is None:
        st = stacks[key] = _Stack()
    return st


class _Stack:
    """Chunk indices, most recently offered on top (`items[-1]`), each present at most once; entries that
    stopped qualifying are dropped when they reach the top (lazy deletion, `drop_top`), so every operation is
    O(1) amortised."""

    __slots__ = ("_in", "items")

    def __init__(self, items: range | None = None) -> None:
        self.items: list[int] = list(items) if items is not None else []
        self._in: set[int] = set(self.items)

    def push(self, i: int) -> None:
        if i not in self._in:
            self._in.add(i)
            self.items.append(i)

    def drop_top(self) -> None:
        self._in.discard(self.items.pop())
