"""The node's end of one TCP plane connection on its asyncio loop: exact reads into caller views, sends
of caller buffers, plain or TLS. Never blocks the loop: every wait is a readiness wait on the socket.

NOTE (why asyncio on raw non-blocking sockets, not asyncio streams nor a thread per connection):
`benchmarks/tcp_server_models.py` serves the same Get work both ways; on the 2-core dev VM the two
models moved pages at the same rate within run-to-run noise (benchmarks/RESULTS.md, "TCP plane").
So the simpler invariants decide: the TierManager stays single-threaded (a thread per connection
would hop to the loop for every lease and every PutTxn page), and a stalled client costs a socket,
not a thread. asyncio's StreamReader would copy every byte into its buffer and again into bytes,
and its transports copy what a send leaves over; `loop.sock_recv_into` and `sendmsg` move page bytes
between the kernel and a slot with no copy in between, with the GIL released in the system call.

Memory per connection is bounded: a STAGING_BYTES buffer for headers and small metadata, the
metadata of one frame (bounded by the node's limits), and, under TLS, OpenSSL's record buffers.

TLS goes through OpenSSL's socket path (an SSLSocket over the connection's descriptor, non-blocking), so
that where the kernel has kTLS OpenSSL hands it the record layer: sends then leave as on a plain
connection. NOTE: measured beside the memory-BIO channel this replaced (peer_bench, VM2 loaded, 3 runs
each): the same GB per CPU-second without kTLS (0.46-0.64 against 0.53-0.66).

Sends are vectored (`sendv`): a GET reply's frame headers and page payloads go to the kernel in one
`sendmsg` per group of pages, and each wait for room in the socket's buffer is one readiness wait,
bounded by the connection's stall timeout (a wait that sees no byte accepted for that long fails), not
by the size of what is sent.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import ssl
from collections.abc import Sequence

from kvstore.names import Buffer
from kvstore.wire.tcp import HEADER_BYTES, OP_ENABLE_KTLS, Header, unpack_header

STAGING_BYTES = 64 << 10  # headers and small reads go through this; larger reads land in place
# Linux's kernel TLS (include/uapi/linux/tls.h, tcp.h): Python 3.11's socket module does not name them.
TCP_ULP = getattr(socket, "TCP_ULP", 31)
SOL_TLS = getattr(socket, "SOL_TLS", 282)
TLS_TX = getattr(socket, "TLS_TX", 1)


IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024  # buffers per sendmsg


class ConnectionClosed(ConnectionError):
    """The peer closed the connection (EOF) before the bytes a frame announced arrived."""


class Channel:
    """Buffered exact reads and whole sends over one connection. Subclasses move raw bytes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        self.loop = loop
        self.sock = sock
        self._buf = bytearray(STAGING_BYTES)
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0  # buffered bytes are _buf[_lo:_hi]

    async def _recv_into(self, view: memoryview) -> int:
        """Receive at least one byte into `view` (0 at EOF)."""
        raise NotImplementedError

    async def send(self, *parts: Buffer) -> None:
        """Send every byte of `parts`, in order; returns once the kernel has them all. Unbounded in time:
        the caller bounds it (small frames)."""
        await self.sendv(parts, None)

    async def sendv(self, parts: Sequence[Buffer], stall_seconds: float | None) -> None:
        """Send every byte of `parts`, in order; returns once the kernel has them all. TimeoutError when
        the peer accepts no byte for `stall_seconds` (None: no bound)."""
        raise NotImplementedError

    def close(self) -> None:
        self._view.release()
        self.sock.close()

    def cert_names(self) -> list[str]:
        """Names of the peer's verified certificate (common name, DNS names); none without mutual TLS."""
        return []

    async def readinto(self, dst: memoryview) -> None:
        """Fill `dst` exactly: buffered bytes first, then large remainders straight from the socket."""
        n = len(dst)
        got = min(n, self._hi - self._lo)
        if got:
            dst[:got] = self._view[self._lo : self._lo + got]
            self._lo += got
        while got < n:
            if n - got >= STAGING_BYTES:
                k = await self._recv_into(dst[got:])
                if not k:
                    raise ConnectionClosed(f"connection closed {n - got} bytes short of a frame")
                got += k
                continue
            await self._fill()
            take = min(n - got, self._hi - self._lo)
            dst[got : got + take] = self._view[self._lo : self._lo + take]
            self._lo += take
            got += take

    async def read(self, n: int) -> bytearray:
        out = bytearray(n)
        if n:
            await self.readinto(memoryview(out))
        return out

    async def wait_frame(self) -> bool:
        """Wait until the next frame's first byte is here (True) or the peer closed cleanly (False). An
        idle wait: the caller bounds it with its idle timeout, then the frame itself with the stall one."""
        return self._hi > self._lo or await self._fill(eof_ok=True)

    async def read_header(self, *, meta_limit: int, body_limit: int, spoken: tuple[int, ...]) -> Header | None:
        """The next frame's header, checked against the limits and the versions `spoken`; None on a clean
        EOF between frames."""
        if not await self.wait_frame():
            return None
        raw = await self.read(HEADER_BYTES)
        return unpack_header(raw, meta_limit=meta_limit, body_limit=body_limit, spoken=spoken)

    async def discard(self, n: int) -> None:
        """Read and drop `n` bytes (the rest of a refused request), through the staging buffer."""
        while n:
            if self._hi == self._lo:
                await self._fill()
            take = min(n, self._hi - self._lo)
            self._lo += take
            n -= take

    async def _fill(self, eof_ok: bool = False) -> bool:
        """Receive into the empty staging buffer; False at EOF when eof_ok, else ConnectionClosed."""
        if self._lo == self._hi:
            self._lo = self._hi = 0
        k = await self._recv_into(self._view[self._hi :])
        if not k:
            if eof_ok:
                return False
            raise ConnectionClosed("connection closed in the middle of a frame")
        self._hi += k
        return True


class PlainChannel(Channel):
    async def _recv_into(self, view: memoryview) -> int:
        return await self.loop.sock_recv_into(self.sock, view)

    async def sendv(self, parts: Sequence[Buffer], stall_seconds: float | None) -> None:
        await send_all(self.loop, self.sock, [p if isinstance(p, bytes) else memoryview(p).cast("B") for p in parts],
                       stall_seconds)  # fmt: skip


async def send_all(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, views: list[bytes | memoryview], stall_seconds: float | None
) -> None:
    """Send every byte of `views` in order on a non-blocking socket: one sendmsg for as much as the socket's
    buffer takes, then a readiness wait (bounded by `stall_seconds` without progress), and again. `views` is
    consumed. NOTE: the socket's own sendmsg, also for an SSLSocket (whose records the kernel makes: kTLS)."""
    sendmsg = functools.partial(socket.socket.sendmsg, sock)
    first = 0  # views[first:] are still to send (views[first] maybe in part)
    waiter: _Writable | None = None
    try:
        while True:
            try:  # NOTE: one system call for everything the socket's buffer takes
                sent = sendmsg(views[first : first + IOV_MAX])
            except (BlockingIOError, InterruptedError):
                sent = 0
            while sent:
                n = len(views[first])
                if sent < n:
                    views[first] = memoryview(views[first])[sent:]
                    break
                sent -= n
                first += 1
            if first == len(views):
                return
            if waiter is None:
                waiter = _Writable(loop, sock.fileno())
            await waiter.wait(stall_seconds)
    finally:
        if waiter is not None:
            waiter.close()


class _Writable:
    """Waits for room in one socket's send buffer: the descriptor stays registered for writing while a
    vectored send is under way (one registration, not one per wait)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self.loop = loop
        self.fd = fd
        self._fut: asyncio.Future[None] | None = None
        loop.add_writer(fd, self._wake)

    def _wake(self) -> None:
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def wait(self, stall_seconds: float | None) -> None:
        self._fut = self.loop.create_future()
        try:
            if stall_seconds is None:
                await self._fut
            else:
                async with asyncio.timeout(stall_seconds):
                    await self._fut
        finally:
            self._fut = None

    def close(self) -> None:
        self.loop.remove_writer(self.fd)


class TlsChannel(Channel):
    """TLS through an SSLSocket over the connection's own socket (OpenSSL reads and writes it), so that OpenSSL
    can hand the record layer to the kernel (kTLS, `SSLContext` with OP_ENABLE_KTLS) where the kernel has it.

    Where the kernel encrypts what this side sends (`kernel_tx`), pages are sent as on a plain connection: one
    vectored sendmsg of many pages, the kernel making the records as it copies. Otherwise OpenSSL writes each
    record itself. Receives always go through OpenSSL (which reads through the kernel where kTLS RX is on: it
    handles the records that are not application data). Every wait is a readiness wait on the socket."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, ctx: ssl.SSLContext) -> None:
        tls = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)  # takes over the descriptor
        super().__init__(loop, tls)
        self._tls = tls
        self.kernel_tx = False

    def cert_names(self) -> list[str]:
        return _cert_names(self._tls.getpeercert())

    async def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await _ready(self.loop, self._tls.fileno(), write=False)
            except ssl.SSLWantWriteError:
                await _ready(self.loop, self._tls.fileno(), write=True)
        self.kernel_tx = kernel_tls_tx(self._tls)

    async def _recv_into(self, view: memoryview) -> int:
        while True:
            try:
                return self._tls.recv_into(view)
            except ssl.SSLWantReadError:
                await _ready(self.loop, self._tls.fileno(), write=False)
            except ssl.SSLWantWriteError:
                await _ready(self.loop, self._tls.fileno(), write=True)
            except ssl.SSLZeroReturnError:
                return 0

    async def sendv(self, parts: Sequence[Buffer], stall_seconds: float | None) -> None:
        views = [p if isinstance(p, bytes) else memoryview(p).cast("B") for p in parts]
        if self.kernel_tx:
            await send_all(self.loop, self._tls, views, stall_seconds)
            return
        for part in views:
            view = memoryview(part)
            while view:
                try:
                    view = view[self._tls.send(view) :]
                except ssl.SSLWantWriteError:
                    await _ready(self.loop, self._tls.fileno(), write=True, timeout=stall_seconds)
                except ssl.SSLWantReadError:
                    await _ready(self.loop, self._tls.fileno(), write=False, timeout=stall_seconds)


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, *, write: bool, timeout: float | None = None) -> None:
    """Wait until `fd` is readable (or writable), for at most `timeout` seconds (None: the caller bounds it)."""
    fut: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, wake)
    try:
        if timeout is None:
            await fut
        else:
            async with asyncio.timeout(timeout):
                await fut
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


def _cert_names(cert: dict | None) -> list[str]:  # type: ignore[type-arg]
    """Common name and DNS names of a peer's verified certificate (none without mutual TLS)."""
    cert = cert or {}
    names = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
    return names + [v for k, v in cert.get("subjectAltName", ()) if k == "DNS"]


def kernel_tls_tx(sock: socket.socket) -> bool:
    """Whether the kernel encrypts what `sock` sends (kTLS: the "tls" upper-layer protocol has this direction's
    keys). Reads the socket's TLS_TX option; any error means no."""
    try:
        sock.getsockopt(SOL_TLS, TLS_TX, 64)
    except OSError:
        return False
    return True


@functools.cache
def kernel_tls_available() -> bool:
    """Whether this kernel attaches the "tls" upper-layer protocol to a TCP connection (kTLS): tried once, on a
    loopback connection of this process's own (which, for root, also loads the kernel's module if it has one)."""
    try:
        with socket.create_server(("127.0.0.1", 0)) as srv, socket.create_connection(srv.getsockname(), 2.0) as a:
            srv.settimeout(2.0)
            peer, _ = srv.accept()
            with peer:
                a.setsockopt(socket.IPPROTO_TCP, TCP_ULP, b"tls")
    except OSError:
        return False
    return True


def tune(sock: socket.socket, buffer_bytes: int) -> None:
    """TCP_NODELAY (a frame is sent whole, never held back for the next one) and, when asked, larger
    kernel buffers than the autotuned start (several pages in flight)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)


def listen_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A non-blocking listening socket on host:port (0: a free port), IPv4 or IPv6 as the host says."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def server_tls_context(cert_file: str, key_file: str, client_ca_file: str | None) -> ssl.SSLContext:
    """The node's TLS context: its certificate; with a client CA, clients must present one it signed. OpenSSL may
    hand the record layer to the kernel (kTLS) where both have it; no session tickets (the plane's clients keep
    their connections and never resume one, and nothing but application data follows the handshake)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= OP_ENABLE_KTLS
    ctx.num_tickets = 0
    ctx.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(client_ca_file)
    return ctx
