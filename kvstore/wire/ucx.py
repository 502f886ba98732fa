"""UCX data plane (through `ucxx`): what the node side and the client side agree on (protocol version 3).

Pure except `load_ucxx` (the one place ucxx is imported). UCX picks the transport by what both hosts
have: RDMA (InfiniBand/RoCE; needs a UCX built with verbs, see README), CUDA IPC, shared memory, TCP.

Why tags carry secrets. UCX tells a receiver nothing about who sent a tagged message: tag matching is
per worker, not per endpoint (ucxx's `ep.tag_recv` posts on the worker too), and a message nobody
receives is buffered by UCX for as long as it stays unreceived. So the node accepts a tagged message
only where it expects that exact tag, and every tag it expects is a secret only the right endpoint knows:
- a connection opens through the node's listener (a sockaddr connection, so the node holds the
  endpoint). The node posts a receive under a fresh random 64-bit nonce and sends the nonce over that
  endpoint (CHALLENGE); the client's HELLO (token, and its worker address when it wants a lane UCX
  picks by worker address: shared memory, RDMA) must come tagged with it. The token is checked before
  anything else; a refused HELLO is answered on that endpoint (ERROR) and the endpoint closed;
- HELLO_OK hands the client a 32-byte session secret (and the node's largest page size), from which
  both sides derive every later tag of the connection (`SessionTags`), per request sequence number:
  the node's control receive, its reply, and the page tags of each direction. A process that did not
  receive HELLO_OK cannot name a tag the node receives, so it cannot make a request run as a
  connection, nor land bytes in one;
- the node drains whatever else arrives (kvstore/node/planes/ucx_intake.py), so unmatched messages
  cost it no memory, and its UCX context enables only tagged messages (no stream, AM or RMA handlers).

Control (no gRPC round trip per call): a request (PUT / GET, a 16-byte frame header + a protobuf
body reused from the shm plane: BulkPutRequest, BulkGetRequest; or LAYOUT, the page-size ask every plane
that sizes its receives first sends: `kvstore.wire.page_size_ask`) and one reply (OK + PutResponse /
BulkGetResponse / the page size, u64, or ERROR + "STATUS\\nmessage", which the client turns into the
server's exception class). A plain get asks LAYOUT once per namespace and sizes its receives by the
answer (`kvstore.client.planes.base.page_size`). In a GET, `targets[i].size` (one target per hash)
says how many bytes the client's receive for page i holds: the node sends a page only where it fits, stops
at the first that does not and reports its size in the OK reply's prefix (GET_REPLY: next_page_bytes,
then BulkGetResponse: a get_into buffer too small, or a page size remembered from before a node restart);
`buffer` and `offset` are the same-host plane's and unused here.

Bulk: every page is one tagged message received straight into its final buffer: a PutTxn slot view on
the node (Put), a buffer of the caller on the client (Get). The client posts every receive of a GET
(and the reply's) before it sends the request, and every send of a PUT at once; the node answers each
page receive a GET's client posted, with the page or an empty message, so no receive is left posted.
Page checksums travel in the control messages and are verified by the receiver (PutTxn.commit on the
node; the client on Get), as on every plane.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import importlib.util
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

from kvstore.errors import ProtocolError

MAGIC = b"KVUX"
VERSION = 3  # 3: LAYOUT (a namespace's page size is asked, never guessed); a peer of another version is refused
FRAME = struct.Struct("<4sBBHII")  # magic, version, kind, flags, seq, total length (header + body)
MAX_CONTROL_BYTES = 1 << 20  # largest control message either side accepts (4096 hashes fit easily)
MAX_HELLO_BYTES = 8192
MAX_PAGES_PER_CALL = 0xFFFF  # the page index is the low 16 bits of a page tag
ADDRESS_SEP = "#"  # host:port#<worker address, urlsafe base64>
HELLO = struct.Struct("<BHH")  # flags, token length, worker address length; then token, address
NONCE = struct.Struct("<Q")
HELLO_OK = struct.Struct("<Q")  # after the secret: the node's max_page_bytes
GET_REPLY = struct.Struct("<Q")  # a GET's OK body starts with next_page_bytes (0: every listed page fitted)
SECRET_BYTES = 32
# Tags a client's own worker receives before it has a session (its worker is private to one connection).
CHALLENGE_TAG = 1
HELLO_REPLY_TAG = 2
SECRET_TAG_BIT = 1 << 63  # set in every nonce and derived tag, clear in the fixed ones above
PAGE_INDEX_MASK = 0xFFFF

# Defaults this library gives UCX (ucp context options) unless the environment sets them (UCX_<name>).
# NOTE: measured on loopback (benchmarks/ucx_bench.py, RESULTS.md): with 8 KiB TCP segments UCX moves a
# large message as a rendezvous fragmented into 8 KiB copies through bounce buffers; with 512 KiB
# segments it selects rendezvous zero-copy (the receiver's socket reads straight into the posted
# buffer). Only the TCP transport reads these; shared memory and RDMA lanes are unaffected.
CONTEXT_DEFAULTS: dict[str, str] = {"TCP_TX_SEG_SIZE": "512K", "TCP_RX_SEG_SIZE": "512K"}


class Kind(enum.IntEnum):
    """Frame kinds (control messages)."""

    CHALLENGE = 1
    HELLO = 2
    HELLO_OK = 3
    PUT = 4
    GET = 5
    OK = 6
    ERROR = 7
    LAYOUT = 8  # c->n: a page-size ask (kvstore.wire.page_size_ask) -> OK (page size, u64) | ERROR


HELLO_FLAG_ERROR_HANDLING = 1  # the client's endpoint reports peer failures (UCP_ERR_HANDLING_MODE_PEER)


def frame(kind: Kind, seq: int, body: bytes = b"", flags: int = 0) -> bytes:
    """A control message: the frame header (which carries the total length: UCX does not tell a
    receiver how many bytes of its buffer a message filled), then the body."""
    return FRAME.pack(MAGIC, VERSION, int(kind), flags, seq & 0xFFFFFFFF, FRAME.size + len(body)) + body


def frame_length(head: bytes | bytearray | memoryview) -> int:
    """The total length a frame header announces (header included); ProtocolError when it is no header."""
    view = memoryview(head).cast("B")
    if len(view) < FRAME.size:
        raise ProtocolError(f"control message of {len(view)} bytes is shorter than its {FRAME.size}-byte header")
    magic, version, _, _, _, total = FRAME.unpack_from(view)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (not a kvstore UCX peer)")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this side speaks {VERSION}")
    if total < FRAME.size:
        raise ProtocolError(f"frame length {total} is shorter than its header")
    return int(total)


def unframe(msg: bytes | bytearray | memoryview) -> tuple[Kind, int, int, memoryview]:
    """(kind, flags, seq, body) of a control message received into `msg` (a buffer at least as long as
    the message); ProtocolError naming what is wrong."""
    view = memoryview(msg).cast("B")
    total = frame_length(view)
    if total > len(view):
        raise ProtocolError(f"frame length {total} runs past the {len(view)} bytes received")
    _, _, kind, flags, seq, _ = FRAME.unpack_from(view)
    try:
        return Kind(kind), flags, seq, view[FRAME.size : total]
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind}") from None


def expect(msg: bytes | bytearray | memoryview, kind: Kind, seq: int) -> memoryview:
    """The body of a control message that must be `kind` for request `seq`; ProtocolError otherwise."""
    got, _, got_seq, body = unframe(msg)
    if got_seq != seq & 0xFFFFFFFF:
        raise ProtocolError(f"message for request {got_seq}, expected {seq}")
    if got is not kind:
        raise ProtocolError(f"expected {kind.name}, got {got.name}")
    return body


def error_body(status_name: str, message: str) -> bytes:
    return f"{status_name}\n{message}".encode()


def parse_error(body: memoryview) -> tuple[str, str]:
    status, _, message = bytes(body).decode("utf-8", "replace").partition("\n")
    return status, message


def new_nonce() -> int:
    """A fresh random tag (secret bit set) for a CHALLENGE."""
    return int.from_bytes(os.urandom(8), "little") | SECRET_TAG_BIT


def parse_nonce(body: memoryview) -> int:
    if len(body) != NONCE.size:
        raise ProtocolError(f"CHALLENGE body is {len(body)} bytes, expected {NONCE.size}")
    (nonce,) = NONCE.unpack_from(body)
    if not nonce & SECRET_TAG_BIT:
        raise ProtocolError("CHALLENGE nonce lacks the secret-tag bit")
    return int(nonce)


@dataclass(frozen=True, slots=True)
class HelloOk:
    """The node's answer to an accepted HELLO: the session secret, and the largest page it serves (the bound
    on every page size the node may answer or announce on this connection)."""

    secret: bytes
    max_page_bytes: int

    def pack(self) -> bytes:
        return self.secret + HELLO_OK.pack(self.max_page_bytes)

    @classmethod
    def parse(cls, body: memoryview) -> HelloOk:
        if len(body) != SECRET_BYTES + HELLO_OK.size:
            raise ProtocolError(f"HELLO_OK body is {len(body)} bytes, expected {SECRET_BYTES + HELLO_OK.size}")
        (max_page_bytes,) = HELLO_OK.unpack_from(body, SECRET_BYTES)
        if max_page_bytes <= 0:
            raise ProtocolError("HELLO_OK announces no page size")
        return cls(bytes(body[:SECRET_BYTES]), int(max_page_bytes))


def pack_get_reply(next_page_bytes: int, response: bytes) -> bytes:
    """A GET's OK body: the size of the first page that did not fit its receive (0: none), then the
    serialized BulkGetResponse listing the pages sent."""
    return GET_REPLY.pack(next_page_bytes) + response


def parse_get_reply(body: memoryview) -> tuple[int, memoryview]:
    """(next_page_bytes, serialized BulkGetResponse) of a GET's OK body; ProtocolError when too short."""
    if len(body) < GET_REPLY.size:
        raise ProtocolError(f"GET reply body of {len(body)} bytes is shorter than {GET_REPLY.size}")
    (next_page_bytes,) = GET_REPLY.unpack_from(body)
    return int(next_page_bytes), body[GET_REPLY.size :]


@dataclass(frozen=True, slots=True)
class Hello:
    """The client's first message (tagged with the node's CHALLENGE nonce)."""

    token: str | None
    worker_address: bytes  # empty: the client sends and receives on the listener endpoint
    error_handling: bool

    def pack(self) -> bytes:
        tok = (self.token or "").encode()
        flags = HELLO_FLAG_ERROR_HANDLING if self.error_handling else 0
        return HELLO.pack(flags, len(tok), len(self.worker_address)) + tok + self.worker_address

    @classmethod
    def parse(cls, body: memoryview) -> Hello:
        if len(body) < HELLO.size:
            raise ProtocolError(f"HELLO body of {len(body)} bytes is shorter than {HELLO.size}")
        flags, ntok, naddr = HELLO.unpack_from(body)
        if len(body) != HELLO.size + ntok + naddr:
            raise ProtocolError(f"HELLO body is {len(body)} bytes, its lengths say {HELLO.size + ntok + naddr}")
        tok = bytes(body[HELLO.size : HELLO.size + ntok]).decode("utf-8", "replace")
        addr = bytes(body[HELLO.size + ntok :])
        return cls(tok or None, addr, bool(flags & HELLO_FLAG_ERROR_HANDLING))


class Lane(enum.Enum):
    """What a session tag is for; each request (seq) of a session has one tag or page range per lane."""

    CONTROL = b"ctrl"  # the client's request, received by the node
    REPLY = b"reply"  # the node's reply, received by the client
    PUT_PAGES = b"put"  # a PUT's pages, client -> node (a range: low 16 bits are the page index)
    GET_PAGES = b"get"  # a GET's pages, node -> client (a range)


class SessionTags:
    """The tags of one authenticated connection, derived from its secret (keyed BLAKE2b, 64 bits).

    Invariants: every tag has SECRET_TAG_BIT set; a range base has its low 16 bits clear (page i of a
    range is `base | i`); tags differ per lane and per request, so a late message of one request can
    never match a receive of another. Without the secret no tag can be named (2^-63 per guess).
    """

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a session secret has {SECRET_BYTES} bytes, got {len(secret)}")
        self._secret = secret

    @classmethod
    def new(cls) -> SessionTags:
        return cls(os.urandom(SECRET_BYTES))

    @property
    def secret(self) -> bytes:
        return self._secret

    def tag(self, lane: Lane, seq: int) -> int:
        """The tag (or, for a page lane, the range base) of `lane` in request `seq`."""
        digest = hashlib.blake2b(lane.value + seq.to_bytes(8, "little"), key=self._secret, digest_size=8).digest()
        value = int.from_bytes(digest, "little") | SECRET_TAG_BIT
        if lane in (Lane.PUT_PAGES, Lane.GET_PAGES):
            value &= ~PAGE_INDEX_MASK
        return value

    @staticmethod
    def page(base: int, index: int) -> int:
        """Page `index`'s tag in the range starting at `base`."""
        if not 0 <= index <= MAX_PAGES_PER_CALL:
            raise ValueError(f"page index {index} does not fit a tag")
        return base | index


def range_base(tag: int) -> int:
    """The range a page tag belongs to."""
    return tag & ~PAGE_INDEX_MASK


@dataclass(frozen=True, slots=True)
class UcxAddress:
    """Where a node's UCX plane is: its listener, and its worker address (empty when not advertised)."""

    host: str
    port: int
    worker: bytes = b""


def format_address(addr: UcxAddress) -> str:
    """The advertised text form (Stats / index record): `host:port`, then `#` and the worker address."""
    text = f"{addr.host}:{addr.port}"
    if addr.worker:
        text += ADDRESS_SEP + base64.urlsafe_b64encode(addr.worker).decode()
    return text


def parse_address(text: str) -> UcxAddress:
    """Inverse of format_address; ValueError naming what is wrong."""
    listener, _, worker = text.partition(ADDRESS_SEP)
    host, sep, port = listener.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"UCX plane address {listener!r} is not host:port")
    try:
        raw = base64.b64decode(worker, altchars=b"-_", validate=True) if worker else b""
    except ValueError as exc:
        raise ValueError(f"UCX plane worker address is not base64: {exc}") from None
    return UcxAddress(host.strip("[]"), int(port), raw)


def context_options(environ: Mapping[str, str]) -> dict[str, str]:
    """The ucp context options this library sets: CONTEXT_DEFAULTS less those the environment sets
    (a UCX_<name> variable always wins: ucxx would otherwise override it)."""
    return {k: v for k, v in CONTEXT_DEFAULTS.items() if f"UCX_{k}" not in environ}


def ucxx_installed() -> bool:
    """Whether ucxx can be imported here (checked without importing it: that takes ~1 s)."""
    try:
        return importlib.util.find_spec("ucxx") is not None
    except (ImportError, ValueError):
        return False


def load_ucxx() -> ModuleType:
    """Import ucxx's low-level bindings (`ucxx._lib.libucxx`). Raises ImportError with the install hint.

    NOTE: ucxx sets UCX_MEMTYPE_CACHE, which UCX >= 1.19 no longer knows, so every UCX context would
    warn about it on stderr; we silence only that class of warning, and only when the user did not ask.
    """
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx._lib.libucxx as ucx_api
    except ImportError as exc:
        raise ImportError(f"the UCX data plane needs ucxx: pip install 'kvstore[ucx]' ({exc})") from exc
    return ucx_api
