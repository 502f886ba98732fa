"""Conversions between the proto messages and kvstore's own types, shared by server and clients.

Pure: builds and parses messages, never touches a channel. The streaming framing of Put and Get lives
here once, both directions: `put_requests` (client) and `PutParser` (node) for Put streams,
`get_responses` (node) and `GetAssembler` (client) for Get streams.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import InvalidArgument, PageCorrupt, StreamError
from kvstore.layout import MAX_PARTS, DType, PageEncoding, PageLayout, PagePart
from kvstore.names import Buffer, TierKind
from kvstore.pageformat import ChecksumForm, key_digest, payload_hasher, wire_checksum
from kvstore.wire import CHUNK_BYTES, PutOpen, check_replicas

M = TypeVar("M", bound=Message)

# Bulk chunks skip protobuf objects on both ends. A message holding only the `chunk` field is, on the
# wire, one tag byte, a varint length, then the bytes; building it with one join copies the payload
# once (straight from a slot), and parsing it yields a zero-copy view of the received message.
# Anything else (headers, malformed or merged messages) goes through protobuf as usual, so the wire
# format is exactly the proto's and any gRPC client interoperates.
PUT_CHUNK_TAG = 0x1A  # PutRequest.chunk: field 3, wire type 2
GET_CHUNK_TAG = 0x12  # GetResponse.chunk: field 2, wire type 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def frame_chunk(tag: int, data: Buffer) -> bytes:
    """The serialized message whose only field is a chunk: one copy of data."""
    return b"".join((bytes((tag,)), _varint(len(data)), data))


def chunk_view(tag: int, msg: bytes) -> memoryview | None:
    """A view of the chunk if msg is exactly one chunk field with this tag, else None."""
    if not msg or msg[0] != tag:
        return None
    n = shift = 0
    pos = 1
    for pos in range(1, min(len(msg), 11)):  # a varint has at most 10 bytes
        b = msg[pos]
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    else:
        return None
    start = pos + 1
    if start + n != len(msg):
        return None
    return memoryview(msg)[start:]


def parse_put_request(msg: bytes) -> tuple[str, object]:
    """(kind, value) of a serialized PutRequest: ("chunk", memoryview) on the fast path, else the
    oneof name and its protobuf value ("open"/"page"/"chunk"/None)."""
    view = chunk_view(PUT_CHUNK_TAG, msg)
    if view is not None:
        return "chunk", view
    try:
        req = pb.PutRequest.FromString(msg)
    except DecodeError:
        raise InvalidArgument("msg", "PutRequest does not parse as kvstore.v1.PutRequest") from None
    kind = req.WhichOneof("msg")
    return kind or "", getattr(req, kind) if kind else None


def layout_to_pb(layout: PageLayout) -> pb.PageLayout:
    return pb.PageLayout(
        dtype=int(layout.dtype),
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        encoding=int(layout.encoding),
        parts=[pb.PagePart(name=p.name, layout=layout_to_pb(p.layout)) for p in layout.parts],
    )


def layout_from_pb(msg: pb.PageLayout, field: str = "open.layout") -> PageLayout:
    """The typed layout of a message (a bundle with its parts); InvalidArgument naming the field that is bad."""
    if msg.dtype == pb.DTYPE_UNSPECIFIED:
        raise InvalidArgument(f"{field}.dtype", "must be set")
    try:
        encoding = PageEncoding(msg.encoding)
    except ValueError:
        raise InvalidArgument(f"{field}.encoding", f"unknown page encoding {msg.encoding}") from None
    if len(msg.parts) > MAX_PARTS:
        raise InvalidArgument(f"{field}.parts", f"{len(msg.parts)} parts; a bundle has at most {MAX_PARTS}")
    parts = []
    for i, part in enumerate(msg.parts):
        where = f"{field}.parts[{i}]"
        if part.layout.encoding == pb.PAGE_ENCODING_BUNDLE or part.layout.parts:
            raise InvalidArgument(f"{where}.layout", "a bundle's part cannot itself be a bundle")
        try:
            parts.append(PagePart(part.name, layout_from_pb(part.layout, f"{where}.layout")))
        except ValueError as exc:
            raise InvalidArgument(f"{where}.name", str(exc)) from None
    try:
        return PageLayout(
            DType(msg.dtype), msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.block_size, encoding, tuple(parts)
        )
    except ValueError as exc:
        raise InvalidArgument(field, str(exc)) from None


def tier_from_pb(value: int, default: TierKind = TierKind.DRAM, field: str = "target_tier") -> TierKind:
    """The tier a message names; an unknown value is InvalidArgument naming `field`."""
    if value == pb.TIER_UNSPECIFIED:
        return default
    try:
        return TierKind(value)
    except ValueError:
        known = ", ".join(f"{int(k)} ({k.label})" for k in TierKind)
        raise InvalidArgument(field, f"{value} is not a tier; known: {known}") from None


E = TypeVar("E", bound=enum.IntEnum)


def enum_from_pb(kind: type[E], value: int, field: str) -> E:
    """A proto enum's value as `kind`; InvalidArgument naming the field for a number it does not define."""
    try:
        return kind(value)
    except ValueError:
        names = ", ".join(f"{m.name} ({m.value})" for m in kind)
        raise InvalidArgument(field, f"{value} is not one of {names}") from None


def put_open_to_pb(op: PutOpen) -> pb.PutOpen:
    return pb.PutOpen(
        namespace=op.namespace,
        layout=layout_to_pb(op.layout),
        target_tier=int(op.target_tier or 0),
        parent_hash=op.parent or b"",
        chain=op.chain,
        checksum_form=int(op.checksums),
        replicas=op.replicas,
    )


def checksum_form_from_pb(value: int, field: str) -> ChecksumForm:
    """The checksum form a request names; an unknown value is InvalidArgument naming `field`."""
    try:
        return ChecksumForm(value)
    except ValueError:
        raise InvalidArgument(field, f"unknown checksum form {value}") from None


def put_open_from_pb(msg: pb.PutOpen, field: str = "open") -> PutOpen:
    """The typed opening of a Put; InvalidArgument naming `field`.layout / .target_tier when they are bad."""
    target = (
        None if msg.target_tier == pb.TIER_UNSPECIFIED else tier_from_pb(msg.target_tier, field=f"{field}.target_tier")
    )
    return PutOpen(
        msg.namespace,
        layout_from_pb(msg.layout, f"{field}.layout"),
        target,
        msg.parent_hash or None,
        msg.chain,
        checksum_form_from_pb(msg.checksum_form, f"{field}.checksum_form"),
        check_replicas(msg.replicas, f"{field}.replicas"),
    )


def put_requests(
    op: PutOpen, hashes: Sequence[bytes], pages: Sequence[Buffer], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[bytes]:
    """The serialized messages of one Put stream: open, then per page its header and chunks."""
    if len(hashes) != len(pages):
        raise ValueError(f"{len(hashes)} hashes but {len(pages)} pages")
    yield pb.PutRequest(open=put_open_to_pb(op)).SerializeToString()
    for h, page in zip(hashes, pages, strict=True):
        view = memoryview(page).cast("B")
        header = pb.PutPage(hash=h, payload_bytes=len(view), checksum=wire_checksum(op.namespace, h, view))
        yield pb.PutRequest(page=header).SerializeToString()
        for off in range(0, len(view), chunk_bytes):
            yield frame_chunk(PUT_CHUNK_TAG, view[off : off + chunk_bytes])


@dataclass(frozen=True, slots=True)
class PutPageHeader:
    """A page announced in a Put stream; its chunks follow."""

    index: int
    hash: bytes
    payload_bytes: int
    checksum: int


@dataclass(frozen=True, slots=True)
class PutChunk:
    """Bytes of the current page, to go at `offset` of its payload."""

    offset: int
    data: memoryview


class PutParser:
    """The node's side of Put stream framing: `feed` each serialized request, act on what it returns.

    Order: one `open` (returned as the PutOpen message), then per page a header (PutPageHeader) and its
    chunks (PutChunk, <= CHUNK_BYTES each, never past the announced size), then `finish()`. Any breach
    raises InvalidArgument naming the field, before the offending bytes are handed out.
    """

    def __init__(self) -> None:
        self.opened = False
        self._page = -1
        self._need = self._fill = 0

    def feed(self, raw: bytes) -> pb.PutOpen | PutPageHeader | PutChunk:
        kind, value = parse_put_request(raw)
        if not self.opened:
            if kind != "open":
                raise InvalidArgument("open", "the first message of a Put stream must be `open`")
            self.opened = True
            return value  # type: ignore[return-value]
        if kind == "page":
            if self._fill != self._need:
                raise InvalidArgument(
                    "page", f"page {self._page} got {self._fill} of {self._need} bytes before the next page header"
                )
            self._page += 1
            self._need, self._fill = value.payload_bytes, 0  # type: ignore[attr-defined]
            return PutPageHeader(self._page, value.hash, value.payload_bytes, value.checksum)  # type: ignore[attr-defined]
        if kind == "chunk":
            data = memoryview(value)  # type: ignore[arg-type]
            n = len(data)
            if self._page < 0:
                raise InvalidArgument("chunk", "data chunk before any page header")
            if n > CHUNK_BYTES:
                raise InvalidArgument("chunk", f"{n} bytes; chunks are at most {CHUNK_BYTES} bytes")
            if self._fill + n > self._need:
                raise InvalidArgument("chunk", f"page {self._page} receives more than its {self._need} bytes")
            chunk = PutChunk(self._fill, data)
            self._fill += n
            return chunk
        if kind == "open":
            raise InvalidArgument("open", "sent twice in one Put stream")
        raise InvalidArgument("msg", "empty PutRequest (no open, page or chunk)")

    def finish(self) -> None:
        """The stream ended: it must have been opened and its last page be complete."""
        if not self.opened:
            raise InvalidArgument("open", "empty Put stream")
        if self._fill != self._need:
            raise InvalidArgument(
                "chunk", f"stream truncated: page {self._page} got {self._fill} of {self._need} bytes"
            )


def get_responses(
    h: bytes, tier: TierKind, checksum: int, payload: memoryview, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[bytes]:
    """The serialized messages of one page in a Get stream: its header, then its chunks (one copy each)."""
    n = len(payload)
    page = pb.GetPage(hash=h, payload_bytes=n, checksum=checksum, tier=int(tier))
    yield pb.GetResponse(page=page).SerializeToString()
    for off in range(0, n, chunk_bytes):
        yield frame_chunk(GET_CHUNK_TAG, payload[off : off + chunk_bytes])


@dataclass(slots=True)
class FetchedPage:
    """A page a Get returned: its hash, the tier it came from, its payload (a writable buffer: a block of the
    client's receive pool, yours for as long as anything refers to it; kvstore/client/planes/pool.py)."""

    hash: bytes
    tier: TierKind
    data: memoryview | bytearray


@dataclass(frozen=True, slots=True)
class PageRef:
    """A page a `get_into` wrote into the caller's buffer: its hash, the tier it came from, its size."""

    hash: bytes
    tier: TierKind
    nbytes: int


class GetAssembler:
    """Reassembles pages from a Get response stream and verifies each page's checksum (KEYED: it binds the
    namespace and key asked for, so a page served under another key fails like a damaged one).

    Feed every response to `feed`; `pages` holds the complete pages in order. `finish` raises when
    the stream ended in the middle of a page.
    """

    def __init__(
        self,
        namespace: str,
        expected: Sequence[bytes],
        verify: bool = True,
        alloc: Callable[[int], memoryview | bytearray] = bytearray,
    ) -> None:
        self._namespace = namespace  # as the request named it: the checksums bind it (ChecksumForm.KEYED)
        self._expected = list(expected)
        self._verify = verify
        self._alloc = alloc  # where a page of n bytes is received (a pool block)
        self.pages: list[FetchedPage] = []
        self._cur: FetchedPage | None = None
        self._fill = 0
        self._checksum = 0
        self._hasher = payload_hasher()  # the current page's checksum, fed chunk by chunk while in cache

    def feed(self, raw: bytes) -> None:
        """Take one serialized GetResponse."""
        chunk = chunk_view(GET_CHUNK_TAG, raw)
        if chunk is not None:
            self._add_chunk(chunk)
            return
        msg = pb.GetResponse.FromString(raw)
        kind = msg.WhichOneof("msg")
        if kind == "page":
            self._close_page()
            idx = len(self.pages)
            if idx >= len(self._expected) or msg.page.hash != self._expected[idx]:
                raise StreamError(f"page {idx}: server sent an unexpected hash")
            self._cur = FetchedPage(msg.page.hash, TierKind(msg.page.tier), self._alloc(msg.page.payload_bytes))
            self._fill = 0
            # The payload's XXH3-64 this page must have to be the page asked for (its key digest taken out).
            self._checksum = msg.page.checksum ^ key_digest(self._namespace, self._expected[idx])
            self._hasher.reset()
        elif kind == "chunk":
            self._add_chunk(memoryview(msg.chunk))
        else:
            raise StreamError("empty message in Get stream")

    def _add_chunk(self, chunk: memoryview) -> None:
        if self._cur is None:
            raise StreamError("data chunk before any page header")
        end = self._fill + len(chunk)
        if end > len(self._cur.data):
            raise StreamError("page longer than its header announced")
        self._cur.data[self._fill : end] = chunk
        self._fill = end
        if self._verify:
            self._hasher.update(chunk)

    def _close_page(self) -> None:
        if self._cur is None:
            return
        if self._fill != len(self._cur.data):
            raise StreamError(f"page {len(self.pages)} truncated: {self._fill}/{len(self._cur.data)} bytes")
        if self._verify and self._hasher.intdigest() != self._checksum:
            raise PageCorrupt(len(self.pages), self._cur.hash, list(self.pages))
        self.pages.append(self._cur)
        self._cur = None

    def finish(self) -> list[FetchedPage]:
        self._close_page()
        return self.pages
