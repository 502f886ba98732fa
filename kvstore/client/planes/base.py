"""The client side of a bulk data plane: Put and Get of page bytes, as exchanges (kvstore/client/exchange.py).

`DataPlane` owns what every plane shares: cutting a call into batches of at most `call_pages` pages (the
client's `pages_per_call`, capped at the page count the node accepts in one request: `capped_pages`),
chaining each batch's first page to the page before it (`PutOpen.batch`), stopping a Get at the first
batch that came back short (there the stored prefix ended), and what happens when a received page fails
its checksum (`PageCorrupt` from a batch): the pages before it are returned, the call is a miss from that
page on, and the page is reported to the node (Report), which verifies its own copy and drops a bad one.
A plane implements one batch of each kind.
"""

from __future__ import annotations

import abc
import ctypes
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.client.exchange import Exchange, Unary
from kvstore.errors import KVStoreError, PageCorrupt
from kvstore.layout import PageLayout
from kvstore.names import Buffer
from kvstore.pointers import buffer_address
from kvstore.wire import PutOpen, page_size_ask
from kvstore.wire.streams import FetchedPage, PageRef

T = TypeVar("T")
log = logging.getLogger(__name__)

MAX_KNOWN_PAGE_SIZES = 64  # namespaces whose page size a plane remembers (the oldest is forgotten first)


@dataclass(slots=True)
class PutResult:
    """What a Put answered. `held`: per page of the call, in order, whether the node holds it as it answered
    (stored, or already present); a page it refused, or that the same Put stored and then evicted, is False.
    None from a node that predates the per-page answer (then only the counts are known)."""

    stored: int
    already_present: int
    held: list[bool] | None = None


def capped_pages(pages_per_call: int, node_limit: int | None) -> int:
    """Pages one batch names: the client's `pages_per_call` (already within its plane's wire limit), capped at
    `node_limit`, the node's max_pages_per_request as its Stats advertised it (None: not advertised, a node
    that predates saying it: the client's own size, as before). The one rule for every plane and every bulk
    call (DESIGN.md §8): a node refuses any request naming more pages than its limit, on every plane."""
    if node_limit is None or node_limit < 1:
        return pages_per_call
    return min(pages_per_call, node_limit)


def batches(n: int, size: int) -> list[tuple[int, int]]:
    """[start, end) ranges of at most `size` covering range(n)."""
    return [(i, min(i + size, n)) for i in range(0, n, size)]


class DataPlane(abc.ABC):
    """One bulk data plane, as a client speaks it.

    A plane that cannot serve a call (the node lacks it, or cannot reach the client's memory) raises
    `PlaneUnavailable` before anything was stored or returned; the client then falls back to the next
    plane for good. Checksums follow DESIGN.md §8: every page is verified once per read, by the party
    that receives its bytes.

    Each batch of a Put is atomic on the node (a page is always atomic); a Get returns the pages of the
    longest stored prefix of its hashes, in order, verified.
    """

    name: str
    pages_per_call: int  # the client's own batch size, within the plane's wire limit
    # NOTE: the node's max_pages_per_request, set by the client each time it reads the node's Stats (at
    # negotiation, and again after the node failed a call: it may have restarted with another limit); None until
    # then, or from a node that does not advertise it. A plain attribute: a batch reads it once as it starts.
    node_pages: int | None = None
    corrupt_pages: int = 0  # pages that failed their checksum on arrival (each a miss, reported to the node)

    @property
    def call_pages(self) -> int:
        """Pages one batch of this plane names now (`capped_pages`)."""
        return capped_pages(self.pages_per_call, self.node_pages)

    # -- one batch: what a plane implements

    @abc.abstractmethod
    def put_batch(self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[Buffer]) -> Exchange[PutResult]:
        """Store one batch (`op` already chained to it)."""

    @abc.abstractmethod
    def get_batch(
        self, namespace: str, hashes: Sequence[bytes], promote: bool, expect: PageLayout | None = None
    ) -> Exchange[list[FetchedPage]]:
        """The pages of the longest stored prefix of one batch of hashes. `expect`: the layout the caller reads
        them as (a bundle's parts), sent with the request: the node refuses a namespace that holds another."""

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
        """`get_batch`, page i written into buffers[i] (`first`: buffers[0]'s index in the caller's call, to
        name it in errors). This default copies each page once, after checking that every page fits, so a
        buffer too small is a ValueError before anything is written; a plane that can receive straight into
        caller memory overrides it."""
        corrupt: PageCorrupt | None = None
        try:
            pages = yield from self.get_batch(namespace, hashes, promote, expect)
        except PageCorrupt as exc:
            corrupt, pages = exc, exc.good  # type: ignore[assignment]
        for i, page in enumerate(pages):
            if memoryview(buffers[i]).nbytes < len(page.data):
                raise ValueError(
                    f"buffers[{first + i}]: {memoryview(buffers[i]).nbytes} bytes cannot hold a "
                    f"{len(page.data)}-byte page"
                )
        out: list[PageRef] = []
        for i, page in enumerate(pages):
            n = len(page.data)
            with memoryview(buffers[i]) as dst, dst.cast("B") as raw:
                # NOTE: memmove through ctypes releases the GIL for the copy (a slice assignment holds it for
                # MiBs), so the caller's other threads (an engine's, another call's) run meanwhile.
                ctypes.memmove(buffer_address(raw), buffer_address(page.data), n)
            out.append(PageRef(page.hash, page.tier, n))
        if corrupt is not None:
            raise PageCorrupt(corrupt.index, corrupt.hash, out)
        return out

    def put_from_batch(
        self, op: PutOpen, hashes: Sequence[bytes], buffers: Sequence[Buffer], first: int
    ) -> Exchange[PutResult]:
        """`put_batch` of pages lying in the caller's buffers; a plane that reads caller memory in place
        (the same-host plane) overrides it."""
        return (yield from self.put_batch(op, hashes, buffers))

    # -- bundles' parts (DESIGN.md §4.3): a plane that can move a page as several regions of caller memory

    scatters = False  # True: put_regions_batch / get_regions_batch move parts without a copy

    def put_regions_batch(
        self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[list[memoryview]]
    ) -> Exchange[PutResult]:
        """Store one batch of pages, page i the concatenation of pages[i]'s regions (only where `scatters`)."""
        raise NotImplementedError(f"the {self.name} plane does not move pages as regions")

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
        """`get_into_batch` with page i received into pages[i]'s regions, in order (only where `scatters`)."""
        raise NotImplementedError(f"the {self.name} plane does not move pages as regions")

    def put_regions(
        self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[list[memoryview]]
    ) -> Exchange[PutResult]:
        """`put` of pages made of regions, one atomic batch per call."""
        ranges = batches(len(hashes), self.call_pages)
        return (
            yield from self._puts(
                op, hashes, ranges, lambda o, a, b: self.put_regions_batch(o, hashes[a:b], pages[a:b])
            )
        )

    def get_regions(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        pages: Sequence[list[memoryview]],
        promote: bool,
        expect: PageLayout | None = None,
    ) -> Exchange[list[PageRef]]:
        """Pages of the longest stored prefix, page i into pages[i]'s regions."""

        def one(a: int, b: int) -> Exchange[list[PageRef]]:
            return self.get_regions_batch(namespace, hashes[a:b], pages[a:b], promote, first=a, expect=expect)

        return (yield from self._prefix(namespace, batches(len(hashes), self.call_pages), one))

    def runs(self, buffers: Sequence[Buffer], writable: bool) -> list[tuple[int, int]]:
        """The batches of a get_into / put_from over `buffers` (already checked by the client); a plane
        whose batches must not cross some boundary of caller memory overrides it."""
        return batches(len(buffers), self.call_pages)

    def close(self) -> None:
        """Release what the plane holds (segments, connections)."""
        return None

    # -- whole calls: the template every plane shares

    def put(self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[Buffer]) -> Exchange[PutResult]:
        """Store pages, one atomic batch per call."""
        ranges = batches(len(hashes), self.call_pages)
        return (yield from self._puts(op, hashes, ranges, lambda o, a, b: self.put_batch(o, hashes[a:b], pages[a:b])))

    def put_from(self, op: PutOpen, hashes: Sequence[bytes], buffers: Sequence[Buffer]) -> Exchange[PutResult]:
        """`put` of pages that lie in the caller's buffers (checked by the client: one per hash, each a page)."""

        def one(o: PutOpen, a: int, b: int) -> Exchange[PutResult]:
            return self.put_from_batch(o, hashes[a:b], buffers[a:b], a)

        return (yield from self._puts(op, hashes, self.runs(buffers, writable=False), one))

    def get(
        self, namespace: str, hashes: Sequence[bytes], promote: bool, expect: PageLayout | None = None
    ) -> Exchange[list[FetchedPage]]:
        """Pages of the longest stored prefix of `hashes`, in order, verified."""
        ranges = batches(len(hashes), self.call_pages)
        return (
            yield from self._prefix(
                namespace, ranges, lambda a, b: self.get_batch(namespace, hashes[a:b], promote, expect)
            )
        )

    def get_into(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        buffers: Sequence[Buffer],
        promote: bool,
        expect: PageLayout | None = None,
    ) -> Exchange[list[PageRef]]:
        """Pages of the longest stored prefix of `hashes` written into the caller's `buffers` (page i into
        buffers[i]; checked by the client: one per hash, writable, contiguous, not overlapping)."""

        def one(a: int, b: int) -> Exchange[list[PageRef]]:
            return self.get_into_batch(namespace, hashes[a:b], buffers[a:b], promote, first=a, expect=expect)

        return (yield from self._prefix(namespace, self.runs(buffers, writable=True), one))

    @staticmethod
    def _puts(
        op: PutOpen,
        hashes: Sequence[bytes],
        ranges: list[tuple[int, int]],
        put: Callable[[PutOpen, int, int], Exchange[PutResult]],
    ) -> Exchange[PutResult]:
        total = PutResult(0, 0, [])
        for a, b in ranges:
            r = yield from put(op.batch(hashes, a), a, b)
            total.stored += r.stored
            total.already_present += r.already_present
            total.held = None if total.held is None or r.held is None else total.held + r.held
        return total

    def _prefix(
        self, namespace: str, ranges: list[tuple[int, int]], fetch: Callable[[int, int], Exchange[list[Any]]]
    ) -> Exchange[list[Any]]:
        """What `fetch(a, b)` returns for each range, in order, stopping after the first range that came
        back short (there the longest stored prefix ended) or held a corrupt page (reported, a miss)."""
        out: list[Any] = []
        for a, b in ranges:
            try:
                got = yield from fetch(a, b)
            except PageCorrupt as exc:
                out.extend(exc.good)
                self.corrupt_pages += 1
                yield from report_corrupt(namespace, [exc.hash])
                break
            out.extend(got)
            if len(got) < b - a:
                break
        return out


def report_corrupt(namespace: str, hashes: list[bytes]) -> Exchange[None]:
    """Tell the node these pages arrived damaged (it verifies its copies and drops bad ones). Best effort: the
    caller already treats them as misses, so a node that cannot take the report changes nothing here."""
    try:
        yield Unary("Report", pb.ReportRequest(namespace=namespace, hashes=hashes))
    except KVStoreError as exc:
        log.warning("could not report %d corrupt page(s) in %r to the node: %s", len(hashes), namespace, exc)


def page_size(known: dict[str, int], namespace: str, first: bytes, ask: Callable[[bytes], int]) -> int:
    """The page size of `namespace`, the one rule of every plane that sizes its receives before a Get (the
    same-host plane, UCX; TCP and gRPC streams read each page's size off its header and need none).

    Asked of the node, never guessed: `ask` sends the page-size ask (`kvstore.wire.page_size_ask`, the first
    hash the Get will ask for, then the namespace) and returns the node's answer, parsed with
    `kvstore.wire.parse_page_size`. The node answers it as that Get would be answered (NamespaceNotFound for a
    namespace it does not hold, counted as the Get's refusal). Remembered in `known` (the plane's, at most
    MAX_KNOWN_PAGE_SIZES namespaces), since a namespace's page size is fixed once its first page is stored; a
    plane forgets it (`known.pop`) when the node shows otherwise (a page bigger than the size asked: the node
    restarted and the namespace was laid out anew)."""
    n = known.get(namespace)
    if n is None:
        n = ask(page_size_ask(namespace, first))
        if len(known) >= MAX_KNOWN_PAGE_SIZES:
            known.pop(next(iter(known)))
        known[namespace] = n
    return n
