"""The client's side of the TCP plane: persistent connections, Put/Get/get_into as exchanges.

Socket work runs in `Blocking` operations (the caller's thread in KVStoreClient, a worker thread in
AsyncKVStoreClient). Each call takes a connection from the plane's pool (opening one when none is
idle: TCP_NODELAY, large buffers, TLS as the node advertises, HELLO with the client's token), sends its
whole request (every page in flight back to back, no per-page round trip) and reads the reply; pages
are received with `recv_into` straight into their destination: a fresh buffer for `get`, the caller's
buffer for `get_into`.

Errors: a node that cannot be reached, that refuses the connection (its plane is full: ERROR
UNAVAILABLE or a close in answer to HELLO), or a TLS setup the two ends do not share, is PlaneUnavailable
before anything was sent (transport "auto" then falls back to gRPC streams); an ERROR frame raises the
node's exception class, as gRPC would; a connection lost mid-request is Unavailable (nothing of an
unfinished PUT is stored: it is atomic); a received page that fails its checksum raises StreamError,
as on the other planes, and its connection is dropped. A call that finds its pooled connection closed by the node
before any reply byte is retried once on a fresh connection (Put and Get are idempotent).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvstore.addresses import split_address, target_host
from kvstore.client.exchange import Abort, Blocking, Exchange
from kvstore.client.planes.base import DataPlane, PutResult
from kvstore.client.planes.buffers import page_sink
from kvstore.client.planes.connections import ConnectionPool
from kvstore.client.planes.pool import ReceivePool
from kvstore.errors import KVStoreError, PageCorrupt, PlaneUnavailable, StreamError, Unavailable, from_status
from kvstore.layout import PageLayout
from kvstore.names import Buffer, TierKind
from kvstore.pageformat import HOT_CHUNK, checksum_in_steps, key_digest, payload_hasher, wire_checksum
from kvstore.security import ClientSecurity, InsecureChannel
from kvstore.stats import PlaneInfo
from kvstore.wire import PutOpen, tcp, unpack_held
from kvstore.wire.streams import FetchedPage, PageRef
from kvstore.wire.tcp import Header, Kind

T = TypeVar("T")

CONNECT_TIMEOUT_S = 5.0  # a firewalled plane port (dropped SYNs) falls back to gRPC after this, not the call timeout
REPLY_META_LIMIT = 1 << 20  # what a client accepts as one reply's metadata (ERROR messages are the largest)


class Connection:
    """One open, authenticated connection to a node's TCP plane. Not thread-safe: one call at a time
    (the pool hands it to one caller). `replied` says whether the current request got any reply byte."""

    def __init__(
        self, host: str, port: int, *, token: str | None, tls: ssl.SSLContext | None, server_name: str, timeout: float
    ) -> None:
        sock = socket.create_connection((host, port), timeout=min(timeout, CONNECT_TIMEOUT_S))
        try:
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                if tcp.SOCKET_BUFFER_BYTES:
                    sock.setsockopt(socket.SOL_SOCKET, opt, tcp.SOCKET_BUFFER_BYTES)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=server_name)
            else:
                # NOTE: a blocking socket with kernel timeouts, not Python's timeout mode: that one makes
                # the descriptor non-blocking, and MSG_WAITALL then returns after every segment.
                sock.settimeout(None)
                tv = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.plain = tls is None  # MSG_WAITALL and sendmsg work on plain sockets only
        self.version = tcp.VERSION  # the connection's frame version (wire/tcp.py): every frame carries it
        self._head = memoryview(bytearray(tcp.PAGE_FRAME_HEAD_BYTES))  # a reply frame's header and metadata
        self.replied = False
        self.usable = True  # False once a send or receive failed: the byte stream is out of step
        self.max_page_bytes = 0
        try:
            self.send(tcp.hello(token))
            head, meta = self.read_frame()
            if head.kind is not Kind.WELCOME:
                raise StreamError(f"the node answered HELLO with {head.kind.name}")
            self.max_page_bytes = tcp.parse_welcome(meta).max_page_bytes
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.usable = False
        self.sock.close()

    def abort(self) -> None:
        """From another thread: end the request in progress (its receive or send fails at once). Only this
        client's thread writes a get's pages (into its buffers), so once that thread returned nothing does."""
        self.usable = False
        with contextlib.suppress(OSError):  # NOTE: the plain socket call, also under TLS: no TLS state touched
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)

    # -- bytes

    def send(self, *parts: Buffer) -> None:
        try:
            self._send(parts)
        except OSError:
            self.usable = False
            self._pending_error()
            raise

    def _pending_error(self) -> None:
        """After a failed send: raise the node's ERROR if it explained itself before closing."""
        try:
            self.sock.settimeout(1.0)
            self.read_frame()
        except KVStoreError:
            raise
        except Exception:  # nothing to add to the send's own error
            pass

    def _send(self, parts: Sequence[Buffer]) -> None:
        if self.plain and len(parts) > 1:
            views = [memoryview(p).cast("B") for p in parts]
            sent = self.sock.sendmsg(views)  # one system call for a header and its page, mostly
            for v in views:
                if sent >= len(v):
                    sent -= len(v)
                    continue
                self.sock.sendall(v[sent:])
                sent = 0
            return
        for p in parts:
            self.sock.sendall(p)

    def readinto(self, dst: memoryview) -> None:
        n, got = len(dst), 0
        flags = socket.MSG_WAITALL if self.plain else 0
        try:
            while got < n:
                k = self.sock.recv_into(dst[got:], n - got, flags)
                if not k:
                    raise ConnectionError(f"the node closed the connection {n - got} bytes short of a frame")
                got += k
                self.replied = True
        except OSError:
            self.usable = False
            raise

    def _recv_some(self, dst: memoryview) -> int:
        """Receive at least one byte into `dst` (whatever is there, up to its length); EOF raises."""
        try:
            k = self.sock.recv_into(dst)
            if not k:
                raise ConnectionError("the node closed the connection before the next frame")
        except OSError:
            self.usable = False
            raise
        self.replied = True
        return k

    def receive_hashed(self, dst: memoryview) -> int:
        """Fill `dst` from the socket and return its payload checksum, each chunk hashed as soon as it is in
        (from cache: no second pass over RAM; pageformat.HOT_CHUNK)."""

        def receive(off: int, k: int) -> memoryview:
            chunk = dst[off : off + k]
            self.readinto(chunk)
            return chunk

        return checksum_in_steps(len(dst), receive)

    def receive_regions(self, regions: list[memoryview], verify: bool) -> int:
        """Fill `regions` in order from the socket (one page's parts); their payload checksum when `verify`, each
        chunk hashed as soon as it is in (as receive_hashed), else 0."""
        h = payload_hasher()
        for region in regions:
            for off in range(0, len(region), HOT_CHUNK):
                chunk = region[off : off + HOT_CHUNK]
                self.readinto(chunk)
                if verify:
                    h.update(chunk)
        return h.intdigest() if verify else 0

    def put_regions(self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[list[memoryview]]) -> PutResult:
        """`put` of pages each made of regions in caller memory (a bundle's parts): hashed in one read pass, then
        sent straight from the regions (sendmsg gathers them: no copy)."""
        self.replied = False
        self.send(tcp.put(op, len(hashes)))
        for h, regions in zip(hashes, pages, strict=True):
            hasher = payload_hasher()
            for r in regions:
                hasher.update(r)
            n = sum(len(r) for r in regions)
            self.send(tcp.page_header(h, hasher.intdigest() ^ key_digest(op.namespace, h), n), *regions)
        head, meta = self.read_frame()
        if head.kind is not Kind.DONE:
            raise StreamError(f"the node answered PUT with {head.kind.name}")
        stored, present = tcp.parse_done(meta)
        return PutResult(stored, present, unpack_held(tcp.done_held(meta), len(hashes)))

    def read_frame(self) -> tuple[Header, bytearray]:
        """The next frame's header and metadata (its body, if any, is still to be read); ERROR raises
        the node's exception."""
        raw = bytearray(tcp.HEADER_BYTES)
        self.readinto(memoryview(raw))
        # NOTE: any version: a refusal before HELLO comes in version 1 (wire/tcp.py)
        head = tcp.unpack_header(
            raw, meta_limit=REPLY_META_LIMIT, body_limit=self.max_page_bytes or 0, spoken=tcp.SPOKEN
        )
        meta = bytearray(head.meta_len)
        if head.meta_len:
            self.readinto(memoryview(meta))
        if head.kind is Kind.ERROR:
            raise from_status(*tcp.parse_error(meta))
        return head, meta

    # -- requests

    def put(self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[Buffer]) -> PutResult:
        self.replied = False
        self.send(tcp.put(op, len(hashes)))
        for h, page in zip(hashes, pages, strict=True):
            view = memoryview(page).cast("B")
            self.send(tcp.page_header(h, wire_checksum(op.namespace, h, view), len(view)), view)
        head, meta = self.read_frame()
        if head.kind is not Kind.DONE:
            raise StreamError(f"the node answered PUT with {head.kind.name}")
        stored, present = tcp.parse_done(meta)
        return PutResult(stored, present, unpack_held(tcp.done_held(meta), len(hashes)))

    def get(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        promote: bool,
        *,
        verify: bool,
        sink: Callable[[int, int], memoryview],
        expect: PageLayout | None = None,
    ) -> list[tuple[bytes, TierKind, memoryview]]:
        """Send a GET and receive its pages in order: page i's `n` bytes land in `sink(i, n)`. Returns
        (hash, tier, filled view) per page, each checked against its checksum when `verify`."""
        self.replied = False
        self.send(tcp.get(namespace, list(hashes), promote, expect))
        out: list[tuple[bytes, TierKind, memoryview]] = []
        while True:
            page = self._reply_page()
            if isinstance(page, int):  # DONE: how many pages the node sent
                if page != len(out):
                    raise StreamError(f"the node announced {page} pages and sent {len(out)}")
                return out
            h, checksum, tier, nbytes = page
            i = len(out)
            if i >= len(hashes) or h != hashes[i]:
                raise StreamError(f"page {i}: the node sent an unexpected hash")
            kind = _TIERS.get(tier)
            if kind is None:
                raise StreamError(f"page {i}: the node named an unknown tier {tier}")
            dst = sink(i, nbytes)
            if isinstance(dst, list):  # a bundle's parts, each straight into its own region (no copy)
                got = self.receive_regions(dst, verify)
            elif not verify:
                self.readinto(dst)
                got = None
            else:
                got = self.receive_hashed(dst)
            if verify and got ^ key_digest(namespace, h) != checksum:  # bound to what was asked
                raise PageCorrupt(i, h, out)
            out.append((h, kind, dst))

    def _reply_page(self) -> tuple[bytes, int, int, int] | int:
        """The next PAGE of a GET reply: (hash, checksum, tier value, payload bytes), its payload still to
        be read; at the reply's DONE, the number of pages it says were sent; ERROR raises.

        NOTE: one system call per page in the common case, not two: a reply is PAGE frames, each 57 bytes
        before its payload, then one DONE or ERROR after which the node sends nothing until the next
        request, so a read of up to 57 bytes never takes bytes past the frame it starts."""
        buf = self._head
        got = self._recv_some(buf)
        if got < tcp.HEADER_BYTES:
            self.readinto(buf[got : tcp.HEADER_BYTES])
            got = tcp.HEADER_BYTES
        magic, version, kind, meta_len, body_len = tcp.HEADER.unpack_from(buf)
        if (
            kind == Kind.PAGE
            and meta_len == tcp.PAGE_META_BYTES
            and magic == tcp.MAGIC
            and version == self.version
            and body_len <= self.max_page_bytes
        ):
            if got < tcp.PAGE_FRAME_HEAD_BYTES:
                self.readinto(buf[got:])
            h, checksum, tier = tcp.parse_page(buf[tcp.HEADER_BYTES :])
            return h, checksum, tier, body_len
        # Anything else: checked in full (a DONE, an ERROR, or a frame that breaks the format).
        try:
            head = tcp.unpack_header(
                buf[: tcp.HEADER_BYTES], meta_limit=REPLY_META_LIMIT, body_limit=self.max_page_bytes, spoken=tcp.SPOKEN
            )
            if got > tcp.HEADER_BYTES + head.meta_len:
                raise StreamError(f"the node sent bytes past the end of a {head.kind.name} frame")
        except KVStoreError:
            self.usable = False  # the byte stream cannot be followed any further
            raise
        meta = bytearray(head.meta_len)
        meta[: got - tcp.HEADER_BYTES] = buf[tcp.HEADER_BYTES : got]
        if got - tcp.HEADER_BYTES < head.meta_len:
            self.readinto(memoryview(meta)[got - tcp.HEADER_BYTES :])
        if head.kind is Kind.ERROR:
            raise from_status(*tcp.parse_error(meta))
        if head.kind is Kind.PAGE:  # a PAGE in another version than the connection's: the checks above
            raise StreamError(f"a PAGE frame of version {head.version} on a version {self.version} connection")
        if head.kind is not Kind.DONE:
            raise StreamError(f"unexpected {head.kind.name} frame in a GET reply")
        return tcp.parse_done(meta)[0]


_TIERS = {int(t): t for t in TierKind}


class TcpPlane(DataPlane):
    """Pages travel over this client's pooled connections to the node's advertised TCP plane.

    Thread-safe: concurrent calls use different connections. Each PUT of at most `call_pages`
    pages is atomic, like a Put stream.
    """

    name = "tcp"

    def __init__(
        self,
        info: PlaneInfo | None,
        *,
        target: str,
        pages_per_call: int,
        verify: bool,
        security: ClientSecurity,
        timeout: float,
        received: ReceivePool | None = None,
    ) -> None:
        """The client side of the TCP plane the node advertised (`info`); PlaneUnavailable when it advertised none,
        or an address this client may not send its token to, or one that does not parse."""
        if info is None or not info.address:
            raise PlaneUnavailable("the node advertises no TCP plane address")
        try:  # the token goes to the advertised address: only where this client may send it (SECURITY.md)
            security.check_target(info.address)
        except InsecureChannel as exc:
            raise PlaneUnavailable(f"tcp: {exc}") from None
        try:
            self.host, self.port = split_address(info.address, default_host=target_host(target))
        except ValueError as exc:
            raise PlaneUnavailable(f"the node advertises a TCP plane address that is unusable: {exc}") from None
        self.pages_per_call = pages_per_call
        self.verify = verify
        self.security = security
        self.timeout = timeout
        self.tls = info.tls
        self.received = ReceivePool() if received is None else received  # where a plain get's pages land
        self.server_name = security.server_name or target_host(target)
        self._pool = ConnectionPool(self._open, f"TCP plane connection to {self.host}:{self.port}")
        self._tls_ctx: ssl.SSLContext | None = None

    # -- connections

    def _open(self) -> Connection:
        if self.tls != self.security.tls:
            raise PlaneUnavailable(
                "the node's TCP plane uses TLS but this client has no CA (KVSTORE_TLS_CA)"
                if self.tls
                else "this client requires TLS but the node's TCP plane is not encrypted"
            )
        if self.tls and self._tls_ctx is None:
            self._tls_ctx = client_tls_context(self.security)
        try:
            return Connection(
                self.host,
                self.port,
                token=self.security.token,
                tls=self._tls_ctx,
                server_name=self.server_name,
                timeout=self.timeout,
            )
        except ssl.SSLCertVerificationError as exc:
            raise Unavailable(
                f"TCP plane at {self.host}:{self.port}: the node's TLS certificate failed "
                f"verification: {exc.verify_message or exc}"
            ) from None
        except (OSError, StreamError) as exc:  # StreamError: the handshake's reply made no sense
            raise PlaneUnavailable(f"cannot open the TCP plane at {self.host}:{self.port}: {exc}") from None
        except Unavailable as exc:  # the node refused the connection (full, or stopping): nothing was sent
            raise PlaneUnavailable(f"the TCP plane at {self.host}:{self.port} refused a connection: {exc}") from None

    def close(self) -> None:
        self._pool.close()

    # -- the DataPlane

    def put_batch(self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[Buffer]) -> Exchange[PutResult]:
        abort = Abort()
        return (yield Blocking(lambda: self._pool.call(lambda c: c.put(op, hashes, pages), abort), abort))

    def get_batch(
        self, namespace: str, hashes: Sequence[bytes], promote: bool, expect: PageLayout | None = None
    ) -> Exchange[list[FetchedPage]]:
        take = self.received.take
        return (
            yield from self._get(
                namespace, hashes, promote, sink=lambda i, n: take(n), result=FetchedPage, expect=expect
            )
        )

    def get_into_batch(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        buffers: Sequence[Buffer],
        promote: bool,
        *,
        first: int,
        expect: PageLayout | None = None,
    ) -> Exchange[list[PageRef]]:
        """Pages received straight into the caller's buffers (one copy: kernel -> buffer), verified."""
        sink = page_sink(buffers, first)
        return (
            yield from self._get(
                namespace, hashes, promote, sink=sink, result=lambda h, t, v: PageRef(h, t, len(v)), expect=expect
            )
        )

    scatters = True  # a bundle's parts move straight between the socket and their regions

    def put_regions_batch(
        self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[list[memoryview]]
    ) -> Exchange[PutResult]:
        abort = Abort()
        return (yield Blocking(lambda: self._pool.call(lambda c: c.put_regions(op, hashes, pages), abort), abort))

    def get_regions_batch(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        pages: Sequence[list[memoryview]],
        promote: bool,
        *,
        first: int,
        expect: PageLayout | None = None,
    ) -> Exchange[list[PageRef]]:
        def sink(i: int, n: int) -> list[memoryview]:
            have = sum(len(r) for r in pages[i])
            if have != n:
                raise ValueError(f"pages[{first + i}]: its parts hold {have} bytes, the node sent a {n}-byte page")
            return pages[i]

        return (yield from self._get(namespace, hashes, promote, sink=sink, result=_ref, expect=expect))  # type: ignore[arg-type]

    def _get(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        promote: bool,
        *,
        sink: Callable[[int, int], memoryview],
        result: Callable[[bytes, TierKind, memoryview], T],
        expect: PageLayout | None = None,
    ) -> Exchange[list[T]]:
        """One GET on a pooled connection: page i lands in sink(i, n); `result` makes what the caller gets
        of each page (a PageCorrupt carries the ones before the bad page, made alike)."""
        abort = Abort()
        try:
            got = yield Blocking(
                lambda: self._pool.call(
                    lambda c: c.get(namespace, hashes, promote, verify=self.verify, sink=sink, expect=expect), abort
                ),
                abort,
            )
        except PageCorrupt as exc:
            raise PageCorrupt(exc.index, exc.hash, [result(*g) for g in exc.good]) from None
        return [result(*g) for g in got]


def _ref(h: bytes, tier: TierKind, dst: memoryview | list[memoryview]) -> PageRef:
    return PageRef(h, tier, sum(len(r) for r in dst) if isinstance(dst, list) else len(dst))


def client_tls_context(security: ClientSecurity) -> ssl.SSLContext:
    """Verify the node like the gRPC channel does: the same CA, the same name; mTLS when a client
    certificate is configured."""
    ctx = ssl.create_default_context(cafile=security.ca_file)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= tcp.OP_ENABLE_KTLS  # the kernel makes and reads the records where it can (wire/tcp.py)
    if security.cert_file and security.key_file:
        ctx.load_cert_chain(security.cert_file, security.key_file)
    return ctx
