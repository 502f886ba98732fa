"""A plane's pooled connections (the TCP plane, the same-host socket): one request at a time on a connection,
idle ones kept for the next call, and the one retry rule both planes follow.

Invariants: a connection in use is out of the idle list (one caller at a time); at most `keep` are idle; a
connection that may be out of step (`usable` False, a reply cut off mid-stream, a socket error) is closed,
never reused; after `close` nothing is kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from kvstore.client.exchange import Abort
from kvstore.errors import KVStoreError, StreamError, Unavailable

KEEP_IDLE = 4  # idle connections a plane keeps open for the next calls


class PooledConnection(Protocol):
    usable: bool  # False once the connection may be out of step: it is closed, never reused
    replied: bool  # whether the current request got any reply (set False by the pool before each one)

    def close(self) -> None: ...

    def abort(self) -> None:
        """Make the request in progress end soon (from another thread): the caller gave up on it."""


C = TypeVar("C", bound=PooledConnection)
T = TypeVar("T")


class ConnectionPool(Generic[C]):
    """Connections `open_` makes, reused one call at a time. `where` names them in errors ("TCP plane
    connection to host:port"). Thread-safe."""

    def __init__(self, open_: Callable[[], C], where: str, keep: int = KEEP_IDLE) -> None:
        self._open = open_
        self.where = where
        self.keep = keep
        self._idle: list[C] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def call(self, fn: Callable[[C], T], abort: Abort | None = None) -> T:
        """Run one request on a pooled connection; once more on a fresh one when a reused connection turns
        out dead before any reply (the node restarted or dropped an idle connection: a Get is idempotent,
        and a Put whose connection died before any reply was aborted by the node). A fired `abort` makes
        the connection's request end soon (`abort()` of the connection); an aborted call is not retried."""
        for attempt in range(2):
            if abort is not None and abort.fired:
                raise Unavailable(f"{self.where}: the call was cancelled")
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            reused = conn is not None
            if conn is None:
                conn = self._open()
            conn.replied = False
            forget = abort.on_abort(conn.abort) if abort is not None else None
            try:
                result = fn(conn)
            except StreamError:  # the reply broke off mid-stream: the connection is out of step
                conn.close()
                raise
            except KVStoreError:  # an error reply: the node consumed the request; the connection is in step
                self._release(conn)
                raise
            except OSError as exc:
                conn.close()
                # NOTE: a timeout is not a dead connection: retrying it would double the caller's wait.
                if reused and not conn.replied and attempt == 0 and not isinstance(exc, TimeoutError):
                    continue
                raise Unavailable(f"{self.where} failed: {exc}") from None
            except BaseException:
                conn.close()
                raise
            finally:
                if forget is not None:
                    forget()
            self._release(conn)
            return result
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _release(self, conn: C) -> None:
        """Keep a connection that is in step for the next call (up to `keep`), else close it."""
        with self._lock:
            keep = conn.usable and not self._closed and len(self._idle) < self.keep
            if keep:
                self._idle.append(conn)
        if not keep:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
