"""Outage tracking and log rate limiting for engine-side adapters. Pure: the clock is injected.

An engine calls its cache on every request. When the cache does not answer, each call must cost a
miss, not a timeout, and the engine's log must say so once, not once per request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]


@dataclass(slots=True)
class Outage:
    """Whether the remote is believed down. Thread-safe.

    Invariants: while down, `allow()` is False except once per `backoff` seconds (a probe call that
    finds out whether it answers again); `failed()` returns a message only on the up -> down edge and
    `succeeded()` only on the down -> up edge, so each edge is logged once.
    """

    backoff: float
    clock: Clock = time.monotonic
    down_since: float | None = None
    skipped: int = 0
    _next_probe: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def allow(self) -> bool:
        """True when a call should be made; False: answer with a miss (counted in `skipped`)."""
        with self._lock:
            if self.down_since is None:
                return True
            now = self.clock()
            if now >= self._next_probe:
                self._next_probe = now + self.backoff
                return True
            self.skipped += 1
            return False

    def failed(self, cause: str) -> str | None:
        with self._lock:
            now = self.clock()
            self._next_probe = now + self.backoff
            if self.down_since is not None:
                return None
            self.down_since, self.skipped = now, 0
        return (
            f"does not answer ({cause}); serving misses and dropping stores without waiting, retrying every "
            f"{self.backoff:g} s"
        )

    def succeeded(self) -> str | None:
        with self._lock:
            if self.down_since is None:
                return None
            gone, skipped = self.clock() - self.down_since, self.skipped
            self.down_since, self.skipped = None, 0
        return f"answers again after {gone:.1f} s; {skipped} call(s) were answered with a miss meanwhile"


@dataclass(slots=True)
class LogLimiter:
    """At most one log line per kind per `interval` seconds; the next one says how many were held back."""

    interval: float
    clock: Clock = time.monotonic
    _last: dict[str, float] = field(default_factory=dict)
    _held: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, kind: str) -> int | None:
        """None: stay quiet. Otherwise log now; the int is how many were held back since the last one."""
        with self._lock:
            now = self.clock()
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                self._held[kind] = self._held.get(kind, 0) + 1
                return None
            self._last[kind] = now
            return self._held.pop(kind, 0)
