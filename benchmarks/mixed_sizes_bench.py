"""Pages of every size in one node: how much of a DRAM budget holds pages (bytes stored / bytes budgeted).

Method: a real node (DRAM only, `--max-page-bytes 2MiB`, default policy) per workload, on loopback; one
client in this process (default transport: the same-host plane) puts rounds of pages until twice the budget
was offered, as engines' stores do (one Put per round and size: SGLang stores 64-page batches of 64 KiB
regions, LMCache 2 MiB chunks, a hybrid model a state page of another size beside them). Afterwards, from the
node's Stats: payload bytes held / `--dram-bytes` (the fill), pages held, evictions and pages not admitted;
the last round's pages fetched back (a Get per size, bytes compared); and of the most recent rounds worth half
the budget, the share of pages the node still holds (a Lookup each): what an engine coming back for its
recent prefixes would find. Workloads (`--workloads`):
- `sglang`: 64 KiB pages only, 64 per Put (the outside report's case);
- `mixed`: per round 64 x 64 KiB + 1 x 2 MiB + 2 x 1 MiB + 32 x 16 KiB (about equal bytes of each size);
- `hybrid`: per round 64 x 64 KiB KV regions + 1 x 1.25 MiB state page (a size over half the largest).

Before and after: run this script once with the tree measured first on PYTHONPATH (the node is started from
the same `kvstore` package; `kvstore_from` in the output names which), e.g.
    PYTHONPATH=/path/to/main .venv/bin/python benchmarks/mixed_sizes_bench.py --label main --out /tmp/b
    PYTHONPATH=$PWD .venv/bin/python benchmarks/mixed_sizes_bench.py --label sizes
Writes <out>/mixed_sizes_bench[-label].{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import time
from pathlib import Path

from machine import machine_line, save_results

import kvstore
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
from kvstore.names import TierKind

MAX_PAGE = 2 << 20
KIB = 1 << 10


def layout_of(nbytes: int) -> PageLayout:
    """A raw uint8 layout of exactly `nbytes` (a multiple of 2 KiB): one layer, one head, 16 tokens."""
    return PageLayout(DType.UINT8, 1, 1, nbytes // (2 * 16), 16)


# workload -> per round: (page bytes, pages per Put)
WORKLOADS: dict[str, list[tuple[int, int]]] = {
    "sglang": [(64 * KIB, 64)],
    "mixed": [(64 * KIB, 64), (2 << 20, 1), (1 << 20, 2), (16 * KIB, 32)],
    "hybrid": [(64 * KIB, 64), (1280 * KIB, 1)],
}


def source() -> str:
    """Where the `kvstore` package under test comes from, and its commit."""
    where = Path(kvstore.__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        rev = "?"
    return f"{where} @ {rev}"


def run(name: str, rounds_of: list[tuple[int, int]], dram: int) -> dict[str, object]:
    node = NodeProcess(dram_bytes=dram, max_page_bytes=MAX_PAGE, node_id=f"bench-sizes-{name}").start()
    pages = {size: os.urandom(size) for size, _ in rounds_of}
    per_round = sum(size * n for size, n in rounds_of)
    rounds = -(-2 * dram // per_round)
    offered = stored = 0
    last: dict[int, list[bytes]] = {}
    recent: list[tuple[int, bytes]] = []  # (size, hash) of every page, in the order put
    try:
        with KVStoreClient(node.addr, timeout=60) as kv:
            t0 = time.perf_counter()
            for r in range(rounds):
                for size, n in rounds_of:
                    hs = [hashlib.sha256(f"{name}-{size}-{r}-{i}".encode()).digest() for i in range(n)]
                    stored += kv.put(f"bench/sizes/{size}", layout_of(size), hs, [pages[size]] * n).stored
                    offered += n
                    last[size] = hs
                    recent += [(size, h) for h in hs]
            put_s = time.perf_counter() - t0
            served = {}
            for size, hs in last.items():
                got = kv.get(f"bench/sizes/{size}", hs, promote=False)
                if any(bytes(p) != pages[size] for p in got):
                    raise RuntimeError(f"{size} B pages came back with other bytes")
                served[size] = len(got)
            t = {s.tier: s for s in kv.stats().tiers}[TierKind.DRAM]
            asked_bytes = asked = held = 0
            for size, h in reversed(recent):  # the most recent pages worth half the budget
                if asked_bytes >= dram // 2:
                    break
                asked_bytes += size
                asked += 1
                held += kv.lookup(f"bench/sizes/{size}", [h])
    finally:
        node.close()
    return {
        "workload": name,
        "round": " + ".join(f"{n} x {size // KIB} KiB" for size, n in rounds_of),
        "offered_bytes": rounds * per_round,
        "pages_offered": offered,
        "pages_stored": stored,
        "capacity_bytes": t.capacity_bytes,
        "held_bytes": t.used_bytes,
        "fill": t.used_bytes / dram,
        "pages_held": t.pages,
        "evictions": t.counters.evictions,
        "not_admitted": t.counters.not_admitted,
        "last_round_served": {f"{size // KIB} KiB": f"{served[size]}/{n}" for size, n in rounds_of},
        "recent_half_budget_held": held / asked,
        "recent_half_budget_pages": asked,
        "put_seconds": round(put_s, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dram-bytes", type=int, default=256 << 20, help="the node's DRAM budget (default 256 MiB)")
    ap.add_argument("--workloads", default="sglang,mixed,hybrid", help=f"some of {','.join(WORKLOADS)}")
    ap.add_argument("--label", default="", help="names the output files (the tree measured, e.g. main)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    names = args.workloads.split(",")
    if unknown := [w for w in names if w not in WORKLOADS]:
        ap.error(f"--workloads: unknown {unknown}; known: {sorted(WORKLOADS)}")
    rows = [run(w, WORKLOADS[w], args.dram_bytes) for w in names]
    lines = [
        f"### mixed_sizes_bench{' (' + args.label + ')' if args.label else ''}",
        machine_line(),
        f"- kvstore from {source()}; --max-page-bytes 2MiB, --dram-bytes {args.dram_bytes}, default policy, "
        f"2x the budget offered; load average (1 min) {os.getloadavg()[0]:.1f}",
        "",
        "| workload | per round | fill (payload held / budget) | pages held | evictions | not admitted "
        "| recent half budget held | last round served |",
        "|---|---|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        served = ", ".join(f"{k} {v}" for k, v in r["last_round_served"].items())  # type: ignore[attr-defined]
        lines.append(
            f"| {r['workload']} | {r['round']} | {r['fill']:.3f} | {r['pages_held']} | {r['evictions']} "
            f"| {r['not_admitted']} | {r['recent_half_budget_held']:.2f} of {r['recent_half_budget_pages']} "
            f"| {served} |"
        )
    name = "mixed_sizes_bench" + (f"-{args.label}" if args.label else "")
    save_results(args.out, name, "\n".join(lines), args, rows=rows, kvstore_from=source())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
