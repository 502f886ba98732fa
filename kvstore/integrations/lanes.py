"""One transfer of a door as several calls in flight: the pages of a task cut into slices, up to `depth` of them
moving at once, their results handed back in order.

Why (measured, benchmarks/RESULTS.md "LMCache's L2 adapters"): one call of a whole task serialises the two
halves of a transfer. On the node's host a page into memory the node did not register is two copies (the node's
into the client's receive block, the client's into the engine's object); over TCP it is the node's send and the
client's receive. With one call the node's half of page k+1 waits for the client's half of page k. Two calls in
flight let them run on two cores at once (no depth above two was measured).

Invariants:
- results come back in the order of the slices; the caller may stop early (break out of `ordered`): no slice past
  those in flight is started after that;
- `ordered` returns (normally, by a break, or by an exception) only once every call it started has ended, so no
  call can still be writing into (or reading from) the caller's memory when the task that owns it completes;
- calls run on this object's own threads (one pool per kind of work: a slow store never holds a load's lane).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

S = TypeVar("S")
T = TypeVar("T")

# NOTE: calls in flight per task, and the bytes each call moves. Two calls keep both halves of a transfer busy
# (above). A call has a fixed cost (a request, a reply, the node's transaction: ~0.7 ms on the shared 2-vCPU VM),
# so slices are large: measured on one host (LMCache L2 adapter, 16-object tasks, same process, alternated, load
# 4-6): 8 MiB slices lost to one call per task at 2 MiB objects (store 2.11 vs 2.46 GB/s, load 2.48 vs 2.80);
# 32 MiB slices matched it there (one call) and beat it at 16 MiB objects (store 2.33 vs 1.73, load 3.50 vs 2.21).
DEPTH = 2
SLICE_BYTES = 32 << 20


def slices(
    n: int, page_bytes: int, slice_bytes: int | None = None, max_pages: int | None = None
) -> list[tuple[int, int]]:
    """[a, b) ranges covering n pages, each of at most `slice_bytes` (SLICE_BYTES when None) and `max_pages` pages
    (at least one page)."""
    per = max(1, (SLICE_BYTES if slice_bytes is None else slice_bytes) // max(1, page_bytes))
    if max_pages is not None:
        per = max(1, min(per, max_pages))
    return [(a, min(a + per, n)) for a in range(0, n, per)]


class Lanes:
    """`depth` calls in flight at most per `ordered` run, on `threads` worker threads shared by all runs."""

    def __init__(self, name: str, threads: int, depth: int = DEPTH) -> None:
        if threads < 1 or depth < 1:
            raise ValueError(f"lanes {name!r}: threads and depth must be at least 1, got {threads} and {depth}")
        self.depth = depth
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"kvstore-{name}")

    def ordered(self, fn: Callable[[S], T], items: Iterable[S]) -> Iterator[T]:
        """fn(item) for each item, up to `depth` at once, yielded in order (see the module invariants).

        With one item, or depth 1, fn runs on the caller's thread (no hand-off to pay)."""
        items = list(items)
        if len(items) <= 1 or self.depth == 1:
            for item in items:
                yield fn(item)
            return
        pending: collections.deque[Future[T]] = collections.deque()
        queue = iter(items)
        try:
            for item in queue:
                pending.append(self._pool.submit(fn, item))
                if len(pending) >= self.depth:
                    break
            while pending:
                result = pending.popleft().result()
                nxt = next(queue, None)
                if nxt is not None:
                    pending.append(self._pool.submit(fn, nxt))
                yield result
        finally:
            for f in pending:  # stopped early: what has not started never will, what has is waited for
                if not f.cancel():
                    with contextlib.suppress(Exception):
                        f.result()

    def close(self) -> None:
        """Stop taking work; calls queued and not started are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
