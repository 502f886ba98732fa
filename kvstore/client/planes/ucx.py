"""The client's side of the UCX plane: a pool of connections (one UCX worker each) and Put/Get as exchanges.

A call takes a connection from the pool (opening one when none is free, so concurrent callers of one
client never share a worker: UCX workers are single-threaded here) and performs the whole transfer as
one `Blocking` operation: on the caller's thread in `KVStoreClient`, in a worker thread in
`AsyncKVStoreClient`. Every wait is bounded by the client's timeout.

Environment (client side):
- KVSTORE_UCX_CONNECT: "worker" (default; connect by the node's advertised worker address, so UCX may
  use shared memory or RDMA lanes) or "listener" (through the node's UCX listener: a sockaddr connection).
- KVSTORE_UCX_ERROR_HANDLING: "1" (default) endpoints report a vanished peer; "0" lets UCX pick
  transports without peer-failure detection (on one host: shared memory). Only for trusted benchmarks:
  a peer that dies mid-transfer then costs a full timeout instead of an immediate error.
- KVSTORE_UCX_ALLOW_PLAINTEXT: "1" lets a client configured for TLS use the UCX plane, which is not
  encrypted (the bearer token and the pages cross it in clear). Without it such a client skips UCX.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.client.exchange import Blocking, Exchange
from kvstore.client.planes.base import DataPlane
from kvstore.client.planes.buffers import page_sink
from kvstore.errors import PageCorrupt, PlaneUnavailable, StreamError, Unavailable, from_status
from kvstore.names import Buffer, TierKind
from kvstore.pageformat import payload_checksum
from kvstore.stats import PlaneInfo
from kvstore.wire import PutOpen
from kvstore.wire import ucx as proto
from kvstore.wire.streams import FetchedPage, PageRef, put_open_to_pb
from kvstore.wire.ucx import Hello, Kind, ProtocolError, TagKind, UcxAddress
from kvstore.wire.ucx_progress import UcxClosed, UcxTimeout, wait_blocking

CLOSE_WAIT_SECONDS = 2.0  # how long closing an endpoint waits for its cancelled transfers
MAX_PAGE_BYTES = 1 << 30  # a page the node announces above this is a protocol error, not an allocation

Sink = Callable[[int, int], memoryview]  # (page index, length) -> where that page's bytes go


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    return default if raw is None else raw.strip().lower() in {"1", "true", "yes", "on"}


class UcxConnection:
    """One endpoint to a node with its own worker; used by one thread at a time (the pool sees to it).

    Invariant: `broken` is set once a transfer failed in a way that may leave messages in flight; a
    broken connection is closed, never reused.
    """

    def __init__(self, ucx: Any, context: Any, addr: UcxAddress, token: str | None, deadline: float) -> None:
        from ucxx._lib.arr import Array

        self.ucx, self.Array = ucx, Array
        self.worker = ucx.UCXWorker(context)
        self.worker.init_blocking_progress_mode()
        self.cid = int.from_bytes(os.urandom(4), "little") % 0xFFFFFFFF  # never the reserved 0xFFFFFFFF
        self.seq = 0
        self.broken = False
        self.ctrl = bytearray(proto.MAX_CONTROL_BYTES)
        eh = _env_flag("KVSTORE_UCX_ERROR_HANDLING", True)
        by_address = os.environ.get("KVSTORE_UCX_CONNECT", "worker").lower() != "listener" and bool(addr.worker)
        if by_address:
            self.ep = ucx.UCXEndpoint.create_from_worker_address(
                self.worker, ucx.UCXAddress.create_from_buffer(addr.worker), eh
            )
            hello = Hello(self.cid, token, bytes(self.worker.address.tobytes()), eh)
        else:
            self.ep = ucx.UCXEndpoint.create(self.worker, addr.host, addr.port, True)
            hello = Hello(self.cid, token, b"", True)
        self.path = "worker-address" if by_address else "listener"
        reply = self._post_reply(0)
        msg = Array(bytearray(proto.frame(Kind.HELLO, 0, hello.pack())))
        send = self.ep.tag_send(msg, ucx.UCXXTag(proto.HELLO_TAG)) if by_address else self.ep.stream_send(msg)
        self._wait([send, reply], deadline, "UCX HELLO")
        self._reply_body(Kind.HELLO_OK, 0)

    def alive(self) -> bool:
        return not self.broken and self.ep.alive

    def _wait(self, reqs: Sequence[Any], deadline: float, what: str) -> None:
        wait_blocking(self.worker, reqs, deadline, lambda: self.ep.alive, what)

    def _post_reply(self, seq: int) -> Any:
        t = self.ucx.UCXXTag(proto.tag(self.cid, TagKind.CTRL_TO_CLIENT, seq))
        return self.ep.tag_recv(self.Array(self.ctrl), t)

    def _reply_body(self, want: Kind, seq: int) -> memoryview:
        """The body of the reply just received; raises the node's error as its exception class."""
        kind, _, got_seq, body = proto.unframe(self.ctrl)
        if got_seq != seq:
            raise ProtocolError(f"reply to request {got_seq}, expected {seq}")
        if kind is Kind.ERROR:
            raise from_status(*proto.parse_error(body))
        if kind is not want:
            raise ProtocolError(f"expected {want.name}, got {kind.name}")
        return body

    def _request(self, kind: Kind, body: bytes) -> tuple[int, Any, list[Any]]:
        """Post the reply receive, then send the request; returns (seq, reply request, [keep-alives])."""
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        seq = self.seq
        reply = self._post_reply(seq)
        msg = self.Array(bytearray(proto.frame(kind, seq, body)))
        send = self.ep.tag_send(msg, self.ucx.UCXXTag(proto.tag(self.cid, TagKind.CTRL_TO_NODE, seq)))
        return seq, reply, [msg, send]

    def put(self, req: pb.PutShmRequest, pages: Sequence[Buffer], deadline: float) -> pb.PutResponse:
        seq, reply, keep = self._request(Kind.PUT, req.SerializeToString())
        sends = []
        for i, page in enumerate(pages):
            arr = self.Array(memoryview(page).cast("B"))
            keep.append(arr)
            sends.append(self.ep.tag_send(arr, self.ucx.UCXXTag(proto.tag(self.cid, TagKind.DATA_TO_NODE, seq, i))))
        try:
            self._wait([reply], deadline, "UCX PUT")
            body = self._reply_body(Kind.OK, seq)
            self._wait(sends, deadline, "UCX PUT pages")  # done: the node received them all before replying
            return pb.PutResponse.FromString(bytes(body))
        finally:
            if not all(s.completed for s in sends):  # an error reply before the node took every page
                self.close_broken(sends)

    def get(self, req: pb.GetShmRequest, sink: Sink, deadline: float) -> tuple[pb.GetShmResponse, list[int]]:
        """Receive pages into `sink(i, length)` until the node's reply; returns the reply and the lengths."""
        seq, reply, keep = self._request(Kind.GET, req.SerializeToString())
        lengths: list[int] = []
        recv = None
        try:
            while True:
                if recv is not None and recv.completed:
                    recv.check_error()
                    recv = None
                if recv is None:
                    want = self.ucx.UCXXTag(proto.tag(self.cid, TagKind.DATA_TO_CLIENT, seq, len(lengths)))
                    probe = self.worker.tag_probe(want, remove=True)
                    if probe.matched:
                        n = probe.length
                        if n > MAX_PAGE_BYTES:
                            raise ProtocolError(f"page {len(lengths)} announced as {n} bytes")
                        arr = self.Array(sink(len(lengths), n))
                        keep.append(arr)
                        recv = self.worker.tag_recv_with_handle(arr, probe)
                        lengths.append(n)
                        continue
                if reply.completed and recv is None:
                    break
                if not self.ep.alive:
                    raise UcxClosed("UCX GET: the endpoint closed")
                if time.monotonic() > deadline:
                    raise UcxTimeout("UCX GET: no reply within the deadline")
                self.worker.progress_worker_event(50)
            reply.check_error()
        except BaseException:
            self.close_broken([r for r in (recv, reply) if r is not None])
            raise
        body = self._reply_body(Kind.OK, seq)  # an error reply leaves the connection clean: raised as is
        return pb.GetShmResponse.FromString(bytes(body)), lengths

    def close_broken(self, reqs: Sequence[Any]) -> None:
        """Close after a failed transfer and wait (bounded) for its requests, so no buffer they use is
        touched by UCX after we return it to the caller."""
        self.broken = True
        self.close()
        with contextlib.suppress(Exception):  # cancelled requests report their cancellation here
            wait_blocking(self.worker, reqs, time.monotonic() + CLOSE_WAIT_SECONDS, None, "closing")

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing an endpoint whose peer is gone may fail
            self.ep.close_blocking(period=10**8, max_attempts=1)


class UcxPlane(DataPlane):
    """Put/Get over UCX to one node (its advertised PlaneInfo). Thread-safe: a pool of connections."""

    name = "ucx"

    def __init__(
        self, pages_per_call: int, verify: bool, timeout: float, token: str | None, tls: bool, info: PlaneInfo | None
    ) -> None:
        self.pages_per_call = min(pages_per_call, proto.MAX_PAGES_PER_CALL)
        self.verify = verify
        self.timeout = timeout
        self.token = token
        self._refuse: str | None = None
        self.addr: UcxAddress | None = None
        if info is None or not info.address:
            self._refuse = "the node advertises no UCX address"
        elif tls and not info.tls and not _env_flag("KVSTORE_UCX_ALLOW_PLAINTEXT", False):
            self._refuse = (
                "this client uses TLS and the UCX plane is not encrypted "
                "(set KVSTORE_UCX_ALLOW_PLAINTEXT=1 on a trusted fabric)"
            )
        else:
            try:
                self.addr = proto.parse_address(info.address)
            except ValueError as exc:
                self._refuse = str(exc)
        self._free: list[UcxConnection] = []
        self._lock = threading.Lock()
        self._context: Any = None
        self._closed = False

    def _acquire(self, deadline: float) -> UcxConnection:
        if self._refuse is not None:
            raise PlaneUnavailable(f"UCX plane: {self._refuse}")
        with self._lock:
            while self._free:
                conn = self._free.pop()
                if conn.alive():
                    return conn
                conn.close()
            if self._context is None:
                try:
                    ucx = proto.load_ucxx()
                    features = (ucx.Feature.TAG, ucx.Feature.STREAM, ucx.Feature.WAKEUP)
                    self._context = (ucx, ucx.UCXContext({}, feature_flags=features))
                except Exception as exc:
                    raise PlaneUnavailable(f"UCX plane: cannot start UCX here: {exc}") from exc
        ucx, context = self._context
        assert self.addr is not None
        try:
            return UcxConnection(ucx, context, self.addr, self.token, deadline)
        except (UcxTimeout, UcxClosed, ProtocolError, ucx.UCXError) as exc:
            raise PlaneUnavailable(f"UCX plane: cannot connect to {self.addr.host}:{self.addr.port}: {exc}") from exc

    def _release(self, conn: UcxConnection) -> None:
        with self._lock:
            if not self._closed and conn.alive():
                self._free.append(conn)
                return
        conn.close()

    def _call(self, fn: Callable[[UcxConnection, float], Any]) -> Any:
        deadline = time.monotonic() + self.timeout
        conn = self._acquire(deadline)
        try:
            return fn(conn, deadline)
        except (UcxTimeout, UcxClosed, ProtocolError) as exc:
            conn.close_broken([])
            raise StreamError(f"UCX plane: {exc}") from exc
        except conn.ucx.UCXError as exc:  # the node went away mid-call (cancelled, reset): nothing usable came
            conn.close_broken([])
            raise Unavailable(f"UCX plane connection failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self._release(conn)

    def put_batch(self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[Buffer]) -> Exchange[tuple[int, int]]:
        req = pb.PutShmRequest(open=put_open_to_pb(op))
        for h, page in zip(hashes, pages, strict=True):
            view = memoryview(page).cast("B")
            req.pages.add(hash=h, payload_bytes=len(view), checksum=payload_checksum(view))
        reply = yield Blocking(lambda: self._call(lambda c, d: c.put(req, pages, d)))
        return reply.stored, reply.already_present

    def get_batch(self, namespace: str, hashes: Sequence[bytes], promote: bool) -> Exchange[list[FetchedPage]]:
        bufs: list[bytearray] = []

        def sink(i: int, n: int) -> memoryview:
            bufs.append(bytearray(n))
            return memoryview(bufs[-1])

        try:
            got = yield from self._get_batch(namespace, hashes, promote, sink)
        except PageCorrupt as exc:
            good = [FetchedPage(r.hash, r.tier, bufs[i]) for i, r in enumerate(exc.good)]  # type: ignore[attr-defined]
            raise PageCorrupt(exc.index, exc.hash, good) from None
        return [FetchedPage(ref.hash, ref.tier, bufs[i]) for i, ref in enumerate(got)]

    def get_into_batch(
        self, namespace: str, hashes: Sequence[bytes], buffers: Sequence[Buffer], promote: bool, first: int
    ) -> Exchange[list[PageRef]]:
        """Pages received straight into the caller's buffers (no copy besides the network's)."""
        return (yield from self._get_batch(namespace, hashes, promote, page_sink(buffers, first)))

    def _get_batch(self, namespace: str, hashes: Sequence[bytes], promote: bool, sink: Sink) -> Exchange[list[PageRef]]:
        req = pb.GetShmRequest(namespace=namespace, hashes=list(hashes), no_promote=not promote)
        views: list[memoryview] = []

        def keep(i: int, n: int) -> memoryview:
            views.append(sink(i, n))
            return views[-1]

        reply, lengths = yield Blocking(lambda: self._call(lambda c, d: c.get(req, keep, d)))
        if len(reply.pages) != len(lengths) or len(reply.pages) > len(hashes):
            raise StreamError(f"UCX GET: {len(lengths)} pages arrived, the reply lists {len(reply.pages)}")
        out = []
        for i, (want, p) in enumerate(zip(hashes, reply.pages, strict=False)):
            if p.hash != want:
                raise StreamError(f"page {i}: server sent an unexpected hash")
            if p.payload_bytes != lengths[i]:
                raise StreamError(f"page {i}: {lengths[i]} bytes arrived, {p.payload_bytes} announced (truncated)")
            if self.verify and payload_checksum(views[i]) != p.checksum:
                raise PageCorrupt(i, p.hash, out)
            out.append(PageRef(p.hash, TierKind(p.tier), lengths[i]))
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = list(self._free)
            self._free.clear()
        while idle:
            idle.pop().close()
