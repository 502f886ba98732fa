"""Same-host shared-memory data plane: pages cross through a client-owned /dev/shm segment.

Protocol (proto: ShmRegion, PutShm, GetShm). The client creates a segment `kvstore-<random>` and writes
a 64-byte header: MAGIC, then a random 16-byte nonce. A PutShm names the segment, repeats the nonce and
lists (hash, offset, length, checksum) slices holding the pages; the node opens the segment, checks
the nonce and the bounds, and reads each slice into its own slot (one copy, by preadv) under the same atomic
transaction as a Put stream. A GetShm names the segment and a window; the node copies each verified
page into the window (one copy, by pwrite) and answers with where it put them.

Why a nonce: the node opens segments by name, so without it any local client could make the node
write into another process's segment. Only a process that can read the segment knows its nonce, and
such a process could write it anyway. Segments are created 0600, so that means the same user.

Ownership: the client creates, grows (a new segment) and unlinks its segments; the node only opens
them (never maps them: see AttachedSegment), keeps at most `MAX_ATTACHED` open, and closes one when
its file is gone or was replaced.
Everything here is synchronous and cheap; copies run on the caller's thread.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
import threading
from collections import OrderedDict
from collections.abc import Generator, Sequence
from pathlib import Path

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import InvalidArgument, ShmNotAvailable
from kvstore.layout import PageLayout
from kvstore.pageformat import payload_checksum
from kvstore.tiers.base import TierKind
from kvstore.wire import Buffer, FetchedPage, StreamError, layout_to_pb

SHM_DIR = Path("/dev/shm")
MAGIC = b"KVSHM001"
NONCE_BYTES = 16
HEADER_BYTES = 64
ALIGN = 4096
MAX_ATTACHED = 64
DEFAULT_PAGE_HINT = 256 << 10  # a client's first GetShm window assumes pages of this size, then learns
NAME_RE = re.compile(r"^kvstore-[A-Za-z0-9_-]{8,64}$")


def align_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def shm_available() -> bool:
    """Whether this host has a POSIX shared-memory directory we can use."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK | os.X_OK)


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


class AttachedSegment:
    """The node's handle on one client segment: positional reads and writes on an open descriptor.

    NOTE: deliberately not an mmap. A client can shrink its segment at any moment; touching a mapped
    page past the new end kills the node with SIGBUS, while pread/pwrite just come up short (checked
    here) or extend the file. Invariant: the descriptor stays open while `users` > 0, even after the
    attachment table dropped the handle (so a number is never reused under an in-flight copy).
    """

    def __init__(self, name: str, fd: int, ino: int, size: int) -> None:
        self.name, self.fd, self.ino, self.size = name, fd, ino, size
        self.users = 0
        self.dropped = False

    def check(self, offset: int, length: int, field: str) -> None:
        """Raise unless [offset, offset+length) lies after the header and inside the segment."""
        if offset < HEADER_BYTES:
            raise InvalidArgument(field, f"offset {offset} overlaps the {HEADER_BYTES}-byte segment header")
        if offset + length > self.size:
            raise InvalidArgument(field, f"[{offset}, {offset + length}) runs past the segment's {self.size} bytes")

    def read_into(self, offset: int, dst: memoryview, field: str) -> None:
        got = os.preadv(self.fd, [dst], offset)
        if got != len(dst):
            raise InvalidArgument(field, f"segment {self.name!r} ended after {got} of {len(dst)} bytes (shrunk?)")

    def write(self, offset: int, src: memoryview | bytes) -> None:
        n = len(src)
        done = 0
        while done < n:  # pwrite to tmpfs is complete in practice; loop for the contract, bounded by n
            wrote = os.pwrite(self.fd, memoryview(src)[done:], offset + done)
            if wrote <= 0:
                raise OSError(f"pwrite to segment {self.name!r} made no progress")
            done += wrote

    def release(self) -> None:
        self.users -= 1
        if self.dropped and self.users == 0:
            self._close()

    def drop(self) -> None:
        self.dropped = True
        if self.users == 0:
            self._close()

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SegmentAttachments:
    """The node's side: named client segments opened on demand, checked on every use. `acquire`
    returns a handle the caller must `release()` when its copies are done."""

    def __init__(self, max_attached: int = MAX_ATTACHED) -> None:
        self.max_attached = max_attached
        self._open: OrderedDict[str, AttachedSegment] = OrderedDict()

    def acquire(self, name: str, nonce: bytes) -> AttachedSegment:
        """The caller's segment, after its name, type and nonce are checked. Raises InvalidArgument
        naming what is wrong, or ShmNotAvailable when this node cannot see the segment."""
        if not NAME_RE.match(name):
            raise InvalidArgument(
                "region.name", f"{name!r} is not a kvstore segment name (kvstore-[A-Za-z0-9_-]{{8,64}})"
            )
        if len(nonce) != NONCE_BYTES:
            raise InvalidArgument("region.nonce", f"must be {NONCE_BYTES} bytes, got {len(nonce)}")
        path = SHM_DIR / name
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            self._drop(name)
            raise ShmNotAvailable(f"no shared-memory segment {name!r} visible to this node") from None
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument("region.name", f"{name!r} is not a regular shared-memory segment")
        att = self._open.get(name)
        if att is None or att.ino != st.st_ino or att.size != st.st_size:
            self._drop(name)
            att = self._attach(name, path)
        self._open.move_to_end(name)
        header = os.pread(att.fd, len(MAGIC) + NONCE_BYTES, 0)
        if header[: len(MAGIC)] != MAGIC or not secrets.compare_digest(header[len(MAGIC) :], nonce):
            raise InvalidArgument("region.nonce", f"does not match the header of segment {name!r}")
        att.users += 1
        return att

    def _attach(self, name: str, path: Path) -> AttachedSegment:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        st = os.fstat(fd)
        if st.st_size < HEADER_BYTES + 1:
            os.close(fd)
            raise InvalidArgument("region.name", f"segment {name!r} is {st.st_size} bytes, smaller than its header")
        att = AttachedSegment(name, fd, st.st_ino, st.st_size)
        self._open[name] = att
        while len(self._open) > self.max_attached:
            self._drop(next(iter(self._open)))
        # Segments their clients unlinked stay allocated while open here: let go of them now.
        for other in [n for n in self._open if n != name and not (SHM_DIR / n).exists()]:
            self._drop(other)
        return att

    def _drop(self, name: str) -> None:
        att = self._open.pop(name, None)
        if att is not None:
            att.drop()

    def close(self) -> None:
        for name in list(self._open):
            self._drop(name)

    def __len__(self) -> int:
        return len(self._open)


# -- client side: requests and replies (no I/O besides the copies into and out of the segment) --------


def put_request(seg: ClientSegment, namespace: str, layout: PageLayout, hashes: Sequence[bytes],
                pages: Sequence[Buffer], target: TierKind | None, parent: bytes | None,
                chain: bool) -> pb.PutShmRequest:  # fmt: skip
    """Copy `pages` into `seg` (4 KiB-aligned, after the header) and describe them in a PutShmRequest.
    `seg` must hold `put_bytes(pages)` data bytes."""
    req = pb.PutShmRequest(
        open=pb.PutOpen(namespace=namespace, layout=layout_to_pb(layout), target_tier=int(target) if target else 0,
                        parent_hash=parent or b"", chain=chain),
        region=pb.ShmRegion(name=seg.name, nonce=seg.nonce),
    )  # fmt: skip
    pos = HEADER_BYTES
    for h, page in zip(hashes, pages, strict=True):
        src = memoryview(page).cast("B")
        n = len(src)
        seg.view[pos : pos + n] = src
        req.pages.add(hash=h, offset=pos, payload_bytes=n, checksum=payload_checksum(src))
        pos = align_up(pos + n)
    return req


def put_bytes(pages: Sequence[Buffer]) -> int:
    """Data bytes a segment needs to carry `pages` for put_request."""
    return sum(align_up(memoryview(p).nbytes) for p in pages)


def get_request(seg: ClientSegment, namespace: str, hashes: Sequence[bytes], promote: bool) -> pb.GetShmRequest:
    return pb.GetShmRequest(namespace=namespace, hashes=list(hashes), no_promote=not promote,
                            region=pb.ShmRegion(name=seg.name, nonce=seg.nonce), offset=HEADER_BYTES,
                            size=seg.data_bytes)  # fmt: skip


def read_reply(
    seg: ClientSegment, hashes: Sequence[bytes], reply: pb.GetShmResponse, verify: bool
) -> list[FetchedPage]:
    """Copy the pages a GetShm put into `seg` out into owned buffers, checking order, bounds and checksums."""
    if len(reply.pages) > len(hashes):
        raise StreamError(f"GetShm returned {len(reply.pages)} pages for {len(hashes)} hashes")
    out = []
    for i, (want, p) in enumerate(zip(hashes, reply.pages, strict=False)):
        if p.hash != want:
            raise StreamError(f"page {i}: server sent an unexpected hash")
        if p.offset < HEADER_BYTES or p.offset + p.payload_bytes > seg.size:
            raise StreamError(f"page {i}: slice [{p.offset}, {p.offset + p.payload_bytes}) outside the segment")
        data = bytearray(seg.view[p.offset : p.offset + p.payload_bytes])
        if verify and payload_checksum(data) != p.checksum:
            raise StreamError(f"page {i}: checksum mismatch after transfer")
        out.append(FetchedPage(p.hash, TierKind(p.tier), data))
    return out


# -- client side: whole exchanges as generators (they yield requests, receive replies, return results),
# so the blocking and the asyncio client drive the same logic and only differ in how they call.

PutExchange = Generator[pb.PutShmRequest, pb.PutResponse, tuple[int, int]]
GetExchange = Generator[pb.GetShmRequest, pb.GetShmResponse, tuple[list[FetchedPage], int]]


def put_exchange(pool: SegmentPool, namespace: str, layout: PageLayout, hashes: Sequence[bytes],
                 pages: Sequence[Buffer], target: TierKind | None, parent: bytes | None, chain: bool,
                 per_call: int) -> PutExchange:  # fmt: skip
    """PutShm calls of at most `per_call` pages each (each atomic); returns (stored, already_present)."""
    stored = present = 0
    for a in range(0, len(hashes), per_call):
        b = min(a + per_call, len(hashes))
        first_parent = parent if a == 0 else hashes[a - 1]
        seg = pool.acquire(put_bytes(pages[a:b]))
        try:
            reply = yield put_request(seg, namespace, layout, hashes[a:b], pages[a:b], target,
                                      first_parent if chain else None, chain)  # fmt: skip
        finally:
            pool.release(seg)
        stored += reply.stored
        present += reply.already_present
    return stored, present


def get_exchange(pool: SegmentPool, namespace: str, hashes: Sequence[bytes], promote: bool, verify: bool,
                 per_call: int, page_hint: int) -> GetExchange:  # fmt: skip
    """GetShm calls for the longest stored prefix of `hashes`; returns (pages, updated page_hint).

    The window is sized for `page_hint` bytes per page and grows when the node reports a page that did
    not fit. Bounded: every call either returns pages or grows the window to fit the next page.
    """
    out: list[FetchedPage] = []
    seg = pool.acquire(page_hint * min(len(hashes), per_call))
    try:
        for _ in range(2 * len(hashes) + 2):
            batch = hashes[len(out) : len(out) + per_call]
            if not batch:
                break
            reply = yield get_request(seg, namespace, batch, promote)
            got = read_reply(seg, batch, reply, verify)
            out.extend(got)
            if not reply.next_page_bytes:
                if len(got) < len(batch):
                    break  # the first missing page ends the prefix
                continue
            page_hint = max(page_hint, align_up(reply.next_page_bytes))
            need = page_hint * min(len(hashes) - len(out), per_call)
            if seg.data_bytes < need:
                pool.release(seg)
                seg = pool.acquire(need)
    finally:
        pool.release(seg)
    return out, page_hint
