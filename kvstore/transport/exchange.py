"""Exchanges: client-side protocol logic written once, driven by a blocking or an asyncio caller.

An exchange is a generator. It yields operations (a gRPC call, or a blocking function such as a socket
transfer), receives each one's result at the yield (or has its error thrown in there), and returns its
own result. It does no I/O of its own beyond memory copies, so the same code serves `KVStoreClient`,
which performs each operation on the caller's thread, and `AsyncKVStoreClient`, which awaits it
(blocking functions run in a worker thread). A new data plane is written once, as exchanges.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstore.layout import PageLayout
from kvstore.names import Buffer, TierKind
from kvstore.wire import FetchedPage, PageRef

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Unary:
    """A unary KVStore RPC by method name; the result is the response message."""

    method: str
    request: Any


@dataclass(frozen=True, slots=True)
class ClientStream:
    """A client-streaming RPC whose requests are already serialized; the result is the response."""

    method: str
    requests: Iterable[bytes]


@dataclass(frozen=True, slots=True)
class ServerStream:
    """A server-streaming RPC; every serialized response is handed to `sink`; the result is None."""

    method: str
    request: Any
    sink: Callable[[bytes], None]


@dataclass(frozen=True, slots=True)
class Blocking:
    """A blocking function (socket transfers, say): called on the caller's thread by the blocking
    client, in a worker thread by the asyncio client; the result is its return value."""

    fn: Callable[[], Any]


Op = Unary | ClientStream | ServerStream | Blocking
Exchange = Generator[Op, Any, T]
Outcome = tuple[Any, Exception | None]  # an operation's (result, error): one of them is None


def advance(exchange: Exchange[T], result: Any = None, error: Exception | None = None) -> tuple[Op | None, T | None]:
    """One step of a driver: send the last operation's result into the exchange (or throw its error in
    at the yield). Returns (next operation, None), or (None, the exchange's result) once it returned.
    The first call (no result) starts the exchange."""
    try:
        op = exchange.throw(error) if error is not None else exchange.send(result)
    except StopIteration as done:
        return None, done.value
    return op, None


class DataPlane(abc.ABC):
    """The client side of one bulk data plane: Put and Get of page bytes, as exchanges.

    A plane that cannot serve a call (the node lacks it, or cannot reach the client's memory) raises
    `PlaneUnavailable` before anything was stored or returned; the client then falls back to the next
    plane for good. Checksums follow DESIGN.md §8: the node verifies every page it reads from a tier; a
    plane whose bytes cross a network verifies them again on arrival (unless the caller opted out with
    verify=False); a same-host plane (shm) crosses none and verifies nothing twice.
    """

    name: str

    @abc.abstractmethod
    def put(self, namespace: str, layout: PageLayout, hashes: Sequence[bytes], pages: Sequence[Buffer],
            target: TierKind | None, parent: bytes | None, chain: bool) -> Exchange[tuple[int, int]]:  # fmt: skip
        """Store pages (each call of at most pages_per_call pages is atomic); returns (stored, already_present).
        With `chain`, page i's chain parent is page i-1 and the first page's is `parent`."""

    @abc.abstractmethod
    def get(self, namespace: str, hashes: Sequence[bytes], promote: bool) -> Exchange[list[FetchedPage]]:
        """Pages of the longest stored prefix of `hashes`, in order, verified."""

    def get_into(self, namespace: str, hashes: Sequence[bytes], buffers: Sequence[Buffer],
                 promote: bool) -> Exchange[list[PageRef]]:  # fmt: skip
        """Pages of the longest stored prefix of `hashes` written into the caller's `buffers` (page i into
        buffers[i]), verified; returns what landed, in order. The caller (ClientCore) checked the buffers
        (one per hash, writable, contiguous, not overlapping). This default gets the pages and copies
        each once, after checking that every page fits, so a buffer too small changes nothing; a plane
        that can write straight into caller memory overrides it."""
        pages = yield from self.get(namespace, hashes, promote)
        for i, page in enumerate(pages):
            if memoryview(buffers[i]).nbytes < len(page.data):
                raise ValueError(f"buffers[{i}]: {memoryview(buffers[i]).nbytes} bytes cannot hold a "
                                 f"{len(page.data)}-byte page")  # fmt: skip
        out: list[PageRef] = []
        for i, page in enumerate(pages):
            n = len(page.data)
            with memoryview(buffers[i]) as dst, dst.cast("B") as raw:
                raw[:n] = page.data
            out.append(PageRef(page.hash, page.tier, n))
        return out

    def put_from(self, namespace: str, layout: PageLayout, hashes: Sequence[bytes], buffers: Sequence[Buffer],
                 target: TierKind | None, parent: bytes | None, chain: bool) -> Exchange[tuple[int, int]]:  # fmt: skip
        """`put` of pages that lie in the caller's buffers (checked by the caller: one per hash, each one
        page). This default is `put` itself; a plane that can read caller memory in place overrides it."""
        return (yield from self.put(namespace, layout, hashes, buffers, target, parent, chain))

    def close(self) -> None:
        """Release what the plane holds (segments, connections)."""
        return None


def batches(n: int, size: int) -> list[tuple[int, int]]:
    """[start, end) ranges of at most `size` covering range(n)."""
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def prefix_batches(n: int, size: int, fetch: Callable[[int, int], Exchange[list[T]]]) -> Exchange[list[T]]:
    """What `fetch(a, b)` returns for the batches [a, b) of range(n) (at most `size` each), in order,
    stopping after the first batch that came back short: there the longest stored prefix ended."""
    out: list[T] = []
    for a, b in batches(n, size):
        got = yield from fetch(a, b)
        out.extend(got)
        if len(got) < b - a:
            break
    return out
