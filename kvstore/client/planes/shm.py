"""The client's side of the shared-memory plane: Put/Get (through pooled scratch segments) and the
zero-copy `get_into`/`put_from` (straight into and out of the caller's registered buffers), as exchanges.

Checksums (DESIGN.md §8: a page is verified when read from a tier and whenever it crossed a network):
the node verifies every page when it reads it from its tier, before a byte of it reaches a segment,
and computes the checksum of every page put from the bytes that landed in its slot. Nothing on this
plane crosses a network (the node and this client share one host's memory), so the client verifies
nothing again: `get_into` costs one copy (tier -> caller's buffer) and one checksum (the tier read),
`put_from` one copy (caller's buffer -> slot) and one checksum (of the slot).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.client.exchange import Exchange, Unary
from kvstore.client.planes.base import DataPlane
from kvstore.client.planes.buffers import buffer_span
from kvstore.client.planes.segments import (
    ClientSegment,
    Placed,
    SegmentPool,
    SharedBuffer,
    SharedBuffers,
    sweep_stale,
)
from kvstore.errors import InvalidArgument, ShmNotAvailable, StreamError
from kvstore.names import Buffer, TierKind
from kvstore.pageformat import align_up
from kvstore.wire import PutOpen
from kvstore.wire.shm import HEADER_BYTES
from kvstore.wire.streams import FetchedPage, PageRef, put_open_to_pb

__all__ = ["ClientSegment", "SegmentPool", "ShmPlane", "sweep_stale"]

DEFAULT_PAGE_HINT = 256 << 10  # a client's first GetShm window assumes pages of this size, then learns
_TARGET_FIELD = re.compile(r"^(?:targets|pages)\[(\d+)\]")


# -- requests and replies (no I/O besides the copies into and out of pooled segments) -----------------


def put_request(seg: ClientSegment, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[Buffer]) -> pb.PutShmRequest:
    """Copy `pages` into `seg` (4 KiB-aligned, after the header) and describe them in a PutShmRequest.
    `seg` must hold `put_bytes(pages)` data bytes. Checksums are left to the node (see the module
    docstring): it computes them from the bytes that landed in its slots."""
    req = pb.PutShmRequest(open=put_open_to_pb(op), region=pb.ShmRegion(name=seg.name, nonce=seg.nonce))
    pos = HEADER_BYTES
    for h, page in zip(hashes, pages, strict=True):
        src = memoryview(page).cast("B")
        n = len(src)
        seg.view[pos : pos + n] = src
        req.pages.add(hash=h, offset=pos, payload_bytes=n)
        pos = align_up(pos + n)
    return req


def put_bytes(pages: Sequence[Buffer]) -> int:
    """Data bytes a segment needs to carry `pages` for put_request."""
    return sum(align_up(memoryview(p).nbytes) for p in pages)


def get_request(seg: ClientSegment, namespace: str, hashes: Sequence[bytes], promote: bool) -> pb.GetShmRequest:
    return pb.GetShmRequest(
        namespace=namespace,
        hashes=list(hashes),
        no_promote=not promote,
        region=pb.ShmRegion(name=seg.name, nonce=seg.nonce),
        offset=HEADER_BYTES,
        size=seg.data_bytes,
    )


def read_reply(seg: ClientSegment, hashes: Sequence[bytes], reply: pb.GetShmResponse) -> list[FetchedPage]:
    """Copy the pages a GetShm put into `seg` out into owned buffers, checking order and bounds."""
    check_reply_order(hashes, reply)
    out = []
    for i, p in enumerate(reply.pages):
        if p.offset < HEADER_BYTES or p.offset + p.payload_bytes > seg.size:
            raise StreamError(f"page {i}: slice [{p.offset}, {p.offset + p.payload_bytes}) outside the segment")
        out.append(FetchedPage(p.hash, TierKind(p.tier), bytearray(seg.view[p.offset : p.offset + p.payload_bytes])))
    return out


def check_reply_order(hashes: Sequence[bytes], reply: pb.GetShmResponse) -> None:
    if len(reply.pages) > len(hashes):
        raise StreamError(f"GetShm returned {len(reply.pages)} pages for {len(hashes)} hashes")
    for i, (want, p) in enumerate(zip(hashes, reply.pages, strict=False)):
        if p.hash != want:
            raise StreamError(f"page {i}: server sent an unexpected hash")


def shared_region(buf: SharedBuffer) -> pb.ShmRegion:
    """The region naming a registered buffer: this process's sealed memfd, for the node to map."""
    return pb.ShmRegion(name=buf.name, nonce=buf.nonce, pid=buf.pid, fd=buf.fd)


def into_request(namespace: str, hashes: Sequence[bytes], placed: Sequence[Placed], promote: bool) -> pb.GetShmRequest:
    """A GetShm that writes page i straight into placed[i] (all in one registered buffer)."""
    return pb.GetShmRequest(
        namespace=namespace,
        hashes=list(hashes),
        no_promote=not promote,
        region=shared_region(placed[0].buffer),
        targets=[pb.ShmTarget(offset=p.offset, size=p.nbytes) for p in placed],
    )


def into_reply(hashes: Sequence[bytes], placed: Sequence[Placed], reply: pb.GetShmResponse) -> list[PageRef]:
    """What a targeted GetShm wrote, checked against what was asked (order, place, size)."""
    check_reply_order(hashes, reply)
    out = []
    for i, (p, want) in enumerate(zip(reply.pages, placed, strict=False)):
        if p.offset != want.offset or p.payload_bytes > want.nbytes:
            raise StreamError(f"page {i}: written at [{p.offset}, +{p.payload_bytes}), not into its buffer")
        out.append(PageRef(p.hash, TierKind(p.tier), p.payload_bytes))
    return out


def segment_runs(placed: Sequence[Placed], per_call: int) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive buffers in one segment, each at most `per_call` long."""
    runs: list[tuple[int, int]] = []
    a = 0
    for i in range(1, len(placed) + 1):
        if i == len(placed) or i - a == per_call or placed[i].buffer is not placed[a].buffer:
            runs.append((a, i))
            a = i
    return runs


def buffer_error(exc: InvalidArgument, first: int) -> Exception:
    """The node's complaint about targets[j] / pages[j] of one call, as the caller's buffers[first + j]."""
    m = _TARGET_FIELD.match(exc.field)
    if m is None:
        return exc
    rest = str(exc).split(":", 1)[1].strip()
    return ValueError(f"buffers[{first + int(m.group(1))}]: {rest}")


class ShmPlane(DataPlane):
    """Pages cross through shared memory on this host; the RPCs carry only hashes and slices.

    `put`/`get` copy through this client's pooled scratch segments; `put_from`/`get_into` use the
    caller's registered buffers (`buffers`, from `client.shared_buffer`) directly: the node reads and
    writes them, and the client touches no page byte. Thread-safe: concurrent calls take different
    scratch segments. Each PutShm of at most `pages_per_call` pages is atomic, like a Put stream.
    """

    name = "shm"

    def __init__(self, pages_per_call: int, buffers: SharedBuffers) -> None:
        self.pages_per_call = pages_per_call
        self.buffers = buffers
        self.pool = SegmentPool()
        self.page_hint = DEFAULT_PAGE_HINT  # bytes per page GetShm windows are sized for (learned)
        # False once the node could not open a registered buffer (another pid namespace, say): then
        # get_into/put_from copy through the scratch segments, which the node reaches by name.
        self.node_maps_buffers = True

    def put_batch(self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[Buffer]) -> Exchange[tuple[int, int]]:
        seg = self.pool.acquire(put_bytes(pages))
        try:
            reply = yield Unary("PutShm", put_request(seg, op, hashes, pages))
        finally:
            self.pool.release(seg)
        return reply.stored, reply.already_present

    def get_batch(self, namespace: str, hashes: Sequence[bytes], promote: bool) -> Exchange[list[FetchedPage]]:
        """GetShm calls for the longest stored prefix of one batch of `hashes`, through a scratch segment.

        The window is sized for `page_hint` bytes per page and grows when the node reports a page that
        did not fit. Bounded: every call either returns pages or grows the window to fit the next page.
        """
        out: list[FetchedPage] = []
        hint = self.page_hint
        seg = self.pool.acquire(hint * len(hashes))
        try:
            for _ in range(2 * len(hashes) + 2):
                rest = hashes[len(out) :]
                if not rest:
                    break
                reply = yield Unary("GetShm", get_request(seg, namespace, rest, promote))
                got = read_reply(seg, rest, reply)
                out.extend(got)
                if not reply.next_page_bytes:
                    if len(got) < len(rest):
                        break  # the first missing page ends the prefix
                    continue
                hint = max(hint, align_up(reply.next_page_bytes))
                need = hint * (len(hashes) - len(out))
                if seg.data_bytes < need:
                    self.pool.release(seg)
                    seg = self.pool.acquire(need)
        finally:
            self.pool.release(seg)
        self.page_hint = hint
        return out

    def place(self, buffers: Sequence[Buffer], writable: bool, first: int = 0) -> list[Placed]:
        """Where each caller buffer lies in this client's registered segments; ValueError naming the
        first that lies in none (the caller checked count, contiguity and overlaps already)."""
        placed = []
        for i, b in enumerate(buffers):
            field = f"buffers[{first + i}]"
            where = self.buffers.locate(*buffer_span(b, field, writable))
            if where is None:
                raise ValueError(
                    f"{field}: not inside a shared buffer of this client; on the shared-memory plane "
                    "pages move straight into registered memory: allocate it with "
                    "client.shared_buffer(nbytes) and pass views of it"
                )
            placed.append(where)
        return placed

    def runs(self, buffers: Sequence[Buffer], writable: bool) -> list[tuple[int, int]]:
        """Batches never cross from one registered buffer into another (one GetShm/PutShm names one)."""
        return segment_runs(self.place(buffers, writable), self.pages_per_call)

    def get_into_batch(
        self, namespace: str, hashes: Sequence[bytes], buffers: Sequence[Buffer], promote: bool, first: int
    ) -> Exchange[list[PageRef]]:
        """A GetShm that has the node write page i straight into buffers[i] (all in one registered buffer).
        The node checks every target before it reads a page, so a buffer too small for the namespace's
        pages changes nothing."""
        if not self.node_maps_buffers:
            return (yield from super().get_into_batch(namespace, hashes, buffers, promote, first))
        placed = self.place(buffers, True, first)
        try:
            reply = yield Unary("GetShm", into_request(namespace, hashes, placed, promote))
        except InvalidArgument as exc:
            raise buffer_error(exc, first) from None
        except ShmNotAvailable:
            if first or not self._cannot_map():
                raise
            return (yield from super().get_into_batch(namespace, hashes, buffers, promote, first))
        return into_reply(hashes, placed, reply)

    def put_from_batch(
        self, op: PutOpen, hashes: Sequence[bytes], buffers: Sequence[Buffer], first: int
    ) -> Exchange[tuple[int, int]]:
        """A PutShm naming the caller's registered buffer as the page slices: the node copies each page once,
        into its slot, and computes its checksum there."""
        if not self.node_maps_buffers:
            return (yield from self.put_batch(op, hashes, buffers))
        placed = self.place(buffers, False, first)
        req = pb.PutShmRequest(
            open=put_open_to_pb(op),
            region=shared_region(placed[0].buffer),
            pages=[
                pb.ShmSlice(hash=h, offset=p.offset, payload_bytes=p.nbytes)
                for h, p in zip(hashes, placed, strict=True)
            ],
        )
        try:
            reply = yield Unary("PutShm", req)
        except InvalidArgument as exc:
            raise buffer_error(exc, first) from None
        except ShmNotAvailable:
            if first or not self._cannot_map():
                raise
            return (yield from self.put_batch(op, hashes, buffers))
        return reply.stored, reply.already_present

    def _cannot_map(self) -> bool:
        """After the node could not open a registered buffer: from now on zero-copy calls copy through the
        scratch segments (True), unless they already did (False: the plane itself is unavailable)."""
        if not self.node_maps_buffers:
            return False
        self.node_maps_buffers = False
        return True

    def close(self) -> None:
        self.pool.close()
