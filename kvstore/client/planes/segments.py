"""Client memory the node can map: sealed memfds (`SharedBuffer`), a client's registry of them, and the
buffers a bundle put gathers its pages into, kept for the next one (`Staging`).

A `SharedBuffer` is staging memory the caller owns and keeps (what an engine keeps as its pinned staging
buffer): `get_into` has the node copy pages straight into views of it, `put_from` straight out of them, one
copy per page and none on the client. The client's receive pool (pool.py) is made of them too, so a plain
`get` on the node's host lands in place the same way. `SharedBuffers` maps any buffer the caller passes back
to (buffer, offset), so the same-host plane knows which registered memory a page goes to.

Why a sealed memfd: the node maps this memory and copies pages straight into it with memcpy. A mapping of
something that can shrink would kill the node with SIGBUS when it shrank mid-copy; F_SEAL_SHRINK and
F_SEAL_GROW make the size final, so the node can map it safely. The node gets the descriptor itself, passed
over its Unix socket (kvstore/wire/shm.py): it never opens a path of ours.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import itertools
import mmap
import os
import threading
from dataclasses import dataclass

from kvstore.pageformat import align_up
from kvstore.pointers import buffer_address

_IDS = itertools.count(1)  # buffer ids, unique in this process (the node keys registrations by them)


class SharedBuffer:
    """Staging memory the node can map: a sealed memfd of this process, owned by the caller until `close()`.

    `view` is its whole writable area (`nbytes`, page aligned); `pages(page_bytes, count)` cuts it into
    page-sized views on 4 KiB-aligned boundaries. Any contiguous part of it (a view, a slice of one, a numpy
    array over it) can be passed to `get_into` and `put_from` of the client that made it. Wrap it for tensors
    with `numpy.frombuffer(buf.view, ...)` or `torch.frombuffer(buf.view, ...)`.

    Invariant: while registered, its id, descriptor and address range do not change; `close()` unregisters it
    first, so no later call can name it. Views still held after close keep the memory mapped until released,
    but no transfer uses them any more.
    """

    def __init__(self, nbytes: int, registry: SharedBuffers) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes: a shared buffer needs at least 1 byte, got {nbytes}")
        self.nbytes = nbytes
        self.id = next(_IDS)
        self.size = align_up(nbytes)
        self.fd = os.memfd_create(f"kvstore-{os.getpid()}-{self.id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.map)[:nbytes]
        self.base = buffer_address(self.map)
        self._registry = registry
        registry.add(self)

    @property
    def closed(self) -> bool:
        return self._registry.get(self.base) is not self

    def pages(self, page_bytes: int, count: int | None = None) -> list[memoryview]:
        """`count` views of `page_bytes` each, at 4 KiB-aligned offsets (as many as fit when None)."""
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        stride = align_up(page_bytes)
        fits = (self.nbytes - page_bytes) // stride + 1 if self.nbytes >= page_bytes else 0
        if count is None:
            count = fits
        if count > fits:
            raise ValueError(f"count: {count} pages of {page_bytes} B do not fit in {self.nbytes} B (at most {fits})")
        return [self.view[i * stride : i * stride + page_bytes] for i in range(count)]

    def close(self) -> None:
        """Unregister, unmap (once no view is left) and close the memfd (idempotent)."""
        if self._registry.remove(self):
            self.view.release()
            with contextlib.suppress(BufferError):  # a caller still holds a view; the mapping goes with it
                self.map.close()
            os.close(self.fd)

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class Placed:
    """Where one caller buffer lies: in `buffer` at byte `offset`, `nbytes` long."""

    buffer: SharedBuffer
    offset: int
    nbytes: int


class SharedBuffers:
    """One client's registered buffers, found by address. Thread-safe.

    `locate` answers which registered buffer a caller's buffer lies in; it never touches the buffer's bytes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bases: list[int] = []  # sorted start addresses
        self._by_base: dict[int, SharedBuffer] = {}

    def allocate(self, nbytes: int) -> SharedBuffer:
        """A new registered staging buffer of `nbytes` (a sealed memfd)."""
        if not hasattr(os, "memfd_create"):
            raise ValueError("shared buffers need memfd_create (Linux)")
        return SharedBuffer(nbytes, self)

    def add(self, buf: SharedBuffer) -> None:
        with self._lock:
            bisect.insort(self._bases, buf.base)
            self._by_base[buf.base] = buf

    def get(self, base: int) -> SharedBuffer | None:
        with self._lock:
            return self._by_base.get(base)

    def remove(self, buf: SharedBuffer) -> bool:
        with self._lock:
            if self._by_base.get(buf.base) is not buf:
                return False
            del self._by_base[buf.base]
            self._bases.remove(buf.base)
            return True

    def close(self) -> None:
        with self._lock:
            bufs = list(self._by_base.values())
        for buf in bufs:
            buf.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._bases)

    def locate(self, addr: int, nbytes: int) -> Placed | None:
        """The registered buffer holding [addr, addr + nbytes) and the offset in it, or None when no registered
        buffer holds all of it."""
        with self._lock:
            i = bisect.bisect_right(self._bases, addr) - 1
            if i < 0:
                return None
            buf = self._by_base[self._bases[i]]
        start = addr - buf.base
        if start < 0 or start + nbytes > buf.nbytes:
            return None
        return Placed(buf, start, nbytes)


class Staging:
    """Registered memory a bundle put gathers its pages into, kept for the next put (registering a buffer with
    the same-host plane costs a round trip). Thread-safe. Invariant: a buffer is in the free list only while no
    call uses it; one whose call failed is closed instead (its memory may still be read by the node)."""

    KEEP = 4  # free buffers kept; more are closed

    def __init__(self, buffers: SharedBuffers) -> None:
        self._buffers = buffers
        self._free: list[SharedBuffer] = []
        self._lock = threading.Lock()

    def take(self, page_bytes: int, count: int) -> SharedBuffer:
        need = align_up(page_bytes) * count
        with self._lock:
            fits = [b for b in self._free if b.nbytes >= need]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self._free.remove(buf)
                return buf
        return self._buffers.allocate(need)

    def give(self, buf: SharedBuffer) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.nbytes)
            extra = self._free[: -self.KEEP] if len(self._free) > self.KEEP else []
            del self._free[: len(extra)]
        for b in extra:
            b.close()

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for b in free:
            b.close()
