"""Recovery of the NVMe tier after a restart: the scan that finds every page a segment file holds, and what it
repairs on the way (failed header blocks erased, an older build's directory adopted, a damaged or missing
metadata file rewritten). Part of `NvmeMedium` (nvme.py), which supplies the attributes `NvmeRecovery`
annotates; what a header block holds and the metadata file's format: nvme_meta.py (DESIGN.md §5.3).

Invariant: only a block at a header position of its chunk's class (named by the chunk's first block) is read
as a page; a page is yielded only with a header that passes its check; a segment file that holds nothing of
ours and mostly other data is refused (NvmeFormatError naming it) before anything is erased or rewritten.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from kvstore.pageformat import HEADER_BYTES, PageHeader
from kvstore.tiers.base import Into
from kvstore.tiers.nvme_meta import (
    META_NAME,
    SEGMENT_FMT,
    Geometry,
    NvmeFormatError,
    SegmentSurvey,
    SlotState,
    chunk_class,
    classify,
    foreign_message,
    grid,
    slot_state,
    write_meta,
)

log = logging.getLogger("kvstore.tiers.nvme")  # NOTE: the medium's name (nvme.py): one logger for the tier


class NvmeRecovery:
    """`NvmeMedium.scan` and the erasing it does; the medium supplies the attributes and I/O annotated here."""

    path: Path
    chunk_bytes: int
    chunks_per_segment: int
    segment_bytes: int
    num_chunks: int
    geometry: Geometry
    chunk_classes: dict[int, int]
    scan_failures: int
    _meta_damage: str | None
    _fds: list[int]

    read: Callable[[int, Into], None]
    _locate: Callable[..., tuple[int, int]]  # (segment fd, offset in it) of a header block
    _pwrite_block: Callable[[int, int, bytes | None], None]

    def scan(self) -> Iterator[tuple[int, PageHeader]]:
        """Yield (offset, header) for every slot holding a valid page header (recovery after restart), and
        fill `chunk_classes`.

        Two passes: every chunk's first block (its class), then the header positions of each chunk's class.
        Counts the header blocks that fail their check in `scan_failures`. After the last one: a segment
        file that holds nothing of ours and mostly other data is refused (NvmeFormatError naming it);
        otherwise the failed headers are erased (so they are counted once) and a damaged, missing or older
        metadata file is rewritten, since the segment files checked out. An older build's directory
        (`Geometry.legacy`, or a rebuilt one with no chunk marker anywhere: it cannot be told apart) is
        adopted: each chunk keeps the page at its start, the other header positions of its class are
        erased (they may hold an older, longer page's payload)."""
        buf = mmap.mmap(-1, HEADER_BYTES)
        view = memoryview(buf)
        self.scan_failures = 0
        self.chunk_classes = {}
        bad: list[int] = []  # header blocks to erase after the scan
        surveys = [SegmentSurvey(SEGMENT_FMT.format(seg), 0, self.chunk_bytes) for seg in range(len(self._fds))]

        def look(offset: int) -> tuple[SlotState, PageHeader | None] | None:
            """Read and classify one header block (None: unreadable, counted)."""
            try:
                self.read(offset, view)
            except OSError as exc:
                surveys[offset // self.segment_bytes].counts[SlotState.UNREADABLE] += 1
                log.warning("NVMe header at %d unreadable during recovery: %s", offset, exc)
                return None
            state, hdr, why = classify(view)
            if why:
                log.warning("NVMe header at %d ignored during recovery: %s", offset, why)
            return state, hdr

        try:
            markers = False
            for chunk in range(self.num_chunks):  # pass 1: what each chunk holds
                base = chunk * self.chunk_bytes
                seg = surveys[base // self.segment_bytes]
                seg.chunks += 1
                got = look(base)
                if got is None:
                    continue
                state, hdr = got
                cls = chunk_class(state, hdr, view, self.chunk_bytes)
                if state in (SlotState.PAGE, SlotState.CHUNK) and not cls:
                    log.warning("NVMe chunk %d: its first block names slots that do not fit it; ignored", chunk)
                    state = SlotState.TORN
                seg.note(state, hdr)
                markers = markers or state is SlotState.CHUNK
                if cls:
                    self.chunk_classes[chunk] = cls
                    if hdr is not None:
                        yield base, hdr
                elif state is not SlotState.BLANK:
                    bad.append(base)
            legacy = self.geometry.legacy or (self._meta_damage is not None and not markers)
            adopted: list[int] = []  # header positions of an older build's chunk tails, erased as it is adopted
            for chunk, cls in self.chunk_classes.items():  # pass 2: the rest of each chunk's grid
                base = chunk * self.chunk_bytes
                if legacy:
                    adopted += [base + rel for rel in grid(self.chunk_bytes, cls)]
                    continue
                seg = surveys[base // self.segment_bytes]
                for rel in grid(self.chunk_bytes, cls):
                    got = look(base + rel)
                    if got is None:
                        continue
                    state = slot_state(got[0], got[1], cls)
                    seg.note(state, got[1])
                    if state is SlotState.PAGE and got[1] is not None:
                        yield base + rel, got[1]
                    elif state is not SlotState.BLANK:
                        bad.append(base + rel)
        finally:
            view.release()
            buf.close()
        self.scan_failures = sum(s.failures for s in surveys)
        if self.scan_failures:
            log.warning("NVMe recovery ignored %d header block(s) that failed their check", self.scan_failures)
        for seg in surveys:
            if seg.foreign:
                raise NvmeFormatError(foreign_message(self.path, seg))
        # Counted once: erased, so the next restart does not count them again. Best effort: a block that
        # cannot be erased fails its check again next time.
        with contextlib.suppress(OSError):
            self._erase(bad)
        if legacy and adopted:
            self._erase(adopted)
            log.warning(
                "NVMe tier %s adopted from an older build: %d chunk(s) keep their first page, %d header "
                "position(s) after them erased",
                self.path,
                len(self.chunk_classes),
                len(adopted),
            )
        if self._meta_damage is not None or self.geometry.legacy:
            self.geometry = Geometry(self.chunk_bytes, self.chunks_per_segment)
            write_meta(self.path, self.geometry)
            if self._meta_damage is not None:
                log.warning(
                    "NVMe metadata %s rebuilt (%s) from %d segment file(s)",
                    self.path / META_NAME,
                    self._meta_damage,
                    len(surveys),
                )
            self._meta_damage = None

    def _erase(self, offsets: list[int]) -> None:
        """Zero the header blocks at `offsets`, then sync each segment file touched once."""
        touched = set()
        for offset in offsets:
            fd, off = self._locate(offset)
            self._pwrite_block(fd, off, None)
            touched.add(fd)
        for fd in touched:
            os.fdatasync(fd)
