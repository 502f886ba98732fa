"""The bulk TCP data plane: what both ends agree on (frame format v2, pure: no I/O).

A client on another host moves page bytes over one or more persistent TCP connections to the node's
TCP plane listener (advertised in Stats and the index record as DataPlaneInfo{name="tcp", address,
tls}); control RPCs (Lookup, Delete, Pin, Stats...) stay on gRPC. `client.py` is the client side (an
exchange DataPlane driven by both clients), `node.py` the node side (a PlaneServer on the node's loop).

Frame (every message, both directions; integers little endian):

    magic "KT" (2 B) | version u8 | kind u8 | meta_len u32 | body_len u64     -- the 16-byte header
    meta  (meta_len bytes, fixed per kind below; bounded by the node's limits)
    body  (body_len bytes: a page payload, only in PAGE frames; empty otherwise)

Kinds and their meta:

    HELLO   c->n  token (UTF-8, empty when none); the first frame of a connection (after TLS if on)
    WELCOME n->c  role u8 (1 read, 2 read-write) | max_page_bytes u64 | max_pages u32
    PUT     c->n  target_tier u8 | chain u8 | has_parent u8 | npages u32 | parent 32 B | layout 20 B |
                  namespace_len u16 | namespace (UTF-8) [| part table] [| replicas u8]; then exactly `npages`
                  PAGE frames follow. The part table (kvstore/layout.py `pack_part_table`) names a bundle's
                  parts: only a bundle layout has one, and it may be left out. `replicas` (PutOpen.replicas)
                  ends the meta, sent only when set (> 0), so a PUT without it is byte for byte what nodes that
                  predate it take; a table's own lengths say where it ends, so the two never read as each other
    GET     c->n  promote u8 | nhashes u32 | namespace_len u16 | namespace | hashes (32 B each)
                  [| layout 20 B | part table]: the layout the client expects (a bundle and its parts),
                  checked by the node against the namespace's before any page
    PAGE    both  hash 32 B | checksum u64 (of the body, in the connection's form: below) | tier u8 (n->c;
                  0 from a client); body = the page payload
    DONE    n->c  a u32 | b u32: after a PUT (stored, already present); after a GET's PAGE frames
                  (pages sent, 0)
    ERROR   n->c  status_len u8 | status name (a kvstore.errors status, e.g. INVALID_ARGUMENT) | message

Conversation: HELLO, then WELCOME or ERROR (an unknown token, a version this node does not speak: the
node closes). Then any number of requests, one at a time per connection: PUT + its PAGE frames ->
DONE or ERROR; GET -> PAGE frames in order (the longest stored prefix) then DONE, or ERROR (after
any pages already sent). A request-level error (bad namespace, a read token on a PUT, no space, a
checksum mismatch) is answered with ERROR after the node consumed the rest of the request, and the
connection stays usable; a framing error (bad magic or version, an unexpected kind, a length over
the limits) is answered with ERROR when possible and the connection is closed, because the byte
stream cannot be resynchronised. A connection that stalls in a handshake or in the middle of a
frame for longer than the node's `tcp_timeout_seconds` is closed; whatever its request staged is
freed (a PUT is atomic like a Put stream: nothing of it becomes visible).

How frames meet the socket is each side's choice, never the format's: the node writes a GET reply's PAGE
frames a group at a time (headers and payloads gathered into one sendmsg, DONE with the last group), and the
client reads a reply frame's header and PAGE metadata in one receive (nothing follows a DONE or an ERROR
until the next request, so it never reads past a frame).

Versions: a connection speaks the version of its HELLO, and every later frame of it (both ways) carries
that version. They differ only in what a PAGE's checksum covers (kvstore/pageformat.py, ChecksumForm):
version 2 the KEYED form (the payload's XXH3-64 bound to the request's namespace and the page's hash, so a
page served under another key fails), version 1 the payload's XXH3-64 alone (clients that predate the
binding; a node of this build still serves them).

Checksums: every PAGE carries its checksum, computed by the sender; the node verifies a PUT's pages
in its PutTxn (as for every Put), and the client verifies every received page unless it was built
with verify=False. With the tier read's own verification that keeps the DESIGN rule: a page is
verified when read from a tier and whenever it crossed a network. Where it is computed keeps it off
the copy's critical path: all pages of a request are in flight back to back, so while one side
hashes page i the other is already moving page i+1 through the socket buffers (the PutTxn verifies
page i when page i+1 is added, not all pages at commit), and the two hashes of a transfer run in
two processes, on two cores.
"""

from __future__ import annotations

import enum
import ssl
import struct
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.hashing import HASH_BYTES, MAX_NAMESPACE_BYTES
from kvstore.layout import MAX_PART_NAME_BYTES, MAX_PARTS, PageLayout, part_table_len, unpack_part_table
from kvstore.names import TierKind
from kvstore.pageformat import ChecksumForm
from kvstore.wire import PutOpen, check_replicas

MAGIC = b"KT"
VERSION = 2  # what this build's client speaks (module docstring)
SPOKEN = (1, 2)  # what this build's node answers, each in its own version
HEADER = struct.Struct("<2sBBIQ")  # magic, version, kind, meta_len, body_len
HEADER_BYTES = HEADER.size  # 16
LAYOUT_BYTES = 20
_PUT = struct.Struct(f"<BBBI{HASH_BYTES}s{LAYOUT_BYTES}sH")
_GET = struct.Struct("<BIH")
_PAGE = struct.Struct(f"<{HASH_BYTES}sQB")
_DONE = struct.Struct("<II")
_WELCOME = struct.Struct("<BQI")
MAX_TOKEN_BYTES = 4096
# OpenSSL 3's SSL_OP_ENABLE_KTLS (named ssl.OP_ENABLE_KTLS from Python 3.12): both ends' TLS contexts set it, so
# that OpenSSL hands the record layer to the kernel (kTLS) where the kernel has it and the cipher suits it.
OP_ENABLE_KTLS = getattr(ssl, "OP_ENABLE_KTLS", 1 << 3)
# Kernel send/receive buffers per connection, both ends: a few MiB-pages in flight (0: leave the kernel's
# autotuning alone).
SOCKET_BUFFER_BYTES = 4 << 20
PAGE_META_BYTES = _PAGE.size  # 41
MAX_TABLE_BYTES = 1 + MAX_PARTS * (1 + MAX_PART_NAME_BYTES + LAYOUT_BYTES)  # the largest part table
_LAYOUT_FIELDS = ("dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "encoding")
PAGE_FRAME_HEAD = struct.Struct(f"<2sBBIQ{HASH_BYTES}sQB")  # a PAGE frame's header and metadata, packed at once
PAGE_FRAME_HEAD_BYTES = PAGE_FRAME_HEAD.size  # 57


class Kind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    PUT = 3
    GET = 4
    PAGE = 5
    DONE = 6
    ERROR = 7


class FrameError(InvalidArgument):
    """The byte stream broke the frame format (bad magic, version, kind or length). Unlike a request
    error, the connection cannot go on: the node answers ERROR when it can, then closes it."""


@dataclass(frozen=True, slots=True)
class Header:
    kind: Kind
    meta_len: int
    body_len: int
    version: int = VERSION


def checksum_form(version: int) -> ChecksumForm:
    """What a PAGE's checksum covers on a connection of `version` (module docstring)."""
    return ChecksumForm.KEYED if version >= 2 else ChecksumForm.PAYLOAD


def pack_header(kind: Kind, meta_len: int, body_len: int = 0, version: int = VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, kind, meta_len, body_len)


def frame(kind: Kind, meta: bytes = b"", version: int = VERSION) -> bytes:
    """A whole frame without a body: header and meta, one buffer."""
    return pack_header(kind, len(meta), 0, version) + meta


def unpack_header(
    raw: bytes | bytearray | memoryview, *, meta_limit: int, body_limit: int, spoken: tuple[int, ...] = (VERSION,)
) -> Header:
    """Parse a 16-byte header and check it against the receiver's limits; raises FrameError naming the
    field. Only PAGE frames may have a body; `spoken`: the versions the receiver takes."""
    magic, version, kind, meta_len, body_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise FrameError("frame.magic", f"expected {MAGIC!r}, got {bytes(magic)!r} (not a kvstore TCP plane peer)")
    if version not in spoken:
        said = ", ".join(map(str, spoken))
        raise FrameError("frame.version", f"version {version} is not spoken here (this build speaks {said})")
    try:
        k = Kind(kind)
    except ValueError:
        raise FrameError("frame.kind", f"unknown frame kind {kind}") from None
    if meta_len > meta_limit:
        raise FrameError("frame.meta_len", f"{meta_len} bytes of {k.name} metadata; the limit is {meta_limit}")
    if body_len and k is not Kind.PAGE:
        raise FrameError("frame.body_len", f"a {k.name} frame carries no body, got {body_len} bytes")
    if body_len > body_limit:
        raise FrameError("frame.body_len", f"a {body_len}-byte page; this side takes pages up to {body_limit} bytes")
    return Header(k, meta_len, body_len, version)


def expect_len(meta: bytes | memoryview, size: int, kind: Kind) -> None:
    if len(meta) != size:
        raise FrameError("frame.meta_len", f"{kind.name} metadata is {size} bytes, got {len(meta)}")


# -- HELLO / WELCOME ---------------------------------------------------------------------------------


def hello(token: str | None) -> bytes:
    raw = (token or "").encode()
    if len(raw) > MAX_TOKEN_BYTES:
        raise ValueError(f"token longer than {MAX_TOKEN_BYTES} bytes")
    return frame(Kind.HELLO, raw)


def welcome(role: int, max_page_bytes: int, max_pages: int, version: int = VERSION) -> bytes:
    return frame(Kind.WELCOME, _WELCOME.pack(role, max_page_bytes, max_pages), version)


@dataclass(frozen=True, slots=True)
class Welcome:
    role: int
    max_page_bytes: int
    max_pages: int


def parse_welcome(meta: bytes | memoryview) -> Welcome:
    expect_len(meta, _WELCOME.size, Kind.WELCOME)
    return Welcome(*_WELCOME.unpack(meta))


# -- PUT ---------------------------------------------------------------------------------------------


def put(op: PutOpen, npages: int) -> bytes:
    ns = op.namespace.encode()
    table = op.layout.part_table() if op.layout.has_parts else b""
    fixed = _PUT.pack(
        int(op.target_tier) if op.target_tier else 0,
        op.chain,
        op.parent is not None,
        npages,
        op.parent or bytes(HASH_BYTES),
        op.layout.pack(),
        len(ns),
    )
    extra = bytes((op.replicas,)) if op.replicas else b""  # NOTE: only when set: older nodes take exact lengths
    return frame(Kind.PUT, fixed + ns + table + extra)


def put_npages(meta: bytes | memoryview) -> int:
    """How many PAGE frames follow a PUT, read first, so that a PUT refused for any other reason can still be
    consumed whole (the node checks the count before anything else: kvstore/node/drivers.py
    `check_page_count`). FrameError when the frame is malformed."""
    if len(meta) < _PUT.size:
        raise FrameError("frame.meta_len", f"PUT metadata is at least {_PUT.size} bytes, got {len(meta)}")
    *_, npages, _, _, ns_len = _PUT.unpack_from(meta)
    if len(meta) < _PUT.size + ns_len:
        raise FrameError("frame.meta_len", f"PUT metadata is {len(meta)} bytes, short of its {ns_len}-byte namespace")
    return int(npages)


def parse_put(meta: bytes | memoryview, form: ChecksumForm = ChecksumForm.KEYED) -> PutOpen:
    """A PUT's metadata (its size already checked by put_npages), its pages' checksums in `form` (the
    connection's); InvalidArgument names a bad field."""
    target, chain, has_parent, _, parent, layout_raw, ns_len = _PUT.unpack_from(meta)
    namespace = _namespace(meta[_PUT.size : _PUT.size + ns_len], "put.namespace")
    tail = meta[_PUT.size + ns_len :]
    table_end = len(tail)
    if len(tail) and _packed_is_bundle(layout_raw):
        if len(tail) == 1:  # NOTE: a table is at least 22 bytes (a count and one part), so one byte is `replicas`
            table_end = 0
        else:
            try:
                table_end = part_table_len(tail)
            except ValueError as exc:
                raise InvalidArgument("put.layout", str(exc)) from None
    elif len(tail) == 1:
        table_end = 0  # NOTE: only a bundle has a table: one byte after the namespace is `replicas`
    rest = tail[table_end:]
    if len(rest) > 1:
        raise InvalidArgument("put.layout", f"{len(rest)} bytes after the PUT's layout; only `replicas` may follow")
    replicas = check_replicas(rest[0], "put.replicas") if len(rest) else 0
    layout = _layout(layout_raw, tail[:table_end], "put.layout")
    try:
        tier = TierKind(target) if target else None
    except ValueError:
        raise InvalidArgument("put.target_tier", f"unknown tier {target}") from None
    return PutOpen(namespace, layout, tier, bytes(parent) if has_parent else None, bool(chain), form, replicas)


# -- GET ---------------------------------------------------------------------------------------------


def get(namespace: str, hashes: list[bytes], promote: bool, expect: PageLayout | None = None) -> bytes:
    ns = namespace.encode()
    if any(len(h) != HASH_BYTES for h in hashes):
        raise ValueError(f"a block hash is {HASH_BYTES} bytes")
    tail = b"" if expect is None else expect.pack() + (expect.part_table() if expect.has_parts else b"")
    return frame(Kind.GET, _GET.pack(promote, len(hashes), len(ns)) + ns + b"".join(hashes) + tail)


@dataclass(frozen=True, slots=True)
class GetArgs:
    """A GET's request: its namespace, hashes, whether to promote, and the layout it expects (None: any)."""

    namespace: str
    hashes: list[bytes]
    promote: bool
    expect: PageLayout | None = None


def parse_get(meta: bytes | memoryview) -> GetArgs:
    """A GET's arguments; FrameError when the sizes do not add up, InvalidArgument for a bad layout."""
    if len(meta) < _GET.size:
        raise FrameError("frame.meta_len", f"GET metadata is at least {_GET.size} bytes, got {len(meta)}")
    promote, n, ns_len = _GET.unpack_from(meta)
    base = _GET.size + ns_len
    end = base + n * HASH_BYTES
    if len(meta) != end and len(meta) < end + LAYOUT_BYTES:
        raise FrameError(
            "frame.meta_len", f"GET metadata is {end} bytes, or {end + LAYOUT_BYTES}+ with a layout; got {len(meta)}"
        )
    namespace = _namespace(meta[_GET.size : base], "get.namespace")
    expect = None
    if len(meta) > end:
        expect = _layout(meta[end : end + LAYOUT_BYTES], meta[end + LAYOUT_BYTES :], "get.layout")
    return GetArgs(
        namespace,
        [bytes(meta[base + i * HASH_BYTES : base + (i + 1) * HASH_BYTES]) for i in range(n)],
        bool(promote),
        expect,
    )


def get_meta_limit(max_pages: int) -> int:
    """The largest metadata a node accepts: a GET of `max_pages` hashes and a bundle's layout (every other kind
    is smaller)."""
    return _GET.size + MAX_NAMESPACE_BYTES + max_pages * HASH_BYTES + LAYOUT_BYTES + MAX_TABLE_BYTES + MAX_TOKEN_BYTES


def _packed_is_bundle(packed: bytes | memoryview) -> bool:
    """Whether 20 packed layout bytes say a bundle (False when they do not unpack: `_layout` names why)."""
    try:
        return PageLayout.unpack(bytes(packed)).is_bundle
    except ValueError:
        return False


def _layout(packed: bytes | memoryview, table: bytes | memoryview, field: str) -> PageLayout:
    """A layout from its 20 packed bytes and, for a bundle, its part table (may be empty)."""
    try:
        layout = PageLayout.unpack(bytes(packed))
        if len(table):
            if not layout.is_bundle:
                raise ValueError("only a bundle layout is followed by a part table")
            parts = unpack_part_table(table)
            layout = PageLayout(*(getattr(layout, f) for f in _LAYOUT_FIELDS), parts)
    except ValueError as exc:
        raise InvalidArgument(field, str(exc)) from None
    return layout


# -- PAGE / DONE / ERROR -----------------------------------------------------------------------------


def page_header(h: bytes, checksum: int, nbytes: int, tier: TierKind | None = None, version: int = VERSION) -> bytes:
    """Header and meta of a PAGE frame; the `nbytes` payload bytes follow."""
    tier_value = int(tier) if tier else 0
    return PAGE_FRAME_HEAD.pack(MAGIC, version, Kind.PAGE, PAGE_META_BYTES, nbytes, h, checksum, tier_value)


def parse_page(meta: bytes | memoryview) -> tuple[bytes, int, int]:
    """(hash, checksum, tier value) of a PAGE frame."""
    expect_len(meta, PAGE_META_BYTES, Kind.PAGE)
    h, checksum, tier = _PAGE.unpack(meta)
    return h, checksum, tier


def done(a: int, b: int, version: int = VERSION, held: bytes = b"") -> bytes:
    """DONE; after a PUT, on a version 2 connection, `held` (wire.pack_held) follows the two counts."""
    return frame(Kind.DONE, _DONE.pack(a, b) + held, version)


def parse_done(meta: bytes | memoryview) -> tuple[int, int]:
    """The two counts of a DONE (a PUT's per-page answer, if any, follows them: `done_held`)."""
    if len(meta) < _DONE.size:
        expect_len(meta, _DONE.size, Kind.DONE)
    a, b = _DONE.unpack_from(meta)
    return a, b


def done_held(meta: bytes | memoryview) -> bytes | memoryview:
    """What follows a DONE's counts: a PUT's per-page bitmap on a version 2 connection (empty otherwise)."""
    return meta[_DONE.size :]


def error(status_name: str, message: str, version: int = VERSION) -> bytes:
    status = status_name.encode()[:255]
    return frame(Kind.ERROR, bytes((len(status),)) + status + message.encode()[:65536], version)


def parse_error(meta: bytes | memoryview) -> tuple[str, str]:
    """(status name, message) of an ERROR frame (lenient: it is already an error)."""
    raw = bytes(meta)
    n = raw[0] if raw else 0
    return raw[1 : 1 + n].decode(errors="replace") or "UNKNOWN", raw[1 + n :].decode(errors="replace")


def _namespace(raw: bytes | memoryview, field: str) -> str:
    if len(raw) > MAX_NAMESPACE_BYTES:
        raise InvalidArgument(field, f"{len(raw)} bytes; the limit is {MAX_NAMESPACE_BYTES}")
    try:
        return bytes(raw).decode()
    except UnicodeDecodeError:
        raise InvalidArgument(field, "not valid UTF-8") from None
