"""Conversions of the node's answers between the proto messages and kvstore's own types: Stats (node, tiers,
tenants, retention, planes), Lookup and Retain results. Pure, shared by server and clients; the Put and Get
streams' framing and the request conversions are kvstore/wire/streams.py.
"""

from __future__ import annotations

from dataclasses import asdict, fields

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.names import RetainMode, TierKind
from kvstore.security import redact_url
from kvstore.stats import (
    IndexStatus,
    KvEventsStatus,
    LookupResult,
    NodeStats,
    PlaneInfo,
    ReplicationStatus,
    RetainResult,
    RetentionStats,
    SessionState,
    TenantStats,
    TierCounters,
    TierFetch,
    TierRetention,
    TierStats,
)
from kvstore.wire.streams import layout_from_pb, layout_to_pb

_COUNTER_FIELDS = [f.name for f in fields(TierCounters)]
# NOTE: the scalar fields of a node's and a tier's Stats carry the same name on both sides: each is listed once
# here, so a new counter travels in both directions by being added to the dataclass and the proto.
_TIER_SCALARS = [f.name for f in fields(TierStats) if f.name not in ("tier", "counters")]
_NODE_STRUCTURED = ("tiers", "namespaces", "index", "planes", "tenants", "kv_events", "retention", "replication")
_NODE_SCALARS = [f.name for f in fields(NodeStats) if f.name not in _NODE_STRUCTURED]


def plane_to_pb(p: PlaneInfo) -> pb.DataPlaneInfo:
    return pb.DataPlaneInfo(name=p.name, address=p.address, tls=p.tls, uid=p.uid)


def plane_from_pb(msg: pb.DataPlaneInfo) -> PlaneInfo:
    """An advertised plane; `uid` None when the node did not say it (the field's presence, not its value)."""
    return PlaneInfo(msg.name, msg.address, msg.tls, msg.uid if msg.HasField("uid") else None)


def stats_to_pb(stats: NodeStats) -> pb.StatsResponse:
    tiers = [
        pb.TierStats(
            tier=int(t.tier),
            **{name: getattr(t, name) for name in _TIER_SCALARS},
            **{name: getattr(t.counters, name) for name in _COUNTER_FIELDS},
        )
        for t in stats.tiers
    ]
    namespaces = [
        pb.NamespaceStats(namespace=ns, layout=layout_to_pb(layout), pages=pages, page_bytes=layout.page_bytes)
        for ns, layout, pages in stats.namespaces
    ]
    return pb.StatsResponse(
        **{name: getattr(stats, name) for name in _NODE_SCALARS},
        tiers=tiers,
        namespaces=namespaces,
        index=None
        if stats.index is None
        else pb.IndexStats(
            **{f.name: getattr(stats.index, f.name) for f in fields(IndexStatus) if f.name != "url"},
            url=redact_url(stats.index.url),
        ),
        planes=[plane_to_pb(p) for p in stats.planes],
        tenants=[_tenant_to_pb(t) for t in stats.tenants],
        kv_events=None if stats.kv_events is None else pb.KvEventsStats(**asdict(stats.kv_events)),
        checksum_form=pb.CHECKSUM_FORM_KEYED,
        retention=retention_to_pb(stats.retention),
        replication=None if stats.replication is None else pb.ReplicationStats(**asdict(stats.replication)),
    )


_RETENTION_COUNTERS = [f.name for f in fields(RetentionStats) if f.name != "tiers"]


def retention_to_pb(r: RetentionStats) -> pb.RetentionStats:
    return pb.RetentionStats(
        **{n: getattr(r, n) for n in _RETENTION_COUNTERS},
        tiers=[
            pb.TierRetention(tier=int(t.tier), pages=t.pages, held_pages=t.held_pages, hold_cap_pages=t.hold_cap_pages)
            for t in r.tiers
        ],
    )


def retention_from_pb(m: pb.RetentionStats) -> RetentionStats:
    tiers = [TierRetention(TierKind(t.tier), t.pages, t.held_pages, t.hold_cap_pages) for t in m.tiers]
    return RetentionStats(**{n: getattr(m, n) for n in _RETENTION_COUNTERS}, tiers=tiers)


def lookup_to_pb(res: LookupResult) -> pb.LookupResponse:
    fetch = [
        pb.TierFetch(
            tier=int(f.tier),
            pages=f.pages,
            bytes=f.bytes,
            expected_ms=f.expected_ms,
            measured=f.measured,
            rate_bytes_per_second=f.rate_bytes_per_second,
        )
        for f in res.fetch
    ]
    return pb.LookupResponse(
        matched_blocks=res.matched,
        tiers=[int(t) for t in res.tiers],
        namespace_known=res.namespace_known,
        fetch=fetch,
        fetch_ms=res.fetch_ms,
    )


def lookup_from_pb(r: pb.LookupResponse) -> LookupResult:
    fetch = [
        TierFetch(TierKind(f.tier), f.pages, f.bytes, f.expected_ms, f.measured, f.rate_bytes_per_second)
        for f in r.fetch
    ]
    return LookupResult(r.matched_blocks, [TierKind(t) for t in r.tiers], r.namespace_known, fetch, r.fetch_ms)


def session_to_pb(s: SessionState) -> pb.SessionState:
    return pb.SessionState(
        session=s.name,
        priority=s.priority,
        mode=int(s.mode),
        ttl_seconds=s.ttl_seconds,
        pages=s.pages,
        pending=s.pending,
        unheld=s.unheld,
    )


def retain_result_to_pb(r: RetainResult) -> pb.RetainResponse:
    return pb.RetainResponse(
        retained=r.retained,
        pending=r.pending,
        released=r.released,
        prefetching=r.prefetching,
        state=None if r.state is None else session_to_pb(r.state),
        displaced=list(r.displaced),
    )


def retain_result_from_pb(m: pb.RetainResponse) -> RetainResult:
    state = None
    if m.HasField("state"):
        s = m.state
        state = SessionState(s.session, s.priority, RetainMode(s.mode), s.ttl_seconds, s.pages, s.pending, s.unheld)
    return RetainResult(m.retained, m.pending, m.released, m.prefetching, state, list(m.displaced))


_TENANT_COUNTERS = ("lookups", "lookup_blocks", "lookup_matched", "get_pages", "get_served", "cross_tenant_misses")


def _tenant_to_pb(t: TenantStats) -> pb.TenantStats:
    kinds = sorted(set(t.pages) | set(t.quota_bytes))
    return pb.TenantStats(
        tenant=t.tenant,
        **{n: getattr(t, n) for n in _TENANT_COUNTERS},
        tiers=[pb.TenantTier(tier=int(k), pages=t.pages.get(k, 0), quota_bytes=t.quota_bytes.get(k, 0)) for k in kinds],
        retention=retention_to_pb(t.retention),
    )


def _tenant_from_pb(m: pb.TenantStats) -> TenantStats:
    return TenantStats(
        m.tenant,
        {TierKind(x.tier): x.pages for x in m.tiers},
        {TierKind(x.tier): x.quota_bytes for x in m.tiers if x.quota_bytes},
        **{n: getattr(m, n) for n in _TENANT_COUNTERS},
        retention=retention_from_pb(m.retention),
    )


def stats_from_pb(msg: pb.StatsResponse) -> NodeStats:
    tiers = [
        TierStats(
            tier=TierKind(t.tier),
            **{name: getattr(t, name) for name in _TIER_SCALARS},
            counters=TierCounters(**{name: getattr(t, name) for name in _COUNTER_FIELDS}),
        )
        for t in msg.tiers
    ]
    namespaces = [(n.namespace, layout_from_pb(n.layout, "namespaces.layout"), n.pages) for n in msg.namespaces]
    return NodeStats(
        **{name: getattr(msg, name) for name in _NODE_SCALARS},
        tiers=tiers,
        namespaces=namespaces,
        index=IndexStatus(**{f.name: getattr(msg.index, f.name) for f in fields(IndexStatus)})
        if msg.HasField("index")
        else None,
        planes=[plane_from_pb(p) for p in msg.planes],
        tenants=[_tenant_from_pb(t) for t in msg.tenants],
        kv_events=KvEventsStatus(**{f.name: getattr(msg.kv_events, f.name) for f in fields(KvEventsStatus)})
        if msg.HasField("kv_events")
        else None,
        retention=retention_from_pb(msg.retention),
        replication=ReplicationStatus(**{f.name: getattr(msg.replication, f.name) for f in fields(ReplicationStatus)})
        if msg.HasField("replication")
        else None,
    )
