"""The client's side of the shared-memory plane: segments it owns, and Put/Get as exchanges."""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
import threading
from collections.abc import Sequence

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.layout import PageLayout
from kvstore.names import Buffer, TierKind
from kvstore.pageformat import ALIGN, align_up, payload_checksum
from kvstore.transport.exchange import DataPlane, Exchange, Unary
from kvstore.transport.shm import HEADER_BYTES, MAGIC, NONCE_BYTES, SHM_DIR
from kvstore.wire import FetchedPage, StreamError, layout_to_pb

DEFAULT_PAGE_HINT = 256 << 10  # a client's first GetShm window assumes pages of this size, then learns
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


class ShmPlane(DataPlane):
    """Pages cross through this client's own segments; the RPCs carry only hashes and slices.

    Thread-safe: concurrent calls take different segments from the pool. Each PutShm of at most
    `pages_per_call` pages is atomic, like a Put stream.
    """

    name = "shm"

    def __init__(self, pages_per_call: int, verify: bool) -> None:
        self.pages_per_call = pages_per_call
        self.verify = verify
        self.pool = SegmentPool()
        self.page_hint = DEFAULT_PAGE_HINT  # bytes per page GetShm windows are sized for (learned)

    def put(self, namespace: str, layout: PageLayout, hashes: Sequence[bytes], pages: Sequence[Buffer],
            target: TierKind | None, parent: bytes | None, chain: bool) -> Exchange[tuple[int, int]]:  # fmt: skip
        stored = present = 0
        per_call = self.pages_per_call
        for a in range(0, len(hashes), per_call):
            b = min(a + per_call, len(hashes))
            first_parent = parent if a == 0 else hashes[a - 1]
            seg = self.pool.acquire(put_bytes(pages[a:b]))
            try:
                reply = yield Unary("PutShm", put_request(seg, namespace, layout, hashes[a:b], pages[a:b], target,
                                                          first_parent if chain else None, chain))  # fmt: skip
            finally:
                self.pool.release(seg)
            stored += reply.stored
            present += reply.already_present
        return stored, present

    def get(self, namespace: str, hashes: Sequence[bytes], promote: bool) -> Exchange[list[FetchedPage]]:
        """GetShm calls for the longest stored prefix of `hashes`.

        The window is sized for `page_hint` bytes per page and grows when the node reports a page that
        did not fit. Bounded: every call either returns pages or grows the window to fit the next page.
        """
        out: list[FetchedPage] = []
        if not hashes:
            return out
        per_call = self.pages_per_call
        hint = self.page_hint
        seg = self.pool.acquire(hint * min(len(hashes), per_call))
        try:
            for _ in range(2 * len(hashes) + 2):
                batch = hashes[len(out) : len(out) + per_call]
                if not batch:
                    break
                reply = yield Unary("GetShm", get_request(seg, namespace, batch, promote))
                got = read_reply(seg, batch, reply, self.verify)
                out.extend(got)
                if not reply.next_page_bytes:
                    if len(got) < len(batch):
                        break  # the first missing page ends the prefix
                    continue
                hint = max(hint, align_up(reply.next_page_bytes))
                need = hint * min(len(hashes) - len(out), per_call)
                if seg.data_bytes < need:
                    self.pool.release(seg)
                    seg = self.pool.acquire(need)
        finally:
            self.pool.release(seg)
        self.page_hint = hint
        return out

    def close(self) -> None:
        self.pool.close()
