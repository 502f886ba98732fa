"""Receive memory for a plain `get`: pre-faulted and reused, with a lifetime rule nobody can get wrong.

Why (measured, benchmarks/RESULTS.md "read path"): a fresh `bytearray` per received page costs a zeroing pass
and, for MiB pages, a page fault per 4 KiB on every call (glibc hands large blocks straight from mmap and
back). The pool keeps page-sized blocks of a few large mappings, faulted in once when mapped (MAP_POPULATE),
and hands them out again. The mappings are the client's SharedBuffers (sealed memfds, segments.py), so on the
node's host the node copies a page straight into its block: a plain `get` costs what `get_into` does.

The lifetime rule: a page `get` returned is yours as long as anything refers to it — the memoryview, a
slice of it, a numpy array or torch tensor made from it without a copy. Its block goes back to the pool
only when the last such reference is gone (CPython frees it then, on the spot), so its bytes can never
change under a reader, and a block is never handed to two callers at once. Nothing to release by hand.

Memory lent to the node: on the same-host plane the node itself writes a get's pages into these blocks and
copies a put's pages out of them. A block is lent for as long as a request naming it may still be in the node's
hands, and it goes back to the free list only after the node said it is done with it (its reply), or the
connection that carried the request was closed by the node after a hang-up (the node closes only once its work
on the request has ended): a cancelled or timed-out call never returns memory the node may still touch
(kvstore/client/planes/shm.py; DESIGN.md §8). A put's blocks are lent by holding their views; a get's
reservation by `Reservation.hold`, which defers the return of its unclaimed blocks until every hold is released.

Invariants: a block is in exactly one place: the free list of its arena, held by one open or held Reservation
(a call in flight: the same-host plane reserves a block per hash and makes views only of the pages that came
back), or out (owned by the one ndarray a `take` or a claim made, whose finalizer returns it); a mapping is
unmapped only when all its blocks are free, at close or when more than `keep_bytes` are free and a new mapping
would be needed.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from kvstore.client.planes.segments import Placed, SharedBuffers
from kvstore.pageformat import align_up

ARENA_BYTES = 64 << 20  # blocks are carved from mappings of at least this size (or one block, if larger)
KEEP_BYTES = 1 << 30  # free memory a pool keeps mapped for the next calls; beyond it, empty arenas go back


class _Arena:
    """One registered shared buffer cut into blocks of one size class."""

    def __init__(self, registry: SharedBuffers, block: int, count: int) -> None:
        self.block = block
        self.buffer = registry.allocate(block * count)
        self.free = list(range(count - 1, -1, -1))  # block indices; pop() hands out the lowest first
        self.count = count

    def close(self) -> bool:
        """Give the memory back; False while a block of it is still referenced (then nothing changes)."""
        if len(self.free) != self.count:
            return False
        self.buffer.close()
        return True


class ReceivePool:
    """Pooled receive blocks (see the module docstring). Thread-safe."""

    def __init__(self, registry: SharedBuffers | None = None, keep_bytes: int = KEEP_BYTES) -> None:
        self.registry = SharedBuffers() if registry is None else registry
        self.keep_bytes = keep_bytes
        self._arenas: dict[int, list[_Arena]] = defaultdict(list)
        # NOTE: reentrant: a block's finalizer (`_give`) runs wherever the garbage collector frees its array,
        # which may be inside `take` on this very thread (an allocation there can start a collection).
        self._lock = threading.RLock()
        self._free_bytes = 0

    def take(self, nbytes: int) -> memoryview:
        """A writable, C-contiguous uint8 view of `nbytes` bytes, recycled when nothing refers to it any more.
        Its initial contents are undefined (a received page overwrites all of it)."""
        ((arena, index),) = self._blocks(nbytes, 1)
        return self._view(arena, index, nbytes)

    def reserve(self, nbytes: int, count: int) -> Reservation:
        """`count` blocks of `nbytes` held for one call: where each lies is known at once (`placed`, sent to the
        node), a view is made only for the blocks `claim`ed (the pages that came back), and the others go back
        to the pool when the reservation closes (a get whose stored prefix ended early pays for no view)."""
        return Reservation(self, nbytes, self._blocks(nbytes, count))

    def _blocks(self, nbytes: int, count: int) -> list[tuple[_Arena, int]]:
        """`count` free blocks of the size class of `nbytes`, taken off their free lists (mapping arenas as
        needed); on failure (no memory for another arena) none is taken."""
        block = align_up(max(nbytes, 1))
        held: list[tuple[_Arena, int]] = []
        with self._lock:
            arenas = self._arenas[block]
            try:
                while len(held) < count:
                    for arena in arenas:
                        if arena.free:
                            break
                    else:
                        if self._free_bytes > self.keep_bytes:
                            self._trim()
                        arena = _Arena(self.registry, block, max(1, ARENA_BYTES // block))
                        arenas.append(arena)
                        self._free_bytes += arena.count * block
                    free = arena.free
                    k = min(count - len(held), len(free))
                    held += [(arena, free.pop()) for _ in range(k)]
                    self._free_bytes -= k * block
            except BaseException:  # no memory for another arena: the blocks taken so far go back
                self._give_many(held)
                raise
        return held

    def _view(self, arena: _Arena, index: int, nbytes: int) -> memoryview:
        """Block `index` of `arena` as a view of `nbytes`, owned by one ndarray whose finalizer gives it back."""
        array = np.frombuffer(arena.buffer.map, dtype=np.uint8, count=nbytes, offset=index * arena.block)
        weakref.finalize(array, self._give, arena, index)
        return memoryview(array)

    def _give(self, arena: _Arena, index: int) -> None:
        with self._lock:
            arena.free.append(index)
            self._free_bytes += arena.block

    def _give_many(self, blocks: list[tuple[_Arena, int]]) -> None:
        with self._lock:
            for arena, index in blocks:
                arena.free.append(index)
                self._free_bytes += arena.block

    def _trim(self) -> None:
        """Unmap arenas whose blocks are all free (caller holds the lock)."""
        for block, arenas in self._arenas.items():
            for a in list(arenas):
                if a.close():
                    arenas.remove(a)
                    self._free_bytes -= a.count * block

    @property
    def free_bytes(self) -> int:
        """Bytes of mapped blocks free for the next call (neither out to a caller nor lent to a node)."""
        with self._lock:
            return self._free_bytes

    @property
    def mapped_bytes(self) -> int:
        with self._lock:
            return sum(a.count * a.block for arenas in self._arenas.values() for a in arenas)

    def close(self) -> None:
        """Unmap every arena with no block out; the others go with their last block's user."""
        with self._lock:
            self._trim()


class Reservation:
    """Blocks of a ReceivePool held for one call (see ReceivePool.reserve). Invariant: each block is either
    still held here (returned by `close`) or claimed (owned by the one ndarray `claim` made, whose finalizer
    returns it): never both, never lost. Use it as a context manager."""

    def __init__(self, pool: ReceivePool, nbytes: int, blocks: list[tuple[_Arena, int]]) -> None:
        self._pool, self._nbytes, self._blocks = pool, nbytes, blocks
        self._claimed: set[int] = set()
        self._holds = 0  # requests naming these blocks the node may still be working on
        self._closed = False
        self.placed = [Placed(a.buffer, i * a.block, nbytes) for a, i in blocks]

    def hold(self) -> Callable[[], None]:
        """Lend the blocks to a request: until the function returned is called (once), `close` keeps the
        unclaimed blocks out of the pool (they go back when the last hold is released after close)."""
        with self._pool._lock:
            self._holds += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._pool._lock:
                if released:
                    return
                released = True
                self._holds -= 1
                give = self._closed and self._holds == 0
            if give:
                self._give_unclaimed()

        return release

    def claim(self, i: int) -> memoryview:
        """Block i as a writable uint8 view, recycled when nothing refers to it any more (claimed once)."""
        if i in self._claimed:
            raise ValueError(f"block {i} of this reservation is already claimed")
        arena, index = self._blocks[i]
        view = self._pool._view(arena, index, self._nbytes)
        self._claimed.add(i)
        return view

    def close(self) -> None:
        """Give every block not claimed back to the pool (idempotent): now, or once the last hold is released."""
        with self._pool._lock:
            self._closed = True
            give = self._holds == 0
        if give:
            self._give_unclaimed()

    def _give_unclaimed(self) -> None:
        unclaimed = [b for i, b in enumerate(self._blocks) if i not in self._claimed]
        self._claimed.update(range(len(self._blocks)))
        if unclaimed:
            self._pool._give_many(unclaimed)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
