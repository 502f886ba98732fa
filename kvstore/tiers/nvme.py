"""NVMe tier: preallocated segment files of chunks, each holding O_DIRECT-aligned slots of one size.

Methods here block (pread/pwrite/fdatasync); the manager calls them from its I/O thread pool, never on
the event loop. `read_many` keeps up to `queue_depth` O_DIRECT requests in flight (a thread each: preadv
releases the GIL, and a device only reaches its bandwidth with a deep queue); ops of a batch that read
neighbouring slots go out as one preadv (up to RUN_BYTES), and a read may scatter one slot over several
buffers, so a payload lands in its final place (measured in benchmarks/RESULTS.md). Durability rule: `write`
returns only after the slot's header and payload are on stable storage (fdatasync), and the manager
makes a page visible only after that, so whatever a restarted node finds with a valid header was durably
and completely written. `write_many` writes every
slot first and then syncs each touched segment file once: same rule, one flush per file.

Where headers are (kvstore/tiers/nvme_meta.py): a chunk's first block names its class (a page header or
a chunk marker), and its other header blocks sit at multiples of that class; recovery reads only those.
Two rules keep that true: a chunk taken for another class has every header position of the new class
erased before any slot of it is written (`format`), and erasing a chunk's first slot leaves a marker of
its class there, never zeros, so the chunk's other pages stay findable (`invalidate`).

The directory's checks at start: nvme_dir.py; recovery after a restart (`scan`): nvme_recovery.py.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvstore.names import TierKind
from kvstore.pageformat import ALIGN, HEADER_BYTES
from kvstore.tiers.base import Into, Medium, SlotIO, SlotRead
from kvstore.tiers.nvme_dir import NvmeSpaceError, check_meta, check_private_dir, check_space, lock_dir
from kvstore.tiers.nvme_meta import (
    META_NAME,
    SEGMENT_FMT,
    Geometry,
    NvmeFormatError,
    chunk_class,
    classify,
    grid,
    pack_marker,
)
from kvstore.tiers.nvme_recovery import NvmeRecovery

__all__ = ["META_NAME", "SEGMENT_FMT", "NvmeFormatError", "NvmeMedium", "NvmeSpaceError"]  # importable here

log = logging.getLogger(__name__)

_MAX_IO_RETRIES = 64  # a short read/write is retried; this bounds the loop on a misbehaving device
QUEUE_DEPTH = 16  # reads kept in flight by read_many: what NVMe devices need to approach their bandwidth
# read_many reads neighbouring slots of a batch with one preadv, up to this many bytes (not counting the
# slots' header blocks, so two 4 MiB pages make one request) and slots per call:
# fewer syscalls and thread handoffs per page, and large requests the device serves at full speed, while
# a batch of large pages still keeps several requests in flight.
RUN_BYTES = 8 << 20
RUN_SLOTS = 64  # each slot adds up to 4 buffers to the preadv: far below IOV_MAX (1024)


class NvmeMedium(NvmeRecovery, Medium):
    """`num_chunks` chunks of `chunk_bytes`, striped over segment files of `chunks_per_segment` chunks; offset
    o is byte o % segment_bytes of segment file o // segment_bytes.

    The directory's own geometry wins when it has one (its metadata file) and its chunks hold this node's
    largest slot: a node restarted with a smaller `--max-page-bytes` or another segment size keeps its
    pages; one whose largest slot no longer fits a chunk is refused (NvmeFormatError)."""

    kind = TierKind.NVME
    persistent = True
    queue_depth = QUEUE_DEPTH
    scatter_reads = True

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, chunk_bytes: int, segment_bytes: int) -> None:
        if chunk_bytes <= 0 or chunk_bytes % ALIGN:
            raise ValueError("chunk_bytes must be a positive multiple of 4096")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        check_private_dir(self.path)
        self._lock_fd = lock_dir(self.path)
        self._fds: list[int] = []
        self.chunk_classes = {}
        try:
            want = Geometry(chunk_bytes, max(1, segment_bytes // chunk_bytes))
            # the directory's geometry, and what was wrong with its metadata file (if anything)
            self.geometry, self._meta_damage = check_meta(self.path, want)
            self.chunk_bytes = self.geometry.chunk_bytes
            self.chunks_per_segment = self.geometry.chunks_per_segment
            self.segment_bytes = self.geometry.segment_bytes
            self.num_chunks = capacity_bytes // self.chunk_bytes
            self.direct_io = True
            self._readers: ThreadPoolExecutor | None = None  # read_many's threads, started on first use
            self._readers_lock = threading.Lock()
            self.write_errors = 0
            n_segments = -(-self.num_chunks // self.chunks_per_segment)
            sizes = [
                min(self.chunks_per_segment, self.num_chunks - seg * self.chunks_per_segment) * self.chunk_bytes
                for seg in range(n_segments)
            ]
            check_space(self.path, sizes, self.chunk_bytes)
            self._zero = mmap.mmap(-1, HEADER_BYTES)  # aligned zero block for erasing (O_DIRECT needs it)
            self._block = mmap.mmap(-1, HEADER_BYTES)  # where markers are built (aligned); I/O pool only
            self._block_lock = threading.Lock()
            # Where read_many drops the unread bytes between two slots it reads as one request. Several
            # threads may read into it at once: nobody ever reads it back.
            self._gap = mmap.mmap(-1, self.chunk_bytes)
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
        if old_size % self.chunk_bytes and old_size < size:
            # Truncated mid-chunk (a whole-chunk cut cannot be told from a tier that grew, and loses only what
            # blank chunks would): pages wholly before the cut are intact, the one cut in two is erased.
            log.warning(
                "%s was truncated to %d bytes (inside chunk %d): what followed is empty now; "
                "the page cut in two is erased",
                name,
                old_size,
                old_size // self.chunk_bytes,
            )
            self._erase_cut(fd, old_size)
        return fd

    def _erase_cut(self, fd: int, cut: int) -> None:
        """Erase the header of the slot a truncation at file offset `cut` went through, found by the class
        its chunk's first block names (nothing to erase when the cut is on a slot boundary or the chunk
        holds no class)."""
        base = cut // self.chunk_bytes * self.chunk_bytes
        with memoryview(self._block) as view:
            self._preadv_all(fd, [view], base, f"the chunk at {base} of a truncated segment")
            state, hdr, _ = classify(view)
            cls = chunk_class(state, hdr, view, self.chunk_bytes)
        if not cls or (cut - base) % cls == 0 or (cut - base) // cls >= self.chunk_bytes // cls:
            return
        at = base + (cut - base) // cls * cls
        block = pack_marker(cls, self.chunk_bytes) if at == base else None
        self._pwrite_block(fd, at, block)
        os.fdatasync(fd)

    def _locate(self, offset: int, nbytes: int = HEADER_BYTES) -> tuple[int, int]:
        """(segment fd, offset in that file) of a range, which must lie inside one chunk of the medium (a
        read of neighbouring slots checks its own range)."""
        self.check_range(offset, nbytes)
        if nbytes and offset // self.chunk_bytes != (offset + nbytes - 1) // self.chunk_bytes:
            raise IndexError(f"NVMe range [{offset}, +{nbytes}) crosses a chunk boundary")
        seg, off = divmod(offset, self.segment_bytes)
        return self._fds[seg], off

    def write(self, offset: int, src: memoryview) -> None:
        """Durably write `src` (a whole slot: header block + payload, aligned length, aligned buffer)."""
        self.write_many([(offset, src)])

    def write_many(self, ops: Sequence[SlotIO]) -> None:
        """Write every slot, then make them durable with one fdatasync per segment file touched.

        On failure (ENOSPC, EIO) the slots of the batch are erased, best effort, so a restart never finds
        a half-written page there, and the error is raised (the manager drops or keeps the pages)."""
        try:
            for fd in {self._write_one(offset, src) for offset, src in ops}:
                os.fdatasync(fd)
        except OSError as exc:
            self.write_errors += 1
            self.detail = f"{self._detail}; {self.write_errors} failed write(s), last: {exc.strerror or exc}"
            for offset, src in ops:
                # A header block that cannot be rewritten either fails its checksum at recovery instead.
                with contextlib.suppress(OSError, IndexError, ValueError):
                    self.invalidate(offset, len(src))
            raise

    def _write_one(self, offset: int, data: memoryview) -> int:
        if len(data) % ALIGN or not 0 < len(data) <= self.chunk_bytes:
            raise ValueError("write length must be aligned and fit a chunk")
        fd, off = self._locate(offset, len(data))
        self._pwrite_all(fd, data, off)
        return fd

    def read(self, offset: int, into: Into) -> None:
        """Read from a slot into an aligned buffer, or a list of them filled in order (a scatter read: one
        preadv, so a payload lands in its final buffer and only the header block in another); lengths are
        multiples of 4096."""
        fd, off = self._locate(offset, _read_len(into))
        self._preadv_all(fd, _parts(into), off, f"NVMe slot at {offset}")

    def read_many(self, ops: Sequence[SlotRead], done: Callable[[int], None] | None = None) -> None:
        """Read every (offset, destination) with up to `queue_depth` reads in flight, calling `done(i)` in
        the thread that read ops[i] as soon as it completed (so a caller's follow-up, such as verifying
        the page, runs there too, beside the other reads); returns once all ended and every `done` call
        returned, and then raises the first error if any failed (so no buffer is still being written on
        return). Ops that follow each other in neighbouring slots are read with one preadv (`RUN_BYTES`);
        when it fails, every op of it fails (the caller may retry them one by one)."""
        runs = self._runs(ops)

        def one(run: list[int]) -> None:
            if len(run) == 1:
                self.read(*ops[run[0]])
            else:
                first, last = ops[run[0]][0], ops[run[-1]][0]
                fd, off = self._locate(first, 0)
                self.check_range(last, _read_len(ops[run[-1]][1]))
                parts: list[memoryview] = []
                for i, nxt in itertools.pairwise(run):
                    got = _parts(ops[i][1])
                    parts += got
                    gap = ops[nxt][0] - ops[i][0] - sum(p.nbytes for p in got)
                    if gap:
                        parts.append(memoryview(self._gap)[:gap])
                parts += _parts(ops[run[-1]][1])
                self._preadv_all(fd, parts, off, f"NVMe slots at {first}-{last}")
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
        """The batch's ops grouped into requests: an op joins the previous one's when it starts after the
        previous read ends, in the same segment file, the bytes left unread between them (read into `_gap`:
        the end of the previous slot, the end of a chunk) are at most 1/8 of the distance between the two
        starts, and the request stays within RUN_BYTES (plus its header blocks) and RUN_SLOTS."""
        runs: list[list[int]] = []
        size = last_off = last_len = 0
        for i, (offset, into) in enumerate(ops):
            n = _read_len(into)
            gap = offset - last_off - last_len  # unread bytes after the previous read
            if (
                runs
                and gap >= 0
                and offset // self.segment_bytes == last_off // self.segment_bytes  # the same segment file
                and gap * 8 <= offset - last_off
                and size + gap + n <= RUN_BYTES + (len(runs[-1]) + 1) * HEADER_BYTES  # header blocks extra
                and len(runs[-1]) < RUN_SLOTS
            ):
                runs[-1].append(i)
                size += gap + n
            else:
                runs.append([i])
                size = n
            last_off, last_len = offset, n
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

    def invalidate(self, offset: int, slot_bytes: int) -> None:
        """Durably erase a slot's header so recovery never resurrects its page. A chunk's first slot gets a
        marker of the chunk's class instead of zeros: the chunk's other slots stay findable."""
        fd, off = self._locate(offset)
        marker = pack_marker(slot_bytes, self.chunk_bytes) if offset % self.chunk_bytes == 0 else None
        self._pwrite_block(fd, off, marker)
        os.fdatasync(fd)

    def needs_format(self, slot_bytes: int) -> bool:
        """Only a size with header positions after a chunk's first: a chunk of one slot is laid out by the
        page written into it (its header names the size; nothing else in the chunk is ever read)."""
        return bool(grid(self.chunk_bytes, slot_bytes))

    def format(self, chunk_offset: int, slot_bytes: int) -> None:
        """Lay a free chunk out for slots of `slot_bytes`: erase every header position of that class after
        the first (durably, so no old bytes there are read as a page header after a restart), then mark the
        class at the chunk's start (made durable by the first write into the chunk, which follows)."""
        if chunk_offset % self.chunk_bytes:
            raise ValueError(f"offset {chunk_offset} is not a chunk start")
        fd, off = self._locate(chunk_offset)
        positions = grid(self.chunk_bytes, slot_bytes)
        for rel in positions:
            self._pwrite_block(fd, off + rel, None)
        if positions:
            os.fdatasync(fd)
        self._pwrite_block(fd, off, pack_marker(slot_bytes, self.chunk_bytes))

    def _pwrite_block(self, fd: int, off: int, block: bytes | None) -> None:
        """Write one header block at a file offset: `block` (4 KiB), or zeros when None."""
        if block is None:
            self._pwrite_all(fd, memoryview(self._zero), off)
            return
        with self._block_lock, memoryview(self._block) as view:  # O_DIRECT needs an aligned buffer
            view[:] = block
            self._pwrite_all(fd, view, off)

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

    def slot_location(self, offset: int) -> tuple[str, int]:
        """(segment file, byte offset) of a slot: for operators and corruption tests."""
        seg, off = divmod(offset, self.segment_bytes)
        return str(self.path / SEGMENT_FMT.format(seg)), off

    def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self._zero.close()
        self._block.close()
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
