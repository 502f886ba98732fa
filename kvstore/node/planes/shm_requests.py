"""The same-host plane's requests, each once a connection has said HELLO (shm.py): REGISTER maps a memfd the
client handed over, PUT and PUT_SUMS copy pages out of registered memory through the put driver, GET has the
get driver's reader copy each page into it (kvstore/node/drivers.py). Plain functions of what a request needs:
the caller, the node's config, the connection's registered buffers; the connection dispatches, answers and
owns the socket.

Invariants: every slice and target is checked against its buffer before anything is read or written (a bad
one leaves the node unchanged, InvalidArgument naming the field); a buffer is held mapped for as long as a
request uses it (`_using`), so a connection's end never unmaps memory a transfer still reads; a registration
is refused before anything is taken when its holder's room is spent (RESOURCE_EXHAUSTED); a PUT's checksums
are of the bytes that landed in the slot, hashed in the pass that copies them (pageformat.copy_checksum_dest).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.manager.put import Declared, DeclaredLater
from kvstore.node.callers import Caller
from kvstore.node.drivers import PageHead, check_page_count, check_target_count, drive_put, open_get
from kvstore.node.planes.shm_limits import Holder, ShmLimits
from kvstore.node.planes.shm_memory import MappedBuffer, usable_size
from kvstore.node.planes.shm_sums import SumsWait
from kvstore.pageformat import copy_checksum_dest, in_form
from kvstore.wire import pack_held, shm
from kvstore.wire.streams import checksum_form_from_pb, layout_from_pb, put_open_from_pb

if TYPE_CHECKING:
    from kvstore.config import NodeConfig

Buffers = Mapping[int, MappedBuffer]  # a connection's registered buffers by id


def register(
    buffers: dict[int, MappedBuffer], limits: ShmLimits, holder: Holder, body: memoryview, fds: list[int]
) -> None:
    """Map the one memfd a REGISTER carries as buffer `id` of this connection, counted to `holder`."""
    if len(body) != shm.REGISTER.size or len(fds) != 1:
        raise InvalidArgument("register", "a REGISTER carries a buffer id and exactly one descriptor")
    (buf_id,) = shm.REGISTER.unpack(body)
    if buf_id in buffers:
        raise InvalidArgument("register", f"buffer {buf_id} is registered already on this connection")
    if len(buffers) >= shm.MAX_BUFFERS:
        raise ResourceExhausted(f"register: a connection registers at most {shm.MAX_BUFFERS} buffers")
    size = usable_size(fds[0])
    refusal = limits.buffers.refusal(holder) or limits.mapped.refusal(holder, size)
    if refusal is not None:
        raise ResourceExhausted(f"register: {refusal}")
    buf = MappedBuffer(fds[0], size)  # keeps no descriptor: the caller's is closed after this request
    limits.buffers.take(holder)
    limits.mapped.take(holder, size)
    buffers[buf_id] = buf


def buffer_of(buffers: Buffers, buf_id: int, field: str) -> MappedBuffer:
    """Registered buffer `buf_id`; InvalidArgument naming `field` if this connection has none by that id."""
    buf = buffers.get(buf_id)
    if buf is None:
        raise InvalidArgument(field, f"buffer {buf_id} is not registered on this connection")
    return buf


async def put_sums(
    authenticate: Callable[[str], Caller],
    cfg: NodeConfig,
    buffers: Buffers,
    seq: int,
    body: memoryview,
    *,
    sums: SumsWait,
) -> bytes:
    """A PUT whose checksums follow in a SUMS message: the pages are copied and hashed as they come, and
    the transaction publishes none before the SUMS came and matched (manager/put.py: DeclaredLater). The
    connection hands the SUMS to `sums` (shm_sums.py), within shm_idle_seconds, else the Put fails."""
    sums.announce(seq)
    req = pb.BulkPutRequest.FromString(bytes(body))
    with sums.waiting(seq, len(req.pages)) as declared:
        for i, p in enumerate(req.pages):
            if p.checksum:
                raise InvalidArgument(f"pages[{i}].checksum", "a PUT_SUMS declares its checksums in its SUMS")
        return await put(authenticate("Put"), cfg, buffers, req, declared)


async def put(
    caller: Caller,
    cfg: NodeConfig,
    buffers: Buffers,
    req: pb.BulkPutRequest,
    sums: asyncio.Future[Sequence[int]] | None = None,
) -> bytes:
    """A PUT of slices of registered buffers (checksums in the request, or in `sums` for a PUT_SUMS)."""
    if not req.HasField("open"):
        raise InvalidArgument("open", "a PUT needs `open` (namespace and layout)")
    check_page_count(len(req.pages), cfg, "pages", put=True, wire_limit=shm.MAX_PAGES_PER_CALL)
    slices = list(req.pages)
    places = []
    for i, p in enumerate(slices):  # every slice checked first: a bad one leaves the node unchanged
        buf = buffer_of(buffers, p.buffer, f"pages[{i}].buffer")
        buf.check(p.offset, p.payload_bytes, f"pages[{i}]")
        places.append((buf, p.offset))
    op = put_open_from_pb(req.open)
    with _using(b for b, _ in places):
        done = await drive_put(lambda: (caller, op), _heads(slices, sums), _BufferPages(places), drain=False)
    return pb.PutResponse(
        stored=done.stored, already_present=done.present, held=pack_held(done.held)
    ).SerializeToString()


async def get(caller: Caller, cfg: NodeConfig, buffers: Buffers, req: pb.BulkGetRequest) -> bytes:
    """A GET into targets in registered buffers: each page copied there by the reader that verifies it."""
    form = checksum_form_from_pb(req.checksum_form, "checksum_form")
    check_page_count(len(req.hashes), cfg, "hashes", put=False, wire_limit=shm.MAX_PAGES_PER_CALL)
    check_target_count(len(req.targets), len(req.hashes))
    hashes = list(req.hashes)
    page_bytes = caller.view.layout_of(req.namespace).page_bytes
    expect = layout_from_pb(req.layout, "layout") if req.HasField("layout") else None
    # NOTE: the targets' fields read once into tuples: a protobuf field read costs more than the check itself
    targets = [(t.buffer, t.offset, t.size) for t in req.targets]
    bufs = [buffer_of(buffers, t[0], f"targets[{i}].buffer") for i, t in enumerate(targets)]
    check_targets(targets, bufs, page_bytes)
    out = pb.BulkGetResponse()
    with _using(set(bufs)):
        # NOTE: a window is cut when its page is reached: a Get whose stored prefix ends early (a probe of
        # many keys, the first one missing) costs no window per hash.
        windows = _Windows(bufs, targets, page_bytes)
        promote = not req.no_promote
        try:
            async with open_get(
                caller, req.namespace, hashes, promote, into=windows, receiver_verifies=False, expect=expect
            ) as ls:
                async for lease in ls:
                    buf_id, offset, _ = targets[len(out.pages)]
                    out.pages.add(
                        hash=lease.hash,
                        offset=offset,
                        payload_bytes=len(lease.payload),
                        checksum=in_form(lease.checksum, form, req.namespace, lease.hash),
                        tier=int(lease.tier),
                        buffer=buf_id,
                    )
        finally:
            windows.release()
    return out.SerializeToString()


Target = tuple[int, int, int]  # a GET target's (buffer id, offset, size)


class _Windows(Sequence[memoryview]):
    """The windows of a GET's targets, each cut from its buffer on first use; `release` releases those cut."""

    def __init__(self, bufs: Sequence[MappedBuffer], targets: Sequence[Target], page_bytes: int) -> None:
        self._bufs, self._targets, self._page_bytes = bufs, targets, page_bytes
        self._cut: dict[int, memoryview] = {}

    def __len__(self) -> int:
        return len(self._bufs)

    def __getitem__(self, i: int) -> memoryview:  # type: ignore[override]  # NOTE: by index only
        w = self._cut.get(i)
        if w is None:
            w = self._cut[i] = self._bufs[i].window(self._targets[i][1], self._page_bytes)
        return w

    def release(self) -> None:
        for w in self._cut.values():
            w.release()
        self._cut.clear()


def check_targets(targets: Sequence[Target], bufs: Sequence[MappedBuffer], page_bytes: int) -> None:
    """Every target inside its buffer, a page long at least, overlapping no other target of the same buffer;
    InvalidArgument naming `targets[i]` otherwise (checked before anything is read or written)."""
    for i, ((_, offset, size), b) in enumerate(zip(targets, bufs, strict=True)):
        b.check(offset, size, f"targets[{i}]")
        if size < page_bytes:
            raise InvalidArgument(f"targets[{i}]", f"{size} bytes cannot hold a page of this namespace: {page_bytes}")
    order = sorted(range(len(targets)), key=lambda i: targets[i][:2])
    for prev, cur in itertools.pairwise(order):
        a, b = targets[prev], targets[cur]
        if a[0] == b[0] and a[1] + page_bytes > b[1]:
            raise InvalidArgument(f"targets[{max(prev, cur)}]", f"overlaps targets[{min(prev, cur)}]")


@contextlib.contextmanager
def _using(bufs: object) -> object:
    """Hold `bufs` (an iterable of MappedBuffer) mapped for the block."""
    held = list(bufs)  # type: ignore[call-overload]
    for b in held:
        b.users += 1
    try:
        yield
    finally:
        for b in held:
            b.release()


async def _heads(slices: Sequence[pb.BulkPage], sums: asyncio.Future[Sequence[int]] | None) -> AsyncIterator[PageHead]:
    for i, p in enumerate(slices):
        declared: Declared = p.checksum if sums is None else DeclaredLater(sums, i)
        yield PageHead(p.hash, p.payload_bytes, declared)


class _BufferPages:
    """The put driver's page bytes: each slice of a registered buffer (bounds checked before), copied into its
    slot and hashed out of the slot in the same pass (pageformat.copy_checksum_dest: the checksum is of the
    bytes that landed, whatever the client's memory holds by then), on the loop as before: the driver fills
    one page at a time."""

    def __init__(self, places: list[tuple[MappedBuffer, int]]) -> None:
        self.places = places

    async def read_into(self, index: int, view: memoryview) -> int | None:
        buf, offset = self.places[index]
        with buf.window(offset, len(view)) as src:
            return copy_checksum_dest(src, view)

    async def discard(self, index: int, nbytes: int) -> None:
        return None  # nothing to receive: the bytes stay in the caller's memory
