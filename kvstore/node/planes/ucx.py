"""The node's side of the UCX plane: a listener and a worker on the node's event loop, one task per client.

Connecting (kvstore/wire/ucx.py says why): every connection opens through the listener. The node posts
a receive under a fresh nonce, sends the nonce (CHALLENGE), and takes the HELLO only under it, within
`io_timeout`; the token is checked first. A client that asked for worker-address lanes then gets an
endpoint from the node to its worker address (only now, after its token was accepted, so an
unauthenticated peer never makes the node connect anywhere). HELLO_OK carries the session secret all
later tags derive from; the intake (ucx_intake.py) drains every message no receive expects.

Each connection serves one request at a time (a client opens several connections for concurrency); every
kind runs the node's drivers (kvstore/node/drivers.py: the page-count and target checks, the put and get
drivers, the page-size answer), as every plane does:
- LAYOUT: a namespace's page size (`answer_page_size`), asked before a plain get sizes its receives.
- PUT: the token must be a read-write one; each page's tagged message is received straight into its
  staged slot (one copy: the network's), and the transaction verifies and publishes the pages together.
  A page already stored is received into a scratch buffer and dropped (a UCX send cannot be cancelled by
  its receiver).
- GET: every page's send is posted as its lease arrives, from the lease (a DRAM slot, the verified
  bounce copy of an NVMe read, or device memory where the lease says the page is there and UCX can send
  CUDA memory), without waiting for the one before; each lease is held until its send completed. Every
  receive the client posted is answered (a page, or an empty message past the pages sent), then the reply.
Nothing changes when a request fails: the transaction is aborted once the posted receive has finished
(completed, cancelled, or failed with its endpoint), so no late byte can land in a slot given back.

Timeouts (NodeConfig.ucx_io_timeout_seconds): a HELLO must arrive that soon after a connection opens,
and every transfer of a request must finish that soon, else the connection is closed. An authenticated
idle connection stays open until its peer goes away (UCX reports that on the endpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf.message import DecodeError

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import DataLoss, InvalidArgument, KVStoreError, Unavailable
from kvstore.node.callers import Caller
from kvstore.node.drivers import (
    PageHead,
    TransferStuck,
    answer_page_size,
    check_page_count,
    check_target_count,
    drive_put,
    open_get,
)
from kvstore.node.planes import ucx_device
from kvstore.node.planes.base import NodeServices, PlaneServer
from kvstore.node.planes.ucx_intake import Intake
from kvstore.pageformat import in_form
from kvstore.security import AUTH_HEADER
from kvstore.stats import PlaneInfo
from kvstore.wire import pack_held
from kvstore.wire.streams import checksum_form_from_pb, layout_from_pb, put_open_from_pb
from kvstore.wire.ucx import (
    CHALLENGE_TAG,
    FRAME,
    HELLO_REPLY_TAG,
    MAX_CONTROL_BYTES,
    MAX_HELLO_BYTES,
    MAX_PAGES_PER_CALL,
    NONCE,
    Hello,
    HelloOk,
    Kind,
    Lane,
    ProtocolError,
    SessionTags,
    UcxAddress,
    context_options,
    error_body,
    expect,
    format_address,
    frame,
    load_ucxx,
    new_nonce,
    pack_get_reply,
    unframe,
)
from kvstore.wire.ucx_progress import LoopProgress, UcxClosed, UcxTimeout

log = logging.getLogger(__name__)

SETTLE_SECONDS = 5.0  # after a failure: how long cancelled or closed transfers get to finish
MAX_PENDING_HELLOS = 256  # listener connections awaiting their HELLO at once; more are closed at once
# NOTE: a peer that sends stream or active messages to a node (which installs no handler for them)
# makes UCX log a warning with a backtrace per message: the node's UCX logs errors only, unless the
# operator sets UCX_LOG_LEVEL.
NODE_UCX_LOG_LEVEL = "error"

Respond = Callable[[bytes], None]


class Connection:
    """One authenticated client. `ep` carries replies and GET pages and tracks the node's receives (closing
    it cancels them); `hello_ep` is the listener endpoint the HELLO came on (the same one unless the
    client asked for worker-address lanes). Both stay open while the client is served: the listener
    endpoint is in peer-failure mode, so it reports a vanished client even where `ep` is not (shared
    memory has no peer-failure handler). `closed` is set once, by either endpoint's close callback or by us.
    `held`: early PUT pages the intake took for this connection (tag -> probe handle)."""

    def __init__(self, ep: Any, hello_ep: Any, hello: Hello) -> None:
        self.ep = ep
        self.hello_ep = hello_ep
        self.tags = SessionTags.new()
        self.metadata = ((AUTH_HEADER, f"Bearer {hello.token}"),) if hello.token else None
        self.closed = asyncio.Event()
        self.held: dict[int, Any] = {}
        self.scratch = bytearray(0)  # where already-stored pages of a PUT are received and dropped
        self.stuck: list[Any] = []  # buffers a receive that never finished may still write: never reused
        self.name = f"{id(self):#x}"
        ep.set_close_callback(self.closed.set)
        if hello_ep is not ep:
            hello_ep.set_close_callback(self.closed.set)

    def alive(self) -> bool:
        return not self.closed.is_set() and self.ep.alive and self.hello_ep.alive

    def overflow(self) -> None:
        """The intake held too many early messages for us: close (outside the intake's drain)."""
        self.closed.set()
        asyncio.get_running_loop().call_soon(self.close)

    def close(self) -> None:
        self.closed.set()
        for ep in {id(self.ep): self.ep, id(self.hello_ep): self.hello_ep}.values():
            _close(ep)


def _close(ep: Any) -> None:
    with contextlib.suppress(Exception):  # closing an endpoint whose peer is gone may fail
        ep.close_blocking(period=10**8, max_attempts=1)  # bounded: 100 ms


class UcxPlaneServer(PlaneServer):
    """The UCX listener and worker of a node (NodeConfig.ucx_enabled). `start` returns the PlaneInfo the
    node advertises: `host:port#<worker address>` (kvstore.wire.ucx.format_address)."""

    name = "ucx"

    def __init__(self, port: int, io_timeout: float) -> None:
        self.port = port
        self.io_timeout = io_timeout
        self.conns: set[Connection] = set()
        self.pending_hellos = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._progress: LoopProgress | None = None
        self._listener: Any = None
        self._svc: NodeServices | None = None
        self.intake: Intake | None = None

    async def start(self, services: NodeServices) -> PlaneInfo:
        os.environ.setdefault("UCX_LOG_LEVEL", NODE_UCX_LOG_LEVEL)  # read when UCX loads (below)
        self.ucx = ucx = load_ucxx()
        from ucxx._lib.arr import Array

        self.Array = Array
        self._svc = services
        loop = asyncio.get_running_loop()
        # Tagged messages only: a feature without a receive here (stream, AM) would be a buffer peers fill.
        features = (ucx.Feature.TAG, ucx.Feature.WAKEUP)
        self.context = ucx.UCXContext(context_options(os.environ), feature_flags=features)
        self.worker = ucx.UCXWorker(self.context)
        self.intake = Intake(ucx, self.worker, Array, max_held=services.config.max_pages_per_request + 1)
        self._progress = LoopProgress(self.worker, loop, self.intake.drain)
        self._listener = ucx.UCXListener.create(worker=self.worker, port=self.port, cb_func=self._on_conn_request)
        self.cuda = bool(self.context.cuda_support)  # UCX here can send device memory (HBM pages)
        self._empty = Array(bytearray(0))
        addr = UcxAddress(services.advertise_host, self._listener.port, bytes(self.worker.address.tobytes()))
        log.info(
            "UCX plane listening on port %d (UCX %s; CUDA memory can be sent: %s)",
            self._listener.port,
            ".".join(map(str, ucx.get_ucx_version())),
            "yes" if self.cuda else "no",
        )
        return PlaneInfo(self.name, format_address(addr))

    async def stop(self) -> None:
        for conn in list(self.conns):
            conn.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._progress is not None:
            self._progress.progress()
            self._progress.close()
        self._listener = None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wait(
        self, reqs: list[Any], what: str, closed: asyncio.Event | None, timeout: float | None = None
    ) -> None:
        """Wait for requests (io_timeout unless told), failing early (UcxClosed) once `closed` is set."""
        assert self._progress is not None
        await self._progress.wait(reqs, self.io_timeout if timeout is None else timeout, what, closed)

    async def _settle(self, reqs: list[Any], conn: Connection) -> bool:
        """After a failure: make every request finish (close the endpoints, which cancels what is posted
        on them); True when all did, so their buffers may be reused. A request that never finishes is
        reported, and its buffer must then stay out of use (the caller leaks it rather than risk a late
        write)."""
        pending = [r for r in reqs if not r.completed]
        if not pending:
            return True
        conn.close()
        with contextlib.suppress(Exception):
            await self._wait(pending, "cancelling transfers", None, timeout=SETTLE_SECONDS)
        if all(r.completed for r in pending):
            return True
        log.error(
            "UCX connection %s: %d transfer(s) did not finish after close; their buffers stay out of use",
            conn.name,
            sum(not r.completed for r in pending),
        )
        return False

    def _send(self, ep: Any, tag: int, msg: bytes) -> tuple[Any, Any]:
        """Post a send of a control message: (the request, its buffer, to be kept until it completed)."""
        arr = self.Array(bytearray(msg))
        return ep.tag_send(arr, self.ucx.UCXXTag(tag)), arr

    # ---------------------------------------------------------------- connections

    def _on_conn_request(self, conn_request: Any) -> None:
        """Listener (called from progress): an endpoint that must send its HELLO under our nonce."""
        ep = self._listener.create_endpoint_from_conn_request(conn_request, True)
        if self.pending_hellos >= MAX_PENDING_HELLOS:
            log.warning("UCX plane: %d connections await their HELLO; closing a new one", self.pending_hellos)
            asyncio.get_running_loop().call_soon(_close, ep)
            return
        self.pending_hellos += 1
        self._spawn(self._hello(ep))

    async def _hello(self, ep: Any) -> None:
        closed = asyncio.Event()
        ep.set_close_callback(closed.set)
        buf = bytearray(FRAME.size + MAX_HELLO_BYTES)
        try:
            nonce = new_nonce()
            arr = self.Array(buf)
            recv = ep.tag_recv(arr, self.ucx.UCXXTag(nonce))  # posted before the nonce is out
            send, _keep = self._send(ep, CHALLENGE_TAG, frame(Kind.CHALLENGE, 0, NONCE.pack(nonce)))
            await self._wait([recv, send], "HELLO", closed)
            hello = Hello.parse(expect(buf, Kind.HELLO, 0))
        except Exception as exc:  # any failure (protocol, timeout, UCX, a HELLO too long) closes it
            log.info("UCX connection dropped before its HELLO: %s", exc)
            _close(ep)
            return
        finally:
            self.pending_hellos -= 1
        try:
            svc = self._svc
            assert svc is not None
            if svc.callers.auth is not None:  # the token, before anything else
                svc.callers.auth.role_of(((AUTH_HEADER, f"Bearer {hello.token}"),) if hello.token else None)
            ep_out = self._data_endpoint(ep, hello)
        except KVStoreError as exc:
            reply = self._send(ep, HELLO_REPLY_TAG, frame(Kind.ERROR, 0, error_body(exc.status_name, str(exc))))
            with contextlib.suppress(Exception):
                await self._wait([reply[0]], "HELLO refusal", closed)
            _close(ep)
            return
        await self._run(Connection(ep_out, ep, hello))

    def _data_endpoint(self, ep: Any, hello: Hello) -> Any:
        """Where an accepted client is served: the listener endpoint, or an endpoint to its worker."""
        if not hello.worker_address:
            return ep
        try:
            address = self.ucx.UCXAddress.create_from_buffer(hello.worker_address)
            return self.ucx.UCXEndpoint.create_from_worker_address(self.worker, address, hello.error_handling)
        except Exception as exc:
            raise Unavailable(f"cannot reach the client's worker address: {exc}") from None

    async def _run(self, conn: Connection) -> None:
        self.conns.add(conn)
        try:
            await self._serve(conn)
        except (UcxClosed, UcxTimeout, asyncio.CancelledError, self.ucx.UCXError) as exc:
            log.debug("UCX connection %s closed: %s", conn.name, exc)
        except Exception:
            log.exception("UCX connection %s failed", conn.name)
        finally:
            self.conns.discard(conn)
            if self.intake is not None:
                self.intake.release(conn)
            conn.close()

    async def _serve(self, conn: Connection) -> None:
        """Requests in order: seq 1, 2, ... (see `_Requests`)."""
        turn = _Requests(self, conn)
        assert self._svc is not None
        ok = HelloOk(conn.tags.secret, self._svc.config.max_page_bytes)
        hello_ok = self._send(conn.ep, HELLO_REPLY_TAG, frame(Kind.HELLO_OK, 0, ok.pack()))
        await self._wait([hello_ok[0]], "HELLO_OK", conn.closed)
        while conn.alive():
            await self._wait([turn.recv], "request", conn.closed, timeout=float("inf"))
            try:
                kind, _, got, body = unframe(turn.ctrl)
                if got != turn.seq:
                    raise ProtocolError(f"request {got}, expected {turn.seq}")
            except ProtocolError as exc:
                turn.respond(frame(Kind.ERROR, turn.seq, error_body("INVALID_ARGUMENT", f"frame: {exc}")))
                await turn.finish()
                return  # out of step: close
            await self._handle(conn, kind, turn.seq, body, turn.respond)
            await turn.finish()

    def _next_request(self, conn: Connection, seq: int, ctrl_arr: Any) -> Any:
        assert self.intake is not None
        if not self.intake.open_range(conn.tags.tag(Lane.PUT_PAGES, seq), conn):
            raise UcxClosed("session tag range collides with another connection's")
        return conn.ep.tag_recv(ctrl_arr, self.ucx.UCXXTag(conn.tags.tag(Lane.CONTROL, seq)))

    def _end_request(self, conn: Connection, seq: int) -> None:
        assert self.intake is not None
        self.intake.close_range(conn.tags.tag(Lane.PUT_PAGES, seq), conn)

    async def _handle(self, conn: Connection, kind: Kind, seq: int, body: memoryview, respond: Respond) -> None:
        """Run one request; it responds exactly once (OK, or ERROR with the failure's status)."""
        responded = False

        def once(msg: bytes) -> None:
            nonlocal responded
            if not responded:
                responded = True
                respond(msg)

        try:
            if kind is Kind.PUT:
                reply = await self._put(conn, seq, pb.BulkPutRequest.FromString(bytes(body)))
                once(frame(Kind.OK, seq, reply))
            elif kind is Kind.GET:
                await self._get(conn, seq, pb.BulkGetRequest.FromString(bytes(body)), once)
            elif kind is Kind.LAYOUT:
                once(frame(Kind.OK, seq, answer_page_size(self._caller(conn, "Get"), body)))
            else:
                raise InvalidArgument("kind", f"{kind.name} is not a request")
        except DecodeError as exc:
            once(frame(Kind.ERROR, seq, error_body("INVALID_ARGUMENT", f"body: not a {kind.name} request: {exc}")))
        except KVStoreError as exc:
            once(frame(Kind.ERROR, seq, error_body(exc.status_name, str(exc))))

    def _caller(self, conn: Connection, method: str) -> Caller:
        """The connection's caller for `method` (kvstore/node/callers.py); UCX carries no client certificate."""
        assert self._svc is not None
        return self._svc.callers.authenticate(method, conn.metadata, None)

    # ---------------------------------------------------------------- requests

    async def _put(self, conn: Connection, seq: int, req: pb.BulkPutRequest) -> bytes:
        caller = self._caller(conn, "Put")
        if not req.HasField("open"):
            raise InvalidArgument("open", "a PUT needs `open` (namespace and layout)")
        assert self._svc is not None
        check_page_count(len(req.pages), self._svc.config, "pages", put=True, wire_limit=MAX_PAGES_PER_CALL)
        slices = list(req.pages)
        for i, p in enumerate(slices):
            if not p.checksum:  # a short message would leave stale bytes that only the checksum catches
                raise InvalidArgument(f"pages[{i}].checksum", "required on the UCX plane")
        op = put_open_from_pb(req.open)
        pages = _TaggedPages(self, conn, conn.tags.tag(Lane.PUT_PAGES, seq))
        done = await drive_put(lambda: (caller, op), _heads(slices), pages, drain=False)
        return pb.PutResponse(
            stored=done.stored, already_present=done.present, held=pack_held(done.held)
        ).SerializeToString()

    async def _get(self, conn: Connection, seq: int, req: pb.BulkGetRequest, respond: Respond) -> None:
        """Answer every receive the client posted (page i, or an empty message), then respond; the leases
        of pages in flight are held until their sends completed."""
        assert self._svc is not None
        n = check_page_count(len(req.hashes), self._svc.config, "hashes", put=False, wire_limit=MAX_PAGES_PER_CALL)
        check_target_count(len(req.targets), n)
        caps = [t.size for t in req.targets]
        bigger = 0
        base = conn.tags.tag(Lane.GET_PAGES, seq)
        out = pb.BulkGetResponse()
        sends: list[Any] = []
        sources: list[Any] = []  # what the sends read from: referenced until they completed
        releases: list[Callable[[], None]] = []
        reply = frame(Kind.OK, seq)
        try:
            try:
                caller = self._caller(conn, "Get")
                form = checksum_form_from_pb(req.checksum_form, "checksum_form")
                expect = layout_from_pb(req.layout, "layout") if req.HasField("layout") else None
                async with open_get(
                    caller, req.namespace, list(req.hashes), not req.no_promote, receiver_verifies=True, expect=expect
                ) as leases:
                    async for lease in leases:
                        i = len(out.pages)
                        if len(lease.payload) > caps[i]:  # the client's receive cannot hold it: say how big
                            bigger = len(lease.payload)
                            break
                        sources.append(ucx_device.source(self.cuda, lease))
                        releases.append(lease.detach())
                        sends.append(conn.ep.tag_send(sources[-1], self.ucx.UCXXTag(base | i)))
                        out.pages.add(
                            hash=lease.hash,
                            payload_bytes=len(lease.payload),
                            checksum=in_form(lease.checksum, form, req.namespace, lease.hash),
                            tier=int(lease.tier),
                        )
                reply = frame(Kind.OK, seq, pack_get_reply(bigger, out.SerializeToString()))
            except KVStoreError as exc:
                reply = frame(Kind.ERROR, seq, error_body(exc.status_name, str(exc)))
            for i in range(len(out.pages), n):  # the client's other receives complete empty
                sends.append(conn.ep.tag_send(self._empty, self.ucx.UCXXTag(base | i)))
            respond(reply)
            try:
                await self._wait(sends, "GET pages", conn.closed)
            except (UcxClosed, UcxTimeout, self.ucx.UCXError) as exc:
                if not await self._settle(sends, conn):
                    releases.clear()  # UCX may still read them: the pages stay leased (pinned)
                raise _lost(exc) from None
        finally:
            for release in releases:
                release()


class _Requests:
    """The request sequence of one connection. Request seq+1's control receive is posted (and its PUT
    page range opened in the intake) in `respond`, before request seq's reply leaves, so nothing a
    well-behaved client sends is unexpected but PUT pages, which the intake holds for their range."""

    def __init__(self, server: UcxPlaneServer, conn: Connection) -> None:
        self.server = server
        self.conn = conn
        self.ctrl = bytearray(MAX_CONTROL_BYTES)
        self._ctrl_arr = server.Array(self.ctrl)
        self.seq = 1
        self.recv = server._next_request(conn, self.seq, self._ctrl_arr)
        self._sent: list[tuple[Any, Any]] = []

    def respond(self, msg: bytes) -> None:
        """End request `seq` with `msg` (OK or ERROR frame): the next request's receive first."""
        server, conn = self.server, self.conn
        server._end_request(conn, self.seq)
        self.recv = server._next_request(conn, self.seq + 1, self._ctrl_arr)
        self._sent.append(server._send(conn.ep, conn.tags.tag(Lane.REPLY, self.seq), msg))

    async def finish(self) -> None:
        """After the handler: its reply has left; the next request is seq + 1."""
        assert self._sent, "a request ended without a reply"
        await self.server._wait([req for req, _ in self._sent], "reply", self.conn.closed)
        self._sent.clear()
        self.seq += 1


async def _heads(slices: list[pb.BulkPage]) -> AsyncIterator[PageHead]:
    for p in slices:
        yield PageHead(p.hash, p.payload_bytes, p.checksum)


class _TaggedPages:
    """A PUT's pages as the put driver reads them: page i is the message tagged `base | i`, received
    straight into its slot view (one copy: the network's), or into the connection's scratch buffer and
    dropped (a UCX send cannot be cancelled by its receiver). A receive that fails is settled
    (cancelled, its endpoint closed) before this returns; one that never settles is TransferStuck."""

    def __init__(self, server: UcxPlaneServer, conn: Connection, base: int) -> None:
        self.server = server
        self.conn = conn
        self.base = base

    async def read_into(self, index: int, view: memoryview) -> None:
        await self._receive(index, view)

    async def discard(self, index: int, nbytes: int) -> None:
        conn = self.conn
        if len(conn.scratch) < nbytes:
            conn.scratch = bytearray(nbytes)
        try:
            await self._receive(index, memoryview(conn.scratch)[:nbytes])
        except TransferStuck:
            conn.stuck.append(conn.scratch)  # never reused: UCX may still write into it
            conn.scratch = bytearray(0)
            raise _lost(UcxTimeout("a dropped page's receive did not finish")) from None

    async def _receive(self, index: int, dst: memoryview) -> None:
        server, conn = self.server, self.conn
        assert server.intake is not None
        arr = server.Array(dst)  # referenced while UCX may write through it
        req = server.intake.receive(conn, conn.ep, SessionTags.page(self.base, index), arr)
        try:
            await server._wait([req], f"PUT page {index}", conn.closed)
        except BaseException as exc:
            if not await server._settle([req], conn):
                conn.stuck.append(arr)
                raise TransferStuck(f"UCX receive of PUT page {index} did not finish after close") from None
            if isinstance(exc, (UcxClosed, UcxTimeout, server.ucx.UCXError)):
                raise _lost(exc) from None
            raise


def _lost(exc: Exception) -> KVStoreError:
    """A failed page transfer as the client sees it (if its endpoint still listens): DATA_LOSS."""
    return DataLoss(f"UCX page transfer failed ({type(exc).__name__}: {exc}); nothing was stored")
