"""The node side of the same-host plane: a Unix socket on the node's loop, one task per connection, and the
client memory each connection registered (protocol: kvstore/wire/shm.py).

Every PUT and GET runs the node's put and get drivers (kvstore/node/drivers.py): a PUT copies each page from
the client's registered memory into its slot (one memcpy; the transaction checksums the slot), a GET has the
reader copy each page into the client's memory in the pass that verifies it (one copy, one checksum).

What a caller can and cannot make the node do:
- the node maps only memory whose descriptor the caller handed it (SCM_RIGHTS): it never opens a path, a
  /proc entry or a device, so nothing it maps is a file the caller could not already write, and no tty can
  become its controlling terminal;
- it maps a descriptor only if it is a memfd sealed against shrinking and growing and not against writes
  (so a mapped page can never vanish under a copy), and answers one message for every other descriptor,
  whatever it is (socket, pipe, file, tty, a memfd sealed otherwise), so the answer tells nothing;
- what a connection maps is bounded (MAX_BUFFERS buffers, the node's `shm_max_mapped_bytes` in all), and a
  mapping failure is RESOURCE_EXHAUSTED, never an internal error;
- credentials, roles and tenants are those of every plane (kvstore/node/callers.py), checked at HELLO and
  again on every request.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import socket
import stat
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import InvalidArgument, KVStoreError, ResourceExhausted, Unauthenticated
from kvstore.hashing import HASH_BYTES
from kvstore.node.callers import Caller
from kvstore.node.drivers import PageHead, drive_put, open_get
from kvstore.node.planes.base import NodeServices, PlaneServer, accept_forever
from kvstore.pageformat import in_form
from kvstore.security import AUTH_HEADER, Role
from kvstore.stats import PlaneInfo
from kvstore.wire import pack_held, shm
from kvstore.wire.shm import Kind, ProtocolError, default_socket_path
from kvstore.wire.streams import checksum_form_from_pb, put_open_from_pb

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660  # owner and group: in Kubernetes the node's and the workers' pods share a group


class Unusable(KVStoreError):
    """The one answer for a descriptor this node will not map (see the module docstring)."""

    status_name = "INVALID_ARGUMENT"

    def __init__(self) -> None:
        super().__init__(
            "register: the descriptor is not usable (the node maps only memfds sealed with F_SEAL_SHRINK and "
            "F_SEAL_GROW and not against writes)"
        )


class MappedBuffer:
    """A client's registered memfd, mapped by the node. Invariant: the mapping stays until every window given
    out is released and the buffer was dropped (`users` counts the requests using it)."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        self.view = memoryview(self.map)
        self.users = 0
        self.dropped = False

    def check(self, offset: int, length: int, field: str) -> None:
        """InvalidArgument naming `field` unless [offset, offset + length) lies inside the buffer."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise InvalidArgument(field, f"[{offset}, {offset + length}) runs past the buffer's {self.size} bytes")

    def window(self, offset: int, n: int) -> memoryview:
        return self.view[offset : offset + n]

    def drop(self) -> None:
        self.dropped = True
        if self.users == 0:
            self._close()

    def release(self) -> None:
        self.users -= 1
        if self.dropped and self.users == 0:
            self._close()

    def _close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a window still exported: the mapping goes with it
            self.map.close()


def map_descriptor(fd: int, room: int) -> MappedBuffer:
    """Map a descriptor a client passed; Unusable for anything but a memfd sealed as the module docstring says,
    ResourceExhausted (before anything is mapped) when it is larger than `room` bytes. The descriptor is the
    caller's to close."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS) if stat.S_ISREG(st.st_mode) else 0
    except OSError:
        raise Unusable() from None
    need = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    write_seals = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
    if not stat.S_ISREG(st.st_mode) or seals & need != need or seals & write_seals or st.st_size <= 0:
        raise Unusable()
    if st.st_size > room:
        raise ResourceExhausted(f"register: {st.st_size} bytes more would pass the node's shm_max_mapped_bytes")
    try:
        return MappedBuffer(fd, st.st_size)
    except OSError as exc:  # ENOMEM and the like: the node is out of address space, not broken
        raise ResourceExhausted(f"register: the node cannot map {st.st_size} more bytes ({exc.strerror})") from None


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
    the PlaneInfo the node advertises (its path); `stop` closes every connection and removes the socket."""

    name = "shm"

    def __init__(self, path: str | None) -> None:
        self.path = path  # None: the default path for the node's gRPC port
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self.mapped_bytes = 0

    async def start(self, services: NodeServices) -> PlaneInfo:
        self.services = services
        path = self.path or default_socket_path(services.port)
        self.path = path
        self._sock = listen_unix(path)
        self._accepting = asyncio.get_running_loop().create_task(self._accept())
        log.info("same-host plane on unix:%s", path)
        return PlaneInfo(self.name, path)

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # type: ignore[arg-type]
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.wait(list(self._conns), timeout=5.0)

    async def _accept(self) -> None:
        assert self._sock is not None
        await accept_forever(self._sock, self._admit, "same-host plane")

    def _admit(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, shm.SOCKET_BUFFER_BYTES)
        if len(self._conns) >= self.services.config.tcp_max_connections:
            with contextlib.suppress(OSError):
                sock.send(shm.frame(Kind.ERROR, 0, shm.error_body("UNAVAILABLE", "too many connections")))
            sock.close()
            return
        task = asyncio.get_running_loop().create_task(_Connection(self, sock).serve())
        self._conns.add(task)
        task.add_done_callback(self._conns.discard)


def listen_unix(path: str) -> socket.socket:
    """A listening SEQPACKET socket at `path`. A stale socket file (nobody listening) is replaced; a socket
    another process serves, or any other file, is refused with a message naming the path."""
    p = Path(path)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise OSError(f"--local-socket {path}: exists and is not a socket; remove it or choose another path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            p.unlink()  # stale: its node is gone
        except OSError as exc:
            raise OSError(f"--local-socket {path}: cannot tell whether another node serves it: {exc}") from None
        else:
            raise OSError(f"--local-socket {path}: another node serves this socket; choose another path")
        finally:
            probe.close()
    p.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(path)
        os.chmod(path, SOCKET_MODE)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class _Connection:
    """One client connection: HELLO, then registrations and requests, one at a time, until EOF or stop."""

    def __init__(self, server: ShmPlaneServer, sock: socket.socket) -> None:
        self.server = server
        self.sock = sock
        self.cfg = server.services.config
        self.token = ""
        self.buffers: dict[int, MappedBuffer] = {}
        self.loop = asyncio.get_running_loop()

    async def recv(self) -> tuple[bytes, list[int]]:
        """The next message and any descriptors with it; EOF is (b"", [])."""
        while True:
            try:
                return recv_fds(self.sock, shm.MAX_MESSAGE_BYTES)
            except BlockingIOError:
                await self._readable()

    async def _readable(self) -> None:
        ready = self.loop.create_future()
        self.loop.add_reader(self.sock.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            self.loop.remove_reader(self.sock.fileno())

    async def send(self, kind: Kind, seq: int, body: bytes = b"") -> None:
        await self.loop.sock_sendall(self.sock, shm.frame(kind, seq, body))

    async def serve(self) -> None:
        try:
            async with asyncio.timeout(self.cfg.tcp_timeout_seconds):
                await self._hello()
            while True:
                msg, fds = await self.recv()
                if not msg:
                    return
                try:
                    kind, seq, body = shm.unframe(msg)
                    if not await self._watched(self._handle(kind, seq, body, fds)):
                        return  # the client hung up mid-request: closing now tells it its memory is free
                finally:
                    for fd in fds:
                        os.close(fd)
        except (ProtocolError, Unauthenticated) as exc:
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
            for buf in self.buffers.values():
                self.server.mapped_bytes -= buf.size
                buf.drop()
            self.buffers.clear()
            self.sock.close()

    async def _watched(self, request: Coroutine[Any, Any, None]) -> bool:
        """Run one request while watching the socket: a client that gave up on it hangs up (shuts down its
        sending side), and then the request is cancelled. False when that happened. Either way the request's
        work on the client's memory has ended when this returns (the drivers and the I/O pool wait out every
        transfer they started, cancelled or not), so the connection's close that follows tells the client
        its memory is its own again (kvstore/client/planes/shm.py)."""
        task = asyncio.current_task()
        assert task is not None
        fd = self.sock.fileno()
        hung_up = False

        def readable() -> None:
            nonlocal hung_up
            try:
                peeked = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                peeked = b""
            self.loop.remove_reader(fd)  # data instead (a client out of protocol) is left for the next recv
            if not peeked:
                hung_up = True
                task.cancel()

        self.loop.add_reader(fd, readable)
        try:
            await request  # NOTE: inline, not a task of its own: no task per request on the hot path
        except asyncio.CancelledError:
            if not hung_up:  # the node is stopping
                raise
            task.uncancel()
            return False
        finally:
            self.loop.remove_reader(fd)
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
        auth = self.server.services.callers.auth
        role = Role.WRITE if auth is None else auth.role_of(self._metadata())
        max_pages = min(self.cfg.max_pages_per_request, shm.MAX_PAGES_PER_CALL)
        welcome = shm.WELCOME.pack(self.cfg.max_page_bytes, max_pages, role)
        await self.send(Kind.WELCOME, 0, welcome)

    async def _handle(self, kind: Kind, seq: int, body: memoryview, fds: list[int]) -> None:
        try:
            if kind is Kind.REGISTER:
                self._register(body, fds)
                reply = b""
            elif kind is Kind.LAYOUT:
                reply = self._layout(body)
            elif kind is Kind.PUT:
                reply = await self._put(pb.PutShmRequest.FromString(bytes(body)))
            elif kind is Kind.GET:
                reply = await self._get(pb.GetShmRequest.FromString(bytes(body)))
            else:
                raise ProtocolError(f"{kind.name} is not a request")
        except DecodeError as exc:
            await self.send(Kind.ERROR, seq, shm.error_body("INVALID_ARGUMENT", f"body: not a {kind.name}: {exc}"))
            return
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
        buf = map_descriptor(fds[0], self.cfg.shm_max_mapped_bytes - self.server.mapped_bytes)
        self.server.mapped_bytes += buf.size
        self.buffers[buf_id] = buf

    def _layout(self, body: memoryview) -> bytes:
        """The page size a GET's targets need: the first step of a plain get, answered as that Get would be."""
        if len(body) < HASH_BYTES:
            raise InvalidArgument("layout", f"a LAYOUT carries a {HASH_BYTES}-byte hash, then the namespace")
        try:
            namespace = bytes(body[HASH_BYTES:]).decode()
        except UnicodeDecodeError:
            raise InvalidArgument("namespace", "not valid UTF-8") from None
        layout = self._caller("Get").view.layout_of(namespace, first=bytes(body[:HASH_BYTES]))
        return shm.PAGE_BYTES.pack(layout.page_bytes)

    def _buffer(self, buf_id: int, field: str) -> MappedBuffer:
        buf = self.buffers.get(buf_id)
        if buf is None:
            raise InvalidArgument(field, f"buffer {buf_id} is not registered on this connection")
        return buf

    async def _put(self, req: pb.PutShmRequest) -> bytes:
        caller = self._caller("Put")
        if not req.HasField("open"):
            raise InvalidArgument("open", "a PUT needs `open` (namespace and layout)")
        if len(req.pages) > min(self.cfg.max_pages_per_request, shm.MAX_PAGES_PER_CALL):
            raise InvalidArgument("pages", f"{len(req.pages)} pages in one PUT")
        slices = list(req.pages)
        places = []
        for i, p in enumerate(slices):  # every slice checked first: a bad one leaves the node unchanged
            buf = self._buffer(p.buffer, f"pages[{i}].buffer")
            buf.check(p.offset, p.payload_bytes, f"pages[{i}]")
            places.append((buf, p.offset))
        op = put_open_from_pb(req.open)
        with _using(b for b, _ in places):
            done = await drive_put(lambda: (caller, op), _heads(slices), _BufferPages(places), drain=False)
        return pb.PutResponse(
            stored=done.stored, already_present=done.present, held=pack_held(done.held)
        ).SerializeToString()

    async def _get(self, req: pb.GetShmRequest) -> bytes:
        caller = self._caller("Get")
        form = checksum_form_from_pb(req.checksum_form, "checksum_form")
        hashes = list(req.hashes)
        if len(req.targets) != len(hashes):
            raise InvalidArgument("targets", f"{len(req.targets)} targets for {len(hashes)} hashes (one per hash)")
        page_bytes = caller.view.layout_of(req.namespace).page_bytes
        # NOTE: the targets' fields read once into tuples: a protobuf field read costs more than the check itself
        targets = [(t.buffer, t.offset, t.size) for t in req.targets]
        bufs = [self._buffer(t[0], f"targets[{i}].buffer") for i, t in enumerate(targets)]
        check_targets(targets, bufs, page_bytes)
        out = pb.GetShmResponse()
        with _using(set(bufs)):
            # NOTE: a window is cut when its page is reached: a Get whose stored prefix ends early (a probe of
            # many keys, the first one missing) costs no window per hash.
            windows = _Windows(bufs, targets, page_bytes)
            promote = not req.no_promote
            try:
                async with open_get(
                    caller, req.namespace, hashes, promote, into=windows, receiver_verifies=False
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


async def _heads(slices: Sequence[pb.ShmSlice]) -> AsyncIterator[PageHead]:
    for p in slices:
        yield PageHead(p.hash, p.payload_bytes, p.checksum)


class _BufferPages:
    """The put driver's page bytes: each slice of a registered buffer (bounds checked before)."""

    def __init__(self, places: list[tuple[MappedBuffer, int]]) -> None:
        self.places = places

    async def read_into(self, index: int, view: memoryview) -> None:
        buf, offset = self.places[index]
        view[:] = buf.view[offset : offset + len(view)]

    async def discard(self, index: int, nbytes: int) -> None:
        return None  # nothing to receive: the bytes stay in the caller's memory
