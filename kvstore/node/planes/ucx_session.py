"""One UCX connection on the node (ucx.py): the authenticated client (`Connection`: its endpoints, session
tags, token, the buffers a stuck receive may still write) and how the plane waits for, settles and sends its
transfers (`Transfers`), which both the listener (ucx.py) and the requests (ucx_requests.py) use.

Invariants: every wait is bounded (`io_timeout` unless told) and ends early (UcxClosed) once the connection
closed; after a failure every posted transfer is made to finish (the endpoints closed, which cancels them)
before its buffer is reused, and a buffer whose transfer never finished stays out of use for good
(`Connection.stuck`); a failed page transfer is DATA_LOSS to the client (`lost`), with nothing stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from kvstore.errors import DataLoss, KVStoreError
from kvstore.node.planes.ucx_intake import Intake
from kvstore.security import AUTH_HEADER
from kvstore.wire.ucx import Hello, SessionTags
from kvstore.wire.ucx_progress import LoopProgress

log = logging.getLogger("kvstore.node.planes.ucx")  # NOTE: the plane's logger (ucx.py): one name

SETTLE_SECONDS = 5.0  # after a failure: how long cancelled or closed transfers get to finish

Respond = Callable[[bytes], None]


class Connection:
    """One authenticated client. `ep` carries replies and GET pages and tracks the node's receives (closing
    it cancels them); `hello_ep` is the listener endpoint the HELLO came on (the same one unless the
    client asked for worker-address lanes). Both stay open while the client is served: the listener
    endpoint is in peer-failure mode, so it reports a vanished client even where `ep` is not (shared
    memory has no peer-failure handler). `closed` is set once, by either endpoint's close callback or by us.
    `held`: early PUT pages the intake took for this connection (tag -> probe handle)."""

    def __init__(self, ep: Any, hello_ep: Any, hello: Hello) -> None:
        self.ep = ep
        self.hello_ep = hello_ep
        self.tags = SessionTags.new()
        self.metadata = ((AUTH_HEADER, f"Bearer {hello.token}"),) if hello.token else None
        self.closed = asyncio.Event()
        self.held: dict[int, Any] = {}
        self.scratch = bytearray(0)  # where already-stored pages of a PUT are received and dropped
        self.stuck: list[Any] = []  # buffers a receive that never finished may still write: never reused
        self.name = f"{id(self):#x}"
        ep.set_close_callback(self.closed.set)
        if hello_ep is not ep:
            hello_ep.set_close_callback(self.closed.set)

    def alive(self) -> bool:
        return not self.closed.is_set() and self.ep.alive and self.hello_ep.alive

    def overflow(self) -> None:
        """The intake held too many early messages for us: close (outside the intake's drain)."""
        self.closed.set()
        asyncio.get_running_loop().call_soon(self.close)

    def close(self) -> None:
        self.closed.set()
        for ep in {id(self.ep): self.ep, id(self.hello_ep): self.hello_ep}.values():
            close_endpoint(ep)


def close_endpoint(ep: Any) -> None:
    with contextlib.suppress(Exception):  # closing an endpoint whose peer is gone may fail
        ep.close_blocking(period=10**8, max_attempts=1)  # bounded: 100 ms


class Transfers:
    """The plane's UCX machinery as requests use it: the ucxx module (`ucx`) and its `Array`, the worker's
    progress on the loop, the intake of unexpected messages, whether UCX here sends device memory (`cuda`),
    and the I/O timeout."""

    def __init__(
        self, ucx: Any, array: Any, progress: LoopProgress, intake: Intake, *, cuda: bool, io_timeout: float
    ) -> None:
        self.ucx, self.Array, self.progress, self.intake = ucx, array, progress, intake
        self.cuda, self.io_timeout = cuda, io_timeout
        self.empty = array(bytearray(0))  # what a receive past the pages sent gets

    async def wait(
        self, reqs: list[Any], what: str, closed: asyncio.Event | None, timeout: float | None = None
    ) -> None:
        """Wait for requests (io_timeout unless told), failing early (UcxClosed) once `closed` is set."""
        await self.progress.wait(reqs, self.io_timeout if timeout is None else timeout, what, closed)

    async def settle(self, reqs: list[Any], conn: Connection) -> bool:
        """After a failure: make every request finish (close the endpoints, which cancels what is posted
        on them); True when all did, so their buffers may be reused. A request that never finishes is
        reported, and its buffer must then stay out of use (the caller leaks it rather than risk a late
        write)."""
        pending = [r for r in reqs if not r.completed]
        if not pending:
            return True
        conn.close()
        with contextlib.suppress(Exception):
            await self.wait(pending, "cancelling transfers", None, timeout=SETTLE_SECONDS)
        if all(r.completed for r in pending):
            return True
        log.error(
            "UCX connection %s: %d transfer(s) did not finish after close; their buffers stay out of use",
            conn.name,
            sum(not r.completed for r in pending),
        )
        return False

    def send(self, ep: Any, tag: int, msg: bytes) -> tuple[Any, Any]:
        """Post a send of a control message: (the request, its buffer, to be kept until it completed)."""
        arr = self.Array(bytearray(msg))
        return ep.tag_send(arr, self.ucx.UCXXTag(tag)), arr


def lost(exc: Exception) -> KVStoreError:
    """A failed page transfer as the client sees it (if its endpoint still listens): DATA_LOSS."""
    return DataLoss(f"UCX page transfer failed ({type(exc).__name__}: {exc}); nothing was stored")
