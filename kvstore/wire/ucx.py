"""UCX data plane (through `ucxx`): what the node side (`node.py`) and the client side (`client.py`) agree on.

Pure except `load_ucxx` (the one place ucxx is imported). UCX picks the transport by what both hosts
have: RDMA (InfiniBand/RoCE; needs a UCX built with verbs, see README), CUDA IPC, shared memory, TCP.

Connecting. The node opens a UCX listener and advertises `host:port` plus its UCX worker address
(`format_address`). A client connects either by the worker address (default: UCX then wires up the
best lanes both workers have, shared memory or RDMA included) or through the listener (a sockaddr
connection; on hosts without rdmacm that is TCP only). The first message is a HELLO: the bearer token,
a client-chosen connection id `cid` and, on the worker-address path, the client's own worker address
(the node needs an endpoint back). The node checks the token before anything else and answers
HELLO_OK or an ERROR, then closes the endpoint on an error.

Control stays in small UCX messages on the same endpoint (no gRPC round trip per call): a request
(PUT / GET, a 12-byte frame header + a protobuf body reused from the shm plane: PutShmRequest,
GetShmRequest; their `region`/`offset` fields are unused here) and one reply (OK + PutResponse /
GetShmResponse, or ERROR + "STATUS\\nmessage", which the client turns into the server's exception class).

Bulk: every page is one tagged message received straight into its final buffer: a PutTxn slot view on
the node (Put), a buffer of the caller on the client (Get). Tags carry the connection id, the message
kind, the request's sequence number and the page index, so a late message of an aborted request never
lands in another request's buffer. Page checksums travel in the control messages and are verified by
the receiver (PutTxn.commit on the node; the client on Get), as on every plane.
"""

from __future__ import annotations

import base64
import enum
import importlib.util
import os
import struct
from dataclasses import dataclass
from types import ModuleType

MAGIC = b"KVUX"
VERSION = 1
FRAME = struct.Struct("<4sBBHII")  # magic, version, kind, flags, seq, total length (header + body)
MAX_CONTROL_BYTES = 1 << 20  # largest control message either side accepts (4096 hashes fit easily)
MAX_HELLO_BYTES = 8192
MAX_PAGES_PER_CALL = 0xFFFF  # the page index is 16 bits of the tag
HELLO_CID = 0xFFFFFFFF  # the connection id HELLO messages travel under (never handed to a client)
ADDRESS_SEP = "#"  # host:port#<worker address, urlsafe base64>
HELLO = struct.Struct("<BIHH")  # flags, cid, token length, worker address length; then token, address


class Kind(enum.IntEnum):
    """Frame kinds (control messages)."""

    HELLO = 1
    HELLO_OK = 2
    PUT = 3
    GET = 4
    OK = 5
    ERROR = 6


class TagKind(enum.IntEnum):
    """What a tagged message carries; bits 24..31 of its tag."""

    HELLO = 0xFF
    CTRL_TO_NODE = 1
    DATA_TO_NODE = 2
    CTRL_TO_CLIENT = 3
    DATA_TO_CLIENT = 4


HELLO_FLAG_ERROR_HANDLING = 1  # the client's endpoint reports peer failures (UCP_ERR_HANDLING_MODE_PEER)


def tag(cid: int, kind: TagKind, seq: int = 0, index: int = 0) -> int:
    """The 64-bit tag of a message: cid (32 bits) | kind (8) | seq mod 256 (8) | page index (16)."""
    if not 0 <= index <= MAX_PAGES_PER_CALL:
        raise ValueError(f"page index {index} does not fit a tag")
    return (cid & 0xFFFFFFFF) << 32 | int(kind) << 24 | (seq & 0xFF) << 16 | index


HELLO_TAG = tag(HELLO_CID, TagKind.HELLO)
CID_MASK = 0xFFFFFFFF_00000000  # a tag mask matching every message of one connection


class ProtocolError(Exception):
    """A control message that is not what this protocol says (wrong magic, version, kind or size)."""


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


def error_body(status_name: str, message: str) -> bytes:
    return f"{status_name}\n{message}".encode()


def parse_error(body: memoryview) -> tuple[str, str]:
    status, _, message = bytes(body).decode("utf-8", "replace").partition("\n")
    return status, message


@dataclass(frozen=True, slots=True)
class Hello:
    """The first message of a connection."""

    cid: int
    token: str | None
    worker_address: bytes  # empty on the listener path
    error_handling: bool

    def pack(self) -> bytes:
        tok = (self.token or "").encode()
        flags = HELLO_FLAG_ERROR_HANDLING if self.error_handling else 0
        return HELLO.pack(flags, self.cid, len(tok), len(self.worker_address)) + tok + self.worker_address

    @classmethod
    def parse(cls, body: memoryview) -> Hello:
        if len(body) < HELLO.size:
            raise ProtocolError(f"HELLO body of {len(body)} bytes is shorter than {HELLO.size}")
        flags, cid, ntok, naddr = HELLO.unpack_from(body)
        if len(body) != HELLO.size + ntok + naddr:
            raise ProtocolError(f"HELLO body is {len(body)} bytes, its lengths say {HELLO.size + ntok + naddr}")
        if cid == HELLO_CID:
            raise ProtocolError(f"connection id {cid:#x} is reserved")
        tok = bytes(body[HELLO.size : HELLO.size + ntok]).decode("utf-8", "replace")
        addr = bytes(body[HELLO.size + ntok :])
        return cls(cid, tok or None, addr, bool(flags & HELLO_FLAG_ERROR_HANDLING))


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
