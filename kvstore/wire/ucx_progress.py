"""Driving a UCX worker in blocking-progress mode: on an asyncio loop (node) or on the caller's thread (client).

Blocking mode (the worker's epoll fd wakes us; no progress thread) costs no CPU while idle and, measured
on a 2-core host, moves bytes faster than ucxx's progress thread, which competes with the peer process
for the same cores. Every wait here is bounded: UCX operations can hang when a peer vanishes without
its transport noticing, so each carries a deadline and fails with `UcxTimeout`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

EVENT_POLL_MS = 100  # longest single epoll wait of a blocking waiter (it re-checks its deadline after)
TICK_SECONDS = 0.05  # the loop driver also progresses this often while requests are pending
PROGRESS_ROUNDS = 64  # worker progress rounds per loop callback before yielding to the loop


class UcxTimeout(TimeoutError):
    """A UCX operation did not complete within its deadline."""


class UcxClosed(ConnectionError):
    """The endpoint an operation waited on was closed or failed."""


def wait_blocking(
    worker: Any,
    requests: Sequence[Any],
    deadline: float,
    alive: Callable[[], bool] | None = None,
    what: str = "UCX transfer",
) -> None:
    """Progress `worker` on this thread until every request completed (then raise the first error),
    the monotonic `deadline` passed (UcxTimeout), or `alive()` turned False (UcxClosed)."""
    pending = list(requests)
    while True:
        pending = [r for r in pending if not r.completed]
        if not pending:
            break
        if alive is not None and not alive():
            raise UcxClosed(f"{what}: the endpoint closed")
        left = deadline - time.monotonic()
        if left <= 0:
            raise UcxTimeout(f"{what}: no completion within the deadline")
        worker.progress_worker_event(max(1, min(EVENT_POLL_MS, int(left * 1000))))
    for r in requests:
        r.check_error()


@dataclass(slots=True, eq=False)
class _Waiter:
    """A group of requests one task waits for: done at the first error, when all completed, or when
    `closed` (an endpoint's close event) is set."""

    pending: list[Any]
    fut: asyncio.Future[None]
    closed: asyncio.Event | None
    what: str


class LoopProgress:
    """Progresses one worker on an asyncio loop: a reader on its epoll fd, plus a short tick while any
    request is awaited (a safety net against a missed wake-up). Single-threaded: call it from the loop.

    Invariant: after every call into the worker the worker is re-armed (`arm()` returned True), so the
    next UCX event wakes the loop (or another progress is already scheduled). `after_progress` (if
    given) runs after every worker progress, before completions are settled.
    """

    def __init__(
        self, worker: Any, loop: asyncio.AbstractEventLoop, after_progress: Callable[[], object] | None = None
    ) -> None:
        self.worker = worker
        self.loop = loop
        self.after_progress = after_progress
        worker.init_blocking_progress_mode()
        self.fd = worker.epoll_file_descriptor
        self._waiters: list[_Waiter] = []
        self._tick: asyncio.TimerHandle | None = None
        self._closed = False
        loop.add_reader(self.fd, self.progress)

    def progress(self) -> None:
        """Run UCX callbacks and completions until the worker is armed again; settle finished waits.

        One `progress_once` per round (ucxx's `progress` loops for as long as anything moves, so a peer
        that keeps sending would keep it there), then `after_progress`: what UCX takes in between two
        of those calls is bounded by what one round reads off its transports. Bounded: after
        PROGRESS_ROUNDS rounds without arming (a peer keeps the worker busy), the rest is left to a
        callback of its own, so the loop's other work gets its turn in between."""
        if self._closed:
            return
        for _ in range(PROGRESS_ROUNDS):
            moved = self.worker.progress_once()
            if self.after_progress is not None:
                self.after_progress()
            self._settle()
            if not moved and self.worker.arm():  # arm() fails while events are pending: progress again
                break
        else:
            self.loop.call_soon(self.progress)
        self._schedule_tick()

    def _settle(self) -> None:
        if not self._waiters:
            return
        still = []
        for w in self._waiters:
            if w.fut.done():
                continue
            try:
                for req in w.pending:
                    if req.completed:
                        req.check_error()
                w.pending = [r for r in w.pending if not r.completed]
            except Exception as exc:
                w.fut.set_exception(exc)
                continue
            if not w.pending:
                w.fut.set_result(None)
            elif w.closed is not None and w.closed.is_set():
                w.fut.set_exception(UcxClosed(f"{w.what}: the endpoint closed"))
            else:
                still.append(w)
        self._waiters = still

    def _schedule_tick(self) -> None:
        if self._waiters and self._tick is None and not self._closed:
            self._tick = self.loop.call_later(TICK_SECONDS, self._on_tick)

    def _on_tick(self) -> None:
        self._tick = None
        self.progress()

    async def wait(
        self,
        requests: Sequence[Any],
        timeout: float,
        what: str = "UCX transfer",
        closed: asyncio.Event | None = None,
    ) -> None:
        """Until every request completed (raising the first error seen), UcxClosed once `closed` is set
        (checked at every progress, and at least every TICK_SECONDS), or UcxTimeout after `timeout` s."""
        w = _Waiter(list(requests), self.loop.create_future(), closed, what)
        self._waiters.append(w)
        self.progress()
        if not w.fut.done():
            timer = None
            if timeout != float("inf"):
                timer = self.loop.call_later(timeout, _expire, w, timeout)
            try:
                await w.fut
            finally:
                if timer is not None:
                    timer.cancel()
        w.fut.result()

    def close(self) -> None:
        self._closed = True
        if self._tick is not None:
            self._tick.cancel()
        self.loop.remove_reader(self.fd)
        for w in self._waiters:
            if not w.fut.done():
                w.fut.set_exception(UcxClosed("the UCX plane is shutting down"))
        self._waiters = []


def _expire(w: _Waiter, timeout: float) -> None:
    if not w.fut.done():
        w.fut.set_exception(UcxTimeout(f"{w.what}: no completion within {timeout:.1f}s"))
