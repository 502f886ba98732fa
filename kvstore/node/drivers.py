"""The node side of Put and Get, written once for every data plane (gRPC streams, shm, TCP, UCX).

A plane only moves bytes. For a Put it announces each page (`PageHead`: hash, size, declared checksum)
and supplies `PagePlane.read_into` ("receive this page's bytes into this view") and `discard` ("receive
and drop them"); for a Get it iterates the leases `open_get` hands it and sends each (header + payload).
Everything else lives here: the transaction (begin_put -> add_page -> fill -> commit, or abort), who
may promote, how many pages one call may name (`check_page_count`, which a plane calls as soon as it has
a request's count, before it reads or allocates anything sized by it; `check_target_count`), a namespace's
page size for a plane that sizes its receives first (`answer_page_size`), and that nothing leaks when a
call fails.

Put invariants (every plane alike):
- the transaction is opened here, on what `opening()` returns (the plane resolves its caller and parses
  its opening there), so a refused caller, a bad opening and a bad page fail in the same place with the
  same status;
- a page's view is completely filled before the next page is added (PutTxn's contract), and released
  before the transaction commits or aborts;
- on failure the transaction is aborted (nothing of the call becomes visible); with `drain` (a plane
  whose connection must stay in step, TCP) the rest of the request is consumed first and the failure is
  raised after it, else it is raised at once;
- `TransferStuck` from a plane (a receive that may still write after the plane gave up on it) leaks the
  transaction instead of aborting it, so the slot the late bytes could land in is never reused.

Replication (DESIGN.md §7.3) is fed here, once for every plane: each page a Get serves counts as a read of it
by the caller's host in the node's heat table (a peer's Get is a copy, counted apart, not a read), and a Put
that asks for replicas=k records it for the pages it stored.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstore.config import NodeConfig
from kvstore.errors import DataLoss, InvalidArgument, KVStoreError
from kvstore.layout import PageLayout
from kvstore.manager.put import Declared, PutTxn
from kvstore.manager.reads import ReadLease
from kvstore.node.callers import Caller
from kvstore.wire import PAGE_BYTES, PutOpen, parse_page_size_ask


@dataclass(frozen=True, slots=True)
class PageHead:
    """A page a Put announces: its hash, its payload size and the checksum its sender declared (0: none; or
    DeclaredLater: it comes after the page's bytes)."""

    hash: bytes
    nbytes: int
    checksum: Declared


@dataclass(frozen=True, slots=True)
class PutDone:
    """What a Put answers: counts, and per page announced whether the node holds it now (PutTxn.held)."""

    stored: int
    present: int
    held: list[bool]


def check_page_count(count: int, config: NodeConfig, field: str, *, put: bool, wire_limit: int | None = None) -> int:
    """`count` if one request may name that many pages: a Put carries 1 to `max_pages_per_request` of them, a Get
    asks for at most that many (the plane's `wire_limit` lower where its protocol cannot carry more). Every plane
    whose request says its count before its pages (TCP's PUT frame, a same-host or UCX PUT or GET) calls this as
    soon as it has the count, before it reads, allocates or posts anything sized by it; InvalidArgument naming
    `field` otherwise. (A gRPC Put stream says no count first: its transaction refuses the page past the limit,
    with the same status, and the manager checks every Get's hashes again.)"""
    limit = config.max_pages_per_request if wire_limit is None else min(config.max_pages_per_request, wire_limit)
    least = 1 if put else 0
    if not least <= count <= limit:
        what = "a Put carries" if put else "a Get asks for"
        raise InvalidArgument(field, f"{count} pages in one request; {what} {least} to {limit} on this node")
    return count


def check_target_count(targets: int, hashes: int) -> None:
    """A Get that says where each page goes (same-host, UCX: `targets`) names exactly one target per hash;
    InvalidArgument naming `targets` otherwise."""
    if targets != hashes:
        raise InvalidArgument("targets", f"{targets} targets for {hashes} hashes (one per hash)")


def answer_page_size(caller: Caller, ask: bytes | memoryview) -> bytes:
    """The node's one answer to a page-size ask (`kvstore.wire.page_size_ask`, on every plane that sizes its
    receives before a Get: same-host, UCX): the namespace's page size as the caller's tenant sees it, answered
    and counted as the Get starting at the ask's first hash would be (NamespaceNotFound for a namespace the
    tenant does not hold)."""
    namespace, first = parse_page_size_ask(ask)
    return PAGE_BYTES.pack(caller.view.layout_of(namespace, first=first).page_bytes)


class TransferStuck(DataLoss):
    """A plane could not make sure a receive into a page view has finished: the view must never be reused."""


class PagePlane(Protocol):
    """What a plane supplies to `drive_put`: the bytes of the page announced last."""

    async def read_into(self, index: int, view: memoryview) -> int | None:
        """Receive page `index`'s payload into `view` (exactly len(view) bytes). A plane that hashed the bytes
        as they landed in `view` (out of `view`, in the pass that wrote them) returns their XXH3-64, so the
        transaction does not hash the slot again; else None."""

    async def discard(self, index: int, nbytes: int) -> None:
        """Receive page `index`'s `nbytes` payload bytes and drop them (stored already, or refused)."""


async def drive_put(
    opening: Callable[[], tuple[Caller, PutOpen]], pages: AsyncIterable[PageHead], plane: PagePlane, *, drain: bool
) -> PutDone:
    """Run one Put. See the module docstring for the invariants."""
    failure: KVStoreError | None = None
    txn: PutTxn | None = None
    stuck = False
    try:
        try:
            caller, op = opening()
            txn = caller.view.begin_put(op)
        except KVStoreError as exc:
            if not drain:
                raise
            failure = exc
        index = 0
        hashes: list[bytes] = []
        async for head in pages:
            hashes.append(head.hash)
            view = None
            if failure is None and txn is not None:
                try:
                    view = await txn.add_page(head.hash, head.nbytes, head.checksum)
                except KVStoreError as exc:
                    if not drain:
                        raise
                    failure = exc
                    txn.abort()
            if view is None:  # stored already, not admitted anywhere, or refused: its bytes are dropped
                await plane.discard(index, head.nbytes)
            else:
                try:
                    hashed = await plane.read_into(index, view)
                    if hashed is not None and txn is not None:
                        txn.filled(hashed)
                except TransferStuck:
                    stuck = True
                    raise
                finally:
                    if not stuck:
                        view.release()
            index += 1
        if failure is None and txn is not None:
            if index == 0:
                raise InvalidArgument("pages", "a Put with no pages")
            try:
                stored, present = await txn.commit()
                held = txn.held()
                if op.replicas > 1 and caller.heat is not None:
                    ns, now = caller.view.ns(op.namespace), time.monotonic()
                    for h, kept in zip(hashes, held, strict=False):
                        if kept:
                            caller.heat.ask((ns, h), op.replicas, now)
                return PutDone(stored, present, held)
            except KVStoreError as exc:
                if not drain:
                    raise
                failure = exc
        assert failure is not None
        raise failure
    finally:
        if txn is not None and not txn.done and not stuck:
            txn.abort()


@contextlib.asynccontextmanager
async def open_get(
    caller: Caller,
    namespace: str,
    hashes: list[bytes],
    promote: bool,
    *,
    into: Sequence[memoryview] | None = None,
    receiver_verifies: bool,
    expect: PageLayout | None = None,
) -> AsyncIterator[AsyncIterator[ReadLease]]:
    """The leases of one Get, in order, stopping at the first missing page; closed (every lease released)
    when the block ends, however it ends. Promotes only for a caller that may move pages; with `into`,
    page i is copied into into[i] in the pass that verifies it (the same-host plane). `receiver_verifies`:
    the plane's receiver checks every page against its checksum (a client across a network plane), so the
    node does not hash DRAM pages again (DESIGN.md §8); a plane whose receiver trusts the node says False.
    `expect`: the layout the request says it reads (a bundle's parts), checked against the namespace's.
    The manager checks the arguments (namespace, layout, at most max_pages_per_request hashes) first."""
    leases = caller.view.get(
        namespace,
        hashes,
        promote=promote and caller.may_move,
        into=into,
        receiver_verifies=receiver_verifies,
        expect=expect,
    )
    counted = _counted(leases, caller, namespace) if caller.reads is not None else leases
    try:
        yield counted
    finally:
        await counted.aclose()  # type: ignore[attr-defined]


async def _counted(leases: AsyncIterator[ReadLease], caller: Caller, namespace: str) -> AsyncIterator[ReadLease]:
    """The leases, each counted as it is handed to the plane: a read of its page by the caller's host (heat), or
    a copy when the caller is another node."""
    reads, heat, peer = caller.reads, caller.heat, caller.copies
    assert reads is not None
    ns = caller.view.ns(namespace) if heat is not None and not peer else namespace
    try:
        async for lease in leases:
            n = len(lease.payload)
            if peer:
                reads.copies_out += 1
                reads.copy_bytes_out += n
            else:
                reads.served_pages += 1
                reads.served_bytes += n
                if heat is not None:
                    heat.note_read((ns, lease.hash), caller.host, time.monotonic())
            yield lease
    finally:
        await leases.aclose()  # type: ignore[attr-defined]
