"""The client side of the same-host plane: Put and Get through this client's own memory, with the node's Unix
socket as the control channel (protocol: kvstore/wire/shm.py).

Every page crosses with one memcpy, done by the node, and no gRPC round trip: a GET names where each page
goes (a block of the client's receive pool for a plain `get`, the caller's own SharedBuffer for `get_into`)
and the node's reader copies each page there in the pass that verifies it; a PUT names where each page lies
(the caller's SharedBuffer for `put_from`, else a pool block the page is copied into first) and the node
copies it into its slot. Nothing crosses a network, so the client verifies nothing again (DESIGN.md §8). The
writer declares every page's checksum; a `put_from` to a node that takes PUT_SUMS hashes the caller's pages
while the node copies them and sends the sums right after the request (kvstore/wire/shm.py).

Connections, what a request lends the node and when it comes back: kvstore/client/planes/shm_conn.py.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.client.exchange import Abort, Blocking, Exchange
from kvstore.client.planes.base import DataPlane, PutResult, page_size
from kvstore.client.planes.buffers import buffer_span
from kvstore.client.planes.connections import ConnectionPool
from kvstore.client.planes.pool import ReceivePool
from kvstore.client.planes.segments import Placed, SharedBuffers
from kvstore.client.planes.shm_conn import Connection, Loan, Release, nothing
from kvstore.errors import (
    InvalidArgument,
    KVStoreError,
    PlaneUnavailable,
    StreamError,
    Unavailable,
)
from kvstore.layout import PageLayout
from kvstore.memtune import usable_cores
from kvstore.names import Buffer, TierKind
from kvstore.pageformat import checksum_into, key_digest, wire_checksum
from kvstore.wire import PutOpen, parse_page_size, shm, unpack_held
from kvstore.wire.shm import Kind
from kvstore.wire.streams import FetchedPage, PageRef, layout_to_pb, put_open_to_pb

log = logging.getLogger(__name__)

_TARGET_FIELD = "targets["


class ShmPlane(DataPlane):
    """Pages cross through this client's memory on the node's host. Thread-safe: concurrent calls use
    different connections. Each PUT of at most `call_pages` pages is atomic, like a Put stream."""

    name = "shm"

    def __init__(
        self,
        path: str,
        pages_per_call: int,
        *,
        buffers: SharedBuffers,
        received: ReceivePool,
        token: str | None,
        timeout: float,
        uid: int | None,
    ) -> None:
        if not path:
            raise PlaneUnavailable("the node advertises no same-host socket")
        if uid is None:
            raise PlaneUnavailable(
                "the node does not say which user serves its same-host socket (a node of an older release): this "
                "client sends nothing to a socket it cannot check; upgrade the node, or set KVSTORE_LOCAL_SOCKET_UID"
            )
        self.path = path
        self.uid = uid
        self.pages_per_call = min(pages_per_call, shm.MAX_PAGES_PER_CALL)
        self.buffers = buffers
        self.received = received
        self.token = token
        self.timeout = timeout
        self._page_bytes: dict[str, int] = {}  # a namespace's page size (fixed once its first page is stored)
        self._pool = ConnectionPool(self._open, f"same-host plane connection to {path}")

    # -- connections

    def _open(self) -> Connection:
        try:
            return Connection(self.path, self.token, self.timeout, self.uid)
        except Unavailable as exc:  # the node refused the connection (its plane is full, or it is stopping)
            raise PlaneUnavailable(f"the same-host plane at {self.path} refused a connection: {exc}") from None
        except KVStoreError:
            raise
        except (OSError, StreamError, ValueError) as exc:
            raise PlaneUnavailable(f"cannot open the same-host plane at {self.path}: {exc}") from None

    def close(self) -> None:
        self._pool.close()

    # -- where pages lie

    def _place(self, buffers: Sequence[Buffer], writable: bool, first: int) -> list[Placed] | None:
        """Where each buffer lies in this client's registered memory; None when any lies outside it."""
        placed = []
        for i, b in enumerate(buffers):
            where = self.buffers.locate(*buffer_span(b, f"buffers[{first + i}]", writable))
            if where is None:
                return None
            placed.append(where)
        return placed

    def page_bytes(self, namespace: str, first: bytes) -> int:
        """The namespace's page size, on behalf of a Get starting at hash `first`: the one rule of every plane
        (`base.page_size`), asked on this plane as a LAYOUT request."""

        def ask(body: bytes) -> int:
            return self._pool.call(lambda c: parse_page_size(c.call(Kind.LAYOUT, body), c.max_page_bytes))

        return page_size(self._page_bytes, namespace, first, ask)

    # -- the DataPlane

    def put_batch(self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[Buffer]) -> Exchange[PutResult]:
        srcs = [memoryview(page).cast("B") for page in pages]
        blocks = [self.received.take(len(src)) for src in srcs]

        def copy(i: int) -> int:  # one copy into registered memory, hashed as it goes (from cache)
            return checksum_into(srcs[i], blocks[i]) ^ key_digest(op.namespace, hashes[i])

        # NOTE: the node waits for the request, so the copies may take every core (as put_from's hashes do).
        sums = side_by_side(len(srcs), sum(len(src) for src in srcs), copy)
        placed = self._place(blocks, False, 0)
        assert placed is not None  # pool blocks are registered memory
        # NOTE: the blocks are lent to the node for the request: `blocks` keeps them out of the pool until the
        # node is done with them (released by dropping the list), also when this exchange is gone before that.
        return (yield from self._put(op, hashes, placed, sums, first=0, lent=blocks.clear))

    def put_from_batch(
        self, op: PutOpen, hashes: Sequence[bytes], buffers: Sequence[Buffer], first: int
    ) -> Exchange[PutResult]:
        """The node copies each page straight out of the caller's registered memory (none on the client);
        buffers elsewhere are copied into registered memory first."""
        placed = self._place(buffers, False, first)
        if placed is None:
            return (yield from self.put_batch(op, hashes, buffers))
        sizes = [p.nbytes for p in placed]
        # NOTE: the writer declares every page's checksum (DESIGN.md §8): one read pass over the caller's pages,
        # so a page changed while the node copies it, or copied from the wrong place, is refused, not stored.
        # To a node that takes PUT_SUMS that pass runs while the node copies the pages (on another core), its
        # sums sent right after the request; hashed once for the call, however many attempts it takes.
        sums = functools.cache(lambda: declared_checksums(op.namespace, hashes, sizes, buffers, SUMS_AFTER_PARTS))
        bare = put_request(op, hashes, placed, [0] * len(placed)).SerializeToString()

        def request(conn: Connection) -> _Request:
            if conn.sums_after:
                return Kind.PUT_SUMS, bare, lambda: shm.sums_body(sums())
            return Kind.PUT, put_request(op, hashes, placed, sums()).SerializeToString(), None

        reply = yield self._blocking(request, placed, first, nothing)
        res = pb.PutResponse.FromString(bytes(reply))
        return PutResult(res.stored, res.already_present, unpack_held(res.held, len(hashes)))

    def _put(
        self,
        op: PutOpen,
        hashes: Sequence[bytes],
        placed: list[Placed],
        sums: list[int],
        *,
        first: int,
        lent: Release = nothing,
    ) -> Exchange[PutResult]:
        body = put_request(op, hashes, placed, sums).SerializeToString()
        reply = yield self._blocking(_plain(Kind.PUT, body), placed, first, lent)
        res = pb.PutResponse.FromString(bytes(reply))
        return PutResult(res.stored, res.already_present, unpack_held(res.held, len(hashes)))

    def get_batch(
        self, namespace: str, hashes: Sequence[bytes], promote: bool, expect: PageLayout | None = None
    ) -> Exchange[list[FetchedPage]]:
        """Pages straight into blocks of the receive pool: the node copies and verifies each one in place."""
        n = yield Blocking(lambda: self.page_bytes(namespace, hashes[0]))
        with self.received.reserve(n, len(hashes)) as blocks:
            got = yield from self._get(
                namespace, hashes, promote, blocks.placed, first=0, lent=blocks.hold(), expect=expect
            )
            return [FetchedPage(p.hash, TierKind(p.tier), blocks.claim(i)) for i, p in enumerate(got)]

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
        """The node writes page i straight into buffers[i] when they are registered memory (SharedBuffer or a
        pool block); other buffers get their pages through the receive pool, one copy more."""
        placed = self._place(buffers, True, first)
        if placed is None:
            return (yield from super().get_into_batch(namespace, hashes, buffers, promote, first=first, expect=expect))
        got = yield from self._get(namespace, hashes, promote, placed, first=first, expect=expect)
        return [PageRef(p.hash, TierKind(p.tier), p.payload_bytes) for p in got]

    def _get(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        promote: bool,
        placed: list[Placed],
        *,
        first: int,
        lent: Release = nothing,
        expect: PageLayout | None = None,
    ) -> Exchange[list[pb.BulkPage]]:
        req = pb.BulkGetRequest(
            namespace=namespace, hashes=list(hashes), no_promote=not promote, checksum_form=pb.CHECKSUM_FORM_KEYED
        )
        if expect is not None:
            req.layout.CopyFrom(layout_to_pb(expect))
        for p in placed:
            req.targets.add(offset=p.offset, size=p.nbytes, buffer=p.buffer.id)
        body = req.SerializeToString()
        reply = yield self._blocking(_plain(Kind.GET, body), placed, first, lent)
        pages = pb.BulkGetResponse.FromString(bytes(reply)).pages
        if len(pages) > len(hashes):
            raise StreamError(f"the node returned {len(pages)} pages for {len(hashes)} hashes")
        for i, p in enumerate(pages):
            if p.hash != hashes[i] or p.buffer != placed[i].buffer.id or p.offset != placed[i].offset:
                raise StreamError(f"page {i}: the node put an unexpected page, or put it elsewhere")
        return list(pages)

    def _blocking(
        self, request: Callable[[Connection], _Request], placed: list[Placed], first: int, lent: Release
    ) -> Blocking:
        """The request (as `request` makes it for a connection) as one Blocking operation on a pooled
        connection. `lent` runs exactly once, when the node is done with the memory the request names (or never,
        if the node never says so: see QUARANTINE)."""
        abort = Abort()
        loan = Loan(lent)

        def run(conn: Connection) -> memoryview:
            for p in placed:
                conn.register(p.buffer)
            kind, body, then = request(conn)
            try:
                return conn.call(kind, body, loan=loan, then=then)
            except InvalidArgument as exc:
                raise _buffer_error(exc, first) from None

        def call() -> memoryview:
            try:
                return self._pool.call(run, abort)
            finally:
                loan.settle()  # every attempt has ended, and the node with it: the memory is the client's again

        return Blocking(call, abort)


_Request = tuple[Kind, bytes, Callable[[], bytes] | None]  # a request's kind and body, and what follows it (SUMS)


def _plain(kind: Kind, body: bytes) -> Callable[[Connection], _Request]:
    """A request that is the same on every connection, with nothing following it."""
    return lambda _conn: (kind, body, None)


# A put_from of at least PARALLEL_HASH_BYTES hashes its pages (a plain put copies and hashes them) in up to
# HASH_PARTS parts side by side (its own thread taking the first), at most one per core it may run on; below it,
# on the calling thread alone. A plain put's copies of 16 pages of 1 / 4 MiB took 2.43 / 8.38 ms on two threads
# against 2.78 / 9.56 on one (a bare memcpy 1.94 / 7.62; 2 vCPUs, 2026-11-28, caches flushed). NOTE:
# measured (2 vCPUs, 2026-11-28): XXH3 runs 15-20 GB/s over pages in RAM, so hashing 16 MiB costs about 1 ms, a
# handoff to a thread 50-200 us; puts of 16 pages of 1 / 4 MiB ran 1.13x / 1.24x faster hashed on both cores
# than with the split gated on the cores /proc/loadavg said were free (load 9-11, benchmarks/shm_ab.py).
PARALLEL_HASH_BYTES = 4 << 20
HASH_PARTS = 4
# Parts when the pages are hashed while the node copies them (a PUT_SUMS): the node's copy takes the other core.
# NOTE: measured (2 vCPUs, 2026-11-28, single calls of 16 pages interleaved with 3ca0c07's): 1 MiB pages 0.89x of
# 3ca0c07 on one thread, 0.81x on two; 4 MiB 0.78x either way.
SUMS_AFTER_PARTS = 1


@functools.cache
def _hashers() -> ThreadPoolExecutor:
    """The threads that hash pages beside a put_from's own (made once)."""
    return ThreadPoolExecutor(max_workers=HASH_PARTS - 1, thread_name_prefix="kvstore-hash")


def declared_checksums(
    namespace: str, hashes: Sequence[bytes], sizes: Sequence[int], pages: Sequence[Buffer], parts: int = HASH_PARTS
) -> list[int]:
    """The checksum a writer declares for each page (wire_checksum: XXH3-64 ^ the key digest), in one read pass
    over the pages: in up to `parts` parts side by side when there are enough bytes, the calling thread
    taking the first (XXH3 releases the GIL). Returns once every page was hashed."""
    return side_by_side(len(pages), sum(sizes), lambda i: wire_checksum(namespace, hashes[i], pages[i]), parts)


def side_by_side(count: int, nbytes: int, one: Callable[[int], int], parts: int = HASH_PARTS) -> list[int]:
    """[one(0), ..., one(count - 1)]: in up to `parts` parts side by side when `nbytes` (what they read) is at
    least PARALLEL_HASH_BYTES, the calling thread taking the first (XXH3 and the copies release the GIL), at most
    one part per usable core. Returns once every call returned: no thread reads the pages after that."""
    k = min(count, parts, usable_cores()) if nbytes >= PARALLEL_HASH_BYTES else 1
    if k <= 1:
        return [one(i) for i in range(count)]
    bounds = [count * i // k for i in range(k + 1)]

    def share(a: int, b: int) -> list[int]:
        return [one(i) for i in range(a, b)]

    theirs = [_hashers().submit(share, bounds[i], bounds[i + 1]) for i in range(1, k)]
    try:
        mine = share(bounds[0], bounds[1])
    finally:
        concurrent.futures.wait(theirs)  # NOTE: the caller's pages are read by no thread after this returns
    return mine + [r for f in theirs for r in f.result()]


def put_request(
    op: PutOpen, hashes: Sequence[bytes], placed: Sequence[Placed], checksums: Sequence[int]
) -> pb.BulkPutRequest:
    """A PUT naming where each page lies and the checksum the writer declares for it (op.checksums' form)."""
    req = pb.BulkPutRequest(open=put_open_to_pb(op))
    for h, p, c in zip(hashes, placed, checksums, strict=True):
        req.pages.add(hash=h, offset=p.offset, payload_bytes=p.nbytes, buffer=p.buffer.id, checksum=c)
    return req


def _buffer_error(exc: InvalidArgument, first: int) -> Exception:
    """The node's complaint about targets[j] / pages[j] of one call, as the caller's buffers[first + j]."""
    field = exc.field
    for prefix in (_TARGET_FIELD, "pages["):
        if field.startswith(prefix) and "]" in field:
            j = int(field[len(prefix) : field.index("]")])
            rest = str(exc).split(":", 1)[1].strip()
            return ValueError(f"buffers[{first + j}]: {rest}")
    return exc


def plane_path(advertised: str) -> str:
    """The socket to use: KVSTORE_LOCAL_SOCKET when set (a pod mounts the node's socket at a path of its
    own), else what the node advertises."""
    return os.environ.get("KVSTORE_LOCAL_SOCKET") or advertised


def plane_uid(advertised: int | None) -> int | None:
    """The user the node's socket must answer as: KVSTORE_LOCAL_SOCKET_UID when set (where the client sees the
    node's user under another id: a user namespace), else what the node advertises over gRPC."""
    raw = os.environ.get("KVSTORE_LOCAL_SOCKET_UID")
    if not raw:
        return advertised
    try:
        uid = int(raw)
    except ValueError:
        raise ValueError(f"KVSTORE_LOCAL_SOCKET_UID: not a user id: {raw!r}") from None
    if uid < 0:
        raise ValueError(f"KVSTORE_LOCAL_SOCKET_UID: not a user id: {raw!r}")
    return uid
