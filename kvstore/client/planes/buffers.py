"""Checks of caller buffers for `get_into` / `put_from`, shared by every plane (no I/O, no copies).

A caller buffer is anything with the buffer protocol (memoryview, bytearray, mmap, numpy array),
C-contiguous. `get_into` needs writable buffers that do not overlap (two pages must not land on the
same bytes); `put_from` reads them, so read-only ones are fine. Every error is a ValueError naming the
argument (`buffers[i]`), raised before anything is sent, so a bad call changes nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.pointers import buffer_address


def buffer_span(obj: Any, field: str, writable: bool) -> tuple[int, int]:
    """(address, byte length) of a C-contiguous buffer; ValueError naming `field` otherwise."""
    try:
        view = memoryview(obj)
    except TypeError:
        raise ValueError(
            f"{field}: a {type(obj).__name__} is not a buffer (pass a memoryview, bytearray, mmap or numpy array)"
        ) from None
    with view:
        if not view.c_contiguous:
            raise ValueError(f"{field}: the buffer is not C-contiguous")
        if writable and view.readonly:
            raise ValueError(f"{field}: the buffer is read-only; pages can only be written into writable memory")
        nbytes = view.nbytes
        return (buffer_address(view) if nbytes else 0), nbytes


def check_buffers(
    buffers: Sequence[Any], count: int, *, writable: bool, nbytes: int | None = None
) -> list[tuple[int, int]]:
    """Validate the buffers of a `get_into` (writable) or `put_from` (read, each exactly `nbytes`):
    one per hash, buffers, contiguous, and for writes not overlapping. Returns their (address, length)."""
    if isinstance(buffers, (bytes, bytearray, memoryview)):
        raise ValueError("buffers: pass a sequence of buffers (one per hash), not one buffer")
    if len(buffers) != count:
        raise ValueError(f"buffers: {len(buffers)} buffers for {count} hashes (one buffer per hash)")
    spans = [buffer_span(b, f"buffers[{i}]", writable) for i, b in enumerate(buffers)]
    for i, (_, n) in enumerate(spans):
        if nbytes is not None and n != nbytes:
            raise ValueError(f"buffers[{i}]: {n} bytes, but a page of this layout is {nbytes} bytes")
        if n == 0:
            raise ValueError(f"buffers[{i}]: an empty buffer cannot hold a page")
    if writable:
        order = sorted(range(len(spans)), key=lambda i: spans[i][0])
        for prev, cur in itertools.pairwise(order):
            if spans[prev][0] + spans[prev][1] > spans[cur][0]:
                raise ValueError(f"buffers[{max(prev, cur)}]: overlaps buffers[{min(prev, cur)}]")
    return spans


def page_sink(buffers: Sequence[Any], first: int) -> Callable[[int, int], memoryview]:
    """Where a plane receiving a batch puts page i of `n` bytes: buffers[i] (the batch's own buffers), cut to
    the page; ValueError naming it as the caller's buffers[first + i] when it cannot hold the page."""

    def sink(i: int, n: int) -> memoryview:
        dst = memoryview(buffers[i]).cast("B")
        if dst.nbytes < n:
            raise ValueError(f"buffers[{first + i}]: {dst.nbytes} bytes cannot hold a {n}-byte page")
        return dst[:n]

    return sink
