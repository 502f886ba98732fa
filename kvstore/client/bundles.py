"""A bundle's parts in caller memory: the checks and copies every client and door shares (DESIGN.md §4.3).

A bundle is one page whose payload is its parts back to back (kvstore/layout.py). A caller hands the parts of
each page as a mapping part name -> its bytes: one buffer, or a list of regions (an engine's pool often holds
one page of a pool in several places: SGLang's layer-first host pools, a Mamba state's conv and temporal
tensors) whose sizes add up to the part. `put_bundle` gathers them into one page; `get_bundle_into` scatters a
page back into them. Pure: no I/O; the copies are memcpy of caller memory.

Every error is a ValueError naming the argument (`pages[i]['mamba']`, `pages[i]['kv'][2]`), raised before
anything is sent or written, so a bad call changes nothing.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from kvstore.client.planes.buffers import buffer_span
from kvstore.layout import PageLayout

Parts = Mapping[str, Any]  # part name -> a buffer, or a sequence of buffers (regions) in order
Regions = list[tuple[int, int]]  # (address, bytes) of each region of one part


def check_bundle_layout(layout: PageLayout, field: str = "layout") -> None:
    """ValueError unless `layout` is a bundle whose parts are named (what a caller splits pages by)."""
    if not layout.is_bundle:
        raise ValueError(f"{field}: a bundle call needs a bundle layout (PageLayout.bundle), not {layout.describe()}")
    if not layout.has_parts:
        raise ValueError(f"{field}: the bundle's parts must be named (PageLayout.bundle(parts, block_size))")


def part_regions(layout: PageLayout, pages: Sequence[Parts], *, writable: bool) -> list[list[Regions]]:
    """Per page, per part in the layout's order, the (address, bytes) of its regions; checked: every part of
    the layout given and no other, each part's regions adding up to its size, writable where written into,
    and (for writes) no region overlapping another of the same call."""
    check_bundle_layout(layout)
    if isinstance(pages, Mapping):
        raise ValueError("pages: pass a sequence with one mapping of parts per hash, not one mapping")
    spans = layout.part_spans()
    out: list[list[Regions]] = []
    for i, parts in enumerate(pages):
        if not isinstance(parts, Mapping):
            raise ValueError(f"pages[{i}]: a mapping part name -> buffer(s), got a {type(parts).__name__}")
        extra = [n for n in parts if n not in spans]
        if extra:
            raise ValueError(f"pages[{i}][{extra[0]!r}]: the bundle has no such part (it has {', '.join(spans)})")
        page: list[Regions] = []
        for name, (_, nbytes) in spans.items():
            if name not in parts:
                raise ValueError(f"pages[{i}][{name!r}]: missing; a bundle is stored and read whole")
            given = parts[name]
            items = list(given) if isinstance(given, (list, tuple)) else [given]
            where = f"pages[{i}][{name!r}]"
            regions = [
                buffer_span(b, f"{where}[{j}]" if len(items) > 1 else where, writable) for j, b in enumerate(items)
            ]
            total = sum(n for _, n in regions)
            if total != nbytes:
                raise ValueError(f"{where}: {total} bytes, but the part {name!r} is {nbytes} bytes")
            page.append([r for r in regions if r[1]])
        out.append(page)
    if writable:
        _no_overlap([r for page in out for part in page for r in part])
    return out


def _no_overlap(regions: Regions) -> None:
    ordered = sorted(regions)
    for (a, n), (b, _) in itertools.pairwise(ordered):
        if a + n > b:
            raise ValueError("pages: two parts' buffers overlap (a page would be written over another)")


def gather(page: list[Regions], dest: memoryview) -> None:
    """Copy one page's parts, region after region, into `dest` (exactly the page's size)."""
    dst = _address(dest)
    off = 0
    for part in page:
        for addr, n in part:
            ctypes.memmove(dst + off, addr, n)
            off += n
    if off != dest.nbytes:
        raise ValueError(f"the parts hold {off} bytes, the page {dest.nbytes}")


def scatter(payload: memoryview, page: list[Regions]) -> None:
    """Copy a page's payload into its parts' regions, in order (the inverse of `gather`)."""
    src = _address(payload)
    off = 0
    for part in page:
        for addr, n in part:
            ctypes.memmove(addr, src + off, n)
            off += n
    if off != payload.nbytes:
        raise ValueError(f"a {payload.nbytes}-byte page does not fill its parts' {off} bytes")


def _address(view: memoryview) -> int:
    addr, _ = buffer_span(view, "page", writable=False)
    return addr


def region_views(page: list[Regions]) -> list[memoryview]:
    """One page's regions as writable byte views, in order (for a plane that moves them without a copy). The
    caller's buffers they lie in must outlive the call (they do: the caller holds them)."""
    return [memoryview((ctypes.c_uint8 * n).from_address(addr)).cast("B") for part in page for addr, n in part]
