"""Conversions between the proto messages and kvstore's own types, shared by server and clients.

Pure: builds and parses messages, never touches a channel. The streaming framing of Put and Get lives
here once, both directions: `put_requests` (client) and `PutParser` (node) for Put streams,
`get_responses` (node) and `GetAssembler` (client) for Get streams.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import InvalidArgument, PageCorrupt, StreamError
from kvstore.layout import MAX_PARTS, DType, PageEncoding, PageLayout, PagePart
from kvstore.names import Buffer, RetainMode, TierKind
from kvstore.pageformat import ChecksumForm, key_digest, payload_hasher, wire_checksum
from kvstore.security import redact_url
from kvstore.stats import (
    IndexStatus,
    KvEventsStatus,
    LookupResult,
    NodeStats,
    PlaneInfo,
    ReplicationStatus,
    RetainResult,
    RetentionStats,
    SessionState,
    TenantStats,
    TierCounters,
    TierFetch,
    TierRetention,
    TierStats,
)
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


_COUNTER_FIELDS = [f.name for f in fields(TierCounters)]
# NOTE: the scalar fields of a node's and a tier's Stats carry the same name on both sides: each is listed once
# here, so a new counter travels in both directions by being added to the dataclass and the proto.
_TIER_SCALARS = [f.name for f in fields(TierStats) if f.name not in ("tier", "counters")]
_NODE_STRUCTURED = ("tiers", "namespaces", "index", "planes", "tenants", "kv_events", "retention", "replication")
_NODE_SCALARS = [f.name for f in fields(NodeStats) if f.name not in _NODE_STRUCTURED]


def plane_to_pb(p: PlaneInfo) -> pb.DataPlaneInfo:
    return pb.DataPlaneInfo(name=p.name, address=p.address, tls=p.tls, uid=p.uid)


def plane_from_pb(msg: pb.DataPlaneInfo) -> PlaneInfo:
    """An advertised plane; `uid` None when the node did not say it (the field's presence, not its value)."""
    return PlaneInfo(msg.name, msg.address, msg.tls, msg.uid if msg.HasField("uid") else None)


def stats_to_pb(stats: NodeStats) -> pb.StatsResponse:
    tiers = [
        pb.TierStats(
            tier=int(t.tier),
            **{name: getattr(t, name) for name in _TIER_SCALARS},
            **{name: getattr(t.counters, name) for name in _COUNTER_FIELDS},
        )
        for t in stats.tiers
    ]
    namespaces = [
        pb.NamespaceStats(namespace=ns, layout=layout_to_pb(layout), pages=pages, page_bytes=layout.page_bytes)
        for ns, layout, pages in stats.namespaces
    ]
    return pb.StatsResponse(
        **{name: getattr(stats, name) for name in _NODE_SCALARS},
        tiers=tiers,
        namespaces=namespaces,
        index=None
        if stats.index is None
        else pb.IndexStats(
            **{f.name: getattr(stats.index, f.name) for f in fields(IndexStatus) if f.name != "url"},
            url=redact_url(stats.index.url),
        ),
        planes=[plane_to_pb(p) for p in stats.planes],
        tenants=[_tenant_to_pb(t) for t in stats.tenants],
        kv_events=None if stats.kv_events is None else pb.KvEventsStats(**asdict(stats.kv_events)),
        checksum_form=pb.CHECKSUM_FORM_KEYED,
        retention=retention_to_pb(stats.retention),
        replication=None if stats.replication is None else pb.ReplicationStats(**asdict(stats.replication)),
    )


_RETENTION_COUNTERS = [f.name for f in fields(RetentionStats) if f.name != "tiers"]


def retention_to_pb(r: RetentionStats) -> pb.RetentionStats:
    return pb.RetentionStats(
        **{n: getattr(r, n) for n in _RETENTION_COUNTERS},
        tiers=[
            pb.TierRetention(tier=int(t.tier), pages=t.pages, held_pages=t.held_pages, hold_cap_pages=t.hold_cap_pages)
            for t in r.tiers
        ],
    )


def retention_from_pb(m: pb.RetentionStats) -> RetentionStats:
    tiers = [TierRetention(TierKind(t.tier), t.pages, t.held_pages, t.hold_cap_pages) for t in m.tiers]
    return RetentionStats(**{n: getattr(m, n) for n in _RETENTION_COUNTERS}, tiers=tiers)


def lookup_to_pb(res: LookupResult) -> pb.LookupResponse:
    fetch = [
        pb.TierFetch(
            tier=int(f.tier),
            pages=f.pages,
            bytes=f.bytes,
            expected_ms=f.expected_ms,
            measured=f.measured,
            rate_bytes_per_second=f.rate_bytes_per_second,
        )
        for f in res.fetch
    ]
    return pb.LookupResponse(
        matched_blocks=res.matched,
        tiers=[int(t) for t in res.tiers],
        namespace_known=res.namespace_known,
        fetch=fetch,
        fetch_ms=res.fetch_ms,
    )


def lookup_from_pb(r: pb.LookupResponse) -> LookupResult:
    fetch = [
        TierFetch(TierKind(f.tier), f.pages, f.bytes, f.expected_ms, f.measured, f.rate_bytes_per_second)
        for f in r.fetch
    ]
    return LookupResult(r.matched_blocks, [TierKind(t) for t in r.tiers], r.namespace_known, fetch, r.fetch_ms)


def session_to_pb(s: SessionState) -> pb.SessionState:
    return pb.SessionState(
        session=s.name,
        priority=s.priority,
        mode=int(s.mode),
        ttl_seconds=s.ttl_seconds,
        pages=s.pages,
        pending=s.pending,
        unheld=s.unheld,
    )


def retain_result_to_pb(r: RetainResult) -> pb.RetainResponse:
    return pb.RetainResponse(
        retained=r.retained,
        pending=r.pending,
        released=r.released,
        prefetching=r.prefetching,
        state=None if r.state is None else session_to_pb(r.state),
        displaced=list(r.displaced),
    )


def retain_result_from_pb(m: pb.RetainResponse) -> RetainResult:
    state = None
    if m.HasField("state"):
        s = m.state
        state = SessionState(s.session, s.priority, RetainMode(s.mode), s.ttl_seconds, s.pages, s.pending, s.unheld)
    return RetainResult(m.retained, m.pending, m.released, m.prefetching, state, list(m.displaced))


_TENANT_COUNTERS = ("lookups", "lookup_blocks", "lookup_matched", "get_pages", "get_served", "cross_tenant_misses")


def _tenant_to_pb(t: TenantStats) -> pb.TenantStats:
    kinds = sorted(set(t.pages) | set(t.quota_bytes))
    return pb.TenantStats(
        tenant=t.tenant,
        **{n: getattr(t, n) for n in _TENANT_COUNTERS},
        tiers=[pb.TenantTier(tier=int(k), pages=t.pages.get(k, 0), quota_bytes=t.quota_bytes.get(k, 0)) for k in kinds],
        retention=retention_to_pb(t.retention),
    )


def _tenant_from_pb(m: pb.TenantStats) -> TenantStats:
    return TenantStats(
        m.tenant,
        {TierKind(x.tier): x.pages for x in m.tiers},
        {TierKind(x.tier): x.quota_bytes for x in m.tiers if x.quota_bytes},
        **{n: getattr(m, n) for n in _TENANT_COUNTERS},
        retention=retention_from_pb(m.retention),
    )


def stats_from_pb(msg: pb.StatsResponse) -> NodeStats:
    tiers = [
        TierStats(
            tier=TierKind(t.tier),
            **{name: getattr(t, name) for name in _TIER_SCALARS},
            counters=TierCounters(**{name: getattr(t, name) for name in _COUNTER_FIELDS}),
        )
        for t in msg.tiers
    ]
    namespaces = [(n.namespace, layout_from_pb(n.layout, "namespaces.layout"), n.pages) for n in msg.namespaces]
    return NodeStats(
        **{name: getattr(msg, name) for name in _NODE_SCALARS},
        tiers=tiers,
        namespaces=namespaces,
        index=IndexStatus(**{f.name: getattr(msg.index, f.name) for f in fields(IndexStatus)})
        if msg.HasField("index")
        else None,
        planes=[plane_from_pb(p) for p in msg.planes],
        tenants=[_tenant_from_pb(t) for t in msg.tenants],
        kv_events=KvEventsStatus(**{f.name: getattr(msg.kv_events, f.name) for f in fields(KvEventsStatus)})
        if msg.HasField("kv_events")
        else None,
        retention=retention_from_pb(msg.retention),
        replication=ReplicationStatus(**{f.name: getattr(msg.replication, f.name) for f in fields(ReplicationStatus)})
        if msg.HasField("replication")
        else None,
    )
