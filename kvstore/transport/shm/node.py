"""The node's side of the shared-memory plane: client segments opened by name, checked on every use."""

from __future__ import annotations

import os
import secrets
import stat
from collections import OrderedDict
from pathlib import Path

from kvstore.errors import InvalidArgument, ShmNotAvailable
from kvstore.transport.shm import HEADER_BYTES, MAGIC, NAME_RE, NONCE_BYTES, SHM_DIR

MAX_ATTACHED = 64  # segments a node keeps open at once (least recently used closed first)


def unusable(name: str) -> ShmNotAvailable:
    """The one reply for every segment this node will not use. NOTE: one status and one message
    whether the segment is missing, not a regular file, open to other users, too small or carrying
    another nonce, so a caller cannot probe which kvstore-* names exist (issue 16)."""
    return ShmNotAvailable(f"region: segment {name!r} is not usable by this node (not visible here, not a "
                           "private regular file, or another nonce); use Put/Get")  # fmt: skip


def _private_regular(st: os.stat_result) -> bool:
    """A regular file no other user may access: only its owner (and root) can know its nonce, and the
    owner may write it anyway, so the node writing into it on a caller's behalf grants nothing."""
    return stat.S_ISREG(st.st_mode) and not stat.S_IMODE(st.st_mode) & 0o077


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
        if att is None or att.ino != st.st_ino or att.size != st.st_size:
            self._drop(name)
            att = self._attach(name, path)
        self._open.move_to_end(name)
        header = os.pread(att.fd, len(MAGIC) + NONCE_BYTES, 0)
        if header[: len(MAGIC)] != MAGIC or not secrets.compare_digest(header[len(MAGIC) :], nonce):
            raise unusable(name)
        att.users += 1
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
