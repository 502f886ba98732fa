"""NVMe tier: preallocated segment files of fixed-size, O_DIRECT-aligned slots.

Methods here block (pread/pwrite/fdatasync); the manager calls them from its I/O thread pool, never on
the event loop. `read_many` keeps up to `queue_depth` O_DIRECT reads in flight (a thread each: preadv
releases the GIL, and a device only reaches its bandwidth with a deep queue). Durability rule: `write` returns only after the slot's header and payload are on
stable storage (fdatasync), and the manager makes a page visible only after that, so whatever a
restarted node finds with a valid header was durably and completely written. `write_many` writes every
slot first and then syncs each touched segment file once: same rule, one flush per file.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvstore.names import TierKind
from kvstore.pageformat import ALIGN, HEADER_BYTES, HeaderError, PageHeader
from kvstore.tiers.base import Medium, SlotIO

log = logging.getLogger(__name__)

META_NAME = "kvstore-nvme.json"
SEGMENT_FMT = "seg-{:05d}.kvs"
_MAX_IO_RETRIES = 64  # a short read/write is retried; this bounds the loop on a misbehaving device
QUEUE_DEPTH = 16  # reads kept in flight by read_many: what NVMe devices need to approach their bandwidth


class NvmeFormatError(RuntimeError):
    """The directory holds segments of another geometry or format; refusing to reuse them."""


def check_private_dir(path: Path) -> None:
    """Refuse a tier directory other users may write into: they could plant a symlink where a segment
    or the metadata file is about to be created and have the node write through it (issue 16). Group
    write is accepted for the node's own group (Kubernetes fsGroup volumes)."""
    st = os.stat(path)
    if st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != os.getegid()):
        raise PermissionError(f"--nvme-path {path} is writable by other users (mode {st.st_mode & 0o7777:04o}): "
                              f"use a directory only the node's user can write (chmod go-w {path})")  # fmt: skip


class NvmeTier(Medium):
    """`num_slots` slots of `slot_bytes`, striped over segment files of `slots_per_segment` slots."""

    kind = TierKind.NVME
    persistent = True
    queue_depth = QUEUE_DEPTH

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, slot_bytes: int, segment_bytes: int) -> None:
        if slot_bytes % ALIGN:
            raise ValueError("slot_bytes must be a multiple of 4096")
        self.path = Path(path)
        self.slot_bytes = slot_bytes
        self.slots_per_segment = max(1, segment_bytes // slot_bytes)
        self.num_slots = capacity_bytes // slot_bytes
        self.path.mkdir(parents=True, exist_ok=True)
        check_private_dir(self.path)
        self._check_meta()
        self.direct_io = True
        self._fds: list[int] = []
        self._readers: ThreadPoolExecutor | None = None  # read_many's threads, started on first use
        self._readers_lock = threading.Lock()
        n_segments = -(-self.num_slots // self.slots_per_segment)
        for seg in range(n_segments):
            slots = min(self.slots_per_segment, self.num_slots - seg * self.slots_per_segment)
            self._fds.append(self._open_segment(seg, slots * slot_bytes))
        self._zero = mmap.mmap(-1, HEADER_BYTES)  # aligned zero block for invalidation
        self.detail = f"{n_segments} segment file(s) in {self.path}, " + (
            "O_DIRECT" if self.direct_io else "buffered I/O + fdatasync (O_DIRECT unsupported here)"
        )

    def _check_meta(self) -> None:
        meta_path = self.path / META_NAME
        want = {"format": 1, "slot_bytes": self.slot_bytes, "slots_per_segment": self.slots_per_segment}
        if meta_path.exists():
            have = json.loads(meta_path.read_text())
            if {k: have.get(k) for k in want} != want:
                raise NvmeFormatError(
                    f"{self.path} was formatted with {have}, this node wants {want}: start with the same "
                    "--max-page-bytes and segment size, or point --nvme-path at an empty directory"
                )
            return
        tmp = meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(want))
        os.replace(tmp, meta_path)

    def _open_segment(self, seg: int, size: int) -> int:
        name = self.path / SEGMENT_FMT.format(seg)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW  # a symlink planted in its place is refused
        fd = -1
        if self.direct_io and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(name, flags | os.O_DIRECT, 0o600)
            except OSError:
                self.direct_io = False
        else:
            self.direct_io = False
        if fd < 0:
            try:
                fd = os.open(name, flags, 0o600)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise PermissionError(f"{name} is a symbolic link; refusing to write through it") from None
                raise
        if os.fstat(fd).st_size < size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.ftruncate(fd, size)  # filesystems without fallocate (tmpfs on old kernels)
        return fd

    def _locate(self, slot: int) -> tuple[int, int]:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"NVMe slot {slot} out of range")
        seg, idx = divmod(slot, self.slots_per_segment)
        return self._fds[seg], idx * self.slot_bytes

    def write(self, slot: int, src: memoryview) -> None:
        """Durably write `src` (header block + payload, aligned length, aligned buffer) to a slot."""
        os.fdatasync(self._write_one(slot, src))

    def write_many(self, ops: Sequence[SlotIO]) -> None:
        """Write every slot, then make them durable with one fdatasync per segment file touched."""
        for fd in {self._write_one(slot, src) for slot, src in ops}:
            os.fdatasync(fd)

    def _write_one(self, slot: int, data: memoryview) -> int:
        if len(data) % ALIGN or len(data) > self.slot_bytes:
            raise ValueError("write length must be aligned and fit the slot")
        fd, off = self._locate(slot)
        self._pwrite_all(fd, data, off)
        return fd

    def read(self, slot: int, into: memoryview) -> None:
        """Read len(into) bytes (aligned) from the start of a slot into an aligned buffer."""
        fd, off = self._locate(slot)
        done = 0
        for _ in range(_MAX_IO_RETRIES):
            if done == len(into):
                return
            n = os.preadv(fd, [into[done:]], off + done)
            if n <= 0:
                break
            done += n
        raise OSError(f"short read on NVMe slot {slot}: {done}/{len(into)} bytes")

    def read_many(self, ops: Sequence[SlotIO], done: Callable[[int], None] | None = None) -> None:
        """Read every (slot, buffer) with up to `queue_depth` reads in flight, calling `done(i)` as each
        one completes; returns once all ended, and then raises the first error if any failed (so no
        buffer is still being written on return)."""
        if len(ops) <= 1:
            super().read_many(ops, done)
            return
        pool = self._reader_pool()
        futures = [pool.submit(self.read, slot, into) for slot, into in ops]
        if done is not None:
            for i, f in enumerate(futures):
                f.add_done_callback(lambda f, i=i: f.exception() is None and done(i))
        errors = [f.exception() for f in futures]  # waits for every read, failed or not
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _reader_pool(self) -> ThreadPoolExecutor:
        with self._readers_lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(max_workers=self.queue_depth, thread_name_prefix="kvstore-nvme")
            return self._readers

    def invalidate(self, slot: int) -> None:
        """Durably erase a slot's header so recovery never resurrects its page."""
        fd, off = self._locate(slot)
        self._pwrite_all(fd, memoryview(self._zero), off)
        os.fdatasync(fd)

    def scan(self) -> Iterator[tuple[int, PageHeader]]:
        """Yield (slot, header) for every slot holding a valid header (recovery after restart)."""
        buf = mmap.mmap(-1, HEADER_BYTES)
        view = memoryview(buf)
        bad = 0
        for slot in range(self.num_slots):
            try:
                self.read(slot, view)
            except OSError as exc:
                log.warning("NVMe slot %d unreadable during recovery: %s", slot, exc)
                continue
            if view[:4] == b"\0\0\0\0":
                continue
            try:
                yield slot, PageHeader.unpack(view)
            except HeaderError as exc:
                bad += 1
                log.warning("NVMe slot %d ignored during recovery: %s", slot, exc)
        if bad:
            log.warning("NVMe recovery ignored %d slot(s) with invalid headers", bad)
        view.release()
        buf.close()

    def _pwrite_all(self, fd: int, data: memoryview, off: int) -> None:
        done = 0
        for _ in range(_MAX_IO_RETRIES):
            if done == len(data):
                return
            n = os.pwritev(fd, [data[done:]], off + done)
            if n <= 0:
                break
            done += n
        raise OSError(f"short write at offset {off}: {done}/{len(data)} bytes")

    def slot_location(self, slot: int) -> tuple[Path, int]:
        """(segment file, byte offset) of a slot: for operators and corruption tests."""
        seg, idx = divmod(slot, self.slots_per_segment)
        return self.path / SEGMENT_FMT.format(seg), idx * self.slot_bytes

    def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self._zero.close()
