"""The node's side of the UCX plane: a listener and a worker on the node's event loop, one task per client.

Each connection serves one request at a time (a client opens several connections for concurrency); both
kinds run the node's put and get drivers (kvstore/node/drivers.py), as every plane does:
- PUT: the token must be a read-write one; each page's tagged message is received straight into its
  staged slot (one copy: the network's), and the transaction verifies and publishes the pages together.
  A page already stored is received into a scratch buffer and dropped (a UCX send cannot be cancelled by
  its receiver).
- GET: each page is sent straight from its lease (a DRAM slot, the verified bounce copy of an NVMe read,
  or device memory where the lease says the page is there and UCX can send CUDA memory) and the lease is
  held until the client has received it.
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
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf.message import DecodeError

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import DataLoss, InvalidArgument, KVStoreError
from kvstore.node.callers import Caller
from kvstore.node.drivers import PageHead, TransferStuck, drive_put, open_get
from kvstore.node.planes import ucx_device
from kvstore.node.planes.base import NodeServices, PlaneServer
from kvstore.security import AUTH_HEADER
from kvstore.stats import PlaneInfo
from kvstore.wire.streams import put_open_from_pb
from kvstore.wire.ucx import (
    FRAME,
    HELLO_TAG,
    MAX_CONTROL_BYTES,
    MAX_HELLO_BYTES,
    MAX_PAGES_PER_CALL,
    Hello,
    Kind,
    ProtocolError,
    TagKind,
    UcxAddress,
    error_body,
    format_address,
    frame,
    frame_length,
    load_ucxx,
    tag,
    unframe,
)
from kvstore.wire.ucx_progress import LoopProgress, UcxClosed, UcxTimeout

log = logging.getLogger(__name__)

SETTLE_SECONDS = 5.0  # after a failure: how long cancelled or closed transfers get to finish
CTRL_MASK = 0xFFFFFFFF_FF000000  # match a connection's control messages whatever their sequence number


class Connection:
    """One authenticated client endpoint. `closed` is set once, by the endpoint's close callback or by us."""

    def __init__(self, server: UcxPlaneServer, ep: Any, hello: Hello) -> None:
        self.server = server
        self.ep = ep
        self.cid = hello.cid
        self.metadata = ((AUTH_HEADER, f"Bearer {hello.token}"),) if hello.token else None
        self.closed = asyncio.Event()
        self.scratch = bytearray(0)  # where already-stored pages of a PUT are received and dropped
        self.stuck: list[Any] = []  # buffers a receive that never finished may still write: never reused
        ep.set_close_callback(self.closed.set)

    def alive(self) -> bool:
        return not self.closed.is_set() and self.ep.alive

    def close(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            with contextlib.suppress(Exception):
                self.ep.close_blocking(period=10**8, max_attempts=1)  # bounded: 100 ms


class UcxPlaneServer(PlaneServer):
    """The UCX listener and worker of a node (NodeConfig.ucx_enabled). `start` returns the PlaneInfo the
    node advertises: `host:port#<worker address>` (kvstore.wire.ucx.format_address)."""

    name = "ucx"

    def __init__(self, port: int, io_timeout: float) -> None:
        self.port = port
        self.io_timeout = io_timeout
        self.conns: dict[int, Connection] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._progress: LoopProgress | None = None
        self._listener: Any = None
        self._svc: NodeServices | None = None

    async def start(self, services: NodeServices) -> PlaneInfo:
        self.ucx = ucx = load_ucxx()
        self._svc = services
        loop = asyncio.get_running_loop()
        features = (ucx.Feature.TAG, ucx.Feature.STREAM, ucx.Feature.WAKEUP)
        self.context = ucx.UCXContext({}, feature_flags=features)
        self.worker = ucx.UCXWorker(self.context)
        self._progress = LoopProgress(self.worker, loop)
        self._listener = ucx.UCXListener.create(worker=self.worker, port=self.port, cb_func=self._on_conn_request)
        self.cuda = bool(self.context.cuda_support)  # UCX here can send device memory (HBM pages)
        self._spawn(self._accept_worker_hellos())
        addr = UcxAddress(services.advertise_host, self._listener.port, bytes(self.worker.address.tobytes()))
        log.info(
            "UCX plane listening on port %d (UCX %s; CUDA memory can be sent: %s)",
            self._listener.port,
            ".".join(map(str, ucx.get_ucx_version())),
            "yes" if self.cuda else "no",
        )
        return PlaneInfo(self.name, format_address(addr))

    async def stop(self) -> None:
        for conn in list(self.conns.values()):
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
        self, reqs: list[Any], what: str, conn: Connection | None = None, timeout: float | None = None
    ) -> None:
        """Wait for requests, failing early (UcxClosed) when the connection closes meanwhile."""
        assert self._progress is not None
        waiting = asyncio.ensure_future(
            self._progress.wait(reqs, self.io_timeout if timeout is None else timeout, what)
        )
        if conn is None:
            await waiting
            return
        closed = asyncio.ensure_future(conn.closed.wait())
        try:
            done, _ = await asyncio.wait({waiting, closed}, return_when=asyncio.FIRST_COMPLETED)
            if waiting in done:
                waiting.result()
                return
            raise UcxClosed(f"{what}: client endpoint closed")
        finally:
            for f in (waiting, closed):
                if not f.done():
                    f.cancel()
            await asyncio.gather(waiting, closed, return_exceptions=True)

    async def _settle(self, reqs: list[Any], conn: Connection) -> bool:
        """After a failure: make every request finish (cancel them, then close the endpoint); True when
        all did, so their buffers may be reused. A request that never finishes is reported, and its
        buffer must then stay out of use (the caller leaks it rather than risk a late write)."""
        pending = [r for r in reqs if not r.completed]
        if not pending:
            return True
        conn.close()  # UCXX cancels every request posted on a closed endpoint
        with contextlib.suppress(Exception):
            await self._wait(pending, "cancelling transfers", timeout=SETTLE_SECONDS)
        if all(r.completed for r in pending):
            return True
        log.error(
            "UCX connection %#x: %d transfer(s) did not finish after close; their buffers stay out of use",
            conn.cid,
            sum(not r.completed for r in pending),
        )
        return False

    # ---------------------------------------------------------------- connections

    def _on_conn_request(self, conn_request: Any) -> None:
        """Listener path (called from progress): the HELLO comes on the endpoint's stream."""
        ep = self._listener.create_endpoint_from_conn_request(conn_request, True)
        self._spawn(self._listener_hello(ep))

    async def _listener_hello(self, ep: Any) -> None:
        head = bytearray(FRAME.size)
        try:
            await self._wait([ep.stream_recv(self.ucx_array(head))], "HELLO header")
            total = frame_length(head)
            if total > FRAME.size + MAX_HELLO_BYTES:
                raise ProtocolError(f"a HELLO has at most {MAX_HELLO_BYTES} bytes, this one announces {total}")
            msg = head + bytearray(total - FRAME.size)
            if total > FRAME.size:
                await self._wait([ep.stream_recv(self.ucx_array(memoryview(msg)[FRAME.size :]))], "HELLO body")
            kind, _, _, body = unframe(msg)
            if kind is not Kind.HELLO:
                raise ProtocolError(f"first message must be a HELLO, got {kind.name}")
            hello = Hello.parse(body)
        except Exception as exc:  # any failure (protocol, timeout, UCX) closes it
            log.info("UCX listener connection dropped before its HELLO: %s", exc)
            with contextlib.suppress(Exception):
                ep.close_blocking(period=10**8, max_attempts=1)
            return
        await self._admit(ep, hello)

    async def _accept_worker_hellos(self) -> None:
        """Worker-address path: HELLOs arrive as tagged messages on the worker (no endpoint yet)."""
        buf = bytearray(MAX_HELLO_BYTES + FRAME.size)
        while True:
            try:
                await self._wait(
                    [self.worker.tag_recv(self.ucx_array(buf), self.ucx.UCXXTag(HELLO_TAG))],
                    "HELLO",
                    timeout=float("inf"),
                )
                kind, _, _, body = unframe(buf)
                if kind is not Kind.HELLO:
                    raise ProtocolError(f"expected a HELLO, got {kind.name}")
                hello = Hello.parse(body)
                if not hello.worker_address:
                    raise ProtocolError("a HELLO on the worker needs the client's worker address")
                ep = self.ucx.UCXEndpoint.create_from_worker_address(
                    self.worker, self.ucx.UCXAddress.create_from_buffer(hello.worker_address), hello.error_handling
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bad HELLO from one client must not stop the others
                log.info("UCX HELLO rejected: %s", exc)
                continue
            self._spawn(self._admit(ep, hello))

    async def _admit(self, ep: Any, hello: Hello) -> None:
        """Check the token (before anything else), register the connection, then serve it."""
        conn = Connection(self, ep, hello)
        try:
            svc = self._svc
            assert svc is not None
            if svc.callers.auth is not None:
                svc.callers.auth.role_of(conn.metadata)
            if hello.cid in self.conns:
                raise InvalidArgument("hello.cid", "connection id in use; pick another")
        except KVStoreError as exc:
            await self._reply_error(conn, 0, exc)
            conn.close()
            return
        self.conns[conn.cid] = conn
        try:
            await self._send(conn, frame(Kind.HELLO_OK, 0), 0)
            await self._serve(conn)
        except (UcxClosed, UcxTimeout, asyncio.CancelledError, self.ucx.UCXError) as exc:
            log.debug("UCX connection %#x closed: %s", conn.cid, exc)
        except Exception:
            log.exception("UCX connection %#x failed", conn.cid)
        finally:
            self.conns.pop(conn.cid, None)
            conn.close()

    async def _serve(self, conn: Connection) -> None:
        buf = bytearray(MAX_CONTROL_BYTES)
        ctrl = self.ucx.UCXXTag(tag(conn.cid, TagKind.CTRL_TO_NODE))
        while conn.alive():
            req = conn.ep.tag_recv(self.ucx_array(buf), ctrl, self.ucx.UCXXTagMask(CTRL_MASK))
            await self._wait([req], "request", conn, timeout=float("inf"))
            try:
                kind, _, seq, body = unframe(buf)
            except ProtocolError as exc:
                await self._reply_error(conn, 0, InvalidArgument("frame", str(exc)))
                return
            await self._handle(conn, kind, seq, body)

    async def _handle(self, conn: Connection, kind: Kind, seq: int, body: memoryview) -> None:
        try:
            if kind is Kind.PUT:
                reply = await self._put(conn, seq, pb.PutShmRequest.FromString(bytes(body)))
            elif kind is Kind.GET:
                reply = await self._get(conn, seq, pb.GetShmRequest.FromString(bytes(body)))
            else:
                raise InvalidArgument("kind", f"{kind.name} is not a request")
        except DecodeError as exc:
            await self._reply_error(conn, seq, InvalidArgument("body", f"not a {kind.name} request: {exc}"))
            return
        except KVStoreError as exc:
            await self._reply_error(conn, seq, exc)
            return
        await self._send(conn, frame(Kind.OK, seq, reply), seq)

    def _caller(self, conn: Connection, method: str) -> Caller:
        """The connection's caller for `method` (kvstore/node/callers.py); UCX carries no client certificate."""
        assert self._svc is not None
        return self._svc.callers.authenticate(method, conn.metadata, None)

    async def _send(self, conn: Connection, msg: bytes, seq: int) -> None:
        t = self.ucx.UCXXTag(tag(conn.cid, TagKind.CTRL_TO_CLIENT, seq))
        arr = self.ucx_array(bytearray(msg))  # referenced until the send completed: UCX reads it meanwhile
        req = conn.ep.tag_send(arr, t)
        try:
            await self._wait([req], "reply", conn)
        except (UcxClosed, UcxTimeout):
            await self._settle([req], conn)
            raise

    async def _reply_error(self, conn: Connection, seq: int, exc: KVStoreError) -> None:
        with contextlib.suppress(UcxClosed, UcxTimeout, Exception):
            await self._send(conn, frame(Kind.ERROR, seq, error_body(exc.status_name, str(exc))), seq)

    def ucx_array(self, buf: Any) -> Any:
        from ucxx._lib.arr import Array

        return Array(buf)

    # ---------------------------------------------------------------- requests

    async def _put(self, conn: Connection, seq: int, req: pb.PutShmRequest) -> bytes:
        caller = self._caller(conn, "Put")
        if not req.HasField("open"):
            raise InvalidArgument("open", "a PUT needs `open` (namespace and layout)")
        if not req.pages or len(req.pages) > MAX_PAGES_PER_CALL:
            raise InvalidArgument("pages", f"a PUT carries 1..{MAX_PAGES_PER_CALL} pages, got {len(req.pages)}")
        slices = list(req.pages)
        for i, p in enumerate(slices):
            if not p.checksum:  # a short message would leave stale bytes that only the checksum catches
                raise InvalidArgument(f"pages[{i}].checksum", "required on the UCX plane")
        op = put_open_from_pb(req.open)
        pages = _TaggedPages(self, conn, seq)
        stored, present = await drive_put(lambda: caller.view.begin_put(op), _heads(slices), pages, drain=False)
        return pb.PutResponse(stored=stored, already_present=present).SerializeToString()

    async def _get(self, conn: Connection, seq: int, req: pb.GetShmRequest) -> bytes:
        caller = self._caller(conn, "Get")
        if len(req.hashes) > MAX_PAGES_PER_CALL:
            raise InvalidArgument("hashes", f"a GET asks for at most {MAX_PAGES_PER_CALL} pages")
        out = pb.GetShmResponse()
        async with open_get(
            caller, req.namespace, list(req.hashes), not req.no_promote, receiver_verifies=True
        ) as leases:
            async for lease in leases:
                i = len(out.pages)
                t = self.ucx.UCXXTag(tag(conn.cid, TagKind.DATA_TO_CLIENT, seq, i))
                src = ucx_device.source(self.cuda, lease)  # referenced until the send completed
                send = conn.ep.tag_send(src, t)
                try:
                    await self._wait([send], f"GET page {i}", conn)
                except (UcxClosed, UcxTimeout, self.ucx.UCXError) as exc:
                    if not await self._settle([send], conn):
                        lease.keep()  # UCX may still read it: the page stays leased (pinned)
                    raise _lost(exc) from None
                out.pages.add(
                    hash=lease.hash, payload_bytes=len(lease.payload), checksum=lease.checksum, tier=int(lease.tier)
                )
        return out.SerializeToString()


async def _heads(slices: list[pb.ShmSlice]) -> AsyncIterator[PageHead]:
    for p in slices:
        yield PageHead(p.hash, p.payload_bytes, p.checksum)


class _TaggedPages:
    """A PUT's pages as the put driver reads them: page i is the tagged message (cid, DATA_TO_NODE, seq, i),
    received straight into its slot view (one copy: the network's), or into the connection's scratch
    buffer and dropped (a UCX send cannot be cancelled by its receiver). A receive that fails is settled
    (cancelled, its endpoint closed) before this returns; one that never settles is TransferStuck."""

    def __init__(self, server: UcxPlaneServer, conn: Connection, seq: int) -> None:
        self.server = server
        self.conn = conn
        self.seq = seq

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
        t = server.ucx.UCXXTag(tag(conn.cid, TagKind.DATA_TO_NODE, self.seq, index))
        arr = server.ucx_array(dst)  # referenced while UCX may write through it
        req = conn.ep.tag_recv(arr, t)
        try:
            # The client's sends are all posted, so this page's rendezvous request is already waiting.
            await server._wait([req], f"PUT page {index}", conn)
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
