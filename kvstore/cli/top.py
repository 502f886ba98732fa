"""`kvctl top`: a live cluster view from what nodes already export (Stats RPC, /metrics).

Every interval it reads each node's Stats (and its /metrics when a metrics port or address is given),
then shows per node and per tier the hit ratio over that interval, bytes/s in and out, evictions/s,
the index lag, and the slowest RPCs (p99 from the RPC latency histogram). Nothing runs on a node's
hot path beyond the Stats call and a scrape, which any Prometheus does anyway. The rate math lives
in `kvstore/cli/rates.py` (pure).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request
from dataclasses import asdict
from typing import Annotated

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from kvstore.cli.common import friendly_errors
from kvstore.cli.rates import NodeRates, NodeSample, node_rates, parse_rpc_histograms, slowest_rpcs
from kvstore.cli.stats import human_bytes
from kvstore.names import TierKind

SCRAPE_TIMEOUT_S = 5.0


class Sampler:
    """Samples a set of nodes: from the index (re-read every round) or a fixed address list.

    Keeps one client per address across rounds; `close()` closes them."""

    def __init__(
        self, redis_url: str | None, addrs: list[str], metrics_port: int | None, metrics: list[str], timeout: float
    ) -> None:
        if not redis_url and not addrs:
            raise ValueError("give --redis-url (nodes from the index) or --addr (one or more nodes)")
        self.redis_url = redis_url
        self.addrs = addrs
        self.metrics_port = metrics_port
        self.metrics = metrics  # host:port of /metrics endpoints, matched to nodes by their `node` label
        self.timeout = timeout
        self._clients: dict[tuple[str, str | None], object] = {}
        self._metrics_addr: dict[str, str] = {}  # node addr -> its /metrics host:port, from the index
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvctl-top")

    def targets(self) -> list[tuple[str, str | None]]:
        """(address, node id as the index lists it, or None for an address given on the command line)."""
        if not self.redis_url:
            return [(a, None) for a in self.addrs]
        from kvstore.index import IndexReader

        with IndexReader(self.redis_url, socket_timeout=self.timeout) as index:
            live = [n for n in index.nodes() if n.alive and n.addr]
        self._metrics_addr = {n.addr: n.info["metrics_addr"] for n in live if n.info.get("metrics_addr")}
        return sorted((n.addr, n.node_id) for n in live)

    def sample(self) -> list[NodeSample]:
        addrs = self.targets()
        shared = [self._pool.submit(self._scrape, f"http://{m}/metrics") for m in self.metrics]
        futures = [self._pool.submit(self._one, a, node) for a, node in addrs]
        samples = [f.result() for f in futures]
        by_node: dict[str, dict] = {}  # /metrics given by address: each carries its node's id as a label
        for f in shared:
            text = f.result()
            if text:
                by_node.update(_split_by_node(text))
        for s in samples:
            if not s.rpcs and s.stats is not None and s.stats.node_id in by_node:
                s.rpcs = by_node[s.stats.node_id]
        return samples

    def _one(self, addr: str, node: str | None) -> NodeSample:
        from kvstore.client import KVStoreClient
        from kvstore.security import ClientSecurity

        taken = time.monotonic()
        try:
            client = self._clients.get((addr, node))
            if client is None:
                # An address from the index is dialled as that node: it must prove it (kvstore/security.py).
                security = ClientSecurity.from_env()
                client = self._clients[(addr, node)] = KVStoreClient(
                    addr, timeout=self.timeout, security=security if node is None else security.for_node(node)
                )
            stats = client.stats()  # type: ignore[attr-defined]
        except Exception as exc:  # an unreachable node is a row saying so, not the end of the view
            return NodeSample(addr, taken, None, error=f"{type(exc).__name__}: {exc}")
        rpcs = {}
        metrics = f"{addr.rsplit(':', 1)[0]}:{self.metrics_port}" if self.metrics_port else self._metrics_addr.get(addr)
        if metrics:
            text = self._scrape(f"http://{metrics}/metrics")
            rpcs = parse_rpc_histograms(text) if text else {}
        return NodeSample(addr, taken, stats, rpcs)

    def _scrape(self, url: str) -> str | None:
        try:
            with urllib.request.urlopen(url, timeout=min(self.timeout, SCRAPE_TIMEOUT_S)) as r:
                return r.read().decode()
        except OSError:
            return None

    def close(self) -> None:
        for c in self._clients.values():
            c.close()  # type: ignore[attr-defined]
        self._pool.shutdown(wait=False, cancel_futures=True)


def _split_by_node(text: str) -> dict[str, dict]:
    """Histograms of a /metrics page per `node` label (one endpoint serves one node, but be exact)."""
    per: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("kvstore_rpc_duration_seconds") and 'node="' in line:
            node = line.split('node="', 1)[1].split('"', 1)[0]
            per.setdefault(node, []).append(line)
    head = "# TYPE kvstore_rpc_duration_seconds histogram\n"
    return {n: parse_rpc_histograms(head + "\n".join(lines) + "\n") for n, lines in per.items()}


def compute(prev: list[NodeSample], cur: list[NodeSample]) -> tuple[list[NodeRates], list[NodeSample]]:
    """Rates of nodes seen with stats in both rounds; the nodes that failed in `cur`."""
    before = {s.addr: s for s in prev if s.stats is not None}
    rates = [node_rates(before[s.addr], s) for s in cur if s.stats is not None and s.addr in before]
    return sorted(rates, key=lambda r: r.node_id), [s for s in cur if s.stats is None]


def as_json(rates: list[NodeRates], failed: list[NodeSample]) -> dict[str, object]:
    return {
        "nodes": [asdict(r) for r in rates],
        "unreachable": [{"addr": s.addr, "error": s.error} for s in failed],
        "slowest_rpcs": [{"node": n, **asdict(r)} for n, r in slowest_rpcs(rates)],
    }


def redact(url: str) -> str:
    """A URL fit to show: credentials replaced (a Redis URL from the environment carries the password)."""
    from kvstore.security import redact_url

    return redact_url(url)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.2f}"


def render(rates: list[NodeRates], failed: list[NodeSample], source: str, have_metrics: bool) -> Group:
    interval = max((r.interval_s for r in rates), default=0.0)
    nodes = Table(title=f"kvstore top: {len(rates)} node(s) from {source}, last {interval:.1f}s", expand=False)
    tiers = sorted({t.tier for r in rates for t in r.tiers}, key=lambda label: TierKind[label.upper()])
    for col in (
        "node",
        "hit",
        *[f"{t} hit" for t in tiers],
        "in/s",
        "out/s",
        "evict/s",
        "lookups/s",
        "index lag",
        "queued",
    ):
        nodes.add_column(col, justify="left" if col == "node" else "right")
    for r in rates:
        per = {t.tier: t for t in r.tiers}
        lag = "-" if r.index_lag_s is None else f"{r.index_lag_s * 1000:.0f} ms"
        if r.index_connected is False:
            lag = f"[red]down[/] {lag}"
        nodes.add_row(
            r.node_id + (" [yellow](restarted)[/]" if r.restarted else ""),
            _pct(r.hit_ratio),
            *[_pct(per[t].hit_ratio) if t in per else "-" for t in tiers],
            human_bytes(r.bytes_in_per_s),
            human_bytes(r.bytes_out_per_s),
            f"{r.evictions_per_s:.1f}",
            f"{r.lookups_per_s:.1f}",
            lag,
            "-" if r.index_queued is None else str(r.index_queued),
        )
    for s in failed:
        nodes.add_row(f"[red]{s.addr}[/]", f"[red]{s.error}[/]")
    slow = Table(title="slowest RPCs (p99 over the interval)")
    for col in ("node", "method", "calls/s", "mean ms", "p50 ms", "p99 ms"):
        slow.add_column(col, justify="left" if col in ("node", "method") else "right")
    for node, r in slowest_rpcs(rates):
        slow.add_row(node, r.method, f"{r.calls_per_s:.1f}", _ms(r.mean_s), _ms(r.p50_s), _ms(r.p99_s))
    parts: list[object] = [nodes, slow]
    if not have_metrics:
        parts.append(
            "[dim]RPC latencies need the nodes' /metrics: run nodes with --metrics-port, "
            "or pass --metrics-port (or --metrics host:port)[/]"
        )
    return Group(*parts)  # type: ignore[arg-type]


@friendly_errors
# one parameter per CLI option (typer)
def top(  # noqa: PLR0913, PLR0917
    redis_url: Annotated[
        str | None,
        typer.Option("--redis-url", envvar="KVSTORE_REDIS_URL", help="Redis index URL: watch every live node"),
    ] = None,
    addr: Annotated[list[str] | None, typer.Option("--addr", help="node host:port (repeat for several)")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="scrape /metrics on this port of each node's host")] = None,
    metrics: Annotated[list[str] | None, typer.Option("--metrics", help="a /metrics host:port (repeatable)")] = None,
    interval: Annotated[float, typer.Option(min=0.1, help="seconds between samples")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="one interval, print, exit")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON (with --once)")] = False,
    iterations: Annotated[int, typer.Option(min=0, help="stop after N refreshes (0: until Ctrl-C)")] = 0,
    min_nodes: Annotated[int, typer.Option(min=0, help="exit 1 when fewer nodes answer (with --once)")] = 0,
    timeout: Annotated[float, typer.Option(min=0.1, help="seconds to wait for each node")] = 5.0,
) -> None:
    """Live per-node, per-tier hit rates, bytes/s, evictions/s, index lag and the slowest RPCs."""
    if json_out and not once:
        raise ValueError("--json needs --once (a live view is for people; scripts take one interval)")
    sampler = Sampler(redis_url, list(addr or []), metrics_port, list(metrics or []), timeout)
    source = redact(redis_url) if redis_url else ", ".join(addr or [])
    have_metrics = bool(metrics_port or metrics or redis_url)  # with the index: each node record names its /metrics
    try:
        prev = sampler.sample()
        if once:
            time.sleep(interval)
            rates, failed = compute(prev, sampler.sample())
            if json_out:
                typer.echo(json.dumps(as_json(rates, failed), indent=2))
            else:
                Console().print(render(rates, failed, source, have_metrics))
            if len(rates) < min_nodes:
                raise RuntimeError(f"{len(rates)} node(s) answered, fewer than --min-nodes {min_nodes}")
            return
        with Live(render([], [], source, have_metrics), refresh_per_second=4, screen=False) as live:
            n = 0
            while iterations == 0 or n < iterations:
                time.sleep(interval)
                cur = sampler.sample()
                live.update(render(*compute(prev, cur), source, have_metrics))
                prev = cur
                n += 1
    except KeyboardInterrupt:
        pass
    finally:
        sampler.close()
