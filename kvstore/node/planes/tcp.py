"""The node's side of the TCP plane: a listener on the node's loop, one task per connection.

Every PUT and GET runs the node's put and get drivers (kvstore/node/drivers.py): page bytes land in
slot views (one copy, socket -> slot) and leave from leases (slot -> socket, no copy in between), so
atomicity, verification, tiers and stats are those of every plane. Credentials are the node's bearer
tokens, roles and tenants (kvstore/node/callers.py): the HELLO's token is checked before anything else,
and again on every request, so a token removed from its file stops working on open connections too.

Invariants: a connection never blocks the loop (every wait is a socket readiness wait); one that has
not completed TLS and HELLO within `tcp_hello_timeout_seconds` is closed, one that stalls mid-frame
(a partial header included) for `tcp_timeout_seconds` is closed and what its request staged is freed,
and one idle between requests for `tcp_idle_seconds` is closed; who may hold a connection at all is
counted by `ConnectionLimits` (tcp_limits.py: room for authenticated callers that handshakes cannot take,
a share per tenant), and a refusal is an ERROR UNAVAILABLE before the client sent any request (its
client falls back to gRPC); per-connection memory is bounded (tcp_io.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Callable

from kvstore.addresses import peer_host
from kvstore.errors import KVStoreError, Unauthenticated, Unavailable
from kvstore.manager.reads import ReadLease
from kvstore.node.callers import Caller
from kvstore.node.drivers import PageHead, check_page_count, drive_put, open_get
from kvstore.node.planes.base import NodeServices, PlaneServer, accept_forever, port_refusal
from kvstore.node.planes.tcp_io import (
    Channel,
    ConnectionClosed,
    PlainChannel,
    TlsChannel,
    kernel_tls_available,
    listen_socket,
    server_tls_context,
    tune,
)
from kvstore.node.planes.tcp_limits import ConnectionLimits, handshake_limit, tenant_limit
from kvstore.pageformat import in_form
from kvstore.scoping import DEFAULT_TENANT
from kvstore.security import AUTH_HEADER, Role
from kvstore.stats import PlaneInfo
from kvstore.wire import PutOpen, pack_held, tcp
from kvstore.wire.tcp import FrameError, Header, Kind

log = logging.getLogger(__name__)


class TcpPlaneServer(PlaneServer):
    """The TCP plane's listener. `start` binds `config.host:config.tcp_port` (0: a free port) and returns
    the PlaneInfo the node advertises; `stop` lets in-flight requests finish for up to the node's
    grace period, then closes every connection (their staged pages are freed)."""

    name = "tcp"

    def __init__(self) -> None:
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._conns: dict[asyncio.Task[None], _Connection] = {}
        self._closing = False

    async def start(self, services: NodeServices) -> PlaneInfo:
        cfg = services.config
        self.services = services
        self.tls = (
            server_tls_context(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)
            if cfg.tls_cert_file and cfg.tls_key_file
            else None
        )
        self.meta_limit = tcp.get_meta_limit(cfg.max_pages_per_request)
        cap = cfg.tcp_max_connections
        self.limits = ConnectionLimits(
            cap,
            handshake_limit(cap, cfg.tcp_max_handshakes),
            tenant_limit(cap, cfg.tcp_max_connections_per_tenant),
        )
        try:
            self._listener = listen_socket(cfg.host, cfg.tcp_port)
        except OSError as exc:
            raise OSError(port_refusal("TCP data plane", cfg.host, cfg.tcp_port, "--tcp-port", exc)) from None
        port = self._listener.getsockname()[1]
        self._accepting = asyncio.get_running_loop().create_task(self._accept())
        host = services.advertise_host
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        tls = "off" if self.tls is None else f"on, kernel TLS {'available' if kernel_tls_available() else 'absent'}"
        log.info("TCP data plane on %s:%d (advertised %s, TLS %s)", cfg.host, port, address, tls)
        return PlaneInfo("tcp", address, self.tls is not None)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1] if self._listener is not None else 0

    async def stop(self) -> None:
        self._closing = True
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._listener is not None:
            self._listener.close()
        for task, conn in list(self._conns.items()):
            if not conn.busy:
                task.cancel()
        if self._conns:
            await asyncio.wait(list(self._conns), timeout=self.services.config.grace_seconds)
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.wait(list(self._conns), timeout=5.0)

    async def _accept(self) -> None:
        assert self._listener is not None
        await accept_forever(self._listener, self._admit, "TCP plane")

    def _admit(self, sock: socket.socket) -> None:
        if not self.limits.can_start_handshake():
            # Full of connections that have not said HELLO: this one goes at once, told why where it
            # can be (plain TCP), so the room kept for authenticated callers is never theirs.
            _refuse_now(sock, "this node's TCP plane has too many connections in their handshake", self.tls)
            return
        sock.setblocking(False)
        tune(sock, tcp.SOCKET_BUFFER_BYTES)
        self.limits.start_handshake()
        conn = _Connection(self, sock)
        task = asyncio.get_running_loop().create_task(conn.serve())
        self._conns[task] = conn
        task.add_done_callback(self._conns.pop)


def _refuse_now(sock: socket.socket, why: str, tls: ssl.SSLContext | None) -> None:
    """Close a just-accepted connection, with an ERROR UNAVAILABLE first on a plain plane (a TLS client
    gets only the close: nothing is said outside TLS; either way its client falls back to gRPC)."""
    try:
        if tls is None:
            sock.setblocking(False)
            # NOTE: version 1, which clients of every version read: nothing says which one this client speaks
            sock.send(tcp.error("UNAVAILABLE", f"{why}; retry later or use gRPC streams", version=1))
    except OSError:
        pass
    finally:
        sock.close()


class _Connection:
    """One client connection: handshake, then requests one at a time until EOF, an error or stop."""

    def __init__(self, server: TcpPlaneServer, sock: socket.socket) -> None:
        self.server = server
        self.sock = sock
        self.cfg = server.services.config
        self.timeout = self.cfg.tcp_timeout_seconds
        self.token = ""
        self.cert_names: list[str] = []  # of the client's certificate (mutual TLS), for tenant binding
        self.busy = False
        self.version = tcp.VERSION  # the HELLO's: every frame of the connection speaks it (wire/tcp.py)
        self.tenant: str | None = None  # set once admitted (counted in the plane's limits until closed)
        self._handshaking = True  # counted as a handshake until HELLO is answered or the connection ends
        try:
            self.host = peer_host("{}:{}".format(*sock.getpeername()[:2]))  # whose reads (kvstore/node/heat.py)
        except (OSError, TypeError, IndexError):
            self.host = ""

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        chan: Channel | None = None
        limits = self.server.limits
        try:
            try:
                async with asyncio.timeout(min(self.cfg.tcp_hello_timeout_seconds, self.timeout)):
                    if self.server.tls is not None:
                        tls = TlsChannel(loop, self.sock, self.server.tls)
                        chan = tls
                        await tls.handshake()
                        self.cert_names = tls.cert_names()
                    else:
                        chan = PlainChannel(loop, self.sock)
                    await self._hello(chan)
            finally:
                self._end_handshake()
            while not self.server._closing:
                # Idle between requests: bounded by tcp_idle_seconds; once a frame's first byte is here,
                # the rest of its header is a stall bounded by tcp_timeout_seconds like any other read.
                async with asyncio.timeout(self.cfg.tcp_idle_seconds):
                    if not await chan.wait_frame():
                        return
                async with asyncio.timeout(self.timeout):
                    head = await chan.read_header(
                        meta_limit=self.server.meta_limit, body_limit=self.cfg.max_page_bytes, spoken=(self.version,)
                    )
                if head is None:
                    return
                self.busy = True
                try:
                    await self._request(chan, head)
                finally:
                    self.busy = False
        except (FrameError, KVStoreError) as exc:  # refused: HELLO (token, room) or framing
            await self._last_word(chan, exc)
        except (ConnectionError, TimeoutError, ssl.SSLError, OSError) as exc:
            log.debug("TCP plane connection ended: %s", exc)
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            log.exception("TCP plane connection failed unexpectedly")
            await self._last_word(chan, exc)
        finally:
            if self.tenant is not None:
                limits.release(self.tenant)
                self.tenant = None
            if chan is not None:
                chan.close()
            else:
                self.sock.close()

    def _end_handshake(self) -> None:
        if self._handshaking:
            self._handshaking = False
            self.server.limits.end_handshake()

    async def _last_word(self, chan: Channel | None, exc: BaseException) -> None:
        """Best effort: tell the client why before closing (bounded; it may not be reading)."""
        if chan is None:
            return
        status = exc.status_name if isinstance(exc, KVStoreError) else "INTERNAL"
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await chan.send(tcp.error(status, str(exc), self.version))

    async def _hello(self, chan: Channel) -> None:
        head = await chan.read_header(meta_limit=tcp.MAX_TOKEN_BYTES, body_limit=0, spoken=tcp.SPOKEN)
        if head is None:
            raise ConnectionClosed("closed before HELLO")
        self.version = head.version
        if head.kind is not Kind.HELLO:
            raise FrameError("frame.kind", f"a connection starts with HELLO, got {head.kind.name}")
        meta = await chan.read(head.meta_len)
        try:
            self.token = meta.decode()
        except UnicodeDecodeError:
            raise Unauthenticated("the token is not valid UTF-8") from None
        callers = self.server.services.callers
        who = None if callers.auth is None else callers.auth.identify(self._metadata())
        bound = callers.bind(who, self.cert_names)
        role = Role.WRITE if bound is None else bound.role
        tenant = DEFAULT_TENANT if bound is None else bound.scope
        limits = self.server.limits
        self._end_handshake()
        refusal = limits.refusal(tenant)
        if refusal is not None:
            raise Unavailable(refusal)
        limits.admit(tenant)
        self.tenant = tenant
        await chan.send(tcp.welcome(int(role), self.cfg.max_page_bytes, self.cfg.max_pages_per_request, self.version))

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        return ((AUTH_HEADER, f"Bearer {self.token}"),) if self.token else None

    def _caller(self, method: str) -> Caller:
        """The caller of this request (its token is checked again on every request, so a token removed
        from its file stops working on open connections too), bound to its certificate's tenant."""
        return self.server.services.callers.authenticate(method, self._metadata(), self.cert_names, self.host)

    async def _request(self, chan: Channel, head: Header) -> None:
        async with asyncio.timeout(self.timeout):
            meta = await chan.read(head.meta_len)
        if head.kind is Kind.PUT:
            await self._put(chan, meta)
        elif head.kind is Kind.GET:
            try:
                await self._get(chan, meta)
            except (FrameError, ConnectionError, TimeoutError):
                raise
            except KVStoreError as exc:
                await chan.send(tcp.error(exc.status_name, str(exc), self.version))
        else:
            raise FrameError("frame.kind", f"a request starts with PUT or GET, got {head.kind.name}")

    async def _put(self, chan: Channel, meta: bytearray) -> None:
        """The put driver over this connection. A refused request is consumed whole (its page count is
        read first, then every PAGE frame, bounded by that count and the page size) and answered ERROR,
        so the connection stays in step."""
        npages = check_page_count(tcp.put_npages(meta), self.cfg, "put.npages", put=True)
        pages = _FramePages(self, chan, npages)

        def opening() -> tuple[Caller, PutOpen]:
            return self._caller("Put"), tcp.parse_put(meta, tcp.checksum_form(self.version))

        try:
            done = await drive_put(opening, pages.heads(), pages, drain=True)
        except (FrameError, ConnectionError, TimeoutError):
            raise
        except KVStoreError as exc:
            await chan.send(tcp.error(exc.status_name, str(exc), self.version))
            return
        held = pack_held(done.held) if self.version >= 2 else b""  # version 1 clients read 8 bytes of DONE
        await chan.send(tcp.done(done.stored, done.present, self.version, held))

    async def _get(self, chan: Channel, meta: bytearray) -> None:
        """PAGE frames for the longest stored prefix (each payload sent from its leased slot), then DONE."""
        args = tcp.parse_get(meta)
        check_page_count(len(args.hashes), self.cfg, "hashes", put=False)
        reply = _GetReply(chan, self.version, args.namespace, self.timeout)
        try:
            async with open_get(
                self._caller("Get"),
                args.namespace,
                args.hashes,
                args.promote,
                receiver_verifies=True,
                expect=args.expect,
            ) as leases:
                async for lease in leases:
                    if reply.add(lease):
                        await reply.flush()
            await reply.flush(last=True)
        finally:
            reply.release()


# A GET reply goes out in groups: the PAGE frames (headers and leased payloads) of up to GROUP_PAGES pages
# or GROUP_BYTES bytes in one vectored send. NOTE: a send per page cost a system call and often a readiness
# wait per page; grouped, a 16 x 1 MiB reply takes ~5 sendmsg calls (strace, 2026-11-28). A group's leases
# are held until the kernel has its bytes, so what a group pins is bounded by these two.
GROUP_PAGES = 128  # two buffers per page: well under IOV_MAX in one sendmsg
GROUP_BYTES = 2 * tcp.SOCKET_BUFFER_BYTES or 8 << 20


class _GetReply:
    """The frames of one GET reply not yet sent, with their pages' leases (detached from the Get, so that
    their slots stay valid until the kernel has the bytes; released by `flush` or, however the reply
    ends, by `release`)."""

    def __init__(self, chan: Channel, version: int, namespace: str, stall_seconds: float) -> None:
        self.chan = chan
        self.version = version
        self.form = tcp.checksum_form(version)
        self.namespace = namespace
        self.stall_seconds = stall_seconds
        self.parts: list[bytes | memoryview] = []
        self.releases: list[Callable[[], None]] = []
        self.nbytes = 0
        self.sent = 0

    def add(self, lease: ReadLease) -> bool:
        """Queue a page's frame; True when the group is full (flush it)."""
        payload = lease.payload
        checksum = in_form(lease.checksum, self.form, self.namespace, lease.hash)
        self.releases.append(lease.detach())
        self.parts += (tcp.page_header(lease.hash, checksum, len(payload), lease.tier, self.version), payload)
        self.nbytes += len(payload)
        return len(self.releases) >= GROUP_PAGES or self.nbytes >= GROUP_BYTES

    async def flush(self, last: bool = False) -> None:
        """Send the queued frames (and DONE when `last`), then release their pages."""
        n = len(self.releases)
        if last:
            self.parts.append(tcp.done(self.sent + n, 0, self.version))
        if self.parts:
            await self.chan.sendv(self.parts, self.stall_seconds)
        self.sent += n
        self.parts = []
        self.nbytes = 0
        self.release()

    def release(self) -> None:
        releases, self.releases = self.releases, []
        for release in releases:
            release()


class _FramePages:
    """A PUT's PAGE frames, as the put driver reads them: each frame's header (with its page's hash and
    declared checksum), then its body into a slot view or dropped. Every wait is bounded by the node's
    `tcp_timeout_seconds`."""

    def __init__(self, conn: _Connection, chan: Channel, npages: int) -> None:
        self.conn = conn
        self.chan = chan
        self.npages = npages

    async def heads(self) -> AsyncIterator[PageHead]:
        conn, chan = self.conn, self.chan
        for _ in range(self.npages):
            async with asyncio.timeout(conn.timeout):
                head = await chan.read_header(
                    meta_limit=conn.server.meta_limit, body_limit=conn.cfg.max_page_bytes, spoken=(conn.version,)
                )
                if head is None:
                    raise ConnectionClosed("connection closed before the PUT's last page")
                if head.kind is not Kind.PAGE:
                    raise FrameError("frame.kind", f"expected the PUT's next PAGE, got {head.kind.name}")
                h, checksum, _ = tcp.parse_page(await chan.read(head.meta_len))
            yield PageHead(h, head.body_len, checksum)

    async def read_into(self, index: int, view: memoryview) -> None:
        async with asyncio.timeout(self.conn.timeout):
            await self.chan.readinto(view)

    async def discard(self, index: int, nbytes: int) -> None:
        async with asyncio.timeout(self.conn.timeout):
            await self.chan.discard(nbytes)
