"""Edits of a node's NVMe segment files, for conformance runs and tests: what a disk or a metadata bug would do.

- `damage_payload`: flip one bit of a page's payload (bit rot). The header stays valid; only the page's
  checksum can tell.
- `misfile`: rewrite two slots' headers so that each claims the other's identity (namespace and key), every
  other field kept and each header's own checksum re-sealed (`PageHeader.pack`), as a metadata bug, a slot
  reused after a crash or a stale index entry would leave them. Both payloads are intact, so a checksum that covers only the payload
  passes; one that binds the page's identity (namespace, key, layout) fails (DESIGN.md §8).

Run them on a stopped node: recovery reads the headers at start. A page may be in several slots (a page
promoted to DRAM leaves a copy on NVMe that a later demotion reuses), so every slot holding it is edited:
whichever copy recovery publishes is the edited one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore.pageformat import ALIGN, HEADER_BYTES, PageHeader
from kvstore.tiers.nvme_meta import SEGMENT_RE, SlotState, classify


@dataclass(frozen=True, slots=True)
class Slot:
    """A slot holding a valid page header: the segment file, the slot's offset in it, its header."""

    segment: Path
    offset: int
    header: PageHeader


def slots(nvme: Path) -> Iterator[Slot]:
    """Every slot with a valid header, in file order. Slots start on 4 KiB boundaries whatever their size,
    so every boundary is read."""
    for seg in sorted(p for p in nvme.iterdir() if SEGMENT_RE.fullmatch(p.name)):
        with open(seg, "rb") as f:
            for off in range(0, seg.stat().st_size - HEADER_BYTES + 1, ALIGN):
                f.seek(off)
                state, header, _ = classify(f.read(HEADER_BYTES))
                if state is SlotState.PAGE and header is not None:
                    yield Slot(seg, off, header)


PageId = tuple[str, bytes]  # (stored namespace, key): a page's identity on the node


def live_pages(nvme: Path, namespace_part: str = "") -> dict[PageId, list[Slot]]:
    """(namespace, key) -> every slot whose header claims it, for namespaces containing `namespace_part`."""
    out: dict[PageId, list[Slot]] = {}
    for s in slots(nvme):
        if namespace_part in s.header.namespace:
            out.setdefault((s.header.namespace, s.header.hash), []).append(s)
    return out


def _copies(nvme: Path, page: PageId) -> list[Slot]:
    found = live_pages(nvme).get(page)
    if not found:
        raise KeyError(f"no NVMe slot under {nvme} holds page {page[1].hex()[:16]} of {page[0]!r}")
    return found


def damage_payload(nvme: Path, page: PageId, at: int = 100) -> list[Slot]:
    """Flip one bit `at` bytes into the payload of every slot holding `page`."""
    copies = _copies(nvme, page)
    for s in copies:
        with open(s.segment, "r+b") as f:
            f.seek(s.offset + HEADER_BYTES + at)
            byte = f.read(1)
            f.seek(s.offset + HEADER_BYTES + at)
            f.write(bytes([byte[0] ^ 0x40]))
    return copies


def misfile(nvme: Path, a: PageId, b: PageId) -> list[Slot]:
    """Swap the identities the slots of two pages claim (A's bytes filed as B, B's as A), re-sealing every
    header; no slot is left claiming either page truly, so recovery has no right copy to fall back on. The
    two pages must have one layout (a node binds a namespace to one layout)."""
    sa, sb = _copies(nvme, a), _copies(nvme, b)
    if {(s.header.layout, s.header.payload_len) for s in sa + sb} != {(sa[0].header.layout, sa[0].header.payload_len)}:
        raise ValueError("misfile: the two pages have different layouts; the node would refuse either header")
    for group, (ns, key) in ((sa, b), (sb, a)):
        for s in group:
            block = dataclasses.replace(s.header, namespace=ns, hash=key).pack()
            with open(s.segment, "r+b") as f:
                f.seek(s.offset)
                f.write(block)
    return sa + sb
