"""Rates over an interval from two samples of what nodes export (`kvctl top`). Pure: no I/O.

A sample is a node's Stats (cumulative counters since the node started) plus, when its /metrics is
reachable, the cumulative RPC latency histogram per method. Rates are the counters' deltas over the
time between the samples; a counter that went down means the node restarted, and then (as Prometheus'
rate() does) the new value counts as the delta since the restart. A quantile of a histogram delta uses
Prometheus' histogram_quantile interpolation: linear within the bucket that holds the rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvstore.stats import NodeStats

RPC_METRIC = "kvstore_rpc_duration_seconds"


@dataclass(frozen=True, slots=True)
class RpcHistogram:
    """Cumulative latency histogram of one RPC method on one node.

    Invariant: `buckets` is sorted by upper bound, counts are cumulative (non-decreasing) and the last
    bound is +inf with the total count."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float


@dataclass(slots=True)
class NodeSample:
    """What one node exported at monotonic time `taken`; `stats` is None when the node did not answer."""

    addr: str
    taken: float
    stats: NodeStats | None
    rpcs: dict[str, RpcHistogram] = field(default_factory=dict)
    error: str | None = None

    @property
    def node_id(self) -> str:
        return self.stats.node_id if self.stats is not None else self.addr


@dataclass(slots=True)
class TierRates:
    tier: str
    hits_per_s: float
    misses_per_s: float
    hit_ratio: float | None  # None: no reads in the interval
    bytes_in_per_s: float
    bytes_out_per_s: float
    evictions_per_s: float
    promotions_per_s: float
    demotions_per_s: float
    used_bytes: int
    capacity_bytes: int


@dataclass(slots=True)
class RpcRates:
    method: str
    calls_per_s: float
    mean_s: float | None
    p50_s: float | None
    p99_s: float | None


@dataclass(slots=True)
class NodeRates:
    node_id: str
    addr: str
    interval_s: float
    tiers: list[TierRates]
    hit_ratio: float | None
    bytes_in_per_s: float
    bytes_out_per_s: float
    evictions_per_s: float
    lookups_per_s: float
    index_lag_s: float | None  # None: the node is not linked to an index
    index_queued: int | None
    index_connected: bool | None
    rpcs: list[RpcRates]
    restarted: bool


def counter_delta(prev: float, cur: float) -> float:
    """Increase of a cumulative counter; a decrease is a restart, after which `cur` is the increase."""
    return cur - prev if cur >= prev else cur


def _per_s(delta: float, interval: float) -> float:
    return delta / interval if interval > 0 else 0.0


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def histogram_delta(prev: RpcHistogram | None, cur: RpcHistogram) -> RpcHistogram:
    """`cur` minus `prev` bucket by bucket (`cur` alone when there is no prev or the node restarted)."""
    if prev is None or cur.count < prev.count or [b for b, _ in prev.buckets] != [b for b, _ in cur.buckets]:
        return cur
    buckets = tuple((le, c - p) for (le, c), (_, p) in zip(cur.buckets, prev.buckets, strict=True))
    return RpcHistogram(buckets, cur.count - prev.count, cur.sum - prev.sum)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile of a cumulative histogram, interpolated as Prometheus does; None when empty.

    A rank that lands in the +inf bucket answers the largest finite bound (nothing better is known)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


def parse_rpc_histograms(metrics_text: str) -> dict[str, RpcHistogram]:
    """Per-method RPC latency histograms from a node's /metrics text, summed over status codes."""
    buckets: dict[str, dict[float, float]] = {}
    counts: dict[str, float] = {}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != RPC_METRIC:
            continue
        for s in family.samples:
            method = s.labels.get("method", "?")
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                per = buckets.setdefault(method, {})
                per[le] = per.get(le, 0.0) + s.value
            elif s.name.endswith("_count"):
                counts[method] = counts.get(method, 0.0) + s.value
            elif s.name.endswith("_sum"):
                sums[method] = sums.get(method, 0.0) + s.value
    return {m: RpcHistogram(tuple(sorted(b.items())), counts.get(m, 0.0), sums.get(m, 0.0)) for m, b in buckets.items()}


def rpc_rates(prev: dict[str, RpcHistogram], cur: dict[str, RpcHistogram], interval: float) -> list[RpcRates]:
    out = []
    for method, hist in sorted(cur.items()):
        d = histogram_delta(prev.get(method), hist)
        out.append(
            RpcRates(
                method,
                _per_s(d.count, interval),
                _ratio(d.sum, d.count),
                histogram_quantile(0.5, d.buckets),
                histogram_quantile(0.99, d.buckets),
            )
        )
    return out


def node_rates(prev: NodeSample, cur: NodeSample) -> NodeRates:
    """Rates of one node between two of its samples (both must hold stats)."""
    if prev.stats is None or cur.stats is None:
        raise ValueError(f"{cur.addr}: rates need two samples with stats")
    p, c = prev.stats, cur.stats
    interval = cur.taken - prev.taken
    restarted = c.uptime_seconds < p.uptime_seconds
    before = {t.tier.label: t for t in p.tiers}
    tiers: list[TierRates] = []
    for t in c.tiers:
        if not t.available:
            continue
        o = before.get(t.tier.label)

        def d(name: str, t=t, o=o) -> float:  # bind the loop's tier: B023
            now = getattr(t.counters, name)
            return float(now) if o is None or restarted else counter_delta(getattr(o.counters, name), now)

        hits, misses = d("hits"), d("misses")
        tiers.append(
            TierRates(
                t.tier.label,
                _per_s(hits, interval),
                _per_s(misses, interval),
                _ratio(hits, hits + misses),
                _per_s(d("bytes_in"), interval),
                _per_s(d("bytes_out"), interval),
                _per_s(d("evictions"), interval),
                _per_s(d("promotions"), interval),
                _per_s(d("demotions"), interval),
                t.used_bytes,
                t.capacity_bytes,
            )
        )
    hits = sum(t.hits_per_s for t in tiers)
    misses = sum(t.misses_per_s for t in tiers)
    lookups = float(c.lookups) if restarted else counter_delta(p.lookups, c.lookups)
    idx = c.index
    return NodeRates(
        node_id=c.node_id,
        addr=cur.addr,
        interval_s=interval,
        tiers=tiers,
        hit_ratio=_ratio(hits, hits + misses),
        bytes_in_per_s=sum(t.bytes_in_per_s for t in tiers),
        bytes_out_per_s=sum(t.bytes_out_per_s for t in tiers),
        evictions_per_s=sum(t.evictions_per_s for t in tiers),
        lookups_per_s=_per_s(lookups, interval),
        index_lag_s=idx.lag_seconds if idx else None,
        index_queued=idx.queued if idx else None,
        index_connected=idx.connected if idx else None,
        rpcs=rpc_rates({} if restarted else prev.rpcs, cur.rpcs, interval),
        restarted=restarted,
    )


def slowest_rpcs(nodes: Iterable[NodeRates], limit: int = 5) -> list[tuple[str, RpcRates]]:
    """The (node, method) pairs with the highest p99 over the interval, slowest first."""
    seen = [(n.node_id, r) for n in nodes for r in n.rpcs if r.p99_s is not None and r.calls_per_s > 0]
    return sorted(seen, key=lambda x: x[1].p99_s or 0.0, reverse=True)[:limit]
