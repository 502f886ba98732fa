"""The same-host plane: page bytes cross through the client's own memory, control through a node-local
Unix socket that passes memory by file descriptor (what both sides agree on; pure but `shm_available` and
`peer_credentials`).

Why a socket with fd passing (DESIGN.md §8.1, §12): a client on the node's host wants its pages moved with
one memcpy, no gRPC round trip per batch, and the node must never open another process's files to get
there. So the node listens on a Unix socket (AF_UNIX, SOCK_SEQPACKET: one message per send, fds passed
alongside with SCM_RIGHTS), at a path the operator chooses (`--local-socket`; in Kubernetes a hostPath both
the node's and the workers' pods mount: fd passing works across PID and mount namespaces, where
/proc/<pid>/fd and /dev/shm do not).

Who answers (DESIGN.md §12): a path is not an identity, since another local user may bind it while the node is
down, or rename the node's socket where the directory lets it. So before it sends anything (its token, a
descriptor) a client compares the credentials of the socket it reached (SO_PEERCRED: the user that bound and
listens on it) with the user id the node advertises for this plane over gRPC (Stats; DataPlaneInfo.uid),
and sends nothing to any other user. A node's default socket lives in a directory of its own user's
(`default_socket_path`), which nobody else may write.

Conversation (one request at a time per connection; a client keeps a few connections):

    HELLO     c->n  token (UTF-8; empty when none)                  -> WELCOME | ERROR (then closed)
    WELCOME   n->c  max_page_bytes u64 | max_pages u32 | role u8 (low bits; SUMS_AFTER: the top bit)
    REGISTER  c->n  buffer id u32; one fd in SCM_RIGHTS               -> OK | ERROR
    PUT       c->n  BulkPutRequest (each slice names its registered buffer id and offset)
                                                                      -> OK (PutResponse) | ERROR
    PUT_SUMS  c->n  BulkPutRequest without checksums (only to a node whose WELCOME set SUMS_AFTER),
                    followed at once, before any reply, by
    SUMS      c->n  one checksum u64 per page of the PUT_SUMS, its seq -> OK (PutResponse) | ERROR
    GET       c->n  BulkGetRequest (targets: where page i goes: a registered buffer id, offset, size)
                                                                      -> OK (BulkGetResponse) | ERROR
    LAYOUT    c->n  the first hash a GET will ask for (32 B) | namespace (UTF-8)
                                                                      -> OK (page_bytes u64) | ERROR
    ERROR     n->c  status_len u8 | status name | message

Every message: a FRAME header (magic "KL", version, kind, seq u32, body length u32) and its body. A
registered buffer is a memfd sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW): its size is
final, so the node maps it once and copies with memcpy, and no client can make a mapped page vanish under
a copy (SIGBUS). The fd itself proves the client may use the memory (it had it); the node never opens a
path, never opens a tty, and answers one message for every descriptor it will not map.

Checksums (DESIGN.md §8): the node verifies every page it copies into a client's memory in the pass that
copies it, and computes the checksum of every page put from the bytes that landed in its slot; the client
verifies nothing again (nothing crossed a network). A writer declares every page's checksum (the keyed form,
pageformat.wire_checksum), so a page changed while the node copies it, or copied from the wrong place, is
refused: inside the PUT, or (PUT_SUMS) in a SUMS message sent right after it, so that the writer hashes its
pages while the node copies them instead of before (one pass over the pages each, side by side). The node
makes none of a PUT_SUMS's pages visible before the SUMS message came and matched; a SUMS whose request was
answered already (refused before the node read it) is dropped.
"""

from __future__ import annotations

import enum
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import ProtocolError

MAGIC = b"KL"
VERSION = 1
FRAME = struct.Struct("<2sBBII")  # magic, version, kind, seq, body length
WELCOME = struct.Struct("<QIB")  # max_page_bytes, max pages per call, role | feature bits
SUMS_AFTER = 0x80  # a WELCOME role bit: this node takes PUT_SUMS (older clients read the role byte not at all)
ROLE_BITS = 0x0F
CHECKSUM = struct.Struct("<Q")  # one declared checksum of a SUMS message
REGISTER = struct.Struct("<I")  # buffer id
PAGE_BYTES = struct.Struct("<Q")  # a LAYOUT reply
MAX_MESSAGE_BYTES = 1 << 20  # the largest control message either side sends or accepts
MAX_TOKEN_BYTES = 4096
MAX_PAGES_PER_CALL = 4096  # pages one PUT or GET names (its message stays under MAX_MESSAGE_BYTES)
MAX_BUFFERS = 256  # buffers one connection may register
SOCKET_BUFFER_BYTES = 4 << 20  # SO_SNDBUF / SO_RCVBUF: a SEQPACKET message must fit whole


class Kind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    REGISTER = 3
    PUT = 4
    GET = 5
    OK = 6
    ERROR = 7
    LAYOUT = 8
    PUT_SUMS = 9
    SUMS = 10


def frame(kind: Kind, seq: int, body: bytes = b"") -> bytes:
    return FRAME.pack(MAGIC, VERSION, kind, seq, len(body)) + body


def unframe(msg: bytes | memoryview) -> tuple[Kind, int, memoryview]:
    """(kind, seq, body) of one message; ProtocolError naming what is wrong."""
    if len(msg) < FRAME.size:
        raise ProtocolError(f"a message of {len(msg)} bytes is shorter than its {FRAME.size}-byte header")
    magic, version, kind, seq, n = FRAME.unpack_from(msg)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"not a kvstore same-host plane message (magic {bytes(magic)!r}, version {version})")
    if n != len(msg) - FRAME.size:
        raise ProtocolError(f"the header announces {n} body bytes, the message carries {len(msg) - FRAME.size}")
    try:
        k = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind}") from None
    return k, seq, memoryview(msg)[FRAME.size :]


@dataclass(frozen=True, slots=True)
class Welcome:
    """What a node's WELCOME says: its limits, the caller's role, and whether it takes PUT_SUMS."""

    max_page_bytes: int
    max_pages: int
    role: int
    sums_after: bool


def welcome_body(max_page_bytes: int, max_pages: int, role: int, sums_after: bool) -> bytes:
    return WELCOME.pack(max_page_bytes, max_pages, (role & ROLE_BITS) | (SUMS_AFTER if sums_after else 0))


def parse_welcome(body: bytes | memoryview) -> Welcome:
    """A WELCOME body; ProtocolError when it is not one."""
    if len(body) != WELCOME.size:
        raise ProtocolError(f"a WELCOME carries {WELCOME.size} bytes, not {len(body)}")
    max_page_bytes, max_pages, bits = WELCOME.unpack(body)
    return Welcome(max_page_bytes, max_pages, bits & ROLE_BITS, bool(bits & SUMS_AFTER))


def sums_body(checksums: Sequence[int]) -> bytes:
    """A SUMS message's body: the declared checksums, in the order of the PUT_SUMS's pages."""
    return struct.pack(f"<{len(checksums)}Q", *checksums)


def parse_sums(body: bytes | memoryview, pages: int) -> list[int]:
    """The checksums of a SUMS message answering a PUT_SUMS of `pages` pages; ProtocolError when its size is
    not one u64 per page."""
    if len(body) != CHECKSUM.size * pages:
        raise ProtocolError(f"a SUMS for {pages} pages carries {CHECKSUM.size * pages} bytes, not {len(body)}")
    return list(struct.unpack(f"<{pages}Q", body))


def error_body(status_name: str, message: str) -> bytes:
    status = status_name.encode()[:255]
    return bytes((len(status),)) + status + message.encode()[:65536]


def parse_error(body: bytes | memoryview) -> tuple[str, str]:
    raw = bytes(body)
    n = raw[0] if raw else 0
    return raw[1 : 1 + n].decode(errors="replace") or "UNKNOWN", raw[1 + n :].decode(errors="replace")


def default_socket_path(port: int, env: Mapping[str, str] | None = None) -> str:
    """Where a node serving gRPC on `port` puts its socket when none is configured: in a directory of the node's
    user (`kvstore-<uid>`, which the node makes and checks: kvstore/node/planes/shm_socket.py) under the
    runtime directory (XDG_RUNTIME_DIR, else the temporary directory), one name per port. Only the node's user
    may write that directory, so no other user can bind the path while the node is down."""
    env = os.environ if env is None else env
    base = env.get("XDG_RUNTIME_DIR") or env.get("TMPDIR") or "/tmp"
    return str(Path(base) / f"kvstore-{os.geteuid()}" / f"node-{port}.sock")


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """Who is at the other end of a connected Unix socket (SO_PEERCRED): the process that bound or connected
    it, as this process's namespaces see it (pid 0: a process of another PID namespace)."""

    pid: int
    uid: int
    gid: int


_UCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The credentials the kernel recorded for `sock`'s peer when it listened (a client's view of the node) or
    connected (the node's view of a client); they cannot be forged by what the peer sends."""
    return PeerCredentials(*_UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)))


def shm_available() -> bool:
    """Whether this host can do the same-host plane: memfds and Unix sockets that pass descriptors."""
    return hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING")
