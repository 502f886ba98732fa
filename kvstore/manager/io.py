"""The manager's blocking-I/O pool: media transfers run here, never on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
_MAX_CANCEL_DEFERRALS = 10_000  # repeated cancels while waiting out an in-flight I/O (bounded loop)


class IoPool:
    """A bounded thread pool whose calls, once started, always finish before their caller moves on.

    Invariant: when `run` returns or raises (cancellation included), the blocking call it started has
    ended. NOTE: the worker thread reads or writes our buffers (DRAM slots, bounce buffers). If a
    cancelled caller's cleanup freed a slot while the thread still wrote into it, the slot could be handed
    to a Put and overwritten after its bytes arrived, before its checksum is taken.
    """

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvstore-io")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            for _ in range(_MAX_CANCEL_DEFERRALS):
                if fut.done():
                    break
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([fut])
            raise

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
