"""Fetch-time estimates (DESIGN.md §6.6): how long this node expects a Get of some pages to take, per tier, from
its own recent Gets. Pure: the reader measures its Gets (kvstore/manager/reads.py) and hands the seconds in.

Model, per tier: a Get's time is the latency to its first page plus its bytes over the tier's rate. Both are
exponentially weighted averages over the Gets that ran to their end (weight ALPHA each): the first page's latency
is a sample for that page's tier; the rest of the Get's time is shared among the tiers it read in proportion to
what the current rates say each tier's bytes cost, and each share gives that tier a rate sample. The time counts
what the caller sees on the node's side of the wire: the read out of the tier (an NVMe read, a DRAM view), the
checksum where the node verifies, and the plane sending the page (a lease is held until its bytes are sent), but
not the caller's round trip. Until a tier has been read, DEFAULT_RATES and DEFAULT_LATENCY stand in
(`measured` False). An estimate adds each tier's latency once: a conservative sum for a prefix spread over tiers.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.names import TierKind
from kvstore.stats import TierFetch

ALPHA = 0.2  # weight of one Get in the averages: the last ~10 Gets of a tier dominate its estimate
# NOTE: stated defaults for a tier no Get has read yet: a loopback TCP plane's order of DRAM reads, and a
# datacenter NVMe SSD's; HBM as DRAM (the plane, not the medium, bounds what leaves the node).
DEFAULT_RATES: dict[TierKind, float] = {TierKind.HBM: 2e9, TierKind.DRAM: 2e9, TierKind.NVME: 1e9}
DEFAULT_LATENCY: dict[TierKind, float] = {TierKind.HBM: 2e-4, TierKind.DRAM: 2e-4, TierKind.NVME: 5e-4}
_MIN_SECONDS = 1e-7  # a share below this is clock noise, not a rate sample


@dataclass(slots=True)
class _Rate:
    rate: float  # bytes per second
    latency: float  # seconds to the first page
    rate_samples: int = 0
    latency_samples: int = 0


def _blend(old: float, sample: float, seen: int) -> float:
    """The average after one more sample: the first replaces the stated default, later ones weigh ALPHA."""
    return sample if seen == 0 else old + ALPHA * (sample - old)


class FetchRates:
    """Per-tier averages of this node's Gets. Invariant: every rate > 0 and every latency >= 0."""

    def __init__(self) -> None:
        self._tiers = {k: _Rate(DEFAULT_RATES[k], DEFAULT_LATENCY[k]) for k in TierKind}

    def observe(self, first: TierKind, first_seconds: float, read: dict[TierKind, int], rest_seconds: float) -> None:
        """A Get that ran to its end: `first_seconds` until its first page (in tier `first`) was ready, then
        `rest_seconds` for the rest, having read `read[tier]` payload bytes from each tier."""
        r = self._tiers[first]
        r.latency = _blend(r.latency, max(0.0, first_seconds), r.latency_samples)
        r.latency_samples += 1
        costs = {k: n / self._tiers[k].rate for k, n in read.items() if n > 0}
        total = sum(costs.values())
        if total <= 0:
            return
        for k, cost in costs.items():
            share = rest_seconds * cost / total
            if share < _MIN_SECONDS:
                continue  # NOTE: a rate from clock noise would be absurd: skip it, keep the average
            t = self._tiers[k]
            t.rate = _blend(t.rate, read[k] / share, t.rate_samples)
            t.rate_samples += 1

    def estimate(self, tier: TierKind, pages: int, nbytes: int) -> TierFetch:
        """The expected time to fetch `pages` pages (`nbytes` payload bytes) held in `tier`."""
        r = self._tiers[tier]
        ms = (r.latency + nbytes / r.rate) * 1000.0
        return TierFetch(tier, pages, nbytes, ms, r.rate_samples > 0, r.rate)
