"""Plain data a node reports (Stats, Lookup results, kvctl). No behaviour beyond ratios."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from kvstore import __version__
from kvstore.layout import PageLayout
from kvstore.names import RetainMode, TierKind


@dataclass(frozen=True, slots=True)
class TierFetch:
    """How long a node expects a Get of some pages of one tier to take (DESIGN.md §6.6): first-page latency plus
    bytes over the tier's recent rate. `measured` False: no Get read this tier yet, a stated default stands in."""

    tier: TierKind
    pages: int
    bytes: int
    expected_ms: float
    measured: bool
    rate_bytes_per_second: float


@dataclass(slots=True)
class LookupResult:
    """Longest stored prefix of a chain on one node, the tier of each matched block, whether the node knows the
    namespace at all, and the node's fetch-time estimate for the matched prefix (per tier, fastest first, and
    in all: `fetch_ms`, the node's side only). Older nodes send no estimate (`fetch` empty, `fetch_ms` 0)."""

    matched: int
    tiers: list[TierKind]
    namespace_known: bool
    fetch: list[TierFetch] = field(default_factory=list)
    fetch_ms: float = 0.0


@dataclass(slots=True)
class TierRetention:
    """Retained pages in one tier; in a tenant's row also the most it may hold there (HOLD, above the slowest
    tier; 0: no cap in this tier, or the node's row)."""

    tier: TierKind
    pages: int = 0
    held_pages: int = 0
    hold_cap_pages: int = 0


@dataclass(slots=True)
class RetentionStats:
    """Retention on a node, or of one tenant with its caps (DESIGN.md §6.5; the proto's RetentionStats)."""

    sessions: int = 0
    tiers: list[TierRetention] = field(default_factory=list)
    calls: int = 0
    refused: int = 0
    expired: int = 0
    ended: int = 0
    displaced: int = 0
    unheld: int = 0
    pending: int = 0
    resumed: int = 0
    retained_pages: int = 0
    cap_pages: int = 0


@dataclass(frozen=True, slots=True)
class SessionState:
    """A retention session as its node holds it (the proto's SessionState): `pages` named and retained here,
    `pending` named and not stored here, `unheld` stored here but not retained (they arrived at the tenant's cap)."""

    name: str
    priority: int
    mode: RetainMode
    ttl_seconds: float
    pages: int
    pending: int
    unheld: int


@dataclass(slots=True)
class RetainResult:
    """What a Retain call did (the proto's RetainResponse): of its hashes, how many are retained now and how many
    are not stored here (retained once put); pages released; promotions a RESUME started; the session after the
    call (None after END); lower-priority sessions of the tenant displaced at its cap."""

    retained: int = 0
    pending: int = 0
    released: int = 0
    prefetching: int = 0
    state: SessionState | None = None
    displaced: list[str] = field(default_factory=list)


def retention_as_dict(r: RetentionStats) -> dict[str, object]:
    out: dict[str, object] = {f.name: getattr(r, f.name) for f in fields(r) if f.name != "tiers"}
    out["tiers"] = {
        t.tier.label: {"pages": t.pages, "held_pages": t.held_pages, "hold_cap_pages": t.hold_cap_pages}
        for t in r.tiers
    }
    return out


@dataclass(slots=True)
class ReportResult:
    """What a node did with a report of damaged pages (distinct pages: a hash named twice counts once)."""

    dropped: int  # its copy failed its checksum too: dropped
    intact: int  # its copy is intact: the damage happened on the way
    unchecked: int  # not verified: past the reporting caller's rate (kvstore/node/report_budget.py)


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    checksum_failures: int = 0
    dropped: int = 0
    not_admitted: int = 0  # pages this full tier's policy refused (written through to the next tier, or not stored)


@dataclass(slots=True)
class TierStats:
    """A snapshot of one tier for Stats/kvctl."""

    tier: TierKind
    available: bool
    detail: str
    capacity_bytes: int
    used_bytes: int
    slot_bytes: int
    slots_total: int
    slots_used: int
    pages: int
    counters: TierCounters

    @property
    def hit_rate(self) -> float | None:
        seen = self.counters.hits + self.counters.misses
        return self.counters.hits / seen if seen else None


@dataclass(slots=True)
class IndexStatus:
    """The node's link to the cluster index (see kvstore/index.py)."""

    url: str
    connected: bool = False
    epoch: int = 0
    queued: int = 0  # updates waiting to be written
    lag_seconds: float = 0.0  # age of the oldest of them
    flushed: int = 0
    resyncs: int = 0
    overflows: int = 0
    errors: int = 0
    resync_pending: bool = False


@dataclass(slots=True)
class KvEventsStatus:
    """The node's KV-event feed for routers (kvstore/node/kv_events.py). `dropped_events` were refused by its
    full queue (each schedules a snapshot); a subscriber's own losses in ZMQ show to it as sequence gaps."""

    endpoint: str
    queued: int = 0  # changes waiting for the sender thread
    sent_events: int = 0  # block hashes (and clears) sent
    sent_batches: int = 0  # messages sent (one sequence number each)
    dropped_events: int = 0
    snapshots: int = 0  # full states sent (start, a new subscriber, after drops)
    subscribers: int = 0  # subscriptions seen and not withdrawn
    send_errors: int = 0
    refused: int = 0  # subscriptions refused: keys not listed (CURVE), or topics outside the key's tenant
    curve: bool = False  # only listed subscribers may connect (CURVE)


@dataclass(slots=True)
class ReplicationStatus:
    """Replication by heat on one node (DESIGN.md §7.3; proto ReplicationStats): copies made and taken."""

    enabled: bool = False
    hot_pages: int = 0  # pages whose reads (or a Put's replicas) ask for more copies now
    copies_in: int = 0  # pages pulled from other nodes and stored here
    copy_bytes_in: int = 0
    copies_out: int = 0  # pages other nodes pulled from here
    copy_bytes_out: int = 0
    copy_requests: int = 0  # Replicate calls this node sent
    copies_refused: int = 0  # pages refused for want of free room
    copy_failures: int = 0  # pages a copy could not get (source gone, short, a failed call)
    copy_corrupt: int = 0  # pages that failed their checksum on arrival
    handoff_pages: int = 0  # pages handed to other nodes on SIGTERM
    served_bytes: int = 0  # payload bytes served to clients' Gets (copies excluded)
    served_pages: int = 0


@dataclass(frozen=True, slots=True)
class PlaneInfo:
    """A bulk data plane a node serves (proto DataPlaneInfo): its name, where to reach it, whether TLS, and for
    the same-host plane the user id its socket answers as (None: not said, a node that predates it)."""

    name: str
    address: str = ""
    tls: bool = False
    uid: int | None = None


def planes_to_json(planes: list[PlaneInfo]) -> str:
    """The text form of advertised planes (the node's index record)."""
    return json.dumps([asdict(p) for p in planes], separators=(",", ":"))


def planes_from_json(text: str) -> list[PlaneInfo]:
    """Advertised planes from an index record; [] when absent or unreadable (a stale or foreign record)."""
    try:
        return [
            PlaneInfo(
                str(p["name"]),
                str(p.get("address", "")),
                bool(p.get("tls", False)),
                None if p.get("uid") is None else int(p["uid"]),
            )
            for p in json.loads(text)
        ]
    except (ValueError, TypeError, KeyError, AttributeError):
        return []


@dataclass(slots=True)
class TenantStats:
    """One tenant on a node (DESIGN.md §10): its pages and share per tier, and how its reads fared.
    Counters count this tenant's calls; `cross_tenant_misses` are its misses on a page another tenant
    holds under the same namespace and hash (answered as the cold misses they are for it): the
    operator's figure, reported to the default tenant only (0 in a tenant's own row, never in /metrics)."""

    tenant: str
    pages: dict[TierKind, int] = field(default_factory=dict)
    quota_bytes: dict[TierKind, int] = field(default_factory=dict)  # a tier absent: no share set
    lookups: int = 0
    lookup_blocks: int = 0
    lookup_matched: int = 0
    get_pages: int = 0  # pages asked for by Gets that ran to their end
    get_served: int = 0  # of those, served
    cross_tenant_misses: int = 0
    retention: RetentionStats = field(default_factory=RetentionStats)

    @property
    def hit_rate(self) -> float | None:
        """Matched blocks per block asked about (Lookup), the engine-facing hit rate."""
        return self.lookup_matched / self.lookup_blocks if self.lookup_blocks else None

    @property
    def get_hit_rate(self) -> float | None:
        return self.get_served / self.get_pages if self.get_pages else None


def tenant_as_dict(t: TenantStats) -> dict[str, object]:
    return {
        "tenant": t.tenant,
        "pages": {k.label: n for k, n in t.pages.items()},
        "quota_bytes": {k.label: n for k, n in t.quota_bytes.items()},
        "lookups": t.lookups,
        "lookup_blocks": t.lookup_blocks,
        "lookup_matched": t.lookup_matched,
        "hit_rate": t.hit_rate,
        "get_pages": t.get_pages,
        "get_served": t.get_served,
        "get_hit_rate": t.get_hit_rate,
        "cross_tenant_misses": t.cross_tenant_misses,
        "retention": retention_as_dict(t.retention),
    }


@dataclass(slots=True)
class NodeStats:
    node_id: str
    uptime_seconds: float
    max_page_bytes: int
    tiers: list[TierStats]
    namespaces: list[tuple[str, PageLayout, int]]
    lookups: int
    lookup_blocks: int
    lookup_matched: int
    prefetch_issued: int
    prefetch_completed: int
    pinned_pages: int
    put_rejected: int
    version: str = __version__
    prefetch_used: int = 0  # prefetched pages a Get then read
    prefetch_wasted: int = 0  # prefetched pages evicted or dropped unread
    index: IndexStatus | None = None
    planes: list[PlaneInfo] = field(default_factory=list)  # bulk data planes besides Put/Get streams
    host_id: str = ""  # the node's host (kvstore.addresses.host_id)
    tenants: list[TenantStats] = field(default_factory=list)  # the caller's own (every one for the default tenant)
    corrupt_reports: int = 0  # pages clients reported failing their checksum on arrival (Report)
    corrupt_confirmed: int = 0  # of those, pages whose copy here failed too (dropped)
    corrupt_unconfirmed: int = 0  # the others: intact here, not held here, or unchecked
    corrupt_unchecked: int = 0  # of the unconfirmed, pages not verified: past the reporting caller's rate
    scrubbed_bytes: int = 0  # DRAM payload bytes the background scrubber verified
    kv_events: KvEventsStatus | None = None  # the KV-event feed, when the node publishes one
    retention: RetentionStats = field(default_factory=RetentionStats)  # every tenant's (the default tenant sees it)
    replication: ReplicationStatus | None = None  # copies made and taken (None: a node that predates them)
    # pages one Put or Get may name, on every plane (the node's max_pages_per_request); 0: not advertised (a node
    # that predates saying it). Set by the node's servicer, beside `planes`; a client cuts its calls to fit.
    max_pages_per_request: int = 0


def copy_counters(c: TierCounters) -> TierCounters:
    return TierCounters(**{f.name: getattr(c, f.name) for f in fields(c)})


def stats_as_dict(stats: NodeStats) -> dict[str, object]:
    """JSON-ready form (kvctl --json): tiers keyed by name, hit rates included."""
    return {
        "node_id": stats.node_id,
        "version": stats.version,
        "uptime_seconds": round(stats.uptime_seconds, 3),
        "max_page_bytes": stats.max_page_bytes,
        "max_pages_per_request": stats.max_pages_per_request,
        "tiers": {
            t.tier.label: {
                "available": t.available,
                "detail": t.detail,
                "capacity_bytes": t.capacity_bytes,
                "used_bytes": t.used_bytes,
                "slot_bytes": t.slot_bytes,
                "slots_total": t.slots_total,
                "slots_used": t.slots_used,
                "pages": t.pages,
                "hit_rate": t.hit_rate,
                **{f.name: getattr(t.counters, f.name) for f in fields(t.counters)},
            }
            for t in stats.tiers
        },
        "namespaces": [
            {
                "namespace": ns,
                "layout": layout.describe(),
                "encoding": layout.encoding.label,
                "page_bytes": layout.page_bytes,
                "pages": pages,
            }
            for ns, layout, pages in stats.namespaces
        ],
        "lookups": stats.lookups,
        "lookup_blocks": stats.lookup_blocks,
        "lookup_matched": stats.lookup_matched,
        "prefetch_issued": stats.prefetch_issued,
        "prefetch_completed": stats.prefetch_completed,
        "prefetch_used": stats.prefetch_used,
        "prefetch_wasted": stats.prefetch_wasted,
        "pinned_pages": stats.pinned_pages,
        "put_rejected": stats.put_rejected,
        "corrupt_reports": stats.corrupt_reports,
        "corrupt_confirmed": stats.corrupt_confirmed,
        "corrupt_unconfirmed": stats.corrupt_unconfirmed,
        "corrupt_unchecked": stats.corrupt_unchecked,
        "scrubbed_bytes": stats.scrubbed_bytes,
        "index": None if stats.index is None else {f.name: getattr(stats.index, f.name) for f in fields(stats.index)},
        "planes": [{"name": p.name, "address": p.address, "tls": p.tls} for p in stats.planes],
        "host_id": stats.host_id,
        "tenants": [tenant_as_dict(t) for t in stats.tenants],
        "kv_events": None if stats.kv_events is None else asdict(stats.kv_events),
        "retention": retention_as_dict(stats.retention),
        "replication": None if stats.replication is None else asdict(stats.replication),
    }
