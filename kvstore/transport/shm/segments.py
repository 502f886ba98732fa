"""Client-owned shared-memory segments: the plane's scratch pool, and registered staging buffers.

Two kinds of segment, one file format (`kvstore.transport.shm`: MAGIC, nonce, then data):
- `SegmentPool`: the plane's own scratch segments for `get`/`put` (the client copies pages in and out);
- `SharedBuffer`: staging memory the caller owns and keeps (what an engine keeps as its pinned staging
  buffer). `get_into` has the node write pages straight into views of it, `put_from` has the node read
  pages straight out of them: one copy per page, no client-side copy at all. `SharedBuffers` is a
  client's registry of them: it maps any buffer the caller passes back to (segment, offset).

Segments are created 0600 with a fresh random name and nonce and unlinked on close; a pid in the name
lets `sweep_stale()` unlink the orphans of clients that died without closing.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import secrets
import threading
from dataclasses import dataclass

from kvstore.pageformat import ALIGN, align_up
from kvstore.transport.buffers import address_of
from kvstore.transport.shm import HEADER_BYTES, MAGIC, NONCE_BYTES, SHM_DIR, shm_available


class ClientSegment:
    """One segment owned by a client: created 0600 with a fresh name and nonce, unlinked on close."""

    def __init__(self, size: int) -> None:
        self.size = align_up(max(size, HEADER_BYTES + ALIGN))
        self.name = f"kvstore-{os.getpid()}-{secrets.token_hex(12)}"  # the pid lets sweep_stale() find orphans
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.path = SHM_DIR / self.name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self.map = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.map[: len(MAGIC) + NONCE_BYTES] = MAGIC + self.nonce
        self.view = memoryview(self.map)

    @property
    def data_bytes(self) -> int:
        return self.size - HEADER_BYTES

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        self.view.release()
        with contextlib.suppress(BufferError):  # a caller still holds a view; the mapping goes with it
            self.map.close()


def sweep_stale() -> int:
    """Unlink segments left by client processes that died without closing (SIGKILL, OOM): names carry
    the creator's pid, and a pid that no longer exists cannot be using its segment. Returns how many."""
    removed = 0
    try:
        names = [p.name for p in SHM_DIR.glob("kvstore-*-*")]
    except OSError:
        return 0
    for name in names:
        pid_text = name.split("-")[1]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                (SHM_DIR / name).unlink()
                removed += 1
        except PermissionError:
            pass  # alive, another user's
    return removed


class SegmentPool:
    """Segments for concurrent calls of one client: `acquire(n)` gives a segment with >= n data bytes
    that no other call is using; `release` returns it. Thread-safe. Creating a pool sweeps orphans."""

    def __init__(self) -> None:
        sweep_stale()
        self._free: list[ClientSegment] = []
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, data_bytes: int) -> ClientSegment:
        with self._lock:
            for i, seg in enumerate(self._free):
                if seg.data_bytes >= data_bytes:
                    return self._free.pop(i)
            small = self._free.pop() if self._free else None
        if small is not None:
            small.close()  # too small: replaced by a bigger one
        # Grow geometrically so a client whose batches creep up does not remap every call.
        return ClientSegment(HEADER_BYTES + max(data_bytes, 2 * (small.data_bytes if small else 0)))

    def release(self, seg: ClientSegment) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(seg)
                return
        seg.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for seg in free:
            seg.close()


# -- registered staging buffers (zero-copy get_into / put_from) ----------------------------------------


class SharedBuffer:
    """Staging memory in a registered shared-memory segment, owned by the caller until `close()`.

    `view` is its whole writable area (`nbytes`, starting 4 KiB aligned); `pages(page_bytes, count)`
    cuts it into page-sized views on 4 KiB-aligned boundaries. Any contiguous part of it (a view, a
    slice of one, a numpy array over it) can be passed to `get_into` and `put_from` of the client that
    made it. Wrap it for tensors with `numpy.frombuffer(buf.view, ...)` or `torch.frombuffer(buf.view, ...)`.

    Invariant: while registered, its segment's name, nonce and address range do not change; `close()`
    unregisters it before unlinking, so no later call can name it. Views still held after close keep
    the memory mapped (readable) until they are released, but no transfer uses them any more.
    """

    def __init__(self, nbytes: int, registry: SharedBuffers) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes: a shared buffer needs at least 1 byte, got {nbytes}")
        self.nbytes = nbytes
        # Data starts on its own 4 KiB page after the segment header, so views are page aligned.
        self.segment = ClientSegment(ALIGN + align_up(nbytes))
        self.data_offset = ALIGN
        self.view = self.segment.view[ALIGN : ALIGN + nbytes]
        self.base = address_of(self.segment.map)
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
        """Unregister and unlink the segment (idempotent)."""
        if self._registry.remove(self):
            self.view.release()
            self.segment.close()

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class Placed:
    """Where one caller buffer lies: in `buffer`'s segment at byte `offset`, `nbytes` long."""

    buffer: SharedBuffer
    offset: int
    nbytes: int


class SharedBuffers:
    """One client's registered staging buffers, found by address. Thread-safe.

    `locate` answers which registered segment a caller's buffer lies in; it never touches the buffer's
    bytes. Used by planes that can move pages straight into caller memory (shm today)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bases: list[int] = []  # sorted segment start addresses
        self._by_base: dict[int, SharedBuffer] = {}

    def allocate(self, nbytes: int) -> SharedBuffer:
        """A new registered staging buffer of `nbytes` (a /dev/shm segment)."""
        if not shm_available():
            raise ValueError("shared buffers need a writable /dev/shm on this host")
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
        """The registered buffer holding [addr, addr + nbytes) and the offset in its segment, or None
        when no registered buffer holds all of it."""
        with self._lock:
            i = bisect.bisect_right(self._bases, addr) - 1
            if i < 0:
                return None
            buf = self._by_base[self._bases[i]]
        start = addr - buf.base
        if start < buf.data_offset or start + nbytes > buf.data_offset + buf.nbytes:
            return None
        return Placed(buf, start, nbytes)
