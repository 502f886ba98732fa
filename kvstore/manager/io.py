"""The manager's blocking-I/O pool: media transfers run here, never on the event loop. Batches of copies into a
caller's memory (`IoPool.copy_many`, the same-host plane) run on the loop and on this pool's threads side by side."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvstore.tiers.base import Into, Medium, SlotRead

T = TypeVar("T")
_MAX_CANCEL_DEFERRALS = 10_000  # repeated cancels while waiting out an in-flight I/O (bounded loop)

Then = Callable[[], Any] | None  # what runs in the I/O thread right after a read (verification)
_PendingRead = tuple[int, Into, Then, "asyncio.Future[Any]"]
Copy = Callable[[memoryview, memoryview], Any]  # copies its first view into its second (and says what it saw)
Pairs = Sequence[tuple[memoryview, memoryview]]  # (source, destination) of each copy of a batch

# A batch of copies (IoPool.copy_many) of at most INLINE_COPY_BYTES runs on the event loop at once; a larger one
# is cut into parts, one per pool thread and one for the loop, of at least COPY_PART_BYTES each: the loop copies
# the first part itself, LOOP_SLICE_BYTES at a time (other callbacks run between slices), and pool threads the
# others, side by side. NOTE: measured (same-host get_into of 16 DRAM pages of 1 and 4 MiB, 2 vCPUs under load
# 6-10, 2026-11-28, benchmarks/shm_ab.py, same run): all parts (loop + 4 threads) ran 1.47x / 1.55x the GB/s
# of the loop alone and 1.4x / 1.2x of two parts, at equal or less node CPU per GB; gating a split on the cores
# /proc/loadavg says are free left a loaded machine's gets on the loop alone, the slowest of the three.
INLINE_COPY_BYTES = 1 << 20
COPY_PART_BYTES = 1 << 20
LOOP_SLICE_BYTES = 4 << 20


class IoPool:
    """A bounded thread pool whose calls, once started, always finish before their caller moves on.

    Invariant: when `run` or `read` returns or raises (cancellation included), the blocking call it
    started has ended. NOTE: the worker thread reads or writes our buffers (DRAM slots, bounce buffers).
    If a cancelled caller's cleanup freed a slot while the thread still wrote into it, the slot could be
    handed to a Put and overwritten after its bytes arrived, before its checksum is taken.

    Batched reads: `read` gathers the reads of one medium asked for in the same event-loop iteration
    (a batched Get reading ahead asks for many at once) into one `Medium.read_many` call, so a medium
    that can keep I/Os in flight (NVMe: `queue_depth` reads) gets them all at once instead of one per
    pool thread. A read may carry `then`, run in the thread that did the read as soon as it ended (the
    page's verification): hashing releases the GIL, so pages are verified beside the reads still in
    flight and the event loop only compares the result.
    """

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvstore-io")
        self._pending: dict[Medium, list[_PendingRead]] = {}  # reads gathered this loop iteration
        self._batches: set[asyncio.Task[None]] = set()  # running read_many calls (strong references)
        self.parts = threads + 1  # a batch of copies is cut into at most one part per pool thread and the loop

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        return await _wait_out(fut)

    async def read(self, medium: Medium, slot: int, into: Into, then: Then = None) -> Any:
        """`medium.read(slot, into)`, then `then()` in the same thread; returns what `then` returned
        (None without it). Batched with the other reads of `medium` asked for in this loop iteration
        into one `read_many` call (a medium without a queue, `queue_depth` 1, gets each read on its own
        pool thread, as `run` would). Returns or raises only once this read (and `then`) has ended."""
        if medium.queue_depth <= 1:
            return await self.run(_read_then, medium, slot, into, then)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        pending = self._pending.get(medium)
        if pending is None:
            pending = self._pending[medium] = []
            loop.call_soon(self._flush, medium)  # runs after every task already scheduled: they join
        pending.append((slot, into, then, fut))
        return await _wait_out(fut)

    async def copy_many(self, fn: Copy, pairs: Pairs) -> list[Any]:
        """`fn(src, dest)` for each pair; per pair, in order, what `fn` returned or the exception it raised.
        Up to INLINE_COPY_BYTES in all run on the event loop at once; a larger batch is cut in order into up to
        `parts` parts of at least COPY_PART_BYTES: the loop copies the first part itself, in slices, pool
        threads the others side by side (one handoff each). Returns or raises only once every copy it
        started has ended (cancelled or not: no `dest` is written after it returns)."""
        total = sum(len(src) for src, _ in pairs)
        if total <= INLINE_COPY_BYTES:
            return _copy_all(fn, pairs)
        k = min(self.parts, len(pairs), -(-total // COPY_PART_BYTES))
        mine, *others = cut(pairs, k)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        theirs: list[list[Any]] = [[] for _ in others]
        left = len(others)

        def finished(i: int, results: list[Any]) -> None:  # on the loop, once a part's copies have ended
            nonlocal left
            theirs[i] = results
            left -= 1
            if left == 0 and not done.done():
                done.set_result(None)

        for i, part in enumerate(others):
            try:
                self._pool.submit(_copy_part, loop, fn, part, functools.partial(finished, i))
            except RuntimeError as exc:  # the pool is shut down: this part never started
                finished(i, [exc] * len(part))
        if not others:
            done.set_result(None)
        results: list[Any] = []
        try:
            for piece in slices(mine, LOOP_SLICE_BYTES):
                if results:
                    await asyncio.sleep(0)  # NOTE: other requests get the loop between slices
                results += _copy_all(fn, piece)
        finally:
            await _wait_out(done)  # cancelled or not, the threads' copies end before this returns
        return results + [r for part in theirs for r in part]

    def _flush(self, medium: Medium) -> None:
        batch = self._pending.pop(medium, [])
        if batch:
            task = asyncio.get_running_loop().create_task(self._read_batch(medium, batch))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _read_batch(self, medium: Medium, batch: list[_PendingRead]) -> None:
        loop = asyncio.get_running_loop()

        def settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is None:
                fut.set_result(result)
            else:
                fut.set_exception(exc)

        def done(i: int) -> None:  # in an I/O thread: each reader resumes as soon as its own read ended
            _, _, then, fut = batch[i]
            try:
                result, exc = (then() if then is not None else None), None
            except Exception as err:  # a failed follow-up fails only its own read
                result, exc = None, err
            loop.call_soon_threadsafe(settle, fut, result, exc)

        try:
            errors = await self.run(_read_all, medium, [(slot, into) for slot, into, _, _ in batch], done)
        except asyncio.CancelledError:  # the loop is shutting down; the reads themselves have ended
            for *_, fut in batch:
                fut.cancel()
            raise
        except Exception as exc:  # the pool itself failed (shut down): every read fails with it
            errors = [exc] * len(batch)
        # Every `done` call has returned before read_many did, and its settle was queued before this
        # task resumed: a read that succeeded is settled already. What is left failed.
        for (_, _, then, fut), err in zip(batch, errors, strict=True):
            if fut.done():
                continue
            if err is None:  # NOTE: not reached by a medium that keeps the read_many contract
                try:
                    settle(fut, then() if then is not None else None, None)
                except Exception as exc:
                    fut.set_exception(exc)
            else:
                fut.set_exception(err)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def cut(items: Sequence[T], parts: int) -> list[Sequence[T]]:
    """`items` in `parts` consecutive runs of lengths differing by at most one (none empty)."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    runs, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        runs.append(items[start:end])
        start = end
    return runs


def slices(pairs: Pairs, nbytes: int) -> list[Pairs]:
    """`pairs` in consecutive runs of at most `nbytes` of sources each (a larger pair is a run of its own)."""
    runs: list[Pairs] = []
    start = size = 0
    for i, (src, _) in enumerate(pairs):
        if i > start and size + len(src) > nbytes:
            runs.append(pairs[start:i])
            start, size = i, 0
        size += len(src)
    if start < len(pairs):
        runs.append(pairs[start:])
    return runs


def _copy_all(fn: Copy, pairs: Pairs) -> list[Any]:
    """Each copy in order: what it returned, or what it raised (a failed copy fails only its own page)."""
    results: list[Any] = []
    for src, dest in pairs:
        try:
            results.append(fn(src, dest))
        except Exception as exc:
            results.append(exc)
    return results


def _copy_part(
    loop: asyncio.AbstractEventLoop,
    fn: Copy,
    pairs: Pairs,
    then: Callable[[list[Any]], None],
) -> None:
    """In a pool thread: one part's copies, then `then(results)` on the loop (one wake-up)."""
    results = _copy_all(fn, pairs)
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(then, results)


def _read_then(medium: Medium, slot: int, into: Into, then: Then) -> Any:
    medium.read(slot, into)
    return then() if then is not None else None


def _read_all(medium: Medium, ops: Sequence[SlotRead], done: Callable[[int], None]) -> list[BaseException | None]:
    """Every read of a batch, each one's error or None; `done(i)` as each read succeeds. One read_many
    call; when that fails, the reads it did not complete are retried one by one, so a bad slot fails
    only its own reader. NOTE: a completed read is never redone: its reader may already have moved on
    and handed its buffer to someone else."""
    completed: set[int] = set()

    def note(i: int) -> None:
        completed.add(i)
        done(i)

    try:
        medium.read_many(ops, note)
        return [None] * len(ops)
    except Exception:
        errors: list[BaseException | None] = []
        for i, (slot, into) in enumerate(ops):
            if i in completed:
                errors.append(None)
                continue
            try:
                medium.read(slot, into)
                errors.append(None)
                note(i)
            except Exception as exc:
                errors.append(exc)
        return errors


async def _wait_out(fut: asyncio.Future[T]) -> T:
    """Await an I/O's future; when cancelled, first wait (bounded) until the I/O itself has ended."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        for _ in range(_MAX_CANCEL_DEFERRALS):
            if fut.done():
                break
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([fut])
        raise
