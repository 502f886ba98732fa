"""Hit rates of the eviction policies on a request trace, against Belady's offline optimum.

What is measured
    Each request of the trace (its prompt's block ids, in arrival order) is served by a simulated
    cache (kvstore.sim.TieredBlockCache driving the kvstore.policy classes the way the TierManager
    does): the longest cached prefix is looked up, then every block of the request is touched or
    inserted in order, with parent = the previous block. Per policy and capacity:
      block hit   blocks found cached, at any position, over all blocks of the trace;
      prefix hit  per request the longest cached prefix (the prefill really saved), over all blocks;
      per tier    for --tiers, the block/prefix hits served from each tier (exclusive tiers: a hit
                  in a lower tier is promoted to the top one, a victim is demoted one tier down).
    See kvstore/sim.py for the exact semantics.

Reference (same run, same trace)
    Belady's MIN with bypass at the same capacity (for --tiers, at the sum of the tiers): the most
    block hits any cache of that size can get on the trace. Every rate is also given as a fraction
    of that bound, and "ceiling" is the hit rate of an unbounded cache (1 - unique blocks / blocks).

Method
    The replay is deterministic (no timing in any figure but wall time), so each cell is run once.
    Wall time is time.perf_counter around each replay, on this machine, one process.

Trace format
    Mooncake FAST'25 (kvcache-ai/Mooncake, FAST25-release/traces): one JSON object per line with
    `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (the prompt's blocks). Any trace in
    that format works; --synthetic chat|docs|mixed replays a generated one instead
    (kvstore.sim.synthetic_workload).

Plugging in a real node
    `replay_cell` takes any kvstore.sim.ReplayCache (lookup(blocks) -> int, put(blocks)); a cache
    backed by a node over gRPC can be passed instead of the simulated one.

Run:  .venv/bin/python benchmarks/trace_replay.py --trace PATH --capacity 2000,8000 [--tiers hbm:N,dram:N,nvme:N]
          [--policy NAME[,NAME...]|all] [--json [PATH]] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from machine import cpu_model

from kvstore.policy import POLICIES
from kvstore.sim import (
    ReplayCache,
    ReplayResult,
    TieredBlockCache,
    TierSpec,
    TraceRecord,
    Workload,
    belady_block_hits,
    parse_tiers,
    replay,
    replay_policy,
    synthetic_workload,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "out"
# NOTE: the order of the table's columns: the baseline first, the recommended default last.
POLICY_ORDER = ("lru", "prefix-lru", "arc", "s3fifo", "prefix-arc")


@dataclass(slots=True)
class Cell:
    """One replay: a policy on one cache configuration."""

    config: str  # "2000" or "hbm:500,dram:1500"
    policy: str
    block_hit: float | None
    prefix_hit: float
    tiers: dict[str, tuple[float, float]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0


@dataclass(slots=True)
class Bound:
    config: str
    capacity: int
    belady_block_hit: float
    wall_s: float


# ------------------------------------------------------------------------------------------- replay


def load_trace(path: Path) -> list[TraceRecord]:
    records = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(TraceRecord.from_json(json.loads(line)))
            except (ValueError, json.JSONDecodeError) as e:
                raise SystemExit(f"{path}:{lineno}: {e}") from None
    return records


def replay_cell(requests: Sequence[Sequence[int]], cache: ReplayCache) -> tuple[ReplayResult, float]:
    """Replay through any ReplayCache (simulated here; a gRPC-backed one plugs in the same way)."""
    t0 = time.perf_counter()
    res = replay(requests, cache)
    return res, time.perf_counter() - t0


def run(
    requests: Sequence[Sequence[int]],
    configs: Sequence[tuple[str, tuple[TierSpec, ...]]],
    policies: Sequence[str],
    progress: Callable[[str], None],
) -> tuple[list[Cell], list[Bound]]:
    cells: list[Cell] = []
    bounds: list[Bound] = []
    for label, tiers in configs:
        total = sum(t.capacity for t in tiers)
        t0 = time.perf_counter()
        opt = belady_block_hits(requests, total)
        bounds.append(Bound(label, total, opt.block_hit_rate or 0.0, time.perf_counter() - t0))
        for name in policies:
            cache = TieredBlockCache(tiers, name)
            res, wall = replay_cell(requests, cache)
            c = cache.counters
            cells.append(
                Cell(
                    label,
                    name,
                    res.block_hit_rate,
                    res.prefix_hit_rate,
                    res.tier_rates() if len(tiers) > 1 else {},
                    {
                        "promoted": c.promoted,
                        "demoted": c.demoted,
                        "dropped": c.dropped,
                        "not_stored": c.not_stored,
                    },
                    wall,
                )
            )
            progress(
                f"  {label:>24} {name:<11} block {res.block_hit_rate:.3f} prefix {res.prefix_hit_rate:.3f} ({wall:.1f} s)"
            )
    return cells, bounds


# ------------------------------------------------------------------------------------------- report


def source_digest() -> str:
    """Short SHA-256 over kvstore/policy.py and kvstore/sim.py: which code was measured."""
    import kvstore

    root = Path(kvstore.__file__).resolve().parent
    h = hashlib.sha256()
    for name in ("policy.py", "sim.py"):
        h.update(name.encode() + b"\0" + (root / name).read_bytes())
    return h.hexdigest()[:12]


def machine_info() -> dict[str, object]:
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "policy_sim_src": source_digest(),
    }


def machine_line(meta: dict[str, object]) -> str:
    return (
        f"{meta['date']} | cpu: {meta['cpu_model']}, os.cpu_count()={meta['cpu_count']} | {meta['platform']} | "
        f"python {meta['python']} | policy.py+sim.py {meta['policy_sim_src']}"
    )


def trace_summary(requests: Sequence[Sequence[int]]) -> dict[str, float | int]:
    blocks = sum(len(r) for r in requests)
    unique = len({b for r in requests for b in r})
    return {
        "requests": len(requests),
        "blocks": blocks,
        "unique_blocks": unique,
        "ceiling_hit_rate": 1 - unique / blocks if blocks else 0.0,
    }


def _rate(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def markdown(
    source: str,
    summary: dict[str, float | int],
    cells: Sequence[Cell],
    bounds: Sequence[Bound],
    policies: Sequence[str],
    meta: dict[str, object],
    wall_s: float,
) -> str:
    by = {(c.config, c.policy): c for c in cells}
    lines = [
        f"# trace_replay — {source}",
        "",
        f"Machine: {machine_line(meta)}",
        f"Trace: {summary['requests']} requests, {summary['blocks']} blocks, {summary['unique_blocks']} unique; "
        f"ceiling (unbounded cache) {summary['ceiling_hit_rate']:.3f}. Wall time {wall_s:.1f} s.",
        "",
        "Cells: block hit / prefix hit (see kvstore/sim.py). Belady: MIN with bypass, block hits, same capacity "
        "(tiered: the sum of the tiers). (x%) = prefix hit as a fraction of Belady.",
        "",
        "| capacity | " + " | ".join(policies) + " | Belady (block) |",
        "|---:|" + "---:|" * len(policies) + "---:|",
    ]
    for b in bounds:
        row = [b.config]
        for p in policies:
            c = by[(b.config, p)]
            frac = f" ({c.prefix_hit / b.belady_block_hit:.0%})" if b.belady_block_hit else ""
            row.append(f"{_rate(c.block_hit)} / {c.prefix_hit:.3f}{frac}")
        row.append(f"{b.belady_block_hit:.3f}")
        lines.append("| " + " | ".join(row) + " |")
    tiered = [c for c in cells if c.tiers]
    if tiered:
        names = list(tiered[0].tiers)
        lines += [
            "",
            "Tiered: block / prefix hits served from each tier (they sum to the totals above).",
            "",
            "| config | policy | " + " | ".join(names) + " | promoted | demoted | dropped |",
            "|---|---|" + "---:|" * (len(names) + 3),
        ]
        for c in tiered:
            per = [f"{c.tiers[n][0]:.3f} / {c.tiers[n][1]:.3f}" for n in names]
            lines.append(
                f"| {c.config} | {c.policy} | "
                + " | ".join(per)
                + f" | {c.counters['promoted']} | {c.counters['demoted']} | {c.counters['dropped']} |"
            )
    lines += ["", "Wall time per replay (s): " + ", ".join(f"{c.config}/{c.policy} {c.wall_s:.1f}" for c in cells)]
    lines += ["Belady (s): " + ", ".join(f"{b.config} {b.wall_s:.1f}" for b in bounds), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace")
    src.add_argument("--synthetic", choices=[w.value for w in Workload], help="replay a generated workload instead")
    ap.add_argument("--requests", type=int, default=4000, help="requests of a --synthetic workload (default 4000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of a --synthetic workload (default 0)")
    ap.add_argument("--capacity", default="", help="single-tier capacities in blocks, comma-separated")
    ap.add_argument("--tiers", default="", help="a tiered config, e.g. hbm:500,dram:2000,nvme:8000 (exclusive tiers)")
    ap.add_argument("--policy", default="all", help=f"'all' or comma-separated names from {sorted(POLICIES)}")
    ap.add_argument(
        "--json", nargs="?", const="-", default=None, metavar="PATH", help="write the JSON (to stdout without PATH)"
    )
    ap.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"directory for trace_replay.{{json,md}} (default {DEFAULT_OUT})"
    )
    ap.add_argument("--node-requests", type=int, default=0,
                    help="also replay the first N requests through a real node over gRPC per policy and "
                         "--node-capacity, and compare with the simulation of the same requests (0: off)")  # fmt: skip
    ap.add_argument("--node-capacity", default="500,1000", help="capacities (blocks) for the node replay")
    args = ap.parse_args(argv)
    if not args.capacity and not args.tiers:
        ap.error("give --capacity and/or --tiers")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.trace is not None:
        source = str(args.trace)
        requests: list[list[int]] = [list(r.hash_ids) for r in load_trace(args.trace)]
    else:
        source = f"synthetic:{args.synthetic} ({args.requests} requests, seed {args.seed})"
        requests = synthetic_workload(args.synthetic, args.requests, args.seed)
    if args.policy == "all":
        policies = [p for p in POLICY_ORDER if p in POLICIES] + sorted(set(POLICIES) - set(POLICY_ORDER))
    else:
        policies = [p.strip().lower() for p in args.policy.split(",") if p.strip()]
        unknown = [p for p in policies if p not in POLICIES]
        if unknown:
            raise SystemExit(f"unknown policy {unknown}; known: {sorted(POLICIES)}")
    try:
        configs = [(str(int(c)), (TierSpec("cache", int(c)),)) for c in args.capacity.split(",") if c.strip()]
        if args.tiers:
            configs.append((args.tiers, parse_tiers(args.tiers)))
    except ValueError as e:
        raise SystemExit(f"bad capacity or tiers: {e}") from None

    meta = machine_info()
    summary = trace_summary(requests)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json == "-" else (lambda s: print(s, flush=True))
    log(f"# trace_replay — {machine_line(meta)}")
    log(f"# {source}: {summary['requests']} requests, {summary['blocks']} blocks")
    cells, bounds = run(requests, configs, policies, log)
    wall = time.perf_counter() - t_start

    md = markdown(source, summary, cells, bounds, policies, meta, wall)
    node_rows = node_vs_sim(requests[: args.node_requests], [int(c) for c in args.node_capacity.split(",")],
                            policies, log) if args.node_requests else []  # fmt: skip
    if node_rows:
        md += node_markdown(node_rows, args.node_requests)
    doc = {
        "source": source,
        "machine": meta,
        "trace": summary,
        "policies": policies,
        "bounds": [
            {"config": b.config, "capacity": b.capacity, "belady_block_hit": b.belady_block_hit, "wall_s": b.wall_s}
            for b in bounds
        ],
        "cells": [
            {
                "config": c.config,
                "policy": c.policy,
                "block_hit": c.block_hit,
                "prefix_hit": c.prefix_hit,
                "tiers": {k: {"block_hit": v[0], "prefix_hit": v[1]} for k, v in c.tiers.items()},
                "counters": c.counters,
                "wall_s": c.wall_s,
            }
            for c in cells
        ],
        "wall_s": wall,
        "node_replay": node_rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trace_replay.md").write_text(md)
    (args.out / "trace_replay.json").write_text(json.dumps(doc, indent=1) + "\n")
    if args.json == "-":
        print(json.dumps(doc, indent=1))
    else:
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print()
        print(md)
    return 0


def node_vs_sim(requests: Sequence[Sequence[int]], capacities: Sequence[int], policies: Sequence[str],
                log: Callable[[str], None]) -> list[dict[str, object]]:  # fmt: skip
    """Replay `requests` through a real node (benchmarks/node_replay.py) and through the simulation,
    per policy and capacity: the hit counts must be identical if the node runs the policy it claims."""
    from node_replay import NodeReplayCache  # sibling module: the I/O stays out of the pure path

    rows = []
    for cap in capacities:
        for pol in policies:
            sim, _ = replay_policy(requests, cap, pol)
            t0 = time.perf_counter()
            cache = NodeReplayCache(cap, pol)
            try:
                node = replay(requests, cache)
            finally:
                cache.close()
            row = {"capacity": cap, "policy": pol, "sim_prefix_hits": sim.prefix_hits, "node_prefix_hits": node.prefix_hits,
                   "sim_block_hits": sim.block_hits, "node_block_hits": node.block_hits, "blocks": sim.blocks,
                   "agree": (sim.prefix_hits, sim.block_hits) == (node.prefix_hits, node.block_hits),
                   "rpcs": cache.rpcs, "wall_s": time.perf_counter() - t0}  # fmt: skip
            rows.append(row)
            log(f"node replay {pol} @ {cap}: prefix hits sim {sim.prefix_hits} node {node.prefix_hits}, block hits "
                f"sim {sim.block_hits} node {node.block_hits}: {'agree' if row['agree'] else 'DISAGREE'}")  # fmt: skip
    return rows


def node_markdown(rows: Sequence[dict[str, object]], n: int) -> str:
    lines = [f"\n\n## The same policies on a real node over gRPC (first {n} requests)\n",
             "| capacity | policy | prefix hit rate: simulation | node | block hit rate: simulation | node | agree |",
             "|--:|---|--:|--:|--:|--:|---|"]  # fmt: skip
    for r in rows:
        b = int(r["blocks"])  # type: ignore[call-overload]
        lines.append(f"| {r['capacity']} | {r['policy']} | {int(r['sim_prefix_hits']) / b:.4f} | "  # type: ignore[call-overload]
                     f"{int(r['node_prefix_hits']) / b:.4f} | {int(r['sim_block_hits']) / b:.4f} | "  # type: ignore[call-overload]
                     f"{int(r['node_block_hits']) / b:.4f} | {'yes' if r['agree'] else '**no**'} |")  # type: ignore[call-overload]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
