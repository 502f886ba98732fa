"""NVMe tier: preallocated segment files of fixed-size, O_DIRECT-aligned slots.

Methods here block (pread/pwrite/fdatasync); the manager calls them from its I/O thread pool, never on
the event loop. `read_many` keeps up to `queue_depth` O_DIRECT requests in flight (a thread each: preadv
releases the GIL, and a device only reaches its bandwidth with a deep queue); ops of a batch that read
adjacent slots go out as one preadv (up to RUN_BYTES), and a read may scatter one slot over several
buffers, so a payload lands in its final place (measured in benchmarks/RESULTS.md). Durability rule: `write`
returns only after the slot's header and payload are on stable storage (fdatasync), and the manager
makes a page visible only after that, so whatever a restarted node finds with a valid header was durably
and completely written. `write_many` writes every
slot first and then syncs each touched segment file once: same rule, one flush per file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvstore.names import TierKind
from kvstore.pageformat import ALIGN, HEADER_BYTES, PageHeader
from kvstore.tiers.base import Into, Medium, SlotIO, SlotRead
from kvstore.tiers.nvme_meta import (
    META_NAME,
    REPAIR_HINT,
    SEGMENT_FMT,
    Geometry,
    MetaDamaged,
    NvmeFormatError,
    SegmentSurvey,
    SlotState,
    classify,
    decode_meta,
    foreign_message,
    write_meta,
)

__all__ = ["META_NAME", "SEGMENT_FMT", "NvmeFormatError", "NvmeSpaceError", "NvmeTier"]

log = logging.getLogger(__name__)

_MAX_IO_RETRIES = 64  # a short read/write is retried; this bounds the loop on a misbehaving device
QUEUE_DEPTH = 16  # reads kept in flight by read_many: what NVMe devices need to approach their bandwidth
# read_many reads adjacent slots of a batch with one preadv, up to this many bytes (not counting the
# slots' header blocks, so two 4 MiB pages make one request) and slots per call:
# fewer syscalls and thread handoffs per page, and large requests the device serves at full speed, while
# a batch of large pages still keeps several requests in flight.
RUN_BYTES = 8 << 20
RUN_SLOTS = 64  # each slot adds up to 4 buffers to the preadv: far below IOV_MAX (1024)


class NvmeSpaceError(RuntimeError):
    """The NVMe directory's filesystem cannot hold the tier asked for (checked and reserved at start)."""


def check_private_dir(path: Path) -> None:
    """Refuse a tier directory other users may write into: they could plant a symlink where a segment
    or the metadata file is about to be created and have the node write through it (SECURITY.md, "The host"). Group
    write is accepted for the node's own group (Kubernetes fsGroup volumes)."""
    st = os.stat(path)
    if st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != os.getegid()):
        raise PermissionError(
            f"--nvme-path {path} is writable by other users (mode {st.st_mode & 0o7777:04o}): "
            f"use a directory only the node's user can write (chmod go-w {path})"
        )


LOCK_NAME = ".lock"  # held (flock) by the one node using the directory


def lock_dir(path: Path) -> int:
    """Take the tier directory for this process, or refuse: two nodes writing one directory's segment
    files would overwrite each other's pages. The lock goes with the process (kill -9 included)."""
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(
            f"--nvme-path {path} is in use by another kvstore node on this host: give each node its own directory"
        ) from None
    return fd


class NvmeTier(Medium):
    """`num_slots` slots of `slot_bytes`, striped over segment files of `slots_per_segment` slots."""

    kind = TierKind.NVME
    persistent = True
    queue_depth = QUEUE_DEPTH
    scatter_reads = True

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, slot_bytes: int, segment_bytes: int) -> None:
        if slot_bytes % ALIGN:
            raise ValueError("slot_bytes must be a multiple of 4096")
        self.path = Path(path)
        self.slot_bytes = slot_bytes
        self.slots_per_segment = max(1, segment_bytes // slot_bytes)
        self.num_slots = capacity_bytes // slot_bytes
        self.path.mkdir(parents=True, exist_ok=True)
        check_private_dir(self.path)
        self._lock_fd = lock_dir(self.path)
        self._fds: list[int] = []
        try:
            self._meta_damage = self._check_meta()  # what was wrong with the metadata file, if anything
            self.direct_io = True
            self._readers: ThreadPoolExecutor | None = None  # read_many's threads, started on first use
            self._readers_lock = threading.Lock()
            self.write_errors = 0
            n_segments = -(-self.num_slots // self.slots_per_segment)
            sizes = [
                min(self.slots_per_segment, self.num_slots - seg * self.slots_per_segment) * slot_bytes
                for seg in range(n_segments)
            ]
            self._check_space(sizes)
            self._zero = mmap.mmap(-1, HEADER_BYTES)  # aligned zero block for invalidation (O_DIRECT needs it)
            # Where read_many drops the unused end of a slot it reads through to the next one. Several threads
            # may read into it at once: nobody ever reads it back.
            self._gap = mmap.mmap(-1, self.slot_bytes)
            for seg, size in enumerate(sizes):
                self._fds.append(self._open_segment(seg, size))
        except BaseException:
            for fd in [*self._fds, self._lock_fd]:
                os.close(fd)
            raise
        self._detail = f"{n_segments} segment file(s) in {self.path}, " + (
            "O_DIRECT" if self.direct_io else "buffered I/O + fdatasync (O_DIRECT unsupported here)"
        )
        self.detail = self._detail

    def _check_meta(self) -> str | None:
        """Check the metadata file against this node's geometry. Returns None when it is sound (or new),
        else what is wrong with it: the scan at recovery then checks the segment files against the
        node's geometry and rewrites it (refusing files that are not ours)."""
        meta_path = self.path / META_NAME
        want = Geometry(self.slot_bytes, self.slots_per_segment)
        if not meta_path.exists():
            write_meta(self.path, want)
            return None
        try:
            have = decode_meta(meta_path.read_bytes())
        except MetaDamaged as exc:
            log.warning(
                "NVMe metadata %s is damaged: %s; rebuilding it from the segment files and page "
                "headers (this node's geometry: %s)",
                meta_path,
                exc,
                want,
            )
            return str(exc)
        except OSError as exc:
            raise NvmeFormatError(
                f"{meta_path}: unreadable ({exc}); fix the file's permissions or disk, "
                f"or run `{REPAIR_HINT.format(path=self.path)}`"
            ) from None
        if have != want:
            raise NvmeFormatError(
                f"{self.path} was formatted with {have.as_dict()}, this node wants {want.as_dict()}: start with "
                "the same --max-page-bytes and segment size, or point --nvme-path at an empty directory"
            )
        if b'"checksum"' not in meta_path.read_bytes():
            write_meta(self.path, want)  # format 1: add the checksum
        return None

    def _check_space(self, sizes: list[int]) -> None:
        """Refuse to start when the filesystem cannot hold the segment files: better now, with the numbers,
        than ENOSPC on every demotion later."""
        need = 0
        for seg, size in enumerate(sizes):
            try:
                st = (self.path / SEGMENT_FMT.format(seg)).stat()
                need += max(0, size - st.st_blocks * 512)
            except FileNotFoundError:
                need += size
        vfs = os.statvfs(self.path)
        free = vfs.f_bavail * vfs.f_frsize
        if need > free:
            have = sum(sizes) - need + free
            raise NvmeSpaceError(
                f"--nvme-bytes {sum(sizes)} does not fit in {self.path}: its filesystem has {free} bytes free and "
                f"the segment files need {need} more. Lower --nvme-bytes to at most {have} ({have // self.slot_bytes} "
                "slots), or free space there"
            )

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
        old_size = os.fstat(fd).st_size
        try:
            # NOTE: always, not only when the file is short: it reserves the blocks of a sparse file too, so
            # a full disk shows here, at start, and not as ENOSPC mid-demotion.
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                os.close(fd)
                raise NvmeSpaceError(
                    f"{name}: no space to reserve {size} bytes ({exc.strerror}); lower "
                    "--nvme-bytes or free space on its filesystem"
                ) from None
            log.warning(
                "%s: space cannot be reserved here (%s): a full disk will show as failed demotions, "
                "which drop pages instead",
                name,
                exc.strerror,
            )
            if old_size < size:
                os.ftruncate(fd, size)
        if old_size % self.slot_bytes and old_size < size:
            # Truncated mid-slot (a whole-slot cut cannot be told from a tier that grew, and loses only
            # what blank slots would): pages wholly before the cut are intact, the one cut in two is erased.
            cut = old_size // self.slot_bytes
            log.warning(
                "%s was truncated to %d bytes (inside slot %d): slots from there on are empty now; "
                "the page cut in two is erased",
                name,
                old_size,
                cut,
            )
            self._pwrite_all(fd, memoryview(self._zero), cut * self.slot_bytes)
            os.fdatasync(fd)
        return fd

    def _locate(self, slot: int) -> tuple[int, int]:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"NVMe slot {slot} out of range")
        seg, idx = divmod(slot, self.slots_per_segment)
        return self._fds[seg], idx * self.slot_bytes

    def write(self, slot: int, src: memoryview) -> None:
        """Durably write `src` (header block + payload, aligned length, aligned buffer) to a slot."""
        self.write_many([(slot, src)])

    def write_many(self, ops: Sequence[SlotIO]) -> None:
        """Write every slot, then make them durable with one fdatasync per segment file touched.

        On failure (ENOSPC, EIO) the slots of the batch are erased, best effort, so a restart never finds
        a half-written page there, and the error is raised (the manager drops or keeps the pages)."""
        try:
            for fd in {self._write_one(slot, src) for slot, src in ops}:
                os.fdatasync(fd)
        except OSError as exc:
            self.write_errors += 1
            self.detail = f"{self._detail}; {self.write_errors} failed write(s), last: {exc.strerror or exc}"
            for slot, _ in ops:
                # A header block that cannot be rewritten either fails its checksum at recovery instead.
                with contextlib.suppress(OSError):
                    self.invalidate(slot)
            raise

    def _write_one(self, slot: int, data: memoryview) -> int:
        if len(data) % ALIGN or len(data) > self.slot_bytes:
            raise ValueError("write length must be aligned and fit the slot")
        fd, off = self._locate(slot)
        self._pwrite_all(fd, data, off)
        return fd

    def read(self, slot: int, into: Into) -> None:
        """Read from the start of a slot into an aligned buffer, or a list of them filled in order (a
        scatter read: one preadv, so a payload lands in its final buffer and only the header block in
        another); lengths are multiples of 4096."""
        fd, off = self._locate(slot)
        self._preadv_all(fd, _parts(into), off, f"NVMe slot {slot}")

    def read_many(self, ops: Sequence[SlotRead], done: Callable[[int], None] | None = None) -> None:
        """Read every (slot, destination) with up to `queue_depth` reads in flight, calling `done(i)` in
        the thread that read ops[i] as soon as it completed (so a caller's follow-up, such as verifying
        the page, runs there too, beside the other reads); returns once all ended and every `done` call
        returned, and then raises the first error if any failed (so no buffer is still being written on
        return). Ops that follow each other in adjacent slots are read with one preadv (`RUN_BYTES`);
        when it fails, every op of it fails (the caller may retry them one by one)."""
        runs = self._runs(ops)

        def one(run: list[int]) -> None:
            if len(run) == 1:
                self.read(*ops[run[0]])
            else:
                fd, off = self._locate(ops[run[0]][0])
                parts: list[memoryview] = []
                for i in run[:-1]:
                    got = _parts(ops[i][1])
                    parts += got
                    gap = self.slot_bytes - sum(p.nbytes for p in got)
                    if gap:
                        parts.append(memoryview(self._gap)[:gap])
                parts += _parts(ops[run[-1]][1])
                self._preadv_all(fd, parts, off, f"NVMe slots {ops[run[0]][0]}-{ops[run[-1]][0]}")
            if done is not None:
                for i in run:
                    done(i)

        if len(runs) == 1:  # no handoff to another thread for a single request
            one(runs[0])
            return
        pool = self._reader_pool()
        futures = [pool.submit(one, run) for run in runs[1:]]
        errors: list[BaseException | None] = []
        try:
            one(runs[0])  # the first request in this thread, while the pool's threads take the rest
        except Exception as exc:
            errors.append(exc)
        errors += [f.exception() for f in futures]  # waits for every read, failed or not
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _runs(self, ops: Sequence[SlotRead]) -> list[list[int]]:
        """The batch's ops grouped into requests: an op joins the previous one's when it reads the next
        slot of the same segment file, the previous op leaves at most 1/8 of its slot unread (read into
        `_gap`) and the request stays within RUN_BYTES (plus its header blocks) and RUN_SLOTS."""
        runs: list[list[int]] = []
        size = last_slot = last_len = 0
        for i, (slot, into) in enumerate(ops):
            n = _read_len(into)
            gap = self.slot_bytes - last_len  # the unread end of the previous slot
            if (
                runs
                and slot == last_slot + 1
                and slot % self.slots_per_segment  # the same segment file
                and gap * 8 <= self.slot_bytes
                and size + gap + n <= RUN_BYTES + (len(runs[-1]) + 1) * HEADER_BYTES  # header blocks extra
                and len(runs[-1]) < RUN_SLOTS
            ):
                runs[-1].append(i)
                size += gap + n
            else:
                runs.append([i])
                size = n
            last_slot, last_len = slot, n
        return runs

    def _preadv_all(self, fd: int, parts: list[memoryview], off: int, what: str) -> None:
        total = sum(p.nbytes for p in parts)
        done = 0
        for _ in range(_MAX_IO_RETRIES):
            if done == total:
                return
            n = os.preadv(fd, parts if not done else _skip(parts, done), off + done)
            if n <= 0:
                break
            done += n
        raise OSError(f"short read on {what}: {done}/{total} bytes")

    def _reader_pool(self) -> ThreadPoolExecutor:
        with self._readers_lock:
            if self._readers is None:
                # queue_depth - 1: the thread calling read_many does one request itself
                workers = max(1, self.queue_depth - 1)
                self._readers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore-nvme")
            return self._readers

    def invalidate(self, slot: int) -> None:
        """Durably erase a slot's header so recovery never resurrects its page."""
        fd, off = self._locate(slot)
        self._pwrite_all(fd, memoryview(self._zero), off)
        os.fdatasync(fd)

    def scan(self) -> Iterator[tuple[int, PageHeader]]:
        """Yield (slot, header) for every slot holding a valid header (recovery after restart).

        Counts the slots whose header fails its check in `scan_failures`. After the last slot: a segment
        file that holds no page and mostly other data is refused (NvmeFormatError naming it); otherwise
        the failed headers are erased (so they are counted once) and a damaged metadata file is
        rewritten, since the segment files checked out."""
        buf = mmap.mmap(-1, HEADER_BYTES)
        view = memoryview(buf)
        self.scan_failures = 0
        bad: list[int] = []
        surveys = [SegmentSurvey(SEGMENT_FMT.format(seg), 0, self.slot_bytes) for seg in range(len(self._fds))]
        try:
            for slot in range(self.num_slots):
                seg = surveys[slot // self.slots_per_segment]
                try:
                    self.read(slot, view)
                except OSError as exc:
                    seg.counts[SlotState.UNREADABLE] += 1
                    log.warning("NVMe slot %d unreadable during recovery: %s", slot, exc)
                    continue
                state, hdr, why = classify(view)
                seg.counts[state] += 1
                if hdr is not None:
                    yield slot, hdr
                elif state is not SlotState.BLANK:
                    bad.append(slot)
                    log.warning("NVMe slot %d ignored during recovery: %s", slot, why)
        finally:
            view.release()
            buf.close()
        self.scan_failures = sum(s.failures for s in surveys)
        if self.scan_failures:
            log.warning("NVMe recovery ignored %d slot(s) with invalid headers", self.scan_failures)
        for seg in surveys:
            if seg.foreign:
                raise NvmeFormatError(foreign_message(self.path, seg))
        for slot in bad:  # counted once: erased, so the next restart does not count them again
            with contextlib.suppress(OSError):
                self.invalidate(slot)
        if self._meta_damage is not None:
            write_meta(self.path, Geometry(self.slot_bytes, self.slots_per_segment))
            log.warning(
                "NVMe metadata %s rebuilt (%s) from %d segment file(s)",
                self.path / META_NAME,
                self._meta_damage,
                len(surveys),
            )
            self._meta_damage = None

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

    def slot_location(self, slot: int) -> tuple[str, int]:
        """(segment file, byte offset) of a slot: for operators and corruption tests."""
        seg, idx = divmod(slot, self.slots_per_segment)
        return str(self.path / SEGMENT_FMT.format(seg)), idx * self.slot_bytes

    def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self._zero.close()
        with contextlib.suppress(BufferError):  # a view may live on for a moment in a finished request
            self._gap.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the directory for the next node
            self._lock_fd = -1


def _parts(into: Into) -> list[memoryview]:
    return [into] if isinstance(into, memoryview) else list(into)


def _read_len(into: Into) -> int:
    return into.nbytes if isinstance(into, memoryview) else sum(p.nbytes for p in into)


def _skip(parts: Sequence[memoryview], n: int) -> list[memoryview]:
    """The buffers left to fill once the first `n` bytes of `parts` were read (after a short read)."""
    out: list[memoryview] = []
    for p in parts:
        if n >= p.nbytes:
            n -= p.nbytes
            continue
        out.append(p[n:] if n else p)
        n = 0
    return out
