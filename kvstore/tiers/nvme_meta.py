"""The NVMe tier's metadata file and the survey of its segment files (the checks behind recovery and
`kvstore nvme check|repair`).

The metadata file (`kvstore-nvme.json`) records the geometry the segment files were formatted with,
and carries its own checksum:

    {"format": 2, "slot_bytes": N, "slots_per_segment": M, "checksum": "<XXH3-64 hex of the rest>"}

Why the geometry is all it holds: every page header sits at a slot boundary and carries its own
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
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvstore.pageformat import HEADER_BYTES, MAGIC, HeaderError, PageHeader

META_NAME = "kvstore-nvme.json"
SEGMENT_FMT = "seg-{:05d}.kvs"
SEGMENT_RE = re.compile(r"seg-(\d{5})\.kvs")
META_FORMAT = 2  # 1: the same fields without a checksum (read, then rewritten as 2)
REPAIR_HINT = "kvstore nvme repair --nvme-path {path} --max-page-bytes N"


class NvmeFormatError(RuntimeError):
    """The directory holds segments of another geometry or format, or data that is not ours; refusing
    to reuse it. The message names the file, what is wrong and what to run."""


class MetaDamaged(ValueError):
    """The metadata file exists but cannot be trusted (unreadable, not JSON, checksum mismatch)."""


@dataclass(frozen=True, slots=True)
class Geometry:
    slot_bytes: int
    slots_per_segment: int

    def as_dict(self) -> dict[str, int]:
        return {"format": META_FORMAT, "slot_bytes": self.slot_bytes, "slots_per_segment": self.slots_per_segment}


def _body_checksum(body: dict[str, object]) -> str:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"{xxhash.xxh3_64_intdigest(canon):016x}"


def encode_meta(geom: Geometry) -> bytes:
    """The metadata file's bytes: the geometry and the checksum of its canonical JSON."""
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
    if fmt not in (1, META_FORMAT):
        raise MetaDamaged(f"unknown format {fmt!r} (this build reads 1 and {META_FORMAT})")
    try:
        geom = Geometry(int(have["slot_bytes"]), int(have["slots_per_segment"]))
    except (KeyError, TypeError, ValueError):
        raise MetaDamaged("slot_bytes / slots_per_segment missing or not integers") from None
    if fmt == META_FORMAT:
        body = {k: v for k, v in have.items() if k != "checksum"}
        if have.get("checksum") != _body_checksum(body):
            raise MetaDamaged("checksum mismatch (the file was changed or damaged)")
    if geom.slot_bytes <= 0 or geom.slot_bytes % HEADER_BYTES or geom.slots_per_segment <= 0:
        raise MetaDamaged(f"geometry out of range: {geom}")
    return geom


def write_meta(path: Path, geom: Geometry) -> None:
    """Atomically (re)write the metadata file of directory `path`."""
    meta = path / META_NAME
    tmp = meta.with_suffix(".tmp")
    tmp.write_bytes(encode_meta(geom))
    os.replace(tmp, meta)


class SlotState(enum.Enum):
    BLANK = "blank"  # never written, or erased (first 4 bytes zero)
    PAGE = "page"  # a valid page header
    TORN = "torn"  # our magic, but the header fails its checksum or fields (torn write, bit rot)
    FOREIGN = "foreign"  # other bytes: not a header we wrote (bit rot of the magic, or not our file)
    UNREADABLE = "unreadable"  # the read failed (I/O error)


def classify(block: bytes | memoryview) -> tuple[SlotState, PageHeader | None, str]:
    """What a slot's header block holds: (state, header when PAGE, why when not)."""
    if bytes(block[:4]) == b"\0\0\0\0":
        return SlotState.BLANK, None, ""
    if bytes(block[:4]) != MAGIC:
        return SlotState.FOREIGN, None, "no page header magic"
    try:
        return SlotState.PAGE, PageHeader.unpack(block), ""
    except HeaderError as exc:
        return SlotState.TORN, None, str(exc)


@dataclass(slots=True)
class SegmentSurvey:
    """What one segment file holds at its slot boundaries."""

    name: str
    size: int  # bytes on disk now
    slot_bytes: int
    counts: dict[SlotState, int] = field(default_factory=lambda: dict.fromkeys(SlotState, 0))
    formats: dict[int, int] = field(default_factory=dict)  # page headers per format version (pageformat)

    @property
    def slots(self) -> int:
        return sum(self.counts.values())

    @property
    def cut(self) -> bool:
        """Truncated mid-slot (a whole-slot truncation cannot be told from a tier that grew, and loses
        nothing that a blank slot would not)."""
        return self.size % self.slot_bytes != 0

    @property
    def foreign(self) -> bool:
        """No page header anywhere and most slots hold other data: not a segment of this tier (a stray
        file, or one written with another geometry). Bit rot alone never gets here: it leaves pages."""
        c = self.counts
        return c[SlotState.PAGE] == 0 and c[SlotState.TORN] == 0 and c[SlotState.FOREIGN] * 2 > self.slots

    @property
    def failures(self) -> int:
        """Slots whose header failed its check (counted as checksum failures of the tier)."""
        c = self.counts
        return c[SlotState.TORN] + c[SlotState.FOREIGN] + c[SlotState.UNREADABLE]


def foreign_message(path: Path, seg: SegmentSurvey) -> str:
    c = seg.counts
    return (
        f"{path / seg.name}: not a segment of this NVMe tier ({c[SlotState.FOREIGN]} of {seg.slots} slot headers hold "
        f"other data, none a page header; another program's file, or segments of another --max-page-bytes). "
        f"Move it away, point --nvme-path at an empty directory, or run `{REPAIR_HINT.format(path=path)} "
        "--discard-foreign` to reformat it (its contents are discarded)"
    )


def segment_names(path: Path) -> list[str]:
    """Segment files present in the directory, in index order."""
    return sorted(p.name for p in path.iterdir() if SEGMENT_RE.fullmatch(p.name)) if path.is_dir() else []


def survey(path: Path, geom: Geometry) -> list[SegmentSurvey]:
    """Read every slot's header block of every segment file present, under geometry `geom`.

    Buffered reads (no O_DIRECT): this is a check, run by `kvstore nvme check|repair`, not by a node.
    """
    out = []
    for name in segment_names(path):
        size = (path / name).stat().st_size
        seg = SegmentSurvey(name, size, geom.slot_bytes)
        with open(path / name, "rb") as f:
            for slot in range(-(-size // geom.slot_bytes)):
                f.seek(slot * geom.slot_bytes)
                block = f.read(HEADER_BYTES)
                state, hdr, _ = classify(block.ljust(HEADER_BYTES, b"\0"))
                seg.counts[state] += 1
                if hdr is not None:
                    seg.formats[hdr.version] = seg.formats.get(hdr.version, 0) + 1
        out.append(seg)
    return out
