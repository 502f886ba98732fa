"""OpenTelemetry meters for a node and a Prometheus endpoint to scrape them (DESIGN.md §2).

`NodeMetrics` exports, per node (label `node`) and where it applies per tier (label `tier`):

    kvstore_tier_{hits,misses,evictions,promotions,demotions,dropped,not_admitted,checksum_failures}_total
    kvstore_tier_{written,read}_bytes_total          bytes written into / read out of a tier
    kvstore_tier_hit_ratio                           hits / (hits + misses) since start (absent before any)
    kvstore_tier_{capacity,used}_bytes, kvstore_tier_{pages,slots_used,slots_total}
    kvstore_{lookups,lookup_blocks,lookup_matched_blocks,put_rejected}_total
    kvstore_prefetch_{issued,completed,used,wasted}_total, kvstore_pinned_pages,
    kvstore_corrupt_{reported,confirmed,unconfirmed,unchecked}_total, kvstore_scrub_bytes_total
    kvstore_index_{connected,queued,lag_seconds}, kvstore_index_{flushed,resyncs,overflows,errors}_total
    kvstore_kv_events_{sent_events,sent_batches,dropped_events,snapshots,refused}_total, kvstore_kv_events_{queued,
    subscribers}                                     the KV-event feed for routers (when the node publishes one)
    kvstore_rpc_duration_seconds{method,code}        histogram of every KVStore RPC, by gRPC status
    kvstore_tenant_{lookups,lookup_blocks,lookup_matched_blocks,get_pages,get_served_pages}_total{tenant}
    kvstore_tenant_hit_ratio{tenant}, kvstore_tenant_pages{tenant,tier}, kvstore_tenant_share_bytes{tenant,tier}
    kvstore_retention_{calls,refused,expired,ended,displaced,unheld,resumed}_total, kvstore_retention_{sessions,
    pending}, kvstore_retention_pages{tier}, kvstore_retention_held_pages{tier}     retention (DESIGN.md §6.5)
    kvstore_tenant_retention_{sessions,cap_pages}{tenant}, kvstore_tenant_retention_pages{tenant,tier}

No cross-tenant figure is exported: /metrics answers whoever the network admits, and a count of misses
on pages another tenant holds would tell a prober which of its guesses another tenant caches (DESIGN.md §10).
The operator reads it in Stats (`kvctl stats` with a token of the default tenant).

Counters are the node's own cumulative counters (they restart at 0 with the process, which Prometheus'
rate() handles); a hit ratio over a window is rate(hits) / (rate(hits) + rate(misses)).

Thread model: prometheus_client serves scrapes on its own thread, but the TierManager's state belongs
to the node's event loop, so a scrape asks the loop for one stats snapshot (bounded wait) and every
instrument's callback reads that snapshot: a scrape never touches live manager state off the loop.
If the loop does not answer in time the scrape carries only the RPC histogram, never stale or torn
numbers. Each NodeMetrics has its own CollectorRegistry, so several nodes can live in one process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import fields

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, start_http_server

from kvstore import __version__
from kvstore.names import TierKind
from kvstore.stats import NodeStats, TenantStats, TierCounters, TierRetention, TierStats

log = logging.getLogger(__name__)
Row = tuple[dict[str, str], float | int | None]  # an observation's own labels and its value (None: none)

# RPC latencies span ~50 us (a lookup) to seconds (a large NVMe Get): log-spaced buckets.
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SNAPSHOT_TIMEOUT_S = 2.0
SNAPSHOT_MAX_AGE_S = 0.25  # one scrape calls every callback; they share one snapshot

_TIER_COUNTERS = {  # TierCounters field -> (metric name, unit, description)
    "hits": ("kvstore.tier.hits", "", "pages read from this tier"),
    "misses": ("kvstore.tier.misses", "", "page reads this tier could not serve"),
    "evictions": ("kvstore.tier.evictions", "", "pages evicted from this tier"),
    "promotions": ("kvstore.tier.promotions", "", "pages promoted into this tier"),
    "demotions": ("kvstore.tier.demotions", "", "pages demoted out of this tier"),
    "dropped": ("kvstore.tier.dropped", "", "pages dropped from the last tier"),
    "not_admitted": ("kvstore.tier.not_admitted", "", "pages this full tier's admission policy refused"),
    "checksum_failures": ("kvstore.tier.checksum_failures", "", "reads whose page checksum did not match"),
    "bytes_in": ("kvstore.tier.written", "By", "bytes written into this tier"),
    "bytes_out": ("kvstore.tier.read", "By", "bytes read out of this tier"),
}
assert set(_TIER_COUNTERS) == {f.name for f in fields(TierCounters)}, "every tier counter is exported"


class NodeMetrics:
    """Meters over a node's stats, served at http://host:port/metrics once `start()` has run.

    `snapshot` is called on `loop` (the node's event loop) and must return a consistent NodeStats.
    """

    def __init__(self, node_id: str, snapshot: Callable[[], NodeStats], loop: asyncio.AbstractEventLoop) -> None:
        self.node_id = node_id
        self._snapshot_fn = snapshot
        self._loop = loop
        self._lock = threading.Lock()
        self._cached: tuple[float, NodeStats | None] = (0.0, None)
        self.registry = CollectorRegistry()
        self._reader = PrometheusMetricReader(scope_info_enabled=False, registry=self.registry)
        resource = Resource.create(
            {"service.name": "kvstore", "service.version": __version__, "service.instance.id": node_id}
        )
        rpc_view = View(
            instrument_name="kvstore.rpc.duration", aggregation=ExplicitBucketHistogramAggregation(RPC_BUCKETS)
        )
        self.provider = MeterProvider(resource=resource, metric_readers=[self._reader], views=[rpc_view])
        meter = self.provider.get_meter("kvstore", __version__)
        self._base = {"node": node_id}
        for field_name, (name, unit, desc) in _TIER_COUNTERS.items():
            counter = self._per_tier(lambda t, f=field_name: getattr(t.counters, f))
            meter.create_observable_counter(name, [counter], unit=unit, description=desc)
        gauges = {
            "kvstore.tier.capacity": ("By", "bytes this tier can hold", lambda t: t.capacity_bytes),
            "kvstore.tier.used": ("By", "bytes held by pages in this tier", lambda t: t.used_bytes),
            "kvstore.tier.pages": ("", "pages in this tier", lambda t: t.pages),
            "kvstore.tier.slots_used": ("", "slots in use", lambda t: t.slots_used),
            "kvstore.tier.slots_total": ("", "slots in this tier", lambda t: t.slots_total),
            "kvstore.tier.hit_ratio": ("", "hits / (hits + misses) since start", lambda t: t.hit_rate),
        }
        for name, (unit, desc, get) in gauges.items():
            meter.create_observable_gauge(name, [self._per_tier(get)], unit=unit, description=desc)
        node_counters = {
            "kvstore.lookups": lambda s: s.lookups,
            "kvstore.lookup_blocks": lambda s: s.lookup_blocks,
            "kvstore.lookup_matched_blocks": lambda s: s.lookup_matched,
            "kvstore.put_rejected": lambda s: s.put_rejected,
            "kvstore.prefetch.issued": lambda s: s.prefetch_issued,
            "kvstore.prefetch.completed": lambda s: s.prefetch_completed,
            "kvstore.prefetch.used": lambda s: s.prefetch_used,
            "kvstore.prefetch.wasted": lambda s: s.prefetch_wasted,
            "kvstore.corrupt.reported": lambda s: s.corrupt_reports,
            "kvstore.corrupt.confirmed": lambda s: s.corrupt_confirmed,
            "kvstore.corrupt.unconfirmed": lambda s: s.corrupt_unconfirmed,
            "kvstore.corrupt.unchecked": lambda s: s.corrupt_unchecked,
            "kvstore.scrub.bytes": lambda s: s.scrubbed_bytes,
            "kvstore.index.flushed": lambda s: s.index and s.index.flushed,
            "kvstore.index.resyncs": lambda s: s.index and s.index.resyncs,
            "kvstore.index.overflows": lambda s: s.index and s.index.overflows,
            "kvstore.index.errors": lambda s: s.index and s.index.errors,
            "kvstore.kv_events.sent_events": lambda s: s.kv_events and s.kv_events.sent_events,
            "kvstore.kv_events.sent_batches": lambda s: s.kv_events and s.kv_events.sent_batches,
            "kvstore.kv_events.dropped_events": lambda s: s.kv_events and s.kv_events.dropped_events,
            "kvstore.kv_events.snapshots": lambda s: s.kv_events and s.kv_events.snapshots,
            "kvstore.kv_events.refused": lambda s: s.kv_events and s.kv_events.refused,
            **{
                f"kvstore.retention.{n}": (lambda s, n=n: getattr(s.retention, n))
                for n in ("calls", "refused", "expired", "ended", "displaced", "unheld", "resumed")
            },
        }
        for name, get in node_counters.items():
            meter.create_observable_counter(name, [self._node_value(get)], description=name.replace(".", " "))
        node_gauges = {
            "kvstore.pinned_pages": ("", lambda s: s.pinned_pages),
            "kvstore.index.connected": ("", lambda s: s.index and int(s.index.connected)),
            "kvstore.index.queued": ("", lambda s: s.index and s.index.queued),
            "kvstore.index.lag": ("s", lambda s: s.index and s.index.lag_seconds),
            "kvstore.kv_events.queued": ("", lambda s: s.kv_events and s.kv_events.queued),
            "kvstore.kv_events.subscribers": ("", lambda s: s.kv_events and s.kv_events.subscribers),
            "kvstore.retention.sessions": ("", lambda s: s.retention.sessions),
            "kvstore.retention.pending": ("", lambda s: s.retention.pending),
        }
        for name, (unit, get) in node_gauges.items():
            meter.create_observable_gauge(name, [self._node_value(get)], unit=unit, description=name.replace(".", " "))
        tenant_counters = {  # per tenant (label `tenant`, DESIGN.md §10): names the operator chose, no namespaces
            "kvstore.tenant.lookups": lambda t: t.lookups,
            "kvstore.tenant.lookup_blocks": lambda t: t.lookup_blocks,
            "kvstore.tenant.lookup_matched_blocks": lambda t: t.lookup_matched,
            "kvstore.tenant.get_pages": lambda t: t.get_pages,
            "kvstore.tenant.get_served_pages": lambda t: t.get_served,
        }
        for name, tget in tenant_counters.items():
            meter.create_observable_counter(name, [self._per_tenant(tget)], description=name.replace(".", " "))
        breakdowns = {  # name: (unit, one observation per tenant, tier or both, description)
            "kvstore.tenant.hit_ratio": (
                "",
                self._per_tenant(lambda t: t.hit_rate),
                "a tenant's matched / asked Lookup blocks since start",
            ),
            "kvstore.tenant.pages": (
                "",
                self._per_tenant_tier(lambda t, k: t.pages.get(k)),
                "a tenant's pages in a tier",
            ),
            "kvstore.tenant.share": (
                "By",
                self._per_tenant_tier(lambda t, k: t.quota_bytes.get(k)),
                "a tenant's share of a tier (absent: none set)",
            ),
            "kvstore.retention.pages": (
                "",
                self._per_retained_tier(lambda t: t.pages),
                "pages sessions retain in a tier",
            ),
            "kvstore.retention.held_pages": (
                "",
                self._per_retained_tier(lambda t: t.held_pages),
                "of those, pages held there (HOLD: not demoted)",
            ),
            "kvstore.tenant.retention.sessions": (
                "",
                self._per_tenant(lambda t: t.retention.sessions),
                "a tenant's live retention sessions",
            ),
            "kvstore.tenant.retention.cap_pages": (
                "",
                self._per_tenant(lambda t: t.retention.cap_pages),
                "the most pages a tenant's sessions may retain on the node",
            ),
            "kvstore.tenant.retention.pages": (
                "",
                self._per_tenant_tier(lambda t, k: next((r.pages for r in t.retention.tiers if r.tier == k), None)),
                "pages a tenant's sessions retain in a tier",
            ),
        }
        for name, (unit, observe, description) in breakdowns.items():
            meter.create_observable_gauge(name, [observe], unit=unit, description=description)
        self._rpc = meter.create_histogram("kvstore.rpc.duration", unit="s", description="KVStore RPC latency")
        self._server: object | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # -- the endpoint

    def start(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0 picks a free port); returns the bound port."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._server, self._thread = server, thread
        self.port = int(server.server_port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()  # type: ignore[attr-defined]
            self._server.server_close()  # type: ignore[attr-defined]
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self.provider.shutdown()

    # -- recording (called on the event loop by the server's interceptor)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self._rpc.record(seconds, {**self._base, "method": method.rsplit("/", 1)[-1], "code": code})

    # -- collection (called on the scrape thread)

    def snapshot(self) -> NodeStats | None:
        """The node's stats taken on its event loop; None if the loop did not answer in time."""
        with self._lock:
            taken, stats = self._cached
            if stats is not None and time.monotonic() - taken < SNAPSHOT_MAX_AGE_S:
                return stats
            try:
                stats = self._take()
            except (TimeoutError, concurrent.futures.TimeoutError, RuntimeError) as exc:
                log.warning("metrics scrape: no stats snapshot from the node's loop (%s)", exc)
                return None
            self._cached = (time.monotonic(), stats)
            return stats

    def _take(self) -> NodeStats:
        if self._loop.is_closed():
            raise RuntimeError("node event loop is closed")

        async def take() -> NodeStats:
            return self._snapshot_fn()

        return asyncio.run_coroutine_threadsafe(take(), self._loop).result(SNAPSHOT_TIMEOUT_S)

    def _observe(
        self, rows: Callable[[NodeStats], Iterable[Row]]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """Callback observing each (labels, value) row of the snapshot (a None value: that row reports nothing;
        no snapshot: nothing at all), labelled with the node's labels too."""

        def callback(_: CallbackOptions) -> Iterable[Observation]:
            stats = self.snapshot()
            if stats is None:
                return []
            return [Observation(v, {**self._base, **labels}) for labels, v in rows(stats) if v is not None]

        return callback

    def _per_tier(
        self, get: Callable[[TierStats], float | int | None]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """get(tier) for every tier of the snapshot."""
        return self._observe(lambda s: (({"tier": t.tier.label}, get(t)) for t in s.tiers))

    def _per_retained_tier(
        self, get: Callable[[TierRetention], int]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        return self._observe(lambda s: (({"tier": t.tier.label}, get(t)) for t in s.retention.tiers))

    def _per_tenant(
        self, get: Callable[[TenantStats], float | int | None]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        return self._observe(lambda s: (({"tenant": t.tenant}, get(t)) for t in s.tenants))

    def _per_tenant_tier(
        self, get: Callable[[TenantStats, TierKind], int | None]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        return self._observe(
            lambda s: (({"tenant": t.tenant, "tier": k.label}, get(t, k)) for t in s.tenants for k in TierKind)
        )

    def _node_value(
        self, get: Callable[[NodeStats], float | int | None]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        return self._observe(lambda s: [({}, get(s))])
