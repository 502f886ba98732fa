"""The client's side of the UCX plane: a pool of connections (one UCX worker each) and Put/Get as exchanges.

A call takes a connection from the pool (opening one when none is free, so concurrent callers of one
client never share a worker: UCX workers are single-threaded here) and performs the whole transfer as
one `Blocking` operation: on the caller's thread in `KVStoreClient`, in a worker thread in
`AsyncKVStoreClient`. Every wait is bounded by the client's timeout.

One request costs a few Python calls per page and one wait: a GET posts the reply's receive and every
page's receive (into the caller's buffers for get_into; for get, into fresh buffers of the namespace's
page size, asked of the node once per namespace: `base.page_size`, the rule the same-host plane follows
too), then sends the request; a PUT posts the request and every page's send at once. Tags are the
session's (kvstore/wire/ucx.py).

Environment (client side):
- KVSTORE_UCX_CONNECT: "worker" (default; after the HELLO on the node's listener, both sides open
  endpoints to each other's worker address, so UCX may use shared memory or RDMA lanes) or "listener"
  (everything on the listener endpoint: a sockaddr connection).
- KVSTORE_UCX_ERROR_HANDLING: "1" (default) the worker-address endpoints carrying the data are opened in
  UCX's peer-failure mode, so a transfer to a peer that died is cancelled when its endpoint closes (UCX
  then picks TCP or RDMA lanes: its shared-memory transports have no peer-failure handler). "0" opens
  them without it, so UCX may pick shared memory on one host (~1.5x the GB/s on loopback here); a
  vanished peer is still noticed at once by the listener endpoint the HELLO came on, which both sides
  keep open for that, but a GET the client abandons mid-way leaves the node's sends pending for good
  and the pages they read pinned (UCX cannot cancel them). Only for trusted single-host setups.
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
from kvstore.client.exchange import Abort, Blocking, Exchange
from kvstore.client.planes.base import DataPlane, PutResult, page_size
from kvstore.client.planes.pool import ReceivePool
from kvstore.errors import KVStoreError, PageCorrupt, PlaneUnavailable, StreamError, Unavailable, from_status
from kvstore.layout import PageLayout
from kvstore.names import Buffer, TierKind
from kvstore.pageformat import wire_checksum
from kvstore.stats import PlaneInfo
from kvstore.wire import PutOpen, parse_page_size, unpack_held
from kvstore.wire import ucx as proto
from kvstore.wire.streams import FetchedPage, PageRef, layout_to_pb, put_open_to_pb
from kvstore.wire.ucx import Hello, HelloOk, Kind, Lane, ProtocolError, SessionTags, UcxAddress
from kvstore.wire.ucx_progress import UcxClosed, UcxTimeout, wait_blocking

CLOSE_WAIT_SECONDS = 2.0  # how long closing an endpoint waits for its cancelled transfers
ERROR_GRACE_SECONDS = 1.0  # after an ERROR reply: how long the node's empty answers to our receives may take
MAX_PAGE_BYTES = 1 << 30  # a page the node announces above this is a protocol error, not an allocation

STUCK: list[list[Any]] = []  # buffers of receives that never finished after close (see close_broken)

Check = Callable[[int, pb.BulkPage], None]  # (page index, what the reply says of it): raises if it is wrong


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    return default if raw is None else raw.strip().lower() in {"1", "true", "yes", "on"}


class UcxConnection:
    """One authenticated session with a node, on its own worker; used by one thread at a time (the pool
    sees to it).

    Invariant: `broken` is set once a transfer failed in a way that may leave messages in flight; a
    broken connection is closed, never reused.
    """

    def __init__(self, ucx: Any, context: Any, addr: UcxAddress, token: str | None, deadline: float) -> None:
        from ucxx._lib.arr import Array

        self.ucx, self.Array = ucx, Array
        self.worker = ucx.UCXWorker(context)
        self.worker.init_blocking_progress_mode()
        self.seq = 0
        self.broken = False
        self.aborted = False
        self.ctrl = bytearray(proto.MAX_CONTROL_BYTES)
        self.ctrl_arr = Array(self.ctrl)
        eh = _env_flag("KVSTORE_UCX_ERROR_HANDLING", True)
        by_address = os.environ.get("KVSTORE_UCX_CONNECT", "worker").lower() != "listener" and bool(addr.worker)
        self.path = "worker-address" if by_address else "listener"
        hello_ep = ucx.UCXEndpoint.create(self.worker, addr.host, addr.port, True)
        self.ep = self.watch = hello_ep  # `watch`: the listener endpoint, kept open to notice a vanished node
        try:
            challenge = bytearray(proto.FRAME.size + proto.NONCE.size)
            keep = [Array(challenge)]
            got = hello_ep.tag_recv(keep[0], ucx.UCXXTag(proto.CHALLENGE_TAG))
            self._wait([got], deadline, "UCX CHALLENGE")
            nonce = proto.parse_nonce(proto.expect(challenge, Kind.CHALLENGE, 0))
            mine = bytes(self.worker.address.tobytes()) if by_address else b""
            keep.append(
                Array(bytearray(proto.frame(Kind.HELLO, 0, Hello(token, mine, eh if by_address else True).pack())))
            )
            reply = hello_ep.tag_recv(self.ctrl_arr, ucx.UCXXTag(proto.HELLO_REPLY_TAG))
            send = hello_ep.tag_send(keep[1], ucx.UCXXTag(nonce))
            self._wait([send, reply], deadline, "UCX HELLO")
            ok = HelloOk.parse(self._reply_body(Kind.HELLO_OK, 0))
            self.tags = SessionTags(ok.secret)
            self.max_page_bytes = min(ok.max_page_bytes, MAX_PAGE_BYTES)
            if by_address:
                self.ep = ucx.UCXEndpoint.create_from_worker_address(
                    self.worker, ucx.UCXAddress.create_from_buffer(addr.worker), eh
                )
        except BaseException:
            _close(hello_ep)
            raise

    def alive(self) -> bool:
        return not self.broken and not self.aborted and self.ep.alive and self.watch.alive

    def abort(self) -> None:
        """From another thread: the caller gave up; the wait in progress ends within one poll (EVENT_POLL_MS)
        as if the endpoint had closed, and the transfer's requests are cancelled and waited for (close_broken)."""
        self.aborted = True

    def _wait(self, reqs: Sequence[Any], deadline: float, what: str) -> None:
        ep, watch = self.ep, self.watch
        wait_blocking(self.worker, reqs, deadline, lambda: not self.aborted and ep.alive and watch.alive, what)

    def _reply_body(self, want: Kind, seq: int) -> memoryview:
        """The body of the reply just received; raises the node's error as its exception class."""
        kind, _, got_seq, body = proto.unframe(self.ctrl)
        if got_seq != seq & 0xFFFFFFFF:
            raise ProtocolError(f"reply to request {got_seq}, expected {seq}")
        if kind is Kind.ERROR:
            raise from_status(*proto.parse_error(body))
        if kind is not want:
            raise ProtocolError(f"expected {want.name}, got {kind.name}")
        return body

    def _request(self, kind: Kind, body: bytes) -> tuple[int, Any, list[Any]]:
        """Post the reply's receive, then send the request; (seq, reply receive, [keep-alives])."""
        self.seq += 1
        seq, tags = self.seq, self.tags
        reply = self.ep.tag_recv(self.ctrl_arr, self.ucx.UCXXTag(tags.tag(Lane.REPLY, seq)))
        msg = self.Array(bytearray(proto.frame(kind, seq, body)))
        send = self.ep.tag_send(msg, self.ucx.UCXXTag(tags.tag(Lane.CONTROL, seq)))
        return seq, reply, [msg, send]

    def page_size(self, ask: bytes, deadline: float) -> int:
        """The node's answer to a page-size ask (`kvstore.wire.page_size_ask`): a LAYOUT request."""
        seq, reply, keep = self._request(Kind.LAYOUT, ask)
        self._wait([reply, keep[1]], deadline, "UCX LAYOUT")
        return parse_page_size(self._reply_body(Kind.OK, seq), self.max_page_bytes)

    def put(self, req: pb.BulkPutRequest, pages: Sequence[Buffer], deadline: float) -> pb.PutResponse:
        seq, reply, keep = self._request(Kind.PUT, req.SerializeToString())
        base = self.tags.tag(Lane.PUT_PAGES, seq)
        sends = []
        for i, page in enumerate(pages):
            arr = self.Array(memoryview(page).cast("B"))
            keep.append(arr)
            sends.append(self.ep.tag_send(arr, self.ucx.UCXXTag(base | i)))
        try:
            self._wait([reply], deadline, "UCX PUT")
            body = self._reply_body(Kind.OK, seq)
            self._wait(sends, deadline, "UCX PUT pages")  # done: the node received them all before replying
            return pb.PutResponse.FromString(bytes(body))
        finally:
            if not all(s.completed for s in sends):  # an error reply before the node took every page
                self.close_broken(sends, keep)

    def get(
        self, req: pb.BulkGetRequest, sink: Callable[[int], memoryview], check: Check, deadline: float
    ) -> tuple[pb.BulkGetResponse, int]:
        """One GET: page i lands in sink(i) (a buffer of the capacity `req` announced); returns the reply
        and the size of the first page that did not fit its receive (0: none).
        The request leaves first, then each page's receive is posted as its buffer is made: a page that
        arrives before its receive waits in UCX as a rendezvous request (a few bytes), so making the
        buffers overlaps the node's work. The node answers every receive (page or empty) and replies
        (the reply, small, usually overtakes the pages' bytes); `check(i, slice)` runs on each page the
        reply lists as soon as its bytes are in, while they are still in cache. Its first error is
        raised once every receive finished."""
        seq, reply, keep = self._request(Kind.GET, req.SerializeToString())
        base = self.tags.tag(Lane.GET_PAGES, seq)
        recvs = []
        try:
            for i in range(len(req.hashes)):
                arr = self.Array(sink(i))
                keep.append(arr)
                recvs.append(self.ep.tag_recv(arr, self.ucx.UCXXTag(base | i)))
            self._wait([reply, keep[1]], deadline, "UCX GET")
            try:
                body = self._reply_body(Kind.OK, seq)
            except KVStoreError:  # the node answers our receives before an error too: let them finish
                with contextlib.suppress(UcxTimeout, UcxClosed):
                    self._wait(recvs, min(deadline, time.monotonic() + ERROR_GRACE_SECONDS), "UCX GET")
                raise
            bigger, listed = proto.parse_get_reply(body)
            out = pb.BulkGetResponse.FromString(bytes(listed))  # parsed before the next request reuses ctrl
            if len(out.pages) > len(recvs):
                raise ProtocolError(f"the reply lists {len(out.pages)} pages for {len(recvs)} hashes")
            failure: KVStoreError | None = None
            for i, recv in enumerate(recvs):
                self._wait([recv], deadline, "UCX GET pages")
                if failure is None and i < len(out.pages):
                    try:
                        check(i, out.pages[i])
                    except KVStoreError as exc:
                        failure = exc
            if failure is not None:
                raise failure
            return out, bigger
        finally:
            if len(recvs) < len(req.hashes) or not all(r.completed for r in recvs):
                self.close_broken(recvs, keep)

    def close_broken(self, reqs: Sequence[Any], buffers: Sequence[Any] = ()) -> None:
        """Close after a failed transfer and wait (bounded) for its requests, so no buffer they use is
        touched by UCX after we return it to the caller (closing the endpoint cancels its receives). The
        `buffers` of a request that still did not finish stay referenced for good (`STUCK`): a late write
        must never land in a pool block another get was handed."""
        self.broken = True
        self.close()
        with contextlib.suppress(Exception):  # cancelled requests report their cancellation here
            wait_blocking(self.worker, reqs, time.monotonic() + CLOSE_WAIT_SECONDS, None, "closing")
        if not all(r.completed for r in reqs):
            STUCK.append(list(buffers))

    def close(self) -> None:
        _close(self.ep)
        if self.watch is not self.ep:
            _close(self.watch)


def _close(ep: Any) -> None:
    with contextlib.suppress(Exception):  # closing an endpoint whose peer is gone may fail
        ep.close_blocking(period=10**8, max_attempts=1)


class UcxPlane(DataPlane):
    """Put/Get over UCX to one node (its advertised PlaneInfo). Thread-safe: a pool of connections."""

    name = "ucx"

    def __init__(
        self,
        pages_per_call: int,
        *,
        verify: bool,
        timeout: float,
        token: str | None,
        tls: bool,
        info: PlaneInfo | None,
        received: ReceivePool | None = None,
    ) -> None:
        self.received = ReceivePool() if received is None else received  # where a plain get's pages land
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
        self._page_bytes: dict[str, int] = {}  # a namespace's page size, asked (`base.page_size`)

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
                    options = proto.context_options(os.environ)
                    self._context = (ucx, ucx.UCXContext(options, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP)))
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

    def _call(self, fn: Callable[[UcxConnection, float], Any], abort: Abort) -> Any:
        deadline = time.monotonic() + self.timeout
        conn = self._acquire(deadline)
        forget = abort.on_abort(conn.abort)
        try:
            return fn(conn, deadline)
        except (UcxTimeout, UcxClosed, ProtocolError) as exc:
            conn.close_broken([])
            raise StreamError(f"UCX plane: {exc}") from exc
        except conn.ucx.UCXError as exc:  # the node went away mid-call (cancelled, reset): nothing usable came
            conn.close_broken([])
            raise Unavailable(f"UCX plane connection failed: {type(exc).__name__}: {exc}") from exc
        finally:
            forget()
            self._release(conn)

    def put_batch(self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[Buffer]) -> Exchange[PutResult]:
        req = pb.BulkPutRequest(open=put_open_to_pb(op))
        for h, page in zip(hashes, pages, strict=True):
            view = memoryview(page).cast("B")
            req.pages.add(hash=h, payload_bytes=len(view), checksum=wire_checksum(op.namespace, h, view))
        abort = Abort()
        reply = yield Blocking(lambda: self._call(lambda c, d: c.put(req, pages, d), abort), abort)
        return PutResult(reply.stored, reply.already_present, unpack_held(reply.held, len(hashes)))

    def get_batch(
        self, namespace: str, hashes: Sequence[bytes], promote: bool, expect: PageLayout | None = None
    ) -> Exchange[list[FetchedPage]]:
        """Pages received into fresh buffers of the namespace's page size (`base.page_size`: asked of the node
        on this connection the first time, remembered after). A reply saying the first page that did not fit
        is bigger (its `next_page_bytes`) means the size remembered is stale (the node restarted and the
        namespace was laid out anew): it is forgotten and asked again, once."""

        def fetch(conn: UcxConnection, deadline: float) -> list[FetchedPage]:
            out: list[FetchedPage] = []
            for _ in range(2):
                size = page_size(self._page_bytes, namespace, hashes[0], lambda ask: conn.page_size(ask, deadline))
                rest = hashes[len(out) :]
                fresh = _Blocks(self.received, size)
                req = _get_request(namespace, rest, promote, expect)
                req.targets.extend(pb.BulkTarget(size=size) for _ in rest)
                checked = _Checked(namespace, rest, fresh.views.__getitem__, self.verify)
                try:
                    _, bigger = conn.get(req, fresh, checked, deadline)
                except PageCorrupt as exc:
                    good = fresh.pages(exc.good)  # type: ignore[arg-type]
                    raise PageCorrupt(len(out) + exc.index, exc.hash, out + good) from None
                out += fresh.pages(checked.refs)
                if not bigger:
                    return out
                if not size < bigger <= conn.max_page_bytes:
                    raise ProtocolError(f"the node announced a {bigger}-byte page ({size} expected)")
                self._page_bytes.pop(namespace, None)
            raise ProtocolError(f"the node announced a {bigger}-byte page after answering {size} for {namespace!r}")

        abort = Abort()
        return (yield Blocking(lambda: self._call(fetch, abort), abort))

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
        """Pages received straight into the caller's buffers (no copy besides the network's); the node sends
        a page only into a buffer that holds it, else stops there and the call is a ValueError naming it."""
        dests = [memoryview(b).cast("B") for b in buffers]
        req = _get_request(namespace, hashes, promote, expect)
        req.targets.extend(pb.BulkTarget(size=len(d)) for d in dests)

        def fetch(conn: UcxConnection, deadline: float) -> tuple[list[PageRef], int]:
            checked = _Checked(namespace, hashes, dests.__getitem__, self.verify)
            _, bigger = conn.get(req, dests.__getitem__, checked, deadline)
            return checked.refs, bigger

        abort = Abort()
        refs, bigger = yield Blocking(lambda: self._call(fetch, abort), abort)
        if bigger:
            k = len(refs)
            raise ValueError(f"buffers[{first + k}]: {len(dests[k])} bytes cannot hold a {bigger}-byte page")
        return refs

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = list(self._free)
            self._free.clear()
        while idle:
            idle.pop().close()


def _get_request(
    namespace: str, hashes: Sequence[bytes], promote: bool, expect: PageLayout | None = None
) -> pb.BulkGetRequest:
    req = pb.BulkGetRequest(
        namespace=namespace, hashes=list(hashes), no_promote=not promote, checksum_form=pb.CHECKSUM_FORM_KEYED
    )
    if expect is not None:
        req.layout.CopyFrom(layout_to_pb(expect))
    return req


class _Checked:
    """Checks each page a GET reply lists, in order, as its bytes arrive: the hash asked for, a size its
    receive held, and (with `verify`) its checksum, bound to the namespace and hash asked for; `refs` are
    the pages that passed. PageCorrupt at the first that fails its checksum carries the ones before it."""

    def __init__(
        self, namespace: str, hashes: Sequence[bytes], dest: Callable[[int], memoryview], verify: bool
    ) -> None:
        self.namespace = namespace
        self.hashes = hashes
        self.dest = dest
        self.verify = verify
        self.refs: list[PageRef] = []

    def __call__(self, i: int, p: pb.BulkPage) -> None:
        if p.hash != self.hashes[i]:
            raise StreamError(f"page {i}: server sent an unexpected hash")
        dest = self.dest(i)
        if p.payload_bytes > len(dest):
            raise StreamError(f"page {i}: {p.payload_bytes} bytes announced, the receive held {len(dest)}")
        if self.verify and wire_checksum(self.namespace, self.hashes[i], dest[: p.payload_bytes]) != p.checksum:
            raise PageCorrupt(i, p.hash, list(self.refs))
        self.refs.append(PageRef(p.hash, TierKind(p.tier), p.payload_bytes))


class _Blocks:
    """The receive buffers of one round of a plain get: blocks of the client's receive pool (pre-faulted,
    reused; kvstore/client/planes/pool.py), taken one by one as the receives are posted, all `size` bytes;
    `pages` hands them out cut to their pages' lengths (a namespace's pages share one size, so they rarely
    are cut). A block no page is handed out in goes back to the pool once this round is dropped."""

    def __init__(self, pool: ReceivePool, size: int) -> None:
        self.pool = pool
        self.size = size
        self.views: list[memoryview] = []

    def __call__(self, i: int) -> memoryview:
        self.views.append(self.pool.take(self.size))
        return self.views[-1]

    def pages(self, refs: list[PageRef]) -> list[FetchedPage]:
        return [
            FetchedPage(ref.hash, ref.tier, view[: ref.nbytes]) for view, ref in zip(self.views, refs, strict=False)
        ]
