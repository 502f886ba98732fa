"""The node's side of the shared-memory plane: PutShm/GetShm (through the node's put and get drivers) and
the client segments they name, opened on demand and checked on every use.

Two kinds: named /dev/shm segments (the clients' scratch pool), read and written with pread/pwrite
because their size can change under the node; and registered buffers, memfds sealed against
shrinking, which the node maps and copies into with memcpy (about twice as fast as a pwrite into tmpfs).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os
import secrets
import stat
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import InvalidArgument, ShmNotAvailable
from kvstore.node.callers import Caller
from kvstore.node.drivers import PageHead, drive_put, open_get
from kvstore.node.limits import bounded, check_count
from kvstore.pageformat import align_up
from kvstore.wire.shm import HEADER_BYTES, MAGIC, NAME_RE, NONCE_BYTES, SHM_DIR
from kvstore.wire.streams import put_open_from_pb

MAX_ATTACHED = 64  # segments a node keeps open at once (least recently used closed first)


def unusable(name: str) -> ShmNotAvailable:
    """The one reply for every segment this node will not use. NOTE: one status and one message
    whether the segment is missing, not a regular file, open to other users, too small or carrying
    another nonce, so a caller cannot probe which kvstore-* names exist (issue 16)."""
    return ShmNotAvailable(
        f"region: segment {name!r} is not usable by this node (not visible here, not a "
        "private regular file, or another nonce); use Put/Get"
    )


def _private_regular(st: os.stat_result) -> bool:
    """A regular file no other user may access: only its owner (and root) can know its nonce, and the
    owner may write it anyway, so the node writing into it on a caller's behalf grants nothing."""
    return stat.S_ISREG(st.st_mode) and not stat.S_IMODE(st.st_mode) & 0o077


class NodeSegment:
    """What the node does with any caller segment: bounds checks, and a use count.

    Invariant: the segment's descriptor (and mapping) stay open while `users` > 0, even after the
    attachment table dropped the handle, so nothing is closed under an in-flight copy.
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

    def targets(self, targets: Sequence[Any], count: int, page_bytes: int) -> list[int]:
        """Offsets of a zero-copy GetShm's targets (one per hash), after checking that each lies after the
        header and inside the segment, holds a `page_bytes` page, and overlaps no other target's page.
        Raises InvalidArgument naming `targets[i]` (so nothing is read or written for a bad request)."""
        if len(targets) != count:
            raise InvalidArgument("targets", f"{len(targets)} targets for {count} hashes (one per hash)")
        for i, t in enumerate(targets):
            self.check(t.offset, t.size, f"targets[{i}]")
            if t.size < page_bytes:
                raise InvalidArgument(
                    f"targets[{i}]", f"{t.size} bytes cannot hold a page of this namespace ({page_bytes} bytes)"
                )
        order = sorted(range(count), key=lambda i: targets[i].offset)
        for prev, cur in itertools.pairwise(order):
            if targets[prev].offset + page_bytes > targets[cur].offset:
                raise InvalidArgument(f"targets[{max(prev, cur)}]", f"overlaps targets[{min(prev, cur)}]")
        return [t.offset for t in targets]

    def read_into(self, offset: int, dst: memoryview, field: str) -> None:
        """Copy len(dst) bytes at `offset` of the segment into dst."""
        raise NotImplementedError

    def write(self, offset: int, src: memoryview | bytes) -> None:
        """Copy src into the segment at `offset`."""
        raise NotImplementedError

    def gone(self) -> bool:
        """Whether the caller let go of the segment (so the node should too)."""
        raise NotImplementedError

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


class AttachedSegment(NodeSegment):
    """The node's handle on one named client segment: positional reads and writes on an open descriptor.

    NOTE: deliberately not an mmap. A client can shrink a named segment at any moment; touching a mapped
    page past the new end kills the node with SIGBUS, while pread/pwrite just come up short (checked
    here) or extend the file. (Registered buffers are sealed memfds instead, which can be mapped.)
    """

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

    def gone(self) -> bool:
        return not (SHM_DIR / self.name).exists()


class MappedSegment(NodeSegment):
    """The node's mapping of a caller's registered buffer: a memfd sealed against shrinking and growing,
    so its pages can never vanish under a copy (no SIGBUS), copied with plain memcpy.

    `window(offset, n)` is a writable view the node's reads copy pages into (kvstore/manager/reads.py
    verifies each page while copying it there); every window must be released before the handle closes.
    """

    def __init__(self, name: str, fd: int, ino: int, size: int, path: str) -> None:
        super().__init__(name, fd, ino, size)
        self.path = path
        self.map = mmap.mmap(fd, size)
        self.view = memoryview(self.map)

    def window(self, offset: int, n: int) -> memoryview:
        return self.view[offset : offset + n]

    def read_into(self, offset: int, dst: memoryview, field: str) -> None:
        dst[:] = self.view[offset : offset + len(dst)]

    def write(self, offset: int, src: memoryview | bytes) -> None:
        self.view[offset : offset + len(src)] = src

    def nonce_matches(self, nonce: bytes) -> bool:
        header = self.view[: len(MAGIC) + NONCE_BYTES]
        return header[: len(MAGIC)] == MAGIC and secrets.compare_digest(bytes(header[len(MAGIC) :]), nonce)

    def gone(self) -> bool:
        try:
            return os.stat(self.path).st_ino != self.ino
        except OSError:
            return True

    def _close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a window still exported: the mapping goes with it
            self.map.close()
        super()._close()


class SegmentAttachments:
    """The node's side: named client segments opened on demand, checked on every use. `acquire`
    returns a handle the caller must `release()` when its copies are done."""

    def __init__(self, max_attached: int = MAX_ATTACHED) -> None:
        self.max_attached = max_attached
        self._open: OrderedDict[str, NodeSegment] = OrderedDict()

    def acquire(self, name: str, nonce: bytes) -> AttachedSegment:
        """The caller's segment, after its name, type, mode and nonce are checked. Raises InvalidArgument
        for a malformed name or nonce, else `unusable` (ShmNotAvailable) for any segment it will not use."""
        if not NAME_RE.match(name):
            raise InvalidArgument(
                "region.name", f"{name!r} is not a kvstore segment name (kvstore-[A-Za-z0-9_-]{{8,64}})"
            )
        if len(nonce) != NONCE_BYTES:
            raise InvalidArgument("region.nonce", f"must be {NONCE_BYTES} bytes, got {len(nonce)}")
        path = SHM_DIR / name
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            self._drop(name)
            raise unusable(name) from None
        if not _private_regular(st):
            raise unusable(name)
        att = self._open.get(name)
        if not isinstance(att, AttachedSegment) or att.ino != st.st_ino or att.size != st.st_size:
            self._drop(name)
            att = self._attach(name, path)
        self._open.move_to_end(name)
        header = os.pread(att.fd, len(MAGIC) + NONCE_BYTES, 0)
        if header[: len(MAGIC)] != MAGIC or not secrets.compare_digest(header[len(MAGIC) :], nonce):
            raise unusable(name)
        att.users += 1
        return att

    def acquire_memfd(self, pid: int, fd: int, nonce: bytes, name: str) -> MappedSegment:
        """A caller's registered buffer (its memfd `fd` in process `pid`), mapped, after its seals and
        nonce are checked. Raises InvalidArgument naming what is wrong, or ShmNotAvailable when this
        node cannot open it (another pid namespace or user)."""
        if len(nonce) != NONCE_BYTES:
            raise InvalidArgument("region.nonce", f"must be {NONCE_BYTES} bytes, got {len(nonce)}")
        path = f"/proc/{pid}/fd/{fd}"
        key = f"memfd:{pid}:{fd}"
        try:
            ino = os.stat(path).st_ino
        except OSError:
            self._drop(key)
            raise ShmNotAvailable(
                f"cannot open the caller's registered buffer {name!r} (descriptor {fd} of "
                f"process {pid}) from this node: another pid namespace or user?"
            ) from None
        att = self._open.get(key)
        if not isinstance(att, MappedSegment) or att.ino != ino:
            self._drop(key)
            att = self._map(key, path, name)
        self._open.move_to_end(key)
        if not att.nonce_matches(nonce):
            raise InvalidArgument("region.nonce", f"does not match the header of registered buffer {name!r}")
        att.users += 1
        return att

    def _map(self, key: str, path: str, name: str) -> MappedSegment:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ShmNotAvailable(f"cannot open the caller's registered buffer {name!r}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0  # not a memfd at all
            if not stat.S_ISREG(st.st_mode) or not seals & fcntl.F_SEAL_SHRINK:
                raise InvalidArgument(
                    "region.fd", f"{name!r} is not a memfd sealed against shrinking; the node maps only such buffers"
                )
            if st.st_size < HEADER_BYTES + 1:
                raise InvalidArgument("region.fd", f"{name!r} is {st.st_size} bytes, smaller than its header")
            att = MappedSegment(name, fd, st.st_ino, st.st_size, path)
        except BaseException:
            os.close(fd)
            raise
        self._track(key, att)
        return att

    def _attach(self, name: str, path: Path) -> AttachedSegment:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            raise unusable(name) from None
        st = os.fstat(fd)
        if st.st_size < HEADER_BYTES + 1 or not _private_regular(st):  # fstat: the file opened, not the name
            os.close(fd)
            raise unusable(name)
        att = AttachedSegment(name, fd, st.st_ino, st.st_size)
        self._track(name, att)
        return att

    def _track(self, key: str, att: NodeSegment) -> None:
        self._open[key] = att
        while len(self._open) > self.max_attached:
            self._drop(next(iter(self._open)))
        # Segments their clients unlinked or closed stay allocated while open here: let go of them now.
        for other in [k for k, a in self._open.items() if k != key and a.gone()]:
            self._drop(other)

    def _drop(self, name: str) -> None:
        att = self._open.pop(name, None)
        if att is not None:
            att.drop()

    def close(self) -> None:
        for name in list(self._open):
            self._drop(name)

    def __len__(self) -> int:
        return len(self._open)


class ShmPlane:
    """PutShm and GetShm: page bytes cross through the caller's segment, the RPC carries hashes and offsets.
    Same transaction, leases and checks as every plane (kvstore/node/drivers.py)."""

    def __init__(self, attachments: SegmentAttachments, max_pages: int) -> None:
        self.attachments = attachments
        self.max_pages = max_pages

    def segment(self, region: pb.ShmRegion) -> NodeSegment:
        if region.pid:
            return self.attachments.acquire_memfd(region.pid, region.fd, region.nonce, region.name)
        return self.attachments.acquire(region.name, region.nonce)

    async def put(self, caller: Caller, request: pb.PutShmRequest) -> pb.PutResponse:
        """One copy per page, segment -> slot; the checksum is the one the transaction takes of the slot
        (checked against a declared one, if any)."""
        if not request.HasField("open"):
            raise InvalidArgument("open", "PutShm needs `open` (namespace and layout)")
        check_count(request.pages, self.max_pages, "pages")
        seg = self.segment(request.region)
        try:
            slices = list(request.pages)
            for i, p in enumerate(slices):  # bounds first: a bad slice must leave the node unchanged
                seg.check(p.offset, p.payload_bytes, f"pages[{i}]")
            op = put_open_from_pb(request.open)
            stored, present = await drive_put(
                lambda: caller.view.begin_put(op), _heads(slices), _SegmentPages(seg, slices), drain=False
            )
            return pb.PutResponse(stored=stored, already_present=present)
        finally:
            seg.release()

    async def get(self, caller: Caller, request: pb.GetShmRequest) -> pb.GetShmResponse:
        """Get into the caller's segment: one copy per page, from its slot (or tier read) to the segment.
        Pages go back to back into the window [offset, offset + size), or, with `targets` (zero-copy
        get_into), page i into targets[i], all checked before the first page is read. Into a registered
        (mapped) buffer the reader copies each page itself, verifying it in the same pass."""
        hashes = bounded(request.hashes, self.max_pages, "hashes")
        seg = self.segment(request.region)
        windows: list[memoryview] = []
        try:
            places: list[int] | None = None
            if request.targets:
                page_bytes = caller.view.layout_of(request.namespace).page_bytes
                places = seg.targets(request.targets, len(hashes), page_bytes)
                if isinstance(seg, MappedSegment):
                    windows = [seg.window(o, page_bytes) for o in places]
            else:
                seg.check(request.offset, request.size, "size")
            out = pb.GetShmResponse()
            pos, end = request.offset, request.offset + request.size
            promote = not request.no_promote
            async with open_get(
                caller, request.namespace, hashes, promote, into=windows or None, receiver_verifies=False
            ) as leases:
                async for lease in leases:
                    n = len(lease.payload)
                    if places is not None:
                        pos = places[len(out.pages)]
                    elif pos + n > end:
                        out.next_page_bytes = n
                        break
                    if not windows:  # else the reader has copied it there already
                        seg.write(pos, lease.payload)
                    out.pages.add(
                        hash=lease.hash, offset=pos, payload_bytes=n, checksum=lease.checksum, tier=int(lease.tier)
                    )
                    pos = align_up(pos + n)
            return out
        finally:
            for w in windows:
                w.release()
            seg.release()


async def _heads(slices: Sequence[pb.ShmSlice]) -> AsyncIterator[PageHead]:
    for p in slices:
        yield PageHead(p.hash, p.payload_bytes, p.checksum)


class _SegmentPages:
    """The put driver's page bytes: each slice of the caller's segment (bounds checked before)."""

    def __init__(self, seg: NodeSegment, slices: Sequence[pb.ShmSlice]) -> None:
        self.seg = seg
        self.slices = slices

    async def read_into(self, index: int, view: memoryview) -> None:
        self.seg.read_into(self.slices[index].offset, view, f"pages[{index}]")

    async def discard(self, index: int, nbytes: int) -> None:
        return None  # nothing to receive: the bytes stay in the caller's segment
