"""The NVMe tier's metadata file, its chunk markers and the survey of its segment files (the checks behind
recovery and `kvstore nvme check|repair`).

The metadata file (`kvstore-nvme.json`) records the geometry the segment files were formatted with,
and carries its own checksum:

    {"format": 3, "chunk_bytes": N, "chunks_per_segment": M, "checksum": "<XXH3-64 hex of the rest>"}

The segment files are chunks of `chunk_bytes` back to back; a chunk holds slots of one size, its class
(kvstore/tiers/slots.py): header blocks at `j * class` from the chunk's start and nowhere else. The
chunk's first block says the class, and only the node ever writes it: a page header (its slot is
`slot_bytes_for(payload_len)`) or, while that first slot is free, a chunk marker (`pack_marker`):

    magic "KVCH" | version u16 | flags u16 | slot_bytes u64 | chunk_bytes u64 | checksum u64 (XXH3-64 of the
    bytes before it), zero padded to 4 KiB

A blank first block (zeros) is a free chunk. So recovery reads a chunk's first block, then the headers of
its class's grid, and never reads a client's payload bytes as a header (DESIGN.md §5.2): a chunk taken
for another class has every header position of the new class erased first (`NvmeMedium.format`).

Formats 1 and 2 (older builds: {"slot_bytes": S, "slots_per_segment": M}) are the same files with one
page per chunk, at its start: an older build's slot is a chunk here (`Geometry.legacy`). Their chunk tails
may hold any bytes of an earlier, longer page, so the first start of this build reads only each chunk's
first block, erases the other header positions of the class found there, and rewrites the file as
format 3 (an adoption: every page is kept, `NvmeMedium.scan`).

Why the geometry is all the file holds: every page header sits on its chunk's grid and carries its own
checksum, length and key, so the segment files themselves say what they hold. A damaged metadata file
is therefore rebuilt from the node's geometry once the segment files check out against it (see
`judge`); what cannot be told apart from another program's data is refused with a message that names
the file, what is wrong and the command that fixes it.

Slot classification (`classify`) is pure; the survey reads only header blocks.
"""

from __future__ import annotations

import enum
import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import xxhash

from kvstore.pageformat import HEADER_BYTES, MAGIC, HeaderError, PageHeader, slot_bytes_for

META_NAME = "kvstore-nvme.json"
SEGMENT_FMT = "seg-{:05d}.kvs"
SEGMENT_RE = re.compile(r"seg-(\d{5})\.kvs")
META_FORMAT = 3  # 1, 2: an older build's fixed slots (`Geometry.legacy`): read, adopted, rewritten as 3
REPAIR_HINT = "kvstore nvme repair --nvme-path {path} --max-page-bytes N"
CHUNK_MAGIC = b"KVCH"
_MARKER = struct.Struct("<4sHHQQ")
_MARKER_VERSION = 1


class NvmeFormatError(RuntimeError):
    """The directory holds segments of another geometry or format, or data that is not ours; refusing
    to reuse it. The message names the file, what is wrong and what to run."""


class MetaDamaged(ValueError):
    """The metadata file exists but cannot be trusted (unreadable, not JSON, checksum mismatch)."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """How the segment files are cut: chunks of `chunk_bytes`, `chunks_per_segment` of them per file.
    `legacy`: read from an older build's file (format 1 or 2), whose chunks hold one page each, at their
    start, and whose other bytes are not known to be ours (module docstring)."""

    chunk_bytes: int
    chunks_per_segment: int
    legacy: bool = False

    @property
    def segment_bytes(self) -> int:
        return self.chunk_bytes * self.chunks_per_segment

    def as_dict(self) -> dict[str, int]:
        return {"format": META_FORMAT, "chunk_bytes": self.chunk_bytes, "chunks_per_segment": self.chunks_per_segment}

    def same_layout(self, other: Geometry) -> bool:
        """The same chunks and segment files (formats aside)."""
        return (self.chunk_bytes, self.chunks_per_segment) == (other.chunk_bytes, other.chunks_per_segment)


def _body_checksum(body: dict[str, object]) -> str:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"{xxhash.xxh3_64_intdigest(canon):016x}"


def encode_meta(geom: Geometry) -> bytes:
    """The metadata file's bytes (always the current format): the geometry and the checksum of its canonical
    JSON."""
    body: dict[str, object] = dict(geom.as_dict())
    body["checksum"] = _body_checksum(geom.as_dict())  # type: ignore[arg-type]
    return json.dumps(body, sort_keys=True).encode() + b"\n"


def decode_meta(raw: bytes) -> Geometry:
    """The geometry a metadata file records; MetaDamaged (saying what is wrong) when it cannot be trusted."""
    try:
        have = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise MetaDamaged(f"not UTF-8 text (byte {exc.start} is {raw[exc.start]:#04x})") from None
    except ValueError as exc:
        raise MetaDamaged(f"not JSON ({exc})") from None
    if not isinstance(have, dict):
        raise MetaDamaged("not a JSON object")
    fmt = have.get("format")
    if fmt not in (1, 2, META_FORMAT):
        raise MetaDamaged(f"unknown format {fmt!r} (this build reads 1 to {META_FORMAT})")
    names = ("chunk_bytes", "chunks_per_segment") if fmt == META_FORMAT else ("slot_bytes", "slots_per_segment")
    try:
        geom = Geometry(int(have[names[0]]), int(have[names[1]]), legacy=fmt != META_FORMAT)
    except (KeyError, TypeError, ValueError):
        raise MetaDamaged(f"{names[0]} / {names[1]} missing or not integers") from None
    if fmt != 1:
        body = {k: v for k, v in have.items() if k != "checksum"}
        if have.get("checksum") != _body_checksum(body):
            raise MetaDamaged("checksum mismatch (the file was changed or damaged)")
    if geom.chunk_bytes <= 0 or geom.chunk_bytes % HEADER_BYTES or geom.chunks_per_segment <= 0:
        raise MetaDamaged(f"geometry out of range: {geom}")
    return geom


def write_meta(path: Path, geom: Geometry) -> None:
    """Atomically (re)write the metadata file of directory `path`, in the current format."""
    meta = path / META_NAME
    tmp = meta.with_suffix(".tmp")
    tmp.write_bytes(encode_meta(geom))
    os.replace(tmp, meta)


def pack_marker(slot_bytes: int, chunk_bytes: int) -> bytes:
    """The 4 KiB block at the start of a chunk of class `slot_bytes` whose first slot is free."""
    body = _MARKER.pack(CHUNK_MAGIC, _MARKER_VERSION, 0, slot_bytes, chunk_bytes)
    body += struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    return body + bytes(HEADER_BYTES - len(body))


def unpack_marker(block: bytes | memoryview) -> tuple[int, int]:
    """(slot_bytes, chunk_bytes) of a chunk marker; HeaderError when the block is not a sound one."""
    if len(block) < _MARKER.size + 8:
        raise HeaderError("chunk marker too short")
    magic, version, _flags, slot, chunk = _MARKER.unpack_from(block)
    if magic != CHUNK_MAGIC:
        raise HeaderError("no chunk marker")
    (stored,) = struct.unpack_from("<Q", block, _MARKER.size)
    if xxhash.xxh3_64_intdigest(bytes(block[: _MARKER.size])) != stored:
        raise HeaderError("chunk marker checksum mismatch (torn or corrupt)")
    if version != _MARKER_VERSION:
        raise HeaderError(f"chunk marker version {version} is not supported")
    if slot <= 0 or slot % HEADER_BYTES or slot > chunk:
        raise HeaderError(f"chunk marker names slots of {slot} B in a chunk of {chunk} B")
    return slot, chunk


class SlotState(enum.Enum):
    BLANK = "blank"  # never written, or erased (first 4 bytes zero)
    PAGE = "page"  # a valid page header
    CHUNK = "chunk"  # a chunk marker: the chunk's first slot is free, its class is known
    TORN = "torn"  # our magic, but the header fails its checksum or fields (torn write, bit rot)
    FOREIGN = "foreign"  # other bytes: not a header we wrote (bit rot of the magic, or not our file)
    UNREADABLE = "unreadable"  # the read failed (I/O error)


def classify(block: bytes | memoryview) -> tuple[SlotState, PageHeader | None, str]:
    """What a header block holds: (state, header when PAGE, why when not)."""
    head = bytes(block[:4])
    if head == b"\0\0\0\0":
        return SlotState.BLANK, None, ""
    if head == CHUNK_MAGIC:
        try:
            unpack_marker(block)
        except HeaderError as exc:
            return SlotState.TORN, None, str(exc)
        return SlotState.CHUNK, None, ""
    if head != MAGIC:
        return SlotState.FOREIGN, None, "no page header magic"
    try:
        return SlotState.PAGE, PageHeader.unpack(block), ""
    except HeaderError as exc:
        return SlotState.TORN, None, str(exc)


def chunk_class(state: SlotState, hdr: PageHeader | None, block: bytes | memoryview, chunk_bytes: int) -> int:
    """The slot size a chunk holds, from what its first block holds (`classify`): a page's own slot, or the
    marker's; 0 when the chunk is free (blank) or its class cannot be known (torn, foreign, or a page or
    marker that does not fit the chunk: nothing else in it can be read safely)."""
    if state is SlotState.PAGE and hdr is not None:
        cls = slot_bytes_for(hdr.payload_len)
    elif state is SlotState.CHUNK:
        cls, chunk = unpack_marker(block)
        if chunk != chunk_bytes:
            return 0
    else:
        return 0
    return cls if cls <= chunk_bytes else 0


def slot_state(state: SlotState, hdr: PageHeader | None, slot_bytes: int) -> SlotState:
    """What a header position after a chunk's first holds, under the chunk's class: a page of another size,
    or a marker (only ever at a chunk's start), is not a page of this chunk (TORN: a crash mid-`format`)."""
    other_size = state is SlotState.PAGE and hdr is not None and slot_bytes_for(hdr.payload_len) != slot_bytes
    if state is SlotState.CHUNK or other_size:
        return SlotState.TORN
    return state


def grid(chunk_bytes: int, slot_bytes: int) -> range:
    """Offsets, from a chunk's start, of the header blocks of its slots after the first."""
    return range(slot_bytes, chunk_bytes // slot_bytes * slot_bytes, slot_bytes)


@dataclass(slots=True)
class SegmentSurvey:
    """What one segment file holds at its slot boundaries."""

    name: str
    size: int  # bytes on disk now
    chunk_bytes: int
    counts: dict[SlotState, int] = field(default_factory=lambda: dict.fromkeys(SlotState, 0))
    formats: dict[int, int] = field(default_factory=dict)  # page headers per format version (pageformat)
    chunks: int = 0  # chunk starts read
    classes: dict[int, int] = field(default_factory=dict)  # chunks per slot size (those holding a class)
    erase: list[int] = field(default_factory=list)  # file offsets of header blocks a repair zeroes

    def note(self, state: SlotState, hdr: PageHeader | None) -> None:
        self.counts[state] += 1
        if state is SlotState.PAGE and hdr is not None:
            self.formats[hdr.version] = self.formats.get(hdr.version, 0) + 1

    @property
    def slots(self) -> int:
        return sum(self.counts.values())

    @property
    def cut(self) -> bool:
        """Truncated mid-chunk (a whole-chunk truncation cannot be told from a tier that grew, and loses
        nothing that a blank chunk would not)."""
        return self.size % self.chunk_bytes != 0

    @property
    def foreign(self) -> bool:
        """No page header or chunk marker anywhere and most chunk starts hold other data: not a segment of
        this tier (a stray file, or one written with another geometry). Bit rot alone never gets here: it
        leaves pages."""
        c = self.counts
        ours = c[SlotState.PAGE] + c[SlotState.CHUNK] + c[SlotState.TORN]
        return ours == 0 and c[SlotState.FOREIGN] * 2 > self.chunks

    @property
    def failures(self) -> int:
        """Slots whose header failed its check (counted as checksum failures of the tier)."""
        c = self.counts
        return c[SlotState.TORN] + c[SlotState.FOREIGN] + c[SlotState.UNREADABLE]


def foreign_message(path: Path, seg: SegmentSurvey) -> str:
    c = seg.counts
    return (
        f"{path / seg.name}: not a segment of this NVMe tier ({c[SlotState.FOREIGN]} of {seg.slots} slot headers hold "
        f"other data, none a page header; another program's file, or segments of another geometry). "
        f"Move it away, point --nvme-path at an empty directory, or run `{REPAIR_HINT.format(path=path)} "
        "--discard-foreign` to reformat it (its contents are discarded)"
    )


def segment_names(path: Path) -> list[str]:
    """Segment files present in the directory, in index order."""
    return sorted(p.name for p in path.iterdir() if SEGMENT_RE.fullmatch(p.name)) if path.is_dir() else []


def survey(path: Path, geom: Geometry) -> list[SegmentSurvey]:
    """Read the header blocks of every segment file present, under geometry `geom`: each chunk's first
    block, then (unless `geom.legacy`: one page per chunk) the header positions of the class it names; and
    note what a repair erases (`SegmentSurvey.erase`: headers that fail their check, the header of a slot
    a truncation cut in two, and, adopting an older build's files, the header positions after each chunk's
    first page).

    Buffered reads (no O_DIRECT): this is a check, run by `kvstore nvme check|repair`, not by a node.
    """
    out = []
    for name in segment_names(path):
        size = (path / name).stat().st_size
        seg = SegmentSurvey(name, size, geom.chunk_bytes)
        with open(path / name, "rb") as f:

            def block_at(off: int, f: BinaryIO = f) -> bytes:
                f.seek(off)
                return f.read(HEADER_BYTES).ljust(HEADER_BYTES, b"\0")

            for base in range(0, size, geom.chunk_bytes):
                seg.chunks += 1
                block = block_at(base)
                state, hdr, _ = classify(block)
                cls = chunk_class(state, hdr, block, geom.chunk_bytes)
                if state in (SlotState.PAGE, SlotState.CHUNK) and not cls:
                    state = SlotState.TORN  # a page or marker that does not fit the chunk
                seg.note(state, hdr)
                if not cls:
                    if state is not SlotState.BLANK:
                        seg.erase.append(base)
                    continue
                seg.classes[cls] = seg.classes.get(cls, 0) + 1
                for rel in grid(geom.chunk_bytes, cls):
                    if geom.legacy:
                        seg.erase.append(base + rel)
                        continue
                    if base + rel >= size:
                        break
                    state, hdr, _ = classify(block_at(base + rel))
                    state = slot_state(state, hdr, cls)
                    seg.note(state, hdr)
                    if state not in (SlotState.BLANK, SlotState.PAGE):
                        seg.erase.append(base + rel)
                if base + geom.chunk_bytes > size:  # the chunk a truncation cut: the slot it went through
                    cut = (size - base) // cls * cls
                    if cut < size - base and cut + cls <= geom.chunk_bytes and base + cut not in seg.erase:
                        seg.erase.append(base + cut)
        out.append(seg)
    return out
