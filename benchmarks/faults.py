"""The fault suite at full size (tests/faults runs the same scenarios at smoke size in CI).

Scenarios (devkit/faults.py, devkit/fuzz.py), each against real node processes: kill -9 at random points
of Put, demotion, promotion and shutdown spill (100 restarts by default); bit rot over NVMe data and
metadata; disk full on a tmpfs (root only); Redis killed and restarted empty under load; stalled and
silent consumers; fuzzed requests over every plane. Prints the table the issue asks for (fault, rounds
or requests, corrupt served, durable pages lost, recovery seconds, node memory peak) and writes
benchmarks/out/faults.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from machine import machine_line, save_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from devkit import faults
from devkit.fuzz import run_fuzz, setup_target
from kvstore.cli.launch import NodeProcess

SIZES = {  # option: (full, --quick, what)
    "kill_rounds": (100, 20, "kill -9 restarts"),
    "rot_rounds": (10, 3, "bit-rot rounds (restarts)"),
    "rot_flips": (100, 100, "bit flips per bit-rot round"),
    "fuzz_requests": (50_000, 10_000, "fuzzed requests"),
    "redis_outages": (5, 1, "Redis kills and restarts"),
}


def fuzz(requests: int) -> faults.FaultResult:
    res = faults.FaultResult("fuzzed requests (gRPC unary, Put streams, raw frames, shm)")
    node = NodeProcess(dram_bytes="96MiB", max_page_bytes=4096, node_id="fuzz").start()
    try:
        target = setup_target(node.addr)
        try:
            log = run_fuzz(target, requests)
        finally:
            target.close()
        res.rounds, res.requests = 1, log.requests
        res.errors = len(log.violations)
        res.memory_peak_bytes = faults.rss_peak(faults.node_pid(node))
        res.notes = {"case_kinds": len(log.by_label), "node_alive": node.proc is not None and node.proc.poll() is None}
    finally:
        node.close()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, (full, quick, what) in SIZES.items():
        ap.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=full, help=f"{what} (default {full}, --quick {quick})"
        )
    ap.add_argument("--quick", action="store_true", help="the CI smoke sizes")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    for name, (_, quick, _) in SIZES.items():
        if args.quick:
            setattr(args, name, quick)
    results: list[faults.FaultResult] = []
    t0 = time.monotonic()

    def record(name: str, run: Callable[[], faults.FaultResult]) -> None:
        """Run one scenario; a scenario that raises is a row with its error, and the others still run.
        The table is saved after every scenario, so a long run that stops keeps what it measured."""
        try:
            results.append(run())
        except Exception as exc:
            results.append(faults.FaultResult(name, errors=1, notes={"raised": f"{type(exc).__name__}: {exc}"[:2000]}))
        lines = ["## fault suite", "", machine_line(), "", faults.TABLE_HEAD, *(r.row() for r in results), ""]
        lines += [f"- {r.fault}: {r.notes}" for r in results]
        lines.append(f"- wall {time.monotonic() - t0:.0f} s so far")
        save_results(args.out, "faults", "\n".join(lines), args, results=[asdict(r) for r in results])

    with tempfile.TemporaryDirectory(prefix="kvstore-faults-") as tmp:
        work = Path(tmp)
        record("kill -9", lambda: faults.kill9(work / "kill9", args.kill_rounds, seed=1))
        record("bit rot", lambda: faults.bitrot(work / "rot", args.rot_rounds, args.rot_flips, pages=2048, seed=2))
        why = faults.can_mount_tmpfs(work / "probe")
        if why is None:
            record("disk full", lambda: faults.disk_full(work / "full", seconds=10.0))
        else:
            print(f"disk-full scenario not run: {why}")
        record("Redis", lambda: faults.redis_outage(work / "redis", outages=args.redis_outages, down_seconds=3.0))
        record("stalls", lambda: faults.slow_consumers(work / "slow", stalled=16, silent=32, seconds=10.0))
        record("fuzz", lambda: fuzz(args.fuzz_requests))
    bad = [r for r in results if r.corrupt_served or r.durable_lost or r.errors]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
