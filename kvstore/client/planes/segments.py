"""Client-owned shared-memory segments: the plane's scratch pool, and registered staging buffers.

Two kinds of segment, one header format (`kvstore.wire.shm`: MAGIC, nonce, then data):
- `SegmentPool`: the plane's own scratch segments for `get`/`put` (named /dev/shm files the node reads
  and writes with pread/pwrite; the client copies pages in and out). Created 0600 with a fresh random
  name and nonce and unlinked on close; a pid in the name lets `sweep_stale()` unlink the orphans of
  clients that died without closing.
- `SharedBuffer`: staging memory the caller owns and keeps (what an engine keeps as its pinned staging
  buffer), a sealed memfd the node maps. `get_into` has the node copy pages straight into views of it,
  `put_from` straight out of them: one copy per page, none on the client. `SharedBuffers` is a client's
  registry of them: it maps any buffer the caller passes back to (buffer, offset).
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import mmap
import os
import re
import secrets
import stat
import threading
from dataclasses import dataclass

from kvstore.client.planes.buffers import address_of
from kvstore.pageformat import ALIGN, align_up
from kvstore.wire.shm import HEADER_BYTES, MAGIC, NONCE_BYTES, SHM_DIR

_PID_IN_NAME = re.compile(r"^kvstore-(\d{1,10})-")
_PID_MAX = 1 << 22  # Linux's largest pid_max (PID_MAX_LIMIT on 64-bit)


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
    the creator's pid, and a pid that no longer exists cannot be using its segment. Returns how many.

    Tolerates any file name a local user may create in /dev/shm (issue 16: a pid too large for
    os.kill once broke every client): only `kvstore-<pid>-...` regular files of this user with a pid
    in the kernel's range are considered; anything else is left alone."""
    removed = 0
    try:
        paths = list(SHM_DIR.glob("kvstore-*-*"))
    except OSError:
        return 0
    me, uid = os.getpid(), os.geteuid()
    for path in paths:
        m = _PID_IN_NAME.match(path.name)
        if m is None or not 0 < int(m.group(1)) <= _PID_MAX or int(m.group(1)) == me:
            continue
        try:
            st = os.lstat(path)
            if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
        except (OSError, OverflowError):
            pass  # gone meanwhile, or alive and another user's
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
    """Staging memory the node can map: a sealed memfd of this process, owned by the caller until `close()`.

    `view` is its whole writable area (`nbytes`, starting 4 KiB aligned); `pages(page_bytes, count)`
    cuts it into page-sized views on 4 KiB-aligned boundaries. Any contiguous part of it (a view, a
    slice of one, a numpy array over it) can be passed to `get_into` and `put_from` of the client that
    made it. Wrap it for tensors with `numpy.frombuffer(buf.view, ...)` or `torch.frombuffer(buf.view, ...)`.

    Why a sealed memfd and not a /dev/shm file: the node maps this memory and copies pages straight
    into it with memcpy (a kernel pwrite into tmpfs runs at about half memcpy speed here). A mapping of
    a file that can shrink would kill the node with SIGBUS when it shrank mid-copy; F_SEAL_SHRINK (and
    F_SEAL_GROW) makes the size final, so the node can map it safely. The node opens it as
    /proc/<pid>/fd/<fd> (same user and pid namespace as the node), after checking the seals and the
    nonce in its header (as for named segments: only a process that can read it knows the nonce).

    Invariant: while registered, its descriptor, nonce and address range do not change; `close()`
    unregisters it first, so no later call can name it. Views still held after close keep the memory
    mapped until released, but no transfer uses them any more.
    """

    def __init__(self, nbytes: int, registry: SharedBuffers) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes: a shared buffer needs at least 1 byte, got {nbytes}")
        self.nbytes = nbytes
        self.pid = os.getpid()
        self.name = f"kvstore-{self.pid}-{secrets.token_hex(12)}"
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.data_offset = ALIGN  # data starts on its own 4 KiB page after the header: views are page aligned
        self.size = ALIGN + align_up(nbytes)
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.map = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.map[: len(MAGIC) + NONCE_BYTES] = MAGIC + self.nonce
        self.view = memoryview(self.map)[self.data_offset : self.data_offset + nbytes]
        self.base = address_of(self.map)
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
    """Where one caller buffer lies: in `buffer`'s segment at byte `offset`, `nbytes` long."""

    buffer: SharedBuffer
    offset: int  # from the start of the memfd (its header included), as the node addresses it
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
