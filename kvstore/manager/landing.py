"""Where a read out of a medium that is not host memory (NVMe, HBM) lands, and where it is verified.

A Get that has a destination for a page (the same-host `get_into`: the caller's mapped buffer) has it
read straight there when the medium can scatter one slot over several buffers (`Medium.scatter_reads`)
and the destination is O_DIRECT aligned: the header block and the payload's last partial 4 KiB land in
the bounce buffer, the rest of the payload in the destination. That saves a copy of every byte. Without
a destination, or where it cannot take the read, the slot lands in the bounce buffer as before.

A mismatch found in the destination is checked again with a read into the bounce buffer (the caller
may have written its own buffer meanwhile), so a caller cannot make the node drop a sound page.

Either way the payload's checksum is computed in the I/O thread that did the read, right after it
(`IoPool.read`'s `then`): XXH3 releases the GIL, so pages are hashed beside the reads still in flight
and the event loop only compares numbers. The caller (the reader, `reads.py`) still owns the rule: it
compares the checksum and the header with the page's entry and drops a page that fails; a page that
failed may have left bytes in its destination, which is never reported as holding it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from kvstore.manager.io import IoPool
from kvstore.manager.state import Entry
from kvstore.pageformat import ALIGN, HEADER_BYTES, payload_checksum
from kvstore.pointers import buffer_address
from kvstore.tiers.base import Medium

CopyVerify = Callable[[memoryview, memoryview | None], int]  # checksum of a payload, copied into dest


async def read_payload(
    io: IoPool,
    medium: Medium,
    entry: Entry,
    view: memoryview,
    *,
    dest: memoryview | None,
    copy_verify: CopyVerify,
    expected: int,
) -> tuple[memoryview, int]:
    """Read `entry`'s slot; return (payload, its XXH3-64 as read). `view` is a bounce buffer of
    `entry.used_len` bytes that holds the header block afterwards (check it with `header_matches`).
    The payload is a view of `dest` where the read landed there and verified, else of `view` (and
    copied into `dest`, when given, in the verifying pass).
    `copy_verify(payload, dest)` is the reader's one-pass copy-and-hash, used when the read cannot land
    in `dest` directly; `expected` the payload's XXH3-64 as the page asked for (Entry.payload_checksum)."""
    n = entry.payload_len
    body = n // ALIGN * ALIGN  # what lands in dest directly; the partial last block goes through `view`
    if dest is not None and body and medium.scatter_reads and len(dest) >= n and _aligned(dest):
        tail = entry.used_len - HEADER_BYTES - body
        parts = [view[:HEADER_BYTES], dest[:body]]
        if tail:
            parts.append(view[HEADER_BYTES : HEADER_BYTES + tail])
        payload = dest[:n]
        checksum = await io.read(medium, entry.slot, parts, partial(_finish, view, dest, body, n))
        if checksum == expected:
            return payload, checksum
        # NOTE: dest is the caller's memory, which the caller (another of its calls into the same buffer)
        # may write meanwhile: a mismatch there is confirmed by a read into the bounce buffer, which only
        # the node touches, before the page may be called corrupt (and dropped with its durable copy).
        payload.release()
    payload = view[HEADER_BYTES : HEADER_BYTES + n]
    checksum = await io.read(medium, entry.slot, view, partial(copy_verify, payload, dest))
    return payload, checksum


def _finish(view: memoryview, dest: memoryview, body: int, n: int) -> int:
    """After a scatter read: the payload's partial last block into place, then the payload's hash."""
    if n > body:
        dest[body:n] = view[HEADER_BYTES : HEADER_BYTES + n - body]
    return payload_checksum(dest[:n])


def _aligned(buf: memoryview) -> bool:
    """The buffer starts on an O_DIRECT boundary (and is writable and contiguous)."""
    if buf.readonly or not buf.c_contiguous:
        return False
    return buffer_address(buf) % ALIGN == 0
