"""The UCX plane's requests, once a connection said HELLO (ucx.py): each runs the node's drivers
(kvstore/node/drivers.py: the page-count and target checks, the put and get drivers, the page-size answer), as
every plane does:
- LAYOUT: a namespace's page size (`answer_page_size`), asked before a plain get sizes its receives.
- PUT: the token must be a read-write one; each page's tagged message is received straight into its
  staged slot (one copy: the network's), and the transaction verifies and publishes the pages together.
  A page already stored is received into a scratch buffer and dropped (a UCX send cannot be cancelled by
  its receiver).
- GET: every page's send is posted as its lease arrives, from the lease (a DRAM slot, the verified
  bounce copy of an NVMe read, or device memory where the lease says the page is there and UCX can send
  CUDA memory), without waiting for the one before; each lease is held until its send completed. Every
  receive the client posted is answered (a page, or an empty message past the pages sent), then the reply.

Invariants: a request responds exactly once (`handle`); request seq+1's control receive is posted before
request seq's reply leaves (`Requests`); nothing changes when a request fails: the transaction is aborted
once the posted receive has finished (completed, cancelled, or failed with its endpoint), so no late byte can
land in a slot given back, and a receive that never finishes is TransferStuck, its buffer never reused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf.message import DecodeError

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import InvalidArgument, KVStoreError
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
from kvstore.node.planes.base import NodeServices
from kvstore.node.planes.ucx_session import Connection, Respond, Transfers, lost
from kvstore.pageformat import in_form
from kvstore.wire import pack_held
from kvstore.wire.streams import checksum_form_from_pb, layout_from_pb, put_open_from_pb
from kvstore.wire.ucx import (
    MAX_CONTROL_BYTES,
    MAX_PAGES_PER_CALL,
    Kind,
    Lane,
    SessionTags,
    error_body,
    frame,
    pack_get_reply,
)
from kvstore.wire.ucx_progress import UcxClosed, UcxTimeout


async def handle(
    xfer: Transfers,
    services: NodeServices,
    conn: Connection,
    kind: Kind,
    seq: int,
    *,
    body: memoryview,
    respond: Respond,
) -> None:
    """Run one request; it responds exactly once (OK, or ERROR with the failure's status)."""
    responded = False

    def once(msg: bytes) -> None:
        nonlocal responded
        if not responded:
            responded = True
            respond(msg)

    try:
        if kind is Kind.PUT:
            reply = await put(xfer, services, conn, seq, pb.BulkPutRequest.FromString(bytes(body)))
            once(frame(Kind.OK, seq, reply))
        elif kind is Kind.GET:
            await get(xfer, services, conn, seq, pb.BulkGetRequest.FromString(bytes(body)), respond=once)
        elif kind is Kind.LAYOUT:
            once(frame(Kind.OK, seq, answer_page_size(caller_of(services, conn, "Get"), body)))
        else:
            raise InvalidArgument("kind", f"{kind.name} is not a request")
    except DecodeError as exc:
        once(frame(Kind.ERROR, seq, error_body("INVALID_ARGUMENT", f"body: not a {kind.name} request: {exc}")))
    except KVStoreError as exc:
        once(frame(Kind.ERROR, seq, error_body(exc.status_name, str(exc))))


def caller_of(services: NodeServices, conn: Connection, method: str) -> Caller:
    """The connection's caller for `method` (kvstore/node/callers.py); UCX carries no client certificate."""
    return services.callers.authenticate(method, conn.metadata, None)


async def put(xfer: Transfers, services: NodeServices, conn: Connection, seq: int, req: pb.BulkPutRequest) -> bytes:
    """A PUT: each page received straight into its staged slot, the pages verified and published together."""
    caller = caller_of(services, conn, "Put")
    if not req.HasField("open"):
        raise InvalidArgument("open", "a PUT needs `open` (namespace and layout)")
    check_page_count(len(req.pages), services.config, "pages", put=True, wire_limit=MAX_PAGES_PER_CALL)
    slices = list(req.pages)
    for i, p in enumerate(slices):
        if not p.checksum:  # a short message would leave stale bytes that only the checksum catches
            raise InvalidArgument(f"pages[{i}].checksum", "required on the UCX plane")
    op = put_open_from_pb(req.open)
    pages = _TaggedPages(xfer, conn, conn.tags.tag(Lane.PUT_PAGES, seq))
    done = await drive_put(lambda: (caller, op), _heads(slices), pages, drain=False)
    return pb.PutResponse(
        stored=done.stored, already_present=done.present, held=pack_held(done.held)
    ).SerializeToString()


async def get(
    xfer: Transfers, services: NodeServices, conn: Connection, seq: int, req: pb.BulkGetRequest, *, respond: Respond
) -> None:
    """Answer every receive the client posted (page i, or an empty message), then respond; the leases
    of pages in flight are held until their sends completed."""
    n = check_page_count(len(req.hashes), services.config, "hashes", put=False, wire_limit=MAX_PAGES_PER_CALL)
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
            caller = caller_of(services, conn, "Get")
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
                    sources.append(ucx_device.source(xfer.cuda, lease))
                    releases.append(lease.detach())
                    sends.append(conn.ep.tag_send(sources[-1], xfer.ucx.UCXXTag(base | i)))
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
            sends.append(conn.ep.tag_send(xfer.empty, xfer.ucx.UCXXTag(base | i)))
        respond(reply)
        try:
            await xfer.wait(sends, "GET pages", conn.closed)
        except (UcxClosed, UcxTimeout, xfer.ucx.UCXError) as exc:
            if not await xfer.settle(sends, conn):
                releases.clear()  # UCX may still read them: the pages stay leased (pinned)
            raise lost(exc) from None
    finally:
        for release in releases:
            release()


class Requests:
    """The request sequence of one connection. Request seq+1's control receive is posted (and its PUT
    page range opened in the intake) in `respond`, before request seq's reply leaves, so nothing a
    well-behaved client sends is unexpected but PUT pages, which the intake holds for their range."""

    def __init__(self, xfer: Transfers, conn: Connection) -> None:
        self.xfer = xfer
        self.conn = conn
        self.ctrl = bytearray(MAX_CONTROL_BYTES)
        self._ctrl_arr = xfer.Array(self.ctrl)
        self.seq = 1
        self.recv = self._open(self.seq)
        self._sent: list[tuple[Any, Any]] = []

    def _open(self, seq: int) -> Any:
        """Open request `seq`: its PUT page range in the intake, and its control receive posted."""
        conn, xfer = self.conn, self.xfer
        if not xfer.intake.open_range(conn.tags.tag(Lane.PUT_PAGES, seq), conn):
            raise UcxClosed("session tag range collides with another connection's")
        return conn.ep.tag_recv(self._ctrl_arr, xfer.ucx.UCXXTag(conn.tags.tag(Lane.CONTROL, seq)))

    def respond(self, msg: bytes) -> None:
        """End request `seq` with `msg` (OK or ERROR frame): the next request's receive first."""
        xfer, conn = self.xfer, self.conn
        xfer.intake.close_range(conn.tags.tag(Lane.PUT_PAGES, self.seq), conn)
        self.recv = self._open(self.seq + 1)
        self._sent.append(xfer.send(conn.ep, conn.tags.tag(Lane.REPLY, self.seq), msg))

    async def finish(self) -> None:
        """After the handler: its reply has left; the next request is seq + 1."""
        assert self._sent, "a request ended without a reply"
        await self.xfer.wait([req for req, _ in self._sent], "reply", self.conn.closed)
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

    def __init__(self, xfer: Transfers, conn: Connection, base: int) -> None:
        self.xfer = xfer
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
            raise lost(UcxTimeout("a dropped page's receive did not finish")) from None

    async def _receive(self, index: int, dst: memoryview) -> None:
        xfer, conn = self.xfer, self.conn
        arr = xfer.Array(dst)  # referenced while UCX may write through it
        req = xfer.intake.receive(conn, conn.ep, SessionTags.page(self.base, index), arr)
        try:
            await xfer.wait([req], f"PUT page {index}", conn.closed)
        except BaseException as exc:
            if not await xfer.settle([req], conn):
                conn.stuck.append(arr)
                raise TransferStuck(f"UCX receive of PUT page {index} did not finish after close") from None
            if isinstance(exc, (UcxClosed, UcxTimeout, xfer.ucx.UCXError)):
                raise lost(exc) from None
            raise
