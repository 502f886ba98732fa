"""kvctl top's rate math (kvstore/cli/rates.py): pure, on hand-made samples."""

from __future__ import annotations

import math

import pytest

from kvstore.cli.rates import (
    NodeSample,
    RpcHistogram,
    counter_delta,
    histogram_delta,
    histogram_quantile,
    node_rates,
    parse_rpc_histograms,
    slowest_rpcs,
)
from kvstore.names import TierKind
from kvstore.stats import IndexStatus, NodeStats, TierCounters, TierStats

INF = math.inf


def stats(uptime: float, dram: TierCounters, nvme: TierCounters, lookups: int = 0, lag: float = 0.25) -> NodeStats:
    def tier(kind: TierKind, c: TierCounters, avail: bool = True) -> TierStats:
        return TierStats(kind, avail, "", 1000, 100, 10, 100, 10, 10, c)

    return NodeStats("n0", uptime, 1 << 20, [tier(TierKind.HBM, TierCounters(), False), tier(TierKind.DRAM, dram),
                                             tier(TierKind.NVME, nvme)], [], lookups, 0, 0, 0, 0, 0, 0,
                     index=IndexStatus("redis://x", connected=True, queued=3, lag_seconds=lag))  # fmt: skip


def test_counter_delta_treats_a_decrease_as_a_restart() -> None:
    assert counter_delta(10, 25) == 15
    assert counter_delta(10, 4) == 4


def test_node_rates_over_the_interval() -> None:
    prev = NodeSample("a:1", 100.0, stats(50, TierCounters(hits=10, misses=10, bytes_out=1000, evictions=2),
                                          TierCounters(hits=5, misses=0), lookups=7))  # fmt: skip
    cur = NodeSample("a:1", 102.0, stats(52, TierCounters(hits=40, misses=20, bytes_out=5000, bytes_in=800, evictions=6),
                                         TierCounters(hits=15, misses=10), lookups=17))  # fmt: skip
    r = node_rates(prev, cur)
    assert r.interval_s == 2.0 and not r.restarted
    dram, nvme = r.tiers  # the unavailable HBM tier is left out
    assert (dram.tier, dram.hits_per_s, dram.misses_per_s) == ("dram", 15.0, 5.0)
    assert dram.hit_ratio == 0.75  # 30 hits, 10 misses in this interval (not 40/60 since start)
    assert (dram.bytes_out_per_s, dram.bytes_in_per_s, dram.evictions_per_s) == (2000.0, 400.0, 2.0)
    assert nvme.hit_ratio == 0.5
    assert r.hit_ratio == pytest.approx(40 / 60)
    assert r.lookups_per_s == 5.0
    assert (r.index_lag_s, r.index_queued, r.index_connected) == (0.25, 3, True)


def test_a_restarted_node_counts_from_zero() -> None:
    prev = NodeSample("a:1", 0.0, stats(500, TierCounters(hits=1000), TierCounters()))
    cur = NodeSample("a:1", 5.0, stats(3, TierCounters(hits=10, misses=10), TierCounters()))
    r = node_rates(prev, cur)
    assert r.restarted and r.tiers[0].hits_per_s == 2.0 and r.tiers[0].hit_ratio == 0.5


def test_no_reads_means_no_hit_ratio() -> None:
    s = stats(1, TierCounters(hits=3), TierCounters())
    r = node_rates(NodeSample("a", 0.0, s), NodeSample("a", 1.0, s))
    assert r.hit_ratio is None and r.tiers[0].hit_ratio is None


def test_rates_need_stats_on_both_sides() -> None:
    with pytest.raises(ValueError, match="two samples"):
        node_rates(NodeSample("a", 0.0, None, error="down"), NodeSample("a", 1.0, None))


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = ((0.001, 0.0), (0.01, 50.0), (0.1, 90.0), (1.0, 100.0), (INF, 100.0))
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.01)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.001 + 0.009 * 0.5)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.1 + 0.9 * 0.9)
    assert histogram_quantile(0.5, ((1.0, 0.0), (INF, 0.0))) is None
    assert histogram_quantile(0.99, ((0.5, 1.0), (INF, 10.0))) == 0.5  # rank in +Inf: the largest finite bound
    with pytest.raises(ValueError):
        histogram_quantile(1.5, buckets)


def test_histogram_delta_subtracts_and_survives_a_restart() -> None:
    a = RpcHistogram(((0.01, 5.0), (INF, 6.0)), 6.0, 0.1)
    b = RpcHistogram(((0.01, 15.0), (INF, 26.0)), 26.0, 1.1)
    d = histogram_delta(a, b)
    assert d.buckets == ((0.01, 10.0), (INF, 20.0)) and d.count == 20.0 and d.sum == pytest.approx(1.0)
    assert histogram_delta(b, a) == a  # counts went down: the node restarted
    assert histogram_delta(None, a) == a


METRICS = """# HELP kvstore_rpc_duration_seconds KVStore RPC latency
# TYPE kvstore_rpc_duration_seconds histogram
kvstore_rpc_duration_seconds_bucket{code="OK",method="Get",node="n0",le="0.001"} 1.0
kvstore_rpc_duration_seconds_bucket{code="OK",method="Get",node="n0",le="0.01"} 3.0
kvstore_rpc_duration_seconds_bucket{code="OK",method="Get",node="n0",le="+Inf"} 4.0
kvstore_rpc_duration_seconds_count{code="OK",method="Get",node="n0"} 4.0
kvstore_rpc_duration_seconds_sum{code="OK",method="Get",node="n0"} 0.5
kvstore_rpc_duration_seconds_bucket{code="NOT_FOUND",method="Get",node="n0",le="0.001"} 1.0
kvstore_rpc_duration_seconds_bucket{code="NOT_FOUND",method="Get",node="n0",le="0.01"} 1.0
kvstore_rpc_duration_seconds_bucket{code="NOT_FOUND",method="Get",node="n0",le="+Inf"} 1.0
kvstore_rpc_duration_seconds_count{code="NOT_FOUND",method="Get",node="n0"} 1.0
kvstore_rpc_duration_seconds_sum{code="NOT_FOUND",method="Get",node="n0"} 0.0005
# HELP kvstore_tier_hits_total pages read
# TYPE kvstore_tier_hits_total counter
kvstore_tier_hits_total{node="n0",tier="dram"} 7.0
"""


def test_parse_rpc_histograms_sums_status_codes_per_method() -> None:
    h = parse_rpc_histograms(METRICS)
    assert set(h) == {"Get"}
    assert h["Get"].buckets == ((0.001, 2.0), (0.01, 4.0), (INF, 5.0))
    assert (h["Get"].count, h["Get"].sum) == (5.0, pytest.approx(0.5005))


def test_slowest_rpcs_orders_by_p99_and_skips_idle_methods() -> None:
    s0 = stats(1, TierCounters(), TierCounters())
    s1 = stats(2, TierCounters(), TierCounters())
    fast = RpcHistogram(((0.001, 10.0), (0.1, 10.0), (INF, 10.0)), 10.0, 0.005)
    slow = RpcHistogram(((0.001, 0.0), (0.1, 10.0), (INF, 10.0)), 10.0, 0.5)
    prev = NodeSample("a", 0.0, s0, {"Lookup": RpcHistogram(((0.001, 0.0), (0.1, 0.0), (INF, 0.0)), 0, 0),
                                     "Get": RpcHistogram(((0.001, 0.0), (0.1, 0.0), (INF, 0.0)), 0, 0),
                                     "Stats": fast})  # fmt: skip
    cur = NodeSample("a", 1.0, s1, {"Lookup": fast, "Get": slow, "Stats": fast})
    order = [(n, r.method) for n, r in slowest_rpcs([node_rates(prev, cur)])]
    assert order == [("n0", "Get"), ("n0", "Lookup")]  # Stats made no calls in the interval
