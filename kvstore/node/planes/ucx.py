"""The node's side of the UCX plane: a listener and a worker on the node's event loop, one task per client.

Connecting (kvstore/wire/ucx.py says why): every connection opens through the listener. The node posts
a receive under a fresh nonce, sends the nonce (CHALLENGE), and takes the HELLO only under it, within
`io_timeout`; the token is checked first. A client that asked for worker-address lanes then gets an
endpoint from the node to its worker address (only now, after its token was accepted, so an
unauthenticated peer never makes the node connect anywhere). HELLO_OK carries the session secret all
later tags derive from; the intake (ucx_intake.py) drains every message no receive expects.

Each connection serves one request at a time (a client opens several connections for concurrency): this
module is the listener, the HELLO and the loop over a connection's requests; the requests (LAYOUT, PUT, GET:
the node's drivers, as every plane runs them) are ucx_requests.py, the connection and how its transfers are
waited for and settled ucx_session.py. Nothing changes when a request fails (ucx_requests.py says how).

Timeouts (NodeConfig.ucx_io_timeout_seconds): a HELLO must arrive that soon after a connection opens,
and every transfer of a request must finish that soon, else the connection is closed. An authenticated
idle connection stays open until its peer goes away (UCX reports that on the endpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

from kvstore.errors import KVStoreError, Unavailable
from kvstore.node.planes import ucx_requests as requests
from kvstore.node.planes.base import NodeServices, PlaneServer
from kvstore.node.planes.ucx_intake import Intake
from kvstore.node.planes.ucx_session import Connection, Transfers, close_endpoint
from kvstore.security import AUTH_HEADER
from kvstore.stats import PlaneInfo
from kvstore.wire.ucx import (
    CHALLENGE_TAG,
    FRAME,
    HELLO_REPLY_TAG,
    MAX_HELLO_BYTES,
    NONCE,
    Hello,
    HelloOk,
    Kind,
    ProtocolError,
    UcxAddress,
    context_options,
    error_body,
    expect,
    format_address,
    frame,
    load_ucxx,
    new_nonce,
    unframe,
)
from kvstore.wire.ucx_progress import LoopProgress, UcxClosed, UcxTimeout

log = logging.getLogger(__name__)

MAX_PENDING_HELLOS = 256  # listener connections awaiting their HELLO at once; more are closed at once
# NOTE: a peer that sends stream or active messages to a node (which installs no handler for them)
# makes UCX log a warning with a backtrace per message: the node's UCX logs errors only, unless the
# operator sets UCX_LOG_LEVEL.
NODE_UCX_LOG_LEVEL = "error"


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
        self.xfer: Transfers | None = None  # set by `start`

    async def start(self, services: NodeServices) -> PlaneInfo:
        os.environ.setdefault("UCX_LOG_LEVEL", NODE_UCX_LOG_LEVEL)  # read when UCX loads (below)
        self.ucx = ucx = load_ucxx()
        from ucxx._lib.arr import Array

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
        self.xfer = Transfers(ucx, Array, self._progress, self.intake, cuda=self.cuda, io_timeout=self.io_timeout)
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

    # ---------------------------------------------------------------- connections

    def _on_conn_request(self, conn_request: Any) -> None:
        """Listener (called from progress): an endpoint that must send its HELLO under our nonce."""
        ep = self._listener.create_endpoint_from_conn_request(conn_request, True)
        if self.pending_hellos >= MAX_PENDING_HELLOS:
            log.warning("UCX plane: %d connections await their HELLO; closing a new one", self.pending_hellos)
            asyncio.get_running_loop().call_soon(close_endpoint, ep)
            return
        self.pending_hellos += 1
        self._spawn(self._hello(ep))

    async def _hello(self, ep: Any) -> None:
        xfer = self.xfer
        assert xfer is not None
        closed = asyncio.Event()
        ep.set_close_callback(closed.set)
        buf = bytearray(FRAME.size + MAX_HELLO_BYTES)
        try:
            nonce = new_nonce()
            arr = xfer.Array(buf)
            recv = ep.tag_recv(arr, self.ucx.UCXXTag(nonce))  # posted before the nonce is out
            send, _keep = xfer.send(ep, CHALLENGE_TAG, frame(Kind.CHALLENGE, 0, NONCE.pack(nonce)))
            await xfer.wait([recv, send], "HELLO", closed)
            hello = Hello.parse(expect(buf, Kind.HELLO, 0))
        except Exception as exc:  # any failure (protocol, timeout, UCX, a HELLO too long) closes it
            log.info("UCX connection dropped before its HELLO: %s", exc)
            close_endpoint(ep)
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
            reply = xfer.send(ep, HELLO_REPLY_TAG, frame(Kind.ERROR, 0, error_body(exc.status_name, str(exc))))
            with contextlib.suppress(Exception):
                await xfer.wait([reply[0]], "HELLO refusal", closed)
            close_endpoint(ep)
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
        """Requests in order: seq 1, 2, ... (see ucx_requests.Requests)."""
        xfer, svc = self.xfer, self._svc
        assert xfer is not None and svc is not None
        turn = requests.Requests(xfer, conn)
        ok = HelloOk(conn.tags.secret, svc.config.max_page_bytes)
        hello_ok = xfer.send(conn.ep, HELLO_REPLY_TAG, frame(Kind.HELLO_OK, 0, ok.pack()))
        await xfer.wait([hello_ok[0]], "HELLO_OK", conn.closed)
        while conn.alive():
            await xfer.wait([turn.recv], "request", conn.closed, timeout=float("inf"))
            try:
                kind, _, got, body = unframe(turn.ctrl)
                if got != turn.seq:
                    raise ProtocolError(f"request {got}, expected {turn.seq}")
            except ProtocolError as exc:
                turn.respond(frame(Kind.ERROR, turn.seq, error_body("INVALID_ARGUMENT", f"frame: {exc}")))
                await turn.finish()
                return  # out of step: close
            await requests.handle(xfer, svc, conn, kind, turn.seq, body=body, respond=turn.respond)
            await turn.finish()
