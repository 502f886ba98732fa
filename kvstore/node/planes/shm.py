"""The node side of the same-host plane: a Unix socket on the node's loop, one task per connection, and the
client memory each connection registered (protocol: kvstore/wire/shm.py). This module is the listener and each
connection's state machine (HELLO, then one request at a time, watching the socket for a hang-up); the
requests themselves are shm_requests.py, and a PUT_SUMS's checksums, read while its pages are copied,
shm_sums.py.

Every PUT and GET runs the node's put and get drivers (kvstore/node/drivers.py): a PUT copies each page from
the client's registered memory into its slot (one memcpy; the transaction checksums the slot), a GET has the
reader copy each page into the client's memory in the pass that verifies it (one copy, one checksum).

What a caller can and cannot make the node do:
- the node maps only memory whose descriptor the caller handed it (SCM_RIGHTS): it never opens a path, a
  /proc entry or a device, so nothing it maps is a file the caller could not already write, and no tty can
  become its controlling terminal;
- it maps a descriptor only if it is a tmpfs memfd sealed against shrinking and growing and not against
  writes, so no fault in that memory can kill the node, and keeps no descriptor for it (shm_memory.py); it
  answers one message for every other descriptor, whatever it is (socket, pipe, file, tty, a hugetlbfs
  memfd, a memfd sealed otherwise), so the answer tells nothing;
- what callers hold is bounded and shared out (shm_limits.py): handshakes in a room of their own with a
  deadline, authenticated connections (idle ones expire), registrations and mapped bytes, each node-wide and
  per caller and per tenant, registrations per connection too; a refusal is UNAVAILABLE at HELLO and
  RESOURCE_EXHAUSTED at REGISTER, before anything is taken, so the client falls back to another plane; a
  mapping failure is RESOURCE_EXHAUSTED too, never an internal error;
- the node's socket is where only its user may put one (shm_socket.py), and clients check that its user
  answers there (kvstore/wire/shm.py);
- credentials, roles and tenants are those of every plane (kvstore/node/callers.py), checked at HELLO and
  again on every request.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Coroutine
from typing import Any

from google.protobuf.message import DecodeError

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import KVStoreError, Unauthenticated, Unavailable
from kvstore.node.callers import Caller
from kvstore.node.drivers import answer_page_size
from kvstore.node.planes import shm_requests as requests
from kvstore.node.planes.base import NodeServices, PlaneServer, accept_forever
from kvstore.node.planes.shm_limits import Holder, ShmLimits
from kvstore.node.planes.shm_memory import MappedBuffer
from kvstore.node.planes.shm_socket import BoundSocket, bind_node_socket
from kvstore.node.planes.shm_sums import SumsWait
from kvstore.scoping import DEFAULT_TENANT
from kvstore.security import AUTH_HEADER, Role
from kvstore.stats import PlaneInfo
from kvstore.wire import shm
from kvstore.wire.shm import Kind, ProtocolError

log = logging.getLogger(__name__)


def recv_fds(sock: socket.socket, max_bytes: int) -> tuple[bytes, list[int]]:
    """One message and the descriptors passed with it (all of them: the caller closes what it does not keep)."""
    fds = array.array("i")
    msg, anc, _flags, _addr = sock.recvmsg(max_bytes, socket.CMSG_SPACE(4 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


class ShmPlaneServer(PlaneServer):
    """The same-host plane's listener (kvstore/wire/shm.py). `start` binds the node's local socket and returns
    the PlaneInfo the node advertises (its path, and the user it answers as); `stop` closes every connection
    and removes the socket."""

    name = "shm"

    def __init__(self, path: str | None) -> None:
        self.path = path  # None: the default path for the node's gRPC port
        self._bound: BoundSocket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self, services: NodeServices) -> PlaneInfo:
        self.services = services
        cfg = services.config
        self.limits = ShmLimits.build(
            max_connections=cfg.shm_max_connections,
            per_tenant_connections=cfg.shm_max_connections_per_tenant,
            max_handshakes=cfg.shm_max_handshakes,
            max_registrations=cfg.shm_max_registrations,
            max_mapped_bytes=cfg.shm_max_mapped_bytes,
            shared=services.callers.auth is not None,
        )
        self._bound = bind_node_socket(self.path, services.port)
        self.path = self._bound.path
        self._accepting = asyncio.get_running_loop().create_task(self._accept())
        log.info("same-host plane on unix:%s (uid %d)", self.path, os.geteuid())
        return PlaneInfo(self.name, self.path, uid=os.geteuid())

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._bound is not None:
            self._bound.close()
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.wait(list(self._conns), timeout=5.0)

    async def _accept(self) -> None:
        assert self._bound is not None
        await accept_forever(self._bound.sock, self._admit, "same-host plane")

    def _admit(self, sock: socket.socket) -> None:
        if not self.limits.can_start_handshake():
            # Full of connections that have not said HELLO: this one goes at once, told why, so the room kept
            # for authenticated callers is never theirs (its client falls back to another plane).
            with contextlib.suppress(OSError):
                sock.setblocking(False)
                why = "this node's same-host plane has too many connections in their handshake; retry later"
                sock.send(shm.frame(Kind.ERROR, 0, shm.error_body("UNAVAILABLE", why)))
            sock.close()
            return
        sock.setblocking(False)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, shm.SOCKET_BUFFER_BYTES)
        self.limits.start_handshake()
        task = asyncio.get_running_loop().create_task(_Connection(self, sock).serve())
        self._conns.add(task)
        task.add_done_callback(self._conns.discard)


class _Connection:
    """One client connection: HELLO, then registrations and requests, one at a time, until EOF, an idle spell of
    `shm_idle_seconds` between requests, or stop. Counted as a handshake until HELLO is answered, then (once
    admitted) as a connection of its holder, with what it registered, until it ends (shm_limits.py)."""

    def __init__(self, server: ShmPlaneServer, sock: socket.socket) -> None:
        self.server = server
        self.sock = sock
        self.cfg = server.services.config
        self.token = ""
        self.buffers: dict[int, MappedBuffer] = {}
        self.loop = asyncio.get_running_loop()
        self.holder: Holder | None = None  # set once admitted (holds a connection until the end)
        self._handshaking = True  # counted as a handshake until HELLO is answered or the connection ends
        # NOTE: one reader callback watches the socket for the connection's life (`_on_readable`): it wakes the
        # wait for the next message, and during a request it notices a hang-up. No epoll change per request.
        self._watching = False
        self._waiter: asyncio.Future[None] | None = None  # set while waiting for the next message
        self._request: asyncio.Task[Any] | None = None  # the task running a request (cancelled on a hang-up)
        self._hung_up = False
        self.sums = SumsWait(self.loop, self.cfg.shm_idle_seconds)  # a PUT_SUMS's SUMS (shm_sums.py)

    async def recv(self) -> tuple[bytes, list[int]]:
        """The next message and any descriptors with it; EOF is (b"", [])."""
        while True:
            try:
                return recv_fds(self.sock, shm.MAX_MESSAGE_BYTES)
            except BlockingIOError:
                self._waiter = self.loop.create_future()
                self._watch()
                try:
                    await self._waiter
                finally:
                    self._waiter = None

    def _watch(self) -> None:
        if not self._watching:
            self.loop.add_reader(self.sock.fileno(), self._on_readable)
            self._watching = True

    def _unwatch(self) -> None:
        if self._watching:
            self.loop.remove_reader(self.sock.fileno())
            self._watching = False

    def _on_readable(self) -> None:
        """The socket has something: the message `recv` waits for; during a request, a hang-up (EOF: the
        client gave up on it, so it is cancelled) or data out of protocol (left for the next `recv`)."""
        if self._waiter is not None:
            if not self._waiter.done():
                self._waiter.set_result(None)
            return
        if self._request is not None:
            if self.sums.expecting:
                self._take_sums()
                return  # NOTE: still watching: the hang-up of a client giving up may follow
            try:
                peeked = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                peeked = b""
            if not peeked:
                self._hung_up = True
                self._request.cancel()
        # Not waiting for it now: stop watching until the next `recv` (level-triggered: it would fire again
        # and again meanwhile).
        self._unwatch()

    def _take_sums(self) -> None:
        """Read the message that came during a PUT_SUMS and hand it to `sums` (its SUMS, or anything else,
        which fails it: the connection is out of protocol); a hang-up cancels the request."""
        assert self._request is not None
        try:
            msg, fds = recv_fds(self.sock, shm.MAX_MESSAGE_BYTES)
        except BlockingIOError:
            return
        except OSError:
            msg, fds = b"", []
        for fd in fds:
            os.close(fd)
        if not msg:
            self._hung_up = True
            self._request.cancel()
            self._unwatch()
            return
        self.sums.take(msg)

    async def send(self, kind: Kind, seq: int, body: bytes = b"") -> None:
        await self.loop.sock_sendall(self.sock, shm.frame(kind, seq, body))

    async def serve(self) -> None:
        limits = self.server.limits
        try:
            try:
                async with asyncio.timeout(self.cfg.shm_hello_timeout_seconds):
                    await self._hello()
            finally:
                self._end_handshake()
            while True:
                # NOTE: between requests nothing of the client's memory is in use, so an idle connection may go:
                # the client reopens one (its pool retries a call once on a fresh connection).
                async with asyncio.timeout(self.cfg.shm_idle_seconds):
                    msg, fds = await self.recv()
                if not msg:
                    return
                try:
                    kind, seq, body = shm.unframe(msg)
                    if self.sums.is_late(kind, seq):
                        continue  # its PUT_SUMS was answered (refused) before it came
                    if not await self._watched(self._handle(kind, seq, body, fds)):
                        return  # the client hung up mid-request: closing now tells it its memory is free
                finally:
                    for fd in fds:
                        os.close(fd)
        except (ProtocolError, KVStoreError) as exc:  # refused at HELLO (token, room), or out of protocol
            with contextlib.suppress(Exception):
                status = exc.status_name if isinstance(exc, KVStoreError) else "INVALID_ARGUMENT"
                await self.send(Kind.ERROR, 0, shm.error_body(status, str(exc)))
        except (ConnectionError, TimeoutError, OSError) as exc:
            log.debug("same-host plane connection ended: %s", exc)
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("same-host plane connection failed unexpectedly")
        finally:
            self._unwatch()
            for buf in self.buffers.values():
                if self.holder is not None:
                    limits.buffers.give(self.holder)
                    limits.mapped.give(self.holder, buf.size)
                buf.drop()
            self.buffers.clear()
            if self.holder is not None:
                limits.connections.give(self.holder)
                self.holder = None
            self.sock.close()

    def _end_handshake(self) -> None:
        if self._handshaking:
            self._handshaking = False
            self.server.limits.end_handshake()

    async def _watched(self, request: Coroutine[Any, Any, None]) -> bool:
        """Run one request while watching the socket: a client that gave up on it hangs up (shuts down its
        sending side), and then the request is cancelled (`_on_readable`). False when that happened. Either
        way the request's work on the client's memory has ended when this returns (the drivers and the I/O
        pool wait out every transfer they started, cancelled or not), so the connection's close that follows
        tells the client its memory is its own again (kvstore/client/planes/shm.py)."""
        task = asyncio.current_task()
        assert task is not None
        self._request, self._hung_up = task, False
        self._watch()
        try:
            await request  # NOTE: inline, not a task of its own: no task per request on the hot path
        except asyncio.CancelledError:
            if not self._hung_up:  # the node is stopping
                raise
            task.uncancel()
            return False
        finally:
            self._request = None
        return True

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        return ((AUTH_HEADER, f"Bearer {self.token}"),) if self.token else None

    def _caller(self, method: str) -> Caller:
        return self.server.services.callers.authenticate(method, self._metadata(), None)  # no certificate here

    async def _hello(self) -> None:
        msg, fds = await self.recv()
        for fd in fds:
            os.close(fd)
        if not msg:
            raise ConnectionError("closed before HELLO")
        kind, _, body = shm.unframe(msg)
        if kind is not Kind.HELLO:
            raise ProtocolError(f"a connection starts with HELLO, got {kind.name}")
        if len(body) > shm.MAX_TOKEN_BYTES:
            raise ProtocolError(f"a token has at most {shm.MAX_TOKEN_BYTES} bytes")
        try:
            self.token = bytes(body).decode()
        except UnicodeDecodeError:
            raise Unauthenticated("the token is not valid UTF-8") from None
        callers = self.server.services.callers
        who = None if callers.auth is None else callers.auth.identify(self._metadata())
        bound = callers.bind(who, None)  # no certificate on this plane
        role = Role.WRITE if bound is None else bound.role
        holder = Holder(DEFAULT_TENANT, "") if bound is None else Holder(bound.scope, bound.subject)
        self._end_handshake()
        connections = self.server.limits.connections
        refusal = connections.refusal(holder)
        if refusal is not None:
            raise Unavailable(f"{refusal}; close idle ones, retry later or use another plane")
        connections.take(holder)
        self.holder = holder
        max_pages = min(self.cfg.max_pages_per_request, shm.MAX_PAGES_PER_CALL)
        welcome = shm.welcome_body(self.cfg.max_page_bytes, max_pages, role, sums_after=True)
        await self.send(Kind.WELCOME, 0, welcome)

    async def _handle(self, kind: Kind, seq: int, body: memoryview, fds: list[int]) -> None:
        try:
            if kind is Kind.REGISTER:
                self._caller("Get")  # any valid token may register memory: readers need it for get_into
                assert self.holder is not None  # admitted at HELLO
                requests.register(self.buffers, self.server.limits, self.holder, body, fds)
                reply = b""
            elif kind is Kind.LAYOUT:  # the page size a GET's targets need: the first step of a plain get
                reply = answer_page_size(self._caller("Get"), body)
            elif kind is Kind.PUT:
                put = pb.BulkPutRequest.FromString(bytes(body))
                reply = await requests.put(self._caller("Put"), self.cfg, self.buffers, put)
            elif kind is Kind.PUT_SUMS:
                reply = await requests.put_sums(self._caller, self.cfg, self.buffers, seq, body, sums=self.sums)
            elif kind is Kind.GET:
                get = pb.BulkGetRequest.FromString(bytes(body))
                reply = await requests.get(self._caller("Get"), self.cfg, self.buffers, get)
            else:
                raise ProtocolError(f"{kind.name} is not a request")
        except DecodeError as exc:
            await self.send(Kind.ERROR, seq, shm.error_body("INVALID_ARGUMENT", f"body: not a {kind.name}: {exc}"))
            return
        except ProtocolError:
            raise  # the connection cannot go on: `serve` answers and closes it
        except KVStoreError as exc:
            await self.send(Kind.ERROR, seq, shm.error_body(exc.status_name, str(exc)))
            return
        await self.send(Kind.OK, seq, reply)
