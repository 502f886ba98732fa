"""Hit rates of every eviction policy on every workload of the suite and on any trace, against
Belady's offline optimum, and the check of the default policy's target (DESIGN.md §6.4).

What is measured
    Each request of a workload (its prompt's block ids, in arrival order) is served by a simulated
    cache (devkit.sim.TieredBlockCache driving the kvstore.policy classes the way the TierManager
    does, admission included): the longest cached prefix is looked up, then every block of the
    request is touched or inserted in order, with parent = the previous block. Per policy, workload
    and capacity:
      prefix hit  per request the longest cached prefix (the prefill really saved), over all blocks;
                  the figure the target is about;
      block hit   blocks found cached at any position, over all blocks (in the JSON);
      per tier    for --tiers and --tiered-fractions, the hits served from each tier (exclusive tiers)
                  and the GB of KV the prefix hits read from each (blocks x the workload's tokens per
                  block x --kv-bytes-per-token), and the GB computed again (the rest);
      first reuse with --reuse-split, the block hits on a block's second reference apart from later
                  ones: admission on evidence of reuse (second sight) cannot make the first kind.
      with hints  on a workload with sessions (agentic), the default again, told of them as an agent
                  runtime knows them (devkit.workloads.retention_hints, leases of --hint-ttl seconds;
                  devkit.sim.TieredBlockCache.put_hinted); never a candidate of the target.
    See devkit/sim.py for the exact semantics.

Workloads
    The suite (devkit/workloads.py: chat, rag, agent, batch, tenants, conversation, production chat
    as the Mooncake and LMSYS statistics describe it, and agentic, agent sessions as vLLM's AgentX
    figures describe them; seeded) at --suite full or smoke, plus
    every --trace PATH (Mooncake FAST'25 format: one JSON object per line with `timestamp`,
    `input_length`, `output_length`, `hash_ids`; any trace in that format works). --seed N draws
    other requests of the same shapes: the policies' constants were measured on seed 0, so the
    same table at another seed is a held-out check that they were not fitted to those requests.

Capacities
    --fractions of each workload's working set: the blocks it references at least twice (the only
    blocks any cache can hit on; a cache of that size lets Belady reach the trace's ceiling). The
    default 0.02,0.05,0.1,0.2,0.3 is the range of the target. --capacity adds absolute sizes;
    --tiered-fractions adds per workload a DRAM tier at each fraction above an NVMe tier --nvme-ratio
    times its size (the top tier asks admission; what it refuses is written through to NVMe).

Reference (same run, same workload)
    Belady's MIN with bypass at the same capacity (for tiers, the sum of the tiers, and the top tier's
    alone: no policy serves more hits from the top tier): the most block hits any cache of that size
    can get; LRU, the baseline; and second-sight LRU (LRU admitting a
    block on its second sight, a ghost list of 4x the capacity remembering the refused ones).

Target (DESIGN.md §6.4)
    At every workload and capacity, the default policy (--default, "adaptive") is within 5%
    (relative) of the best other policy on prefix hit rate, and never below LRU nor second-sight LRU.
    The summary table says, per cell, the best candidate, the default's ratio to it, its margins
    over LRU and second-sight LRU, and whether the target is met.

Method
    The replay is deterministic (no timing in any figure but wall time), so each cell is run once;
    cells run in --jobs processes (default: every core). Wall time is time.perf_counter around a
    replay, on this machine.

Run:  .venv/bin/python benchmarks/trace_replay.py [--suite full|smoke|none] [--trace PATH ...]
          [--seed N] [--fractions 0.02,...] [--capacity N,...] [--tiers hbm:N,dram:N,nvme:N]
          [--tiered-fractions 0.02,... --nvme-ratio 4 --kv-bytes-per-token B] [--reuse-split] [--hint-ttl S]
          [--policy all|NAME,...]
          [--default adaptive] [--jobs N] [--node-requests N --node-capacity N,...] [--out DIR] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from machine import cpu_model

from devkit.sim import (
    ReplayCache,
    ReplayResult,
    RetentionHint,
    TieredBlockCache,
    TierSpec,
    TraceRecord,
    belady_block_hits,
    parse_tiers,
    replay,
)
from devkit.workloads import SESSION_WORKLOADS, WORKLOADS, Size, generate, generate_tagged, retention_hints
from kvstore.policy import POLICIES

DEFAULT_OUT = Path(__file__).resolve().parent / "out"
# NOTE: the order of the table's columns: the baseline first, the proposed default last.
POLICY_ORDER = ("lru", "prefix-lru", "arc", "s3fifo", "prefix-arc", "tinylfu", "second-sight", "duel", "adaptive")
DEFAULT_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.3)
TARGET_RATIO = 0.95  # DESIGN.md §6.4: within 5% (relative) of the best candidate
FLOORS = ("lru", "second-sight")  # DESIGN.md §6.4: the default is never below these
TRACE_BLOCK_TOKENS = 512  # the Mooncake format's blocks (a suite workload says its own: WorkloadSpec.block_tokens)
# NOTE: the KV of one token of Llama-3.1-8B in bf16: 32 layers x 2 (K, V) x 8 KV heads x 128 x 2 bytes.
KV_BYTES_PER_TOKEN = 131_072
REUSE_POLICIES = ("lru", "second-sight")  # beside the default and Belady in the --reuse-split table
HINTED = "+hints"  # a policy name with this suffix: the policy, told of sessions through retention leases
HINT_TTL_S = 60.0  # the lease an agent runtime asks when a session pauses (a tool call's usual timeout)


@dataclass(slots=True)
class Cell:
    """One replay: a policy on one cache configuration of one workload."""

    source: str
    config: str  # "2000" or "hbm:500,dram:1500"
    capacity: int  # total blocks
    policy: str
    block_hit: float | None
    prefix_hit: float
    tiers: dict[str, tuple[float, float]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    first_reuse_hit: float | None = None  # block hits on a block's second reference (devkit/sim.py)


@dataclass(slots=True)
class Bound:
    """Belady's MIN at a configuration's whole capacity (and, for tiers, at its top tier's alone: no
    policy serves more hits from the top tier than MIN would at that capacity)."""

    source: str
    config: str
    capacity: int
    belady_block_hit: float
    wall_s: float
    first_reuse_hit: float = 0.0  # of belady_block_hit, the hits on a block's second reference
    top_capacity: int | None = None
    belady_top_block_hit: float | None = None


@dataclass(slots=True)
class Verdict:
    """The target check for one single-tier cell."""

    source: str
    capacity: int
    default: str
    default_hit: float
    best: str
    best_hit: float
    floors: dict[str, float] = field(default_factory=dict)  # FLOORS replayed in this cell -> prefix hit

    @property
    def ratio(self) -> float:
        return self.default_hit / self.best_hit if self.best_hit else 1.0

    @property
    def met(self) -> bool:
        return self.ratio >= TARGET_RATIO and all(self.default_hit >= v for v in self.floors.values())


# ------------------------------------------------------------------------------------------ sources


def load_trace(path: Path) -> list[list[int]]:
    """A Mooncake-format trace's requests; exits naming the file and line of a malformed record."""
    requests = []
    try:
        f = path.open()
    except OSError as e:
        raise SystemExit(f"--trace {path}: {e.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                requests.append(list(TraceRecord.from_json(json.loads(line)).hash_ids))
            except (ValueError, json.JSONDecodeError) as e:
                raise SystemExit(f"{path}:{lineno}: {e}") from None
    return requests


_SOURCES: dict[str, list[list[int]]] = {}  # per process: workloads are rebuilt, not pickled


def source_requests(spec: str) -> list[list[int]]:
    """'suite:NAME:SIZE:SEED' (a generated workload) or 'trace:PATH' -> its requests (cached per process)."""
    reqs = _SOURCES.get(spec)
    if reqs is None:
        kind, _, rest = spec.partition(":")
        if kind == "suite":
            name, size, seed = rest.split(":")
            reqs = generate(name, size=size, seed=int(seed))
        else:
            reqs = load_trace(Path(rest))
        _SOURCES[spec] = reqs
    return reqs


_HINTS: dict[tuple[str, float], list[RetentionHint]] = {}  # per process, as _SOURCES


def source_hints(spec: str, ttl_s: float) -> list[RetentionHint]:
    """The retention hints of a suite workload with sessions ('suite:NAME:SIZE:SEED'), one per request of
    source_requests(spec) (devkit.workloads.retention_hints with a lease of `ttl_s`)."""
    hints = _HINTS.get((spec, ttl_s))
    if hints is None:
        name, size, seed = spec.partition(":")[2].split(":")
        reqs, tags = generate_tagged(name, size=size, seed=int(seed))
        if reqs != source_requests(spec):
            raise RuntimeError(f"{spec}: generate_tagged() drew other requests than generate()")
        hints = _HINTS[(spec, ttl_s)] = retention_hints(tags, ttl_s)
    return hints


def _block_tokens(spec: str) -> int:
    """Tokens one block of a source stands for (a trace: the Mooncake format's 512)."""
    kind, _, rest = spec.partition(":")
    return WORKLOADS[rest.partition(":")[0]].block_tokens if kind == "suite" else TRACE_BLOCK_TOKENS


def source_label(spec: str) -> str:
    kind, _, rest = spec.partition(":")
    return rest.partition(":")[0] if kind == "suite" else Path(rest).stem


def trace_summary(requests: Sequence[Sequence[int]]) -> dict[str, float | int]:
    counts = Counter(b for r in requests for b in r)
    blocks = sum(counts.values())
    return {
        "requests": len(requests),
        "blocks": blocks,
        "unique_blocks": len(counts),
        "working_set": sum(1 for n in counts.values() if n > 1),  # blocks referenced at least twice
        "ceiling_hit_rate": 1 - len(counts) / blocks if blocks else 0.0,
    }


# ------------------------------------------------------------------------------------------- replay


def replay_cell(
    requests: Sequence[Sequence[int]], cache: ReplayCache, hints: Sequence[RetentionHint] | None = None
) -> tuple[ReplayResult, float]:
    """Replay through any ReplayCache (simulated here; a gRPC-backed one plugs in the same way)."""
    t0 = time.perf_counter()
    res = replay(requests, cache, hints)
    return res, time.perf_counter() - t0


def _run_cell(job: tuple[str, str, tuple[TierSpec, ...], str, float]) -> Cell:
    spec, label, tiers, policy, ttl_s = job
    hinted = policy.endswith(HINTED)
    cache = TieredBlockCache(tiers, policy.removesuffix(HINTED))
    res, wall = replay_cell(source_requests(spec), cache, source_hints(spec, ttl_s) if hinted else None)
    c = cache.counters
    counters = {"promoted": c.promoted, "demoted": c.demoted, "dropped": c.dropped, "not_admitted": c.not_admitted,
                "not_stored": c.not_stored}  # fmt: skip
    if hinted:
        counters |= {"leased": c.leased, "lease_refused": c.lease_refused}
    return Cell(source_label(spec), label, sum(t.capacity for t in tiers), policy, res.block_hit_rate,
                res.prefix_hit_rate, res.tier_rates() if len(tiers) > 1 else {}, counters, wall,
                res.first_reuse_hit_rate)  # fmt: skip


def _run_bound(job: tuple[str, str, int, int | None]) -> Bound:
    spec, label, capacity, top = job
    t0 = time.perf_counter()
    requests = source_requests(spec)
    opt = belady_block_hits(requests, capacity)
    top_hit = None if top is None else belady_block_hits(requests, top).block_hit_rate
    return Bound(source_label(spec), label, capacity, opt.block_hit_rate or 0.0, time.perf_counter() - t0,
                 opt.first_reuse_hit_rate or 0.0, top, top_hit)  # fmt: skip


def run(
    configs: Sequence[tuple[str, str, tuple[TierSpec, ...]]],
    policies: Sequence[str],
    jobs: int,
    progress: Callable[[str], None],
    hinted: str | None = None,
    ttl_s: float = HINT_TTL_S,
) -> tuple[list[Cell], list[Bound]]:
    """Every (source, config) x policy, and Belady per (source, config); `jobs` processes. `hinted`, a
    policy name: also that policy told of sessions (leases of `ttl_s`) on the workloads that have them."""
    bound_jobs = [(spec, label, sum(t.capacity for t in tiers), tiers[0].capacity if len(tiers) > 1 else None)
                  for spec, label, tiers in configs]  # fmt: skip
    # NOTE: the slowest policies first, so the pool's last jobs are short ones.
    cell_jobs = [(spec, label, tiers, p, ttl_s) for p in reversed(policies) for spec, label, tiers in configs]
    if hinted is not None:
        cell_jobs = [(spec, label, tiers, hinted + HINTED, ttl_s) for spec, label, tiers in configs
                     if source_label(spec) in SESSION_WORKLOADS and spec.startswith("suite:")] + cell_jobs  # fmt: skip
    if jobs <= 1:
        bounds = [_run_bound(j) for j in bound_jobs]
        cells = []
        for j in cell_jobs:
            cells.append(_run_cell(j))
            _log_cell(cells[-1], progress)
        return cells, bounds
    with ProcessPoolExecutor(jobs) as pool:
        bounds = list(pool.map(_run_bound, bound_jobs))
        cells = []
        for cell in pool.map(_run_cell, cell_jobs):
            cells.append(cell)
            _log_cell(cell, progress)
    return cells, bounds


def _log_cell(c: Cell, progress: Callable[[str], None]) -> None:
    progress(f"  {c.source:>10} {c.config:>20} {c.policy:<11} prefix {c.prefix_hit:.3f} ({c.wall_s:.1f} s)")


def verdicts(cells: Sequence[Cell], default: str) -> list[Verdict]:
    """The target check for every single-tier (source, capacity) where the default was replayed."""
    out = []
    groups: dict[tuple[str, str], list[Cell]] = {}
    for c in cells:
        if not c.tiers:
            groups.setdefault((c.source, c.config), []).append(c)
    for (source, _), group in groups.items():
        by = {c.policy: c for c in group}
        others = [c for c in group if c.policy != default and not c.policy.endswith(HINTED)]
        if default not in by or not others:
            continue
        best = max(others, key=lambda c: c.prefix_hit)
        floors = {f: by[f].prefix_hit for f in FLOORS if f in by and f != default}
        out.append(Verdict(source, by[default].capacity, default, by[default].prefix_hit, best.policy, best.prefix_hit,
                           floors))  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------- report


def source_digest() -> str:
    """Short SHA-256 over kvstore/policy/*.py, devkit/sim.py and devkit/workloads.py: which code was measured."""
    import devkit
    import kvstore

    files = sorted((Path(kvstore.__file__).resolve().parent / "policy").glob("*.py"))
    files += [Path(devkit.__file__).resolve().parent / n for n in ("sim.py", "workloads.py")]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
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
        f"python {meta['python']} | policy+sim+workloads {meta['policy_sim_src']} | suite seed {meta.get('seed', 0)}"
    )


def markdown(
    summaries: dict[str, dict[str, float | int]],
    cells: Sequence[Cell],
    bounds: Sequence[Bound],
    policies: Sequence[str],
    checks: Sequence[Verdict],
    meta: dict[str, object],
    wall_s: float,
    *,
    block_bytes: dict[str, int] | None = None,
    reuse_split: str | None = None,
    hinted: str | None = None,
    ttl_s: float = HINT_TTL_S,
) -> str:
    """The report. `block_bytes` (source -> KV bytes of one block) adds the bytes read from each tier to
    the tiered table; `reuse_split` (the default policy's name) adds the first-reuse table; `hinted` (a
    policy name) the column of that policy told of sessions, on the workloads that have them."""
    by = {(c.source, c.config, c.policy): c for c in cells}
    lines = [
        "# trace_replay — every policy on every workload, against Belady",
        "",
        f"Machine: {machine_line(meta)}. Wall time {wall_s:.0f} s.",
        "",
        "Cells: prefix hit rate (the prefill saved, over all blocks; devkit/sim.py). Belady: MIN with bypass, "
        "block hits, same capacity (an upper bound for both rates). Capacities are fractions of the workload's "
        "working set (blocks referenced at least twice).",
    ]
    for source, summary in summaries.items():
        hinted_here = hinted is not None and source in SESSION_WORKLOADS
        lines += [
            "",
            f"**{source}**: {summary['requests']} requests, {summary['blocks']} blocks, {summary['unique_blocks']} "
            f"unique, working set {summary['working_set']}; ceiling (unbounded cache) {summary['ceiling_hit_rate']:.3f}.",
            "",
            "| capacity | " + " | ".join(policies) + " | Belady |" + (f" {hinted} with hints |" if hinted_here else ""),
            "|---:|" + "---:|" * len(policies) + "---:|" + ("---:|" if hinted_here else ""),
        ]
        for b in (b for b in bounds if b.source == source and b.top_capacity is None):
            row = [b.config]
            for p in policies:
                c = by.get((source, b.config, p))
                row.append("" if c is None else f"{c.prefix_hit:.3f}")
            row.append(f"{b.belady_block_hit:.3f}")
            if hinted_here:
                c = by.get((source, b.config, f"{hinted}{HINTED}"))
                row.append("" if c is None else f"{c.prefix_hit:.3f}")
            lines.append("| " + " | ".join(row) + " |")
        if hinted_here:
            lines += ["", f"With hints: {hinted} told of each request's session as an agent runtime knows it "
                      f"(devkit.workloads.retention_hints), as DESIGN.md §6.5's sessions in HOLD mode: a session that pauses "
                      f"(a tool call, or its subagents) retains its blocks for {ttl_s:g} s, its next request resumes "
                      "it (its held blocks promoted to the top tier first), its last request ends it; at most half "
                      "of each tier held (devkit/sim.py, TieredBlockCache.resume, put_hinted)."]  # fmt: skip
    tiered = [c for c in cells if c.tiers]
    if tiered:
        order = {p: i for i, p in enumerate(policies)}
        tiered = sorted(tiered, key=lambda c: (c.source, c.capacity, order.get(c.policy, len(order))))
        lines += tiered_markdown(tiered, bounds, summaries, block_bytes or {})
    if reuse_split:
        lines += reuse_markdown(cells, bounds, reuse_split)
    if checks:
        met = sum(v.met for v in checks)
        lines += [
            "",
            f"Target (DESIGN.md §6.4): `{checks[0].default}` within {1 - TARGET_RATIO:.0%} of the best other policy "
            f"on "
            f"prefix hit rate, and never below {' nor '.join(FLOORS)}: **met in {met} of {len(checks)} cells**.",
            "",
            "| workload | capacity | default | best other | ratio | "
            + " | ".join(f"vs {f}" for f in FLOORS)
            + " | met |",
            "|---|--:|--:|---|--:|" + "--:|" * len(FLOORS) + "---|",
        ]
        for v in checks:
            vs = [f"{v.default_hit - v.floors[f]:+.3f}" if f in v.floors else "" for f in FLOORS]
            lines.append(f"| {v.source} | {v.capacity} | {v.default_hit:.3f} | {v.best} {v.best_hit:.3f} | "
                         f"{v.ratio:.3f} | " + " | ".join(vs) + f" | {'yes' if v.met else '**no**'} |")  # fmt: skip
    walls: dict[str, float] = {}
    for c in cells:
        walls[c.policy] = walls.get(c.policy, 0.0) + c.wall_s
    lines += ["", "Replay time per policy, all cells (s): " + ", ".join(f"{p} {w:.0f}" for p, w in walls.items())]
    lines += [f"Belady (s): {sum(b.wall_s for b in bounds):.0f}", ""]
    return "\n".join(lines)


def tiered_markdown(
    tiered: Sequence[Cell],
    bounds: Sequence[Bound],
    summaries: dict[str, dict[str, float | int]],
    block_bytes: dict[str, int],
) -> list[str]:
    """The tiered cells (each configuration's cells together): hits served from each tier, the KV bytes
    those prefix hits read from it and the bytes computed again, and per configuration Belady's bounds."""
    lines = [
        "",
        "Tiered: block / prefix hit rate served from each tier (they sum to the totals), the GB (10^9 bytes) of "
        "KV the prefix hits read from each tier, and the GB of KV computed again (the blocks past each request's "
        "cached prefix). Belady (bounds): at most the block hits of MIN at the top tier's capacity from the top "
        "tier, at most MIN's at the whole capacity from the cache, so at least the rest computed.",
    ]
    groups: dict[tuple[str, ...], list[Cell]] = {}
    for c in tiered:
        groups.setdefault(tuple(c.tiers), []).append(c)
    bound = {(b.source, b.config): b for b in bounds if b.top_capacity is not None}
    for names, group in groups.items():
        lines += [
            "",
            "| workload | config | policy | prefix hit | " + " | ".join(names) + " | "
            + " | ".join(f"GB from {n}" for n in names) + " | GB computed | promoted | demoted | dropped | not admitted |",
            "|---|---|---|--:|" + "--:|" * (2 * len(names) + 5),
        ]  # fmt: skip
        last: tuple[str, str] | None = None
        for c in [*group, None]:
            if last is not None and (c is None or (c.source, c.config) != last) and last in bound:
                b, gb = bound[last], _gb(block_bytes, summaries, last[0])
                top = b.belady_top_block_hit or 0.0
                lines.append(f"| {last[0]} | {last[1]} | Belady (bound) | ≤ {b.belady_block_hit:.3f} | ≤ {top:.3f} | "
                             + " | " * (len(names) - 1) + f"≤ {top * gb:,.1f} | " + " | " * (len(names) - 1)
                             + f"≥ {(1 - b.belady_block_hit) * gb:,.1f} | | | | |")  # fmt: skip
            if c is None:
                break
            last = (c.source, c.config)
            gb = _gb(block_bytes, summaries, c.source)
            per = [f"{c.tiers[n][0]:.3f} / {c.tiers[n][1]:.3f}" for n in names]
            read = [f"{c.tiers[n][1] * gb:,.1f}" for n in names]
            k = c.counters
            lines.append(f"| {c.source} | {c.config} | {c.policy} | {c.prefix_hit:.3f} | " + " | ".join(per + read)
                         + f" | {(1 - c.prefix_hit) * gb:,.1f} | {k['promoted']} | {k['demoted']} | {k['dropped']} | "
                         f"{k['not_admitted']} |")  # fmt: skip
    return lines


def _gb(block_bytes: dict[str, int], summaries: dict[str, dict[str, float | int]], source: str) -> float:
    """GB (10^9 bytes) of KV in all the blocks `source` references (0 when its block size is unknown)."""
    return block_bytes.get(source, 0) * int(summaries[source]["blocks"]) / 1e9


def reuse_markdown(cells: Sequence[Cell], bounds: Sequence[Bound], default: str) -> list[str]:
    """Block hits on a block's first reuse (its second reference) / on later references, per single-tier
    cell, for the reference policies, the default and Belady: what admission on evidence cannot reach."""
    pols = [*REUSE_POLICIES, default]
    by = {(c.source, c.config, c.policy): c for c in cells if not c.tiers}
    lines = [
        "",
        "Where the block hits are: on a block's first reuse (its second reference) / on later references. A policy "
        "that admits a block on evidence of reuse (second sight) cannot hit a first reuse.",
        "",
        "| workload | capacity | " + " | ".join(pols) + " | Belady |",
        "|---|--:|" + "--:|" * (len(pols) + 1),
    ]
    for b in bounds:
        if b.top_capacity is not None:
            continue
        row = []
        for p in pols:
            c = by.get((b.source, b.config, p))
            first = None if c is None else c.first_reuse_hit
            row.append("" if c is None or first is None else f"{first:.3f} / {(c.block_hit or 0.0) - first:.3f}")
        row.append(f"{b.first_reuse_hit:.3f} / {b.belady_block_hit - b.first_reuse_hit:.3f}")
        lines.append(f"| {b.source} | {b.config} | " + " | ".join(row) + " |")
    return lines


# ------------------------------------------------------------------------------------------- main


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{what}: {text!r} is not a comma-separated list of numbers") from None
    return vals


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--suite", choices=["full", "smoke", "none"], default="full", help="the generated workloads (default full)"
    )
    ap.add_argument("--seed", type=int, default=0, help="the suite's seed (default 0; another is a held-out check)")
    ap.add_argument("--workloads", default="", help=f"a subset of the suite, comma-separated, from {sorted(WORKLOADS)}")
    ap.add_argument(
        "--trace", type=Path, action="append", default=[], help="a Mooncake-format JSONL trace (repeatable)"
    )
    ap.add_argument("--fractions", default=",".join(map(str, DEFAULT_FRACTIONS)),
                    help="capacities as fractions of each workload's working set ('' for none)")  # fmt: skip
    ap.add_argument("--capacity", default="", help="absolute single-tier capacities in blocks, comma-separated")
    ap.add_argument("--tiers", default="", help="a tiered config, e.g. hbm:500,dram:2000,nvme:8000 (exclusive tiers)")
    ap.add_argument("--tiered-fractions", default="",
                    help="tiered configs per workload: DRAM at these fractions of its working set, NVMe --nvme-ratio "
                         "times that (e.g. 0.02,0.05,0.1; '' for none)")  # fmt: skip
    ap.add_argument("--nvme-ratio", type=float, default=4.0, help="NVMe blocks per DRAM block in --tiered-fractions")
    ap.add_argument("--kv-bytes-per-token", type=int, default=KV_BYTES_PER_TOKEN,
                    help=f"KV bytes of one token, for the bytes read from each tier (default {KV_BYTES_PER_TOKEN:,}: "
                         "Llama-3.1-8B in bf16)")  # fmt: skip
    ap.add_argument("--reuse-split", action="store_true",
                    help="add the table of hits on a block's first reuse against later ones (lru, second sight, the "
                         "default, Belady)")  # fmt: skip
    ap.add_argument("--hint-ttl", type=float, default=HINT_TTL_S,
                    help=f"seconds of the retention lease a pausing agent session asks (default {HINT_TTL_S:g}); the "
                         "default policy is also replayed with these hints on the workloads with sessions (0: not)")  # fmt: skip
    ap.add_argument("--policy", default="all", help=f"'all' or comma-separated names from {sorted(POLICIES)}")
    ap.add_argument("--default", default="adaptive", help="the policy checked against the target (default adaptive)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: every core)")
    ap.add_argument(
        "--json", nargs="?", const="-", default=None, metavar="PATH", help="write the JSON (to stdout without PATH)"
    )
    ap.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"directory for trace_replay.{{json,md}} (default {DEFAULT_OUT})"
    )
    ap.add_argument("--node-requests", type=int, default=0,
                    help="also replay the first N requests of the first workload through a real node over gRPC per "
                         "policy and --node-capacity, and compare with the simulation (0: off)")  # fmt: skip
    ap.add_argument("--node-capacity", default="500,1000", help="capacities (blocks) for the node replay")
    args = ap.parse_args(argv)
    if args.suite == "none" and not args.trace:
        ap.error("nothing to replay: give --trace or a --suite")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    names = [w.strip() for w in args.workloads.split(",") if w.strip()] or list(WORKLOADS)
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; known: {sorted(WORKLOADS)}")
    specs = [] if args.suite == "none" else [f"suite:{n}:{Size(args.suite).value}:{args.seed}" for n in names]
    specs += [f"trace:{p}" for p in args.trace]
    if args.policy == "all":
        policies = [p for p in POLICY_ORDER if p in POLICIES] + sorted(set(POLICIES) - set(POLICY_ORDER))
    else:
        policies = [p.strip().lower() for p in args.policy.split(",") if p.strip()]
        unknown = [p for p in policies if p not in POLICIES]
        if unknown:
            raise SystemExit(f"unknown policy {unknown}; known: {sorted(POLICIES)}")
    fractions = _floats(args.fractions, "--fractions")
    if any(not 0 < f <= 1 for f in fractions):
        raise SystemExit(f"--fractions: each must be in (0, 1], got {fractions}")
    tier_fractions = _floats(args.tiered_fractions, "--tiered-fractions")
    if any(not 0 < f <= 1 for f in tier_fractions):
        raise SystemExit(f"--tiered-fractions: each must be in (0, 1], got {tier_fractions}")
    if not args.nvme_ratio > 0:
        raise SystemExit(f"--nvme-ratio must be > 0, got {args.nvme_ratio}")
    if args.kv_bytes_per_token < 1:
        raise SystemExit(f"--kv-bytes-per-token must be >= 1, got {args.kv_bytes_per_token}")
    if not (args.hint_ttl >= 0 and math.isfinite(args.hint_ttl)):
        raise SystemExit(f"--hint-ttl must be >= 0 seconds (0: no hinted replay), got {args.hint_ttl}")
    capacities = [int(c) for c in _floats(args.capacity, "--capacity")]
    try:
        tiers = parse_tiers(args.tiers) if args.tiers else None
        extra = [(str(c), (TierSpec("cache", c),)) for c in capacities]
    except ValueError as e:
        raise SystemExit(f"bad capacity or tiers: {e}") from None

    meta = machine_info() | {"seed": args.seed}
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json == "-" else (lambda s: print(s, flush=True))
    log(f"# trace_replay — {machine_line(meta)}")
    summaries: dict[str, dict[str, float | int]] = {}
    configs: list[tuple[str, str, tuple[TierSpec, ...]]] = []
    for spec in specs:
        summary = trace_summary(source_requests(spec))
        summaries[source_label(spec)] = summary
        caps = sorted({max(1, int(f * int(summary["working_set"]))) for f in fractions})
        configs += [(spec, str(c), (TierSpec("cache", c),)) for c in caps]
        for c in sorted({max(1, int(f * int(summary["working_set"]))) for f in tier_fractions}):
            nvme = max(1, round(args.nvme_ratio * c))
            configs.append((spec, f"dram:{c},nvme:{nvme}", (TierSpec("dram", c), TierSpec("nvme", nvme))))
        configs += [(spec, label, t) for label, t in extra]
        if tiers is not None:
            configs.append((spec, args.tiers, tiers))
        log(f"# {source_label(spec)}: {summary['requests']} requests, {summary['blocks']} blocks, "
            f"working set {summary['working_set']}")  # fmt: skip
    hinted = None if args.hint_ttl == 0 else args.default
    cells, bounds = run(configs, policies, args.jobs, log, hinted, args.hint_ttl or HINT_TTL_S)
    checks = verdicts(cells, args.default)
    wall = time.perf_counter() - t_start

    block_bytes = {source_label(spec): args.kv_bytes_per_token * _block_tokens(spec) for spec in specs}
    md = markdown(summaries, cells, bounds, policies, checks, meta, wall, block_bytes=block_bytes,
                  reuse_split=args.default if args.reuse_split else None, hinted=hinted, ttl_s=args.hint_ttl)  # fmt: skip
    node_rows = []
    if args.node_requests and specs:
        node_rows = node_vs_sim(source_requests(specs[0])[: args.node_requests],
                                [int(c) for c in _floats(args.node_capacity, "--node-capacity")], policies, log)  # fmt: skip
        md += node_markdown(node_rows, args.node_requests, source_label(specs[0]))
    doc = {
        "machine": meta,
        "workloads": summaries,
        "policies": policies,
        "default": args.default,
        "hint_ttl_s": args.hint_ttl,
        "kv_bytes_per_block": block_bytes,
        "bounds": [asdict(b) for b in bounds],
        "cells": [asdict(c) for c in cells],
        "target": [asdict(v) | {"ratio": v.ratio, "met": v.met} for v in checks],
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
    """Replay `requests` through a real node (benchmarks/node_replay.py) and through the simulation
    of the node's own keys, per policy and capacity: the hit counts must be identical if the node runs
    the policy it claims, admission included (the node's manager asks admit() where the simulation does)."""
    from node_replay import NodeReplayCache, node_requests  # sibling module: the I/O stays out of the pure path

    keyed = node_requests(requests)
    rows = []
    for cap in capacities:
        for pol in policies:
            sim = replay(keyed, TieredBlockCache(cap, pol, admission=True))
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


def node_markdown(rows: Sequence[dict[str, object]], n: int, source: str) -> str:
    lines = [f"\n\n## The same policies on a real node over gRPC (first {n} requests of {source})\n",
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
