"""`kvctl stats`: per-tier capacity, occupancy, hit rates and movements of one node."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvstore.cli.common import friendly_errors
from kvstore.scoping import DEFAULT_TENANT
from kvstore.stats import NodeStats, stats_as_dict


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def render_stats(stats: NodeStats, console: Console | None = None) -> None:
    """Print the stats table the SRE reads: one column per tier."""
    console = console or Console()
    table = Table(title=f"kvstore node {stats.node_id}  (v{stats.version}, up {stats.uptime_seconds:.0f}s)")
    table.add_column("metric", style="bold")
    for t in stats.tiers:
        table.add_column(t.tier.label.upper(), justify="right")

    def row(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        table.add_row(name, *[fn(t) if t.available else "-" for t in stats.tiers])

    table.add_row("available", *[("yes" if t.available else "[dim]no[/]") for t in stats.tiers])
    row("capacity", lambda t: human_bytes(t.capacity_bytes))
    row("used", lambda t: human_bytes(t.used_bytes))
    row("slots used/total", lambda t: f"{t.slots_used}/{t.slots_total}")
    row("pages", lambda t: str(t.pages))
    row("hits", lambda t: str(t.counters.hits))
    row("misses", lambda t: str(t.counters.misses))
    row("hit rate", lambda t: "-" if t.hit_rate is None else f"{t.hit_rate:.1%}")
    row("evictions", lambda t: str(t.counters.evictions))
    row("promotions in", lambda t: str(t.counters.promotions))
    row("demotions in", lambda t: str(t.counters.demotions))
    row("dropped", lambda t: str(t.counters.dropped))
    row("not admitted", lambda t: str(t.counters.not_admitted))
    row("bytes in", lambda t: human_bytes(t.counters.bytes_in))
    row("bytes out", lambda t: human_bytes(t.counters.bytes_out))
    row("checksum failures", lambda t: str(t.counters.checksum_failures))
    console.print(table)
    for t in stats.tiers:
        console.print(f"[dim]{t.tier.label}: {t.detail}[/]")
    matched = f"{stats.lookup_matched}/{stats.lookup_blocks}" if stats.lookup_blocks else "0/0"
    console.print(
        f"lookups {stats.lookups} (blocks matched {matched}), prefetch issued {stats.prefetch_issued} "
        f"completed {stats.prefetch_completed} used {stats.prefetch_used} wasted {stats.prefetch_wasted}, "
        f"pinned pages {stats.pinned_pages}, "
        f"rejected puts {stats.put_rejected}"
    )
    console.print(
        f"corruption: reported by clients {stats.corrupt_reports} (confirmed here and dropped "
        f"{stats.corrupt_confirmed}, unconfirmed {stats.corrupt_unconfirmed} of which unchecked "
        f"{stats.corrupt_unchecked}: past the reporter's rate), DRAM scrubbed {human_bytes(stats.scrubbed_bytes)}"
    )
    if stats.index is not None:
        i = stats.index
        state = "[green]connected[/]" if i.connected else "[red]unreachable[/]"
        console.print(
            f"index {i.url}: {state}, epoch {i.epoch}, queued {i.queued} (lag {i.lag_seconds * 1000:.0f} ms), "
            f"flushed {i.flushed}, resyncs {i.resyncs}{' (one pending)' if i.resync_pending else ''}, "
            f"overflows {i.overflows}, errors {i.errors}"
        )
    if stats.replication is not None:
        r = stats.replication
        console.print(
            f"served {human_bytes(r.served_bytes)} in {r.served_pages} pages; replication "
            + (
                f"on: {r.hot_pages} page(s) asking for copies, copies taken {r.copies_in} "
                f"({human_bytes(r.copy_bytes_in)}), given {r.copies_out} ({human_bytes(r.copy_bytes_out)}), "
                f"requests sent {r.copy_requests}, refused {r.copies_refused}, failed {r.copy_failures}, "
                f"corrupt on arrival {r.copy_corrupt}, handed off {r.handoff_pages}"
                if r.enabled
                else "off"
            )
        )
    if stats.kv_events is not None:
        e = stats.kv_events
        console.print(
            f"kv events {e.endpoint}: {e.subscribers} subscriber(s), sent {e.sent_events} in {e.sent_batches} "
            f"messages, queued {e.queued}, dropped {e.dropped_events}, snapshots {e.snapshots}, "
            + (f"CURVE (listed keys only), refused {e.refused}" if e.curve else "open (no authentication)")
        )
    for ns, layout, pages in stats.namespaces:
        console.print(f"namespace [cyan]{ns}[/]: {pages} pages, encoding {layout.encoding.label}, {layout.describe()}")
    render_retention(stats, console)
    render_tenants(stats, console)


def render_retention(stats: NodeStats, console: Console) -> None:
    """One line of retention (DESIGN.md §6.5): the node's as the default tenant sees it, else the caller's own
    row with its caps. Nothing when no session ever called."""
    own = [t.retention for t in stats.tenants if t.retention.calls or t.retention.sessions]
    r = stats.retention if stats.retention.calls else (own[0] if len(own) == 1 else None)
    if r is None:
        return
    where = ", ".join(
        f"{t.tier.label} {t.pages}"
        + (f" (held {t.held_pages}" + (f"/{t.hold_cap_pages})" if t.hold_cap_pages else ")"))
        for t in r.tiers
    )
    cap = f" of at most {r.cap_pages}" if r.cap_pages else ""
    console.print(
        f"retention: {r.sessions} session(s), {r.retained_pages}{cap} pages retained ({where}), {r.pending} named "
        f"and not stored; calls {r.calls} (refused at the cap {r.refused}), sessions ended {r.ended}, expired "
        f"{r.expired}, displaced {r.displaced}; unheld puts {r.unheld}; resume promotions {r.resumed}"
    )


def render_tenants(stats: NodeStats, console: Console) -> None:
    """One row per tenant the caller may see (its own; every one for the default tenant): pages and share
    per tier, hit rates, and for the operator (the default tenant) cross-tenant misses. Nothing on a node
    where only the default tenant ever called."""
    if not stats.tenants or [t.tenant for t in stats.tenants] == [DEFAULT_TENANT]:
        return
    operator = any(t.tenant == DEFAULT_TENANT for t in stats.tenants)  # a tenant's view has its own row only
    table = Table(title="tenants")
    for col in (
        "tenant",
        *[f"{t.tier.label.upper()} pages/share" for t in stats.tiers if t.available],
        "lookup hit rate",
        "get hit rate",
        *(["cross-tenant misses"] if operator else []),
    ):
        table.add_column(col, justify="left" if col == "tenant" else "right")
    for t in stats.tenants:
        per_tier = [
            f"{t.pages.get(k.tier, 0)}/" + (human_bytes(t.quota_bytes[k.tier]) if k.tier in t.quota_bytes else "-")
            for k in stats.tiers
            if k.available
        ]
        rate = [("-" if r is None else f"{r:.1%}") for r in (t.hit_rate, t.get_hit_rate)]
        table.add_row(t.tenant, *per_tier, *rate, *([str(t.cross_tenant_misses)] if operator else []))
    console.print(table)


@friendly_errors
def stats(
    addr: Annotated[str, typer.Option(help="node address host:port")] = "127.0.0.1:50051",
    json_out: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the node")] = 10.0,
) -> None:
    """Per-tier capacity, used, pages, hits, misses, hit rate, evictions, movements, bytes, checksum failures."""
    from kvstore.client import KVStoreClient

    with KVStoreClient(addr, timeout=timeout) as kv:
        s = kv.stats()
    if json_out:
        typer.echo(json.dumps(stats_as_dict(s), indent=2))
    else:
        render_stats(s)
