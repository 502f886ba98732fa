"""What the same-host benchmarks share: their size/run options, and cells timed in turns (shm_bench.py,
nvme_bench.py)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from machine import save_results

from kvstore.memtune import tune_malloc_for_bulk_io
from kvstore.wire.shm import shm_available


def add_run_options(ap: argparse.ArgumentParser, *, iters: int, warmup: int, quick: str) -> None:
    """--sizes-kib, --batch, --iters, --runs, --warmup, --quick and --out, with these defaults."""
    ap.add_argument("--sizes-kib", default="256,1024,4096", help="page sizes in KiB, multiples of 8")
    ap.add_argument("--batch", type=int, default=16, help="pages per call (default 16)")
    ap.add_argument("--iters", type=int, default=iters, help=f"timed calls per run (default {iters})")
    ap.add_argument("--runs", type=int, default=5, help="runs per cell; GB/s is the median (default 5)")
    ap.add_argument("--warmup", type=int, default=warmup, help=f"untimed calls per run and cell (default {warmup})")
    ap.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")


def start(
    ap: argparse.ArgumentParser, argv: list[str] | None, quick_iters: int
) -> tuple[argparse.Namespace, list[int]]:
    """Parse the options; the page sizes asked for (a --quick run: 256 KiB, one run of `quick_iters`
    calls). Exits with a message when this host has no /dev/shm or an option is bad. Tunes malloc for
    bulk I/O as the node does."""
    args = ap.parse_args(argv)
    if not shm_available():
        ap.exit(1, "no writable /dev/shm on this host: the same-host planes cannot run here\n")
    if args.quick:
        args.sizes_kib, args.runs, args.iters, args.warmup = "256", 1, quick_iters, 1
    try:
        sizes = [int(s) for s in args.sizes_kib.split(",")]
    except ValueError:
        ap.error(f"--sizes-kib: {args.sizes_kib!r} is not a comma-separated list of integers")
    if any(s <= 0 or s % 8 for s in sizes):
        ap.error("--sizes-kib: each size must be a positive multiple of 8")
    tune_malloc_for_bulk_io()
    return args, sizes


def round_robin(cells: dict[str, Callable[[], object]], iters: int, warmup: int, nbytes: int) -> dict[str, float]:
    """GB/s (10^9 B/s) of each cell over `iters` calls of `nbytes` each, the cells taking turns call by
    call in a rotating order, so a burst of load from elsewhere on a shared machine hits them all alike.
    A call may return a cleanup (a delete after a put), which runs untimed."""
    names = list(cells)

    def once(name: str) -> float:
        t0 = time.perf_counter()
        cleanup = cells[name]()
        spent = time.perf_counter() - t0
        if callable(cleanup):
            cleanup()
        return spent

    for name in names:
        for _ in range(warmup):
            once(name)
    spent = dict.fromkeys(names, 0.0)
    for i in range(iters):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            spent[name] += once(name)
    return {name: iters * nbytes / spent[name] / 1e9 for name in names}


Column = tuple[str, Callable[[dict[str, object]], str]]  # (header, cell text of a row)


def save_table(args: argparse.Namespace, name: str, preamble: Sequence[str], columns: Sequence[Column],
               rows: list[dict[str, object]], wall: float) -> None:  # fmt: skip
    """Print the preamble lines and a markdown table of `rows`; write out/<name>.md and .json."""
    lines = [*preamble, "", "| " + " | ".join(h for h, _ in columns) + " |",
             "|" + "|".join("--:" for _ in columns) + "|"]  # fmt: skip
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in rows]
    save_results(args.out, name, "\n".join(lines), args, rows=rows, wall_s=wall)
