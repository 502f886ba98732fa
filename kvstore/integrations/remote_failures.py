"""The doors' error policy (what remote.py's module docstring lists): every failure of a call to the remote is a
miss (or a dropped store) and at most one log line per kind per LOG_INTERVAL seconds, saying what failed and what
to do about it; a remote that does not answer is skipped for `down_backoff` seconds (integrations/health.py).
Part of `RemoteStore` (remote.py), which supplies the attributes `FailurePolicy` annotates.

Invariant: `_guard` never raises for a remote failure (a KVStoreError, or a ValueError: an argument the client
refused before sending anything); a namespace the node never stored is a plain miss, not logged; calls cut
short by `close()` are not logged as the remote's fault.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from kvstore.client.cluster import NoLiveNode
from kvstore.errors import (
    DataLoss,
    InvalidArgument,
    KVStoreError,
    LayoutMismatch,
    NamespaceNotFound,
    PermissionDenied,
    RemoteError,
    ResourceExhausted,
    StreamError,
    Unauthenticated,
    Unavailable,
)
from kvstore.integrations.health import LogLimiter, Outage

T = TypeVar("T")
LOG_INTERVAL = 30.0  # seconds between two log lines of the same kind
_UNREACHABLE = (Unavailable, NoLiveNode)  # IndexUnavailable too: the index reader wraps Redis's errors
_SLOW = ("DEADLINE_EXCEEDED", "CANCELLED")  # statuses that mean "did not answer in time", not "refused"
# Every kvstore failure is a KVStoreError (the clients map RPC and socket errors onto it, the index reader
# Redis's); ValueError: a caller's argument the client refused before sending anything.
FAILURES = (KVStoreError, ValueError)


class FailurePolicy:
    """`RemoteStore`'s failures turned into misses and log lines; the store supplies what is annotated here."""

    log: logging.Logger
    where: str
    outage: Outage
    limiter: LogLimiter
    _hint: str  # the door's setting prefix, e.g. "remote_storage_plugin.kvstore." for messages
    _closed: bool

    def _guard(self, op: str, ns: str, fn: Callable[[], T], miss: T) -> T:
        """Run fn unless the remote is known to be down; turn every failure into `miss` and a log line."""
        if self._closed or not self.outage.allow():
            return miss
        try:
            result = fn()
        except NamespaceNotFound:
            return miss  # nothing was ever stored there: a plain miss
        except FAILURES as exc:
            if not self._closed:  # calls cut short by close() are not the remote's fault
                self._failed(op, ns, exc)
            return miss
        back = self.outage.succeeded()
        if back is not None:
            self.log.info("%s %s", self.where, back)
        return result

    def _failed(self, op: str, ns: str, exc: BaseException) -> None:
        """One log line (rate-limited per kind) saying what failed and what to do about it."""
        if isinstance(exc, RemoteError) and exc.status_name not in _SLOW:
            self.say("remote:" + op, logging.ERROR, "%s failed %s (namespace %r): %s", self.where, op, ns, exc)
        elif isinstance(exc, (*_UNREACHABLE, RemoteError)):
            self._down(op, exc)
        elif isinstance(exc, (Unauthenticated, PermissionDenied)):
            self.say(
                "auth",
                logging.ERROR,
                "%s refused %s: %s. Check %stoken / %stoken_file (or KVSTORE_TOKEN): "
                "it must be a read-write token of that node",
                self.where,
                op,
                exc,
                self._hint,
                self._hint,
            )
        elif isinstance(exc, (InvalidArgument, LayoutMismatch)):
            self.say(
                "rejected:" + op,
                logging.ERROR,
                "%s rejected %s in namespace %r: %s. Nothing was stored; the engine recomputes these chunks",
                self.where,
                op,
                ns,
                exc,
            )
        elif isinstance(exc, ResourceExhausted):
            self.say("full", logging.WARNING, "%s is full, %s dropped: %s", self.where, op, exc)
        elif isinstance(exc, (DataLoss, StreamError)):
            self.say(
                "corrupt",
                logging.ERROR,
                "%s sent a page that failed verification in namespace %r (%s); it is a miss, from that page on",
                self.where,
                ns,
                exc,
            )
        else:
            self.say("other:" + op, logging.ERROR, "%s: %s failed: %s: %s", self.where, op, type(exc).__name__, exc)

    def _down(self, op: str, exc: BaseException) -> None:
        msg = self.outage.failed(f"{op}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        if msg is not None:
            self.log.error("%s %s", self.where, msg)

    def say(self, kind: str, level: int, fmt: str, *args: object) -> None:
        """Log at most once per LOG_INTERVAL per kind (the next line counts what was held back)."""
        held = self.limiter.admit(kind)
        if held is None:
            return
        if held:
            fmt += " (%d more like this since the last report)"
            args = (*args, held)
        self.log.log(level, fmt, *args)
