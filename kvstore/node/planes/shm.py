"""The node side of the same-host plane: a Unix socket on the node's loop, one task per connection, and the
client memory each connection registered (protocol: kvstore/wire/shm.py).

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
import itertools
import logging
import os
import socket
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

from google.protobuf.message import DecodeError

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import InvalidArgument, KVStoreError, ResourceExhausted, Unauthenticated, Unavailable
from kvstore.manager.put import Declared, DeclaredLater
from kvstore.node.callers import Caller
from kvstore.node.drivers import PageHead, answer_page_size, check_page_count, check_target_count, drive_put, open_get
from kvstore.node.planes.base import NodeServices, PlaneServer, accept_forever
from kvstore.node.planes.shm_limits import Holder, ShmLimits
from kvstore.node.planes.shm_memory import MappedBuffer, usable_size
from kvstore.node.planes.shm_socket import BoundSocket, bind_node_socket
from kvstore.pageformat import copy_checksum_dest, in_form
from kvstore.scoping import DEFAULT_TENANT
from kvstore.security import AUTH_HEADER, Role
from kvstore.stats import PlaneInfo
from kvstore.wire import pack_held, shm
from kvstore.wire.shm import Kind, ProtocolError
from kvstore.wire.streams import checksum_form_from_pb, layout_from_pb, put_open_from_pb

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
        # A PUT_SUMS in progress: the checksums its SUMS message brings (kvstore/wire/shm.py), its seq and pages.
        self._sums: asyncio.Future[Sequence[int]] | None = None
        self._sums_seq = 0
        self._sums_pages = 0
        self._late_sums: int | None = None  # the seq of a PUT_SUMS answered before its SUMS came (dropped)

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
            if self._sums is not None and not self._sums.done():
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
        """Read the SUMS message a PUT_SUMS in progress waits for into `_sums` (anything else fails it: the
        connection is out of protocol); a hang-up cancels the request."""
        assert self._sums is not None and self._request is not None
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
        try:
            kind, seq, body = shm.unframe(msg)
            if kind is not Kind.SUMS or seq != self._sums_seq:
                raise ProtocolError(f"a PUT_SUMS (request {self._sums_seq}) is followed by its SUMS, not {kind.name} "
                                    f"(request {seq})")  # fmt: skip
            self._sums.set_result(shm.parse_sums(body, self._sums_pages))
        except ProtocolError as exc:
            self._sums.set_exception(exc)

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
                    if kind is Kind.SUMS and seq == self._late_sums:
                        self._late_sums = None  # its PUT_SUMS was answered (refused) before it came
                        continue
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
                self._register(body, fds)
                reply = b""
            elif kind is Kind.LAYOUT:
                reply = self._layout(body)
            elif kind is Kind.PUT:
                reply = await self._put(pb.BulkPutRequest.FromString(bytes(body)))
            elif kind is Kind.PUT_SUMS:
                reply = await self._put_sums(seq, body)
            elif kind is Kind.GET:
                reply = await self._get(pb.BulkGetRequest.FromString(bytes(body)))
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

    def _register(self, body: memoryview, fds: list[int]) -> None:
        self._caller("Get")  # any valid token may register memory: readers need it for get_into
        if len(body) != shm.REGISTER.size or len(fds) != 1:
            raise InvalidArgument("register", "a REGISTER carries a buffer id and exactly one descriptor")
        (buf_id,) = shm.REGISTER.unpack(body)
        if buf_id in self.buffers:
            raise InvalidArgument("register", f"buffer {buf_id} is registered already on this connection")
        if len(self.buffers) >= shm.MAX_BUFFERS:
            raise ResourceExhausted(f"register: a connection registers at most {shm.MAX_BUFFERS} buffers")
        size = usable_size(fds[0])
        limits, holder = self.server.limits, self.holder
        assert holder is not None  # admitted at HELLO
        refusal = limits.buffers.refusal(holder) or limits.mapped.refusal(holder, size)
        if refusal is not None:
            raise ResourceExhausted(f"register: {refusal}")
        buf = MappedBuffer(fds[0], size)  # keeps no descriptor: the caller's is closed after this request
        limits.buffers.take(holder)
        limits.mapped.take(holder, size)
        self.buffers[buf_id] = buf

    def _layout(self, body: memoryview) -> bytes:
        """The page size a GET's targets need: the first step of a plain get (drivers.answer_page_size)."""
        return answer_page_size(self._caller("Get"), body)

    def _buffer(self, buf_id: int, field: str) -> MappedBuffer:
        buf = self.buffers.get(buf_id)
        if buf is None:
            raise InvalidArgument(field, f"buffer {buf_id} is not registered on this connection")
        return buf

    async def _put_sums(self, seq: int, body: memoryview) -> bytes:
        """A PUT whose checksums follow in a SUMS message: the pages are copied and hashed as they come, and
        the transaction publishes none before the SUMS came and matched (manager/put.py: DeclaredLater). The
        SUMS is read by `_on_readable`, within shm_idle_seconds, else the Put fails."""
        self._late_sums = seq  # until its SUMS is read: one answered before it comes drops it when it comes
        req = pb.BulkPutRequest.FromString(bytes(body))
        self._sums = sums = self.loop.create_future()
        self._sums_seq, self._sums_pages = seq, len(req.pages)
        timer = self.loop.call_later(self.cfg.shm_idle_seconds, self._sums_overdue, sums)
        try:
            for i, p in enumerate(req.pages):
                if p.checksum:
                    raise InvalidArgument(f"pages[{i}].checksum", "a PUT_SUMS declares its checksums in its SUMS")
            return await self._put(req, sums)
        finally:
            timer.cancel()
            self._sums = None
            if not sums.done():
                sums.cancel()
            else:
                self._late_sums = None
                if not sums.cancelled():
                    sums.exception()  # NOTE: retrieved: a failed SUMS no Put waited for is no "never retrieved"

    def _sums_overdue(self, sums: asyncio.Future[Sequence[int]]) -> None:
        if not sums.done():
            sums.set_exception(
                ProtocolError(f"no SUMS came for a PUT_SUMS within {self.cfg.shm_idle_seconds:g} s (shm_idle_seconds)")
            )

    async def _put(self, req: pb.BulkPutRequest, sums: asyncio.Future[Sequence[int]] | None = None) -> bytes:
        caller = self._caller("Put")
        if not req.HasField("open"):
            raise InvalidArgument("open", "a PUT needs `open` (namespace and layout)")
        check_page_count(len(req.pages), self.cfg, "pages", put=True, wire_limit=shm.MAX_PAGES_PER_CALL)
        slices = list(req.pages)
        places = []
        for i, p in enumerate(slices):  # every slice checked first: a bad one leaves the node unchanged
            buf = self._buffer(p.buffer, f"pages[{i}].buffer")
            buf.check(p.offset, p.payload_bytes, f"pages[{i}]")
            places.append((buf, p.offset))
        op = put_open_from_pb(req.open)
        with _using(b for b, _ in places):
            done = await drive_put(lambda: (caller, op), _heads(slices, sums), _BufferPages(places), drain=False)
        return pb.PutResponse(
            stored=done.stored, already_present=done.present, held=pack_held(done.held)
        ).SerializeToString()

    async def _get(self, req: pb.BulkGetRequest) -> bytes:
        caller = self._caller("Get")
        form = checksum_form_from_pb(req.checksum_form, "checksum_form")
        check_page_count(len(req.hashes), self.cfg, "hashes", put=False, wire_limit=shm.MAX_PAGES_PER_CALL)
        check_target_count(len(req.targets), len(req.hashes))
        hashes = list(req.hashes)
        page_bytes = caller.view.layout_of(req.namespace).page_bytes
        expect = layout_from_pb(req.layout, "layout") if req.HasField("layout") else None
        # NOTE: the targets' fields read once into tuples: a protobuf field read costs more than the check itself
        targets = [(t.buffer, t.offset, t.size) for t in req.targets]
        bufs = [self._buffer(t[0], f"targets[{i}].buffer") for i, t in enumerate(targets)]
        check_targets(targets, bufs, page_bytes)
        out = pb.BulkGetResponse()
        with _using(set(bufs)):
            # NOTE: a window is cut when its page is reached: a Get whose stored prefix ends early (a probe of
            # many keys, the first one missing) costs no window per hash.
            windows = _Windows(bufs, targets, page_bytes)
            promote = not req.no_promote
            try:
                async with open_get(
                    caller, req.namespace, hashes, promote, into=windows, receiver_verifies=False, expect=expect
                ) as ls:
                    async for lease in ls:
                        buf_id, offset, _ = targets[len(out.pages)]
                        out.pages.add(
                            hash=lease.hash,
                            offset=offset,
                            payload_bytes=len(lease.payload),
                            checksum=in_form(lease.checksum, form, req.namespace, lease.hash),
                            tier=int(lease.tier),
                            buffer=buf_id,
                        )
            finally:
                windows.release()
        return out.SerializeToString()


Target = tuple[int, int, int]  # a GET target's (buffer id, offset, size)


class _Windows(Sequence[memoryview]):
    """The windows of a GET's targets, each cut from its buffer on first use; `release` releases those cut."""

    def __init__(self, bufs: Sequence[MappedBuffer], targets: Sequence[Target], page_bytes: int) -> None:
        self._bufs, self._targets, self._page_bytes = bufs, targets, page_bytes
        self._cut: dict[int, memoryview] = {}

    def __len__(self) -> int:
        return len(self._bufs)

    def __getitem__(self, i: int) -> memoryview:  # type: ignore[override]  # NOTE: by index only
        w = self._cut.get(i)
        if w is None:
            w = self._cut[i] = self._bufs[i].window(self._targets[i][1], self._page_bytes)
        return w

    def release(self) -> None:
        for w in self._cut.values():
            w.release()
        self._cut.clear()


def check_targets(targets: Sequence[Target], bufs: Sequence[MappedBuffer], page_bytes: int) -> None:
    """Every target inside its buffer, a page long at least, overlapping no other target of the same buffer;
    InvalidArgument naming `targets[i]` otherwise (checked before anything is read or written)."""
    for i, ((_, offset, size), b) in enumerate(zip(targets, bufs, strict=True)):
        b.check(offset, size, f"targets[{i}]")
        if size < page_bytes:
            raise InvalidArgument(f"targets[{i}]", f"{size} bytes cannot hold a page of this namespace: {page_bytes}")
    order = sorted(range(len(targets)), key=lambda i: targets[i][:2])
    for prev, cur in itertools.pairwise(order):
        a, b = targets[prev], targets[cur]
        if a[0] == b[0] and a[1] + page_bytes > b[1]:
            raise InvalidArgument(f"targets[{max(prev, cur)}]", f"overlaps targets[{min(prev, cur)}]")


@contextlib.contextmanager
def _using(bufs: object) -> object:
    """Hold `bufs` (an iterable of MappedBuffer) mapped for the block."""
    held = list(bufs)  # type: ignore[call-overload]
    for b in held:
        b.users += 1
    try:
        yield
    finally:
        for b in held:
            b.release()


async def _heads(slices: Sequence[pb.BulkPage], sums: asyncio.Future[Sequence[int]] | None) -> AsyncIterator[PageHead]:
    for i, p in enumerate(slices):
        declared: Declared = p.checksum if sums is None else DeclaredLater(sums, i)
        yield PageHead(p.hash, p.payload_bytes, declared)


class _BufferPages:
    """The put driver's page bytes: each slice of a registered buffer (bounds checked before), copied into its
    slot and hashed out of the slot in the same pass (pageformat.copy_checksum_dest: the checksum is of the
    bytes that landed, whatever the client's memory holds by then), on the loop as before: the driver fills
    one page at a time."""

    def __init__(self, places: list[tuple[MappedBuffer, int]]) -> None:
        self.places = places

    async def read_into(self, index: int, view: memoryview) -> int | None:
        buf, offset = self.places[index]
        with buf.window(offset, len(view)) as src:
            return copy_checksum_dest(src, view)

    async def discard(self, index: int, nbytes: int) -> None:
        return None  # nothing to receive: the bytes stay in the caller's memory
