"""The client side of the same-host plane: Put and Get through this client's own memory, with the node's Unix
socket as the control channel (protocol: kvstore/wire/shm.py).

Every page crosses with one memcpy, done by the node, and no gRPC round trip: a GET names where each page
goes (a block of the client's receive pool for a plain `get`, the caller's own SharedBuffer for `get_into`)
and the node's reader copies each page there in the pass that verifies it; a PUT names where each page lies
(the caller's SharedBuffer for `put_from`, else a pool block the page is copied into first) and the node
copies it into its slot. Nothing crosses a network, so the client verifies nothing again (DESIGN.md §8).

Connections: a pool of SEQPACKET connections (one request at a time each), opened on demand with HELLO and
the client's token; each registers a SharedBuffer (passing its memfd with SCM_RIGHTS) the first time a
request names it. A node that cannot be reached (no socket, another host, the plane off) is PlaneUnavailable
before anything was sent: the client falls back to the next plane.
"""

from __future__ import annotations

import array
import os
import socket
from collections.abc import Sequence

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.client.exchange import Blocking, Exchange
from kvstore.client.planes.base import DataPlane
from kvstore.client.planes.buffers import buffer_span
from kvstore.client.planes.connections import ConnectionPool
from kvstore.client.planes.pool import ReceivePool
from kvstore.client.planes.segments import Placed, SharedBuffer, SharedBuffers
from kvstore.errors import (
    InvalidArgument,
    KVStoreError,
    PlaneUnavailable,
    ResourceExhausted,
    StreamError,
    from_status,
)
from kvstore.names import Buffer, TierKind
from kvstore.wire import PutOpen, shm
from kvstore.wire.shm import Kind
from kvstore.wire.streams import FetchedPage, PageRef, put_open_to_pb

_TARGET_FIELD = "targets["


class Connection:
    """One connection to the node's socket: HELLO'd, with the buffers registered on it. One call at a time."""

    def __init__(self, path: str, token: str | None, timeout: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(timeout)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, opt, shm.SOCKET_BUFFER_BYTES)
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.seq = 0
        self.registered: set[int] = set()
        self.usable = True
        self.replied = False  # whether the current request got a reply (the pool clears it before each one)
        try:
            body = self.call(Kind.HELLO, (token or "").encode(), want=Kind.WELCOME)
            self.max_page_bytes, self.max_pages, _ = shm.WELCOME.unpack(body)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.usable = False
        self.sock.close()

    def call(self, kind: Kind, body: bytes, fds: Sequence[int] = (), want: Kind = Kind.OK) -> memoryview:
        """Send one request and return its reply's body; an ERROR reply raises the node's exception."""
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        msg = shm.frame(kind, self.seq, body)
        try:
            if fds:
                self.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                self.sock.send(msg)
            reply = self.sock.recv(shm.MAX_MESSAGE_BYTES)
        except OSError:
            self.usable = False
            raise
        if not reply:
            self.usable = False
            raise ConnectionError("the node closed the same-host plane connection")
        self.replied = True
        got, seq, payload = shm.unframe(reply)
        if got is Kind.ERROR:
            raise from_status(*shm.parse_error(payload))
        if got is not want or (seq != self.seq and kind is not Kind.HELLO):
            self.usable = False
            raise StreamError(f"the node answered {kind.name} with {got.name} (request {seq}, expected {self.seq})")
        return payload

    def register(self, buf: SharedBuffer) -> None:
        """Have the node map `buf`. A node out of mapping room (its shm_max_mapped_bytes, or address space)
        makes the plane unavailable for this call: an auto-mode client carries on over the next plane."""
        if buf.id not in self.registered:
            try:
                self.call(Kind.REGISTER, shm.REGISTER.pack(buf.id), fds=[buf.fd])
            except ResourceExhausted as exc:
                raise PlaneUnavailable(f"shm: {exc}") from None
            self.registered.add(buf.id)


class ShmPlane(DataPlane):
    """Pages cross through this client's memory on the node's host. Thread-safe: concurrent calls use
    different connections. Each PUT of at most `pages_per_call` pages is atomic, like a Put stream."""

    name = "shm"

    def __init__(
        self,
        path: str,
        pages_per_call: int,
        buffers: SharedBuffers,
        received: ReceivePool,
        token: str | None,
        timeout: float,
    ) -> None:
        if not path:
            raise PlaneUnavailable("the node advertises no same-host socket")
        self.path = path
        self.pages_per_call = min(pages_per_call, shm.MAX_PAGES_PER_CALL)
        self.buffers = buffers
        self.received = received
        self.token = token
        self.timeout = timeout
        self._page_bytes: dict[str, int] = {}  # a namespace's page size (fixed once its first page is stored)
        self._pool = ConnectionPool(self._open, f"same-host plane connection to {path}")

    # -- connections

    def _open(self) -> Connection:
        try:
            return Connection(self.path, self.token, self.timeout)
        except KVStoreError:
            raise
        except (OSError, StreamError, ValueError) as exc:
            raise PlaneUnavailable(f"cannot open the same-host plane at {self.path}: {exc}") from None

    def close(self) -> None:
        self._pool.close()

    # -- where pages lie

    def _place(self, buffers: Sequence[Buffer], writable: bool, first: int) -> list[Placed] | None:
        """Where each buffer lies in this client's registered memory; None when any lies outside it."""
        placed = []
        for i, b in enumerate(buffers):
            where = self.buffers.locate(*buffer_span(b, f"buffers[{first + i}]", writable))
            if where is None:
                return None
            placed.append(where)
        return placed

    def page_bytes(self, namespace: str, first: bytes) -> int:
        """The namespace's page size, asked of the node once (NamespaceNotFound when it has none), on behalf
        of a Get starting at hash `first`."""
        n = self._page_bytes.get(namespace)
        if n is None:
            body = self._pool.call(lambda c: c.call(Kind.LAYOUT, first + namespace.encode()))
            (n,) = shm.PAGE_BYTES.unpack(body)
            self._page_bytes[namespace] = n
        return n

    # -- the DataPlane

    def put_batch(self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[Buffer]) -> Exchange[tuple[int, int]]:
        blocks = []
        for page in pages:  # one copy into registered memory; the node copies it into its slot
            src = memoryview(page).cast("B")
            block = self.received.take(len(src))
            block[:] = src
            blocks.append(block)
        placed = self._place(blocks, False, 0)
        assert placed is not None  # pool blocks are registered memory
        return (yield from self._put(op, hashes, placed, 0))

    def put_from_batch(
        self, op: PutOpen, hashes: Sequence[bytes], buffers: Sequence[Buffer], first: int
    ) -> Exchange[tuple[int, int]]:
        """The node copies each page straight out of the caller's registered memory (none on the client);
        buffers elsewhere are copied into registered memory first."""
        placed = self._place(buffers, False, first)
        if placed is None:
            return (yield from self.put_batch(op, hashes, buffers))
        return (yield from self._put(op, hashes, placed, first))

    def _put(self, op: PutOpen, hashes: Sequence[bytes], placed: list[Placed], first: int) -> Exchange[tuple[int, int]]:
        body = put_request(op, hashes, placed).SerializeToString()
        reply = yield Blocking(lambda: self._pool.call(lambda c: self._request(c, Kind.PUT, body, placed, first)))
        res = pb.PutResponse.FromString(bytes(reply))
        return res.stored, res.already_present

    def get_batch(self, namespace: str, hashes: Sequence[bytes], promote: bool) -> Exchange[list[FetchedPage]]:
        """Pages straight into blocks of the receive pool: the node copies and verifies each one in place."""
        n = yield Blocking(lambda: self.page_bytes(namespace, hashes[0]))
        with self.received.reserve(n, len(hashes)) as blocks:
            got = yield from self._get(namespace, hashes, promote, blocks.placed, 0)
            return [FetchedPage(p.hash, TierKind(p.tier), blocks.claim(i)) for i, p in enumerate(got)]

    def get_into_batch(
        self, namespace: str, hashes: Sequence[bytes], buffers: Sequence[Buffer], promote: bool, first: int
    ) -> Exchange[list[PageRef]]:
        """The node writes page i straight into buffers[i] when they are registered memory (SharedBuffer or a
        pool block); other buffers get their pages through the receive pool, one copy more."""
        placed = self._place(buffers, True, first)
        if placed is None:
            return (yield from super().get_into_batch(namespace, hashes, buffers, promote, first))
        got = yield from self._get(namespace, hashes, promote, placed, first)
        return [PageRef(p.hash, TierKind(p.tier), p.payload_bytes) for p in got]

    def _get(
        self, namespace: str, hashes: Sequence[bytes], promote: bool, placed: list[Placed], first: int
    ) -> Exchange[list[pb.ShmSlice]]:
        req = pb.GetShmRequest(namespace=namespace, hashes=list(hashes), no_promote=not promote)
        for p in placed:
            req.targets.add(offset=p.offset, size=p.nbytes, buffer=p.buffer.id)
        body = req.SerializeToString()
        reply = yield Blocking(lambda: self._pool.call(lambda c: self._request(c, Kind.GET, body, placed, first)))
        pages = pb.GetShmResponse.FromString(bytes(reply)).pages
        if len(pages) > len(hashes):
            raise StreamError(f"the node returned {len(pages)} pages for {len(hashes)} hashes")
        for i, p in enumerate(pages):
            if p.hash != hashes[i] or p.buffer != placed[i].buffer.id or p.offset != placed[i].offset:
                raise StreamError(f"page {i}: the node put an unexpected page, or put it elsewhere")
        return list(pages)

    def _request(self, conn: Connection, kind: Kind, body: bytes, placed: list[Placed], first: int) -> memoryview:
        for p in placed:
            conn.register(p.buffer)
        try:
            return conn.call(kind, body)
        except InvalidArgument as exc:
            raise _buffer_error(exc, first) from None


def put_request(op: PutOpen, hashes: Sequence[bytes], placed: Sequence[Placed]) -> pb.PutShmRequest:
    """A PUT naming where each page lies. No checksums: the node takes them of the bytes in its slots."""
    req = pb.PutShmRequest(open=put_open_to_pb(op))
    for h, p in zip(hashes, placed, strict=True):
        req.pages.add(hash=h, offset=p.offset, payload_bytes=p.nbytes, buffer=p.buffer.id)
    return req


def _buffer_error(exc: InvalidArgument, first: int) -> Exception:
    """The node's complaint about targets[j] / pages[j] of one call, as the caller's buffers[first + j]."""
    field = exc.field
    for prefix in (_TARGET_FIELD, "pages["):
        if field.startswith(prefix) and "]" in field:
            j = int(field[len(prefix) : field.index("]")])
            rest = str(exc).split(":", 1)[1].strip()
            return ValueError(f"buffers[{first + j}]: {rest}")
    return exc


def plane_path(advertised: str) -> str:
    """The socket to use: KVSTORE_LOCAL_SOCKET when set (a pod mounts the node's socket at a path of its
    own), else what the node advertises."""
    return os.environ.get("KVSTORE_LOCAL_SOCKET") or advertised
