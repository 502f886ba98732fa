"""A node's Stats snapshot (`NodeStats`, kvstore/stats.py): its tiers, namespaces and counters as the manager
holds them (core.py `TierManager.stats`), with the index's, the KV-event feed's, the tenants' and retention's
status beside them.

Invariant: a snapshot is a copy taken at once on the node's loop (counters copied, never live objects), so a
scrape or a Stats call reads one consistent moment and nothing it holds changes under it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict

from kvstore.config import NodeConfig
from kvstore.manager.ledger import TenantLedger
from kvstore.manager.retention import Retention
from kvstore.manager.state import NodeCounters, PageTable
from kvstore.stats import IndexStatus, KvEventsStatus, NodeStats, TierStats, copy_counters


def node_stats(  # NOTE: keyword-only past the table: what the manager holds, named
    table: PageTable,
    *,
    config: NodeConfig,
    counters: NodeCounters,
    started: float,
    tenants: TenantLedger,
    retention: Retention,
    index_status: Callable[[], IndexStatus] | None,
    kv_events_status: Callable[[], KvEventsStatus] | None,
) -> NodeStats:
    """The snapshot of a node whose manager started at `started` (time.monotonic)."""
    tiers = []
    for kind, t in table.tiers.items():
        tiers.append(
            TierStats(
                tier=kind,
                available=t.available,
                detail=t.medium.detail,
                capacity_bytes=t.alloc.capacity_bytes if t.available else 0,
                used_bytes=t.used_bytes,
                slot_bytes=t.medium.chunk_bytes,
                slots_total=t.slots_total if t.available else 0,
                slots_used=t.alloc.used_count,
                pages=t.pages,
                counters=copy_counters(t.counters),
            )
        )
    namespaces = [(ns, layout, table.ns_pages.get(ns, 0)) for ns, layout in sorted(table.layouts.items())]
    return NodeStats(
        node_id=config.node_id,
        uptime_seconds=time.monotonic() - started,
        max_page_bytes=config.max_page_bytes,
        tiers=tiers,
        namespaces=namespaces,
        pinned_pages=sum(1 for e in table if e.pinned),
        **asdict(counters),  # every node-wide counter is a NodeStats field of the same name
        index=index_status() if index_status is not None else None,
        tenants=tenants.snapshot(retention.snapshot),
        kv_events=kv_events_status() if kv_events_status is not None else None,
        retention=retention.snapshot(),
    )
