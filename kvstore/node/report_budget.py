"""How many reported pages each caller may have the node verify: one token bucket per caller. Pure: no I/O,
the clock is an argument.

A Report (a client saw a page fail its checksum on arrival) makes the node re-read and re-verify its copy of
each page named: an NVMe read for a page there. The manager deduplicates a report's hashes; this bounds how
many distinct pages one caller can have verified over time, so a reader cannot keep the node's media busy
by reporting pages again and again. A caller reports a page only when a Get of it failed, so an honest one
stays far below the rate; pages past it are counted (`corrupt_unchecked`) and not read.

Invariant: `take(caller, n, now)` grants at most `burst + rate * (now - first take)` pages to one caller in
all; a caller's bucket refills at `rate` pages a second up to `burst`; at most `max_callers` buckets are kept
(full buckets go first: forgetting one changes nothing).
"""

from __future__ import annotations

REPORT_PAGES_PER_SECOND = 32  # pages one caller may have verified a second, sustained
REPORT_BURST = 256  # and at once: a client that found a run of damaged pages reports them all
MAX_CALLERS = 4096  # buckets kept; past it the fullest are forgotten


class ReportBudget:
    """Token buckets of pages to verify, one per caller (a token's subject, or a peer's host)."""

    def __init__(
        self, rate: float = REPORT_PAGES_PER_SECOND, burst: int = REPORT_BURST, max_callers: int = MAX_CALLERS
    ) -> None:
        if rate <= 0 or burst < 1 or max_callers < 1:
            raise ValueError(f"rate, burst and max_callers must be positive, got {rate}, {burst}, {max_callers}")
        self.rate = rate
        self.burst = burst
        self.max_callers = max_callers
        self._buckets: dict[str, tuple[float, float]] = {}  # caller -> (tokens, when counted)

    def available(self, caller: str, now: float) -> int:
        """Pages `caller` may have verified now."""
        return int(self._tokens(caller, now))

    def take(self, caller: str, pages: int, now: float) -> int:
        """Grant up to `pages` verifications to `caller` now; returns how many were granted."""
        tokens = self._tokens(caller, now)
        granted = min(pages, int(tokens))
        if caller not in self._buckets and len(self._buckets) >= self.max_callers:
            self._forget_full(now)
        self._buckets[caller] = (tokens - granted, now)
        return granted

    def _tokens(self, caller: str, now: float) -> float:
        held = self._buckets.get(caller)
        if held is None:
            return float(self.burst)
        tokens, then = held
        return min(float(self.burst), tokens + max(0.0, now - then) * self.rate)

    def _forget_full(self, now: float) -> None:
        """Drop the buckets that refilled (nothing lost), or else the fullest half."""
        full = [c for c in self._buckets if self._tokens(c, now) >= self.burst]
        if not full:
            by_tokens = sorted(self._buckets, key=lambda c: self._tokens(c, now), reverse=True)
            full = by_tokens[: max(1, len(by_tokens) // 2)]
        for c in full:
            del self._buckets[c]
