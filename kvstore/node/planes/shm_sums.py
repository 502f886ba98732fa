"""A same-host PUT_SUMS's checksums: the SUMS message that follows its request on the same connection
(kvstore/wire/shm.py), read while the node copies the pages and handed to the put transaction, which publishes
nothing before every page's checksum came and matched (manager/put.py: DeclaredLater).

The connection (shm.py) owns the socket: it reads a message that comes during a PUT_SUMS and hands it here
(`SumsWait.take`); this module owns what the connection waits for, the deadline, and a SUMS that comes after
its PUT_SUMS was answered.

Invariants: a SUMS is taken only for the PUT_SUMS in progress (same seq), anything else during one fails it
(the connection is out of protocol); a SUMS not come within `shm_idle_seconds` fails the Put; a PUT_SUMS
answered (refused) before its SUMS came leaves that SUMS to be dropped when it comes (`is_late`), never read
as a request; a failed SUMS no Put waited for is retrieved, never logged as "never retrieved".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence

from kvstore.wire import shm
from kvstore.wire.shm import Kind, ProtocolError


class SumsWait:
    """What one connection waits for of a PUT_SUMS: the checksums its SUMS brings, its seq and page count, and
    the seq of one answered before its SUMS came (dropped when it comes). One at a time: a connection serves
    one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop, self.timeout_s = loop, timeout_s
        self._sums: asyncio.Future[Sequence[int]] | None = None
        self._seq = 0
        self._pages = 0
        self._late: int | None = None  # the seq of a PUT_SUMS answered before its SUMS came (dropped)

    def announce(self, seq: int) -> None:
        """A PUT_SUMS `seq` came: until its SUMS is read, one answered before it comes drops it when it comes
        (set before the request is parsed: a PUT_SUMS refused as unreadable has its SUMS following too)."""
        self._late = seq

    def is_late(self, kind: Kind, seq: int) -> bool:
        """Whether this message is the SUMS of a PUT_SUMS answered before it came (then forgotten: once)."""
        if kind is Kind.SUMS and seq == self._late:
            self._late = None
            return True
        return False

    @property
    def expecting(self) -> bool:
        """A PUT_SUMS is in progress and its SUMS has not come."""
        return self._sums is not None and not self._sums.done()

    @contextlib.contextmanager
    def waiting(self, seq: int, pages: int) -> Iterator[asyncio.Future[Sequence[int]]]:
        """The future of PUT_SUMS `seq`'s `pages` checksums for the block: failed past the deadline; when the
        block ends with it unresolved it is cancelled (and its SUMS left to `is_late`)."""
        self._sums = sums = self.loop.create_future()
        self._seq, self._pages = seq, pages
        timer = self.loop.call_later(self.timeout_s, self._overdue, sums)
        try:
            yield sums
        finally:
            timer.cancel()
            self._sums = None
            if not sums.done():
                sums.cancel()
            else:
                self._late = None
                if not sums.cancelled():
                    sums.exception()  # NOTE: retrieved: a failed SUMS no Put waited for is no "never retrieved"

    def take(self, msg: bytes) -> None:
        """A message read during the PUT_SUMS: its SUMS resolves the wait; anything else fails it."""
        assert self._sums is not None
        try:
            kind, seq, body = shm.unframe(msg)
            if kind is not Kind.SUMS or seq != self._seq:
                raise ProtocolError(f"a PUT_SUMS (request {self._seq}) is followed by its SUMS, not {kind.name} "
                                    f"(request {seq})")  # fmt: skip
            self._sums.set_result(shm.parse_sums(body, self._pages))
        except ProtocolError as exc:
            self._sums.set_exception(exc)

    def _overdue(self, sums: asyncio.Future[Sequence[int]]) -> None:
        if not sums.done():
            sums.set_exception(
                ProtocolError(f"no SUMS came for a PUT_SUMS within {self.timeout_s:g} s (shm_idle_seconds)")
            )
