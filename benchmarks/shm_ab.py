"""The same-host zero-copy path of one or more kvstore checkouts beside Mooncake's same-host path, alternated.

What it answers: is a change to the same-host plane faster than the tree it started from, and where does it stand
against Mooncake Store's same-host path (the client mounts its segment itself and copies: memcpy in the caller's
own process), on the same machine in the same minutes. On a shared, loaded machine absolute GB/s swing several
times over between minutes; the alternation makes the ratios comparable.

Method. One worker per system, each in its own process: for a kvstore tree, benchmarks/shm_ab_worker.py run with
PYTHONPATH=<tree> (its own node, a client with transport="shm", `get_into` / `put_from` of `--batch` pages in a
SharedBuffer: the node copies each page once, verifying a get's in the pass that copies it); for Mooncake,
benchmarks/peer_driver.py's `mooncake-local` in the peers' venv (`batch_get_into` / `batch_put_from` on registered
buffers). Per page size, `--rounds` rounds; in each round every system runs `--iters` timed calls of each op, in
an order rotated and reversed from round to round. GB/s (10^9 B/s) is the median over rounds of each round's
rate; "fast" is the 10th percentile of the per-round time (what a call gets when the machine leaves it alone);
"vs FIRST (paired)" is the median over rounds of the first system's time over this one's in the same round.
kvstore's workers also report CPU per GB of the client and the node (every thread). The load average is printed
beside the figures. Writes benchmarks/out/shm_ab.{json,md}.

Run:  .venv/bin/python benchmarks/shm_ab.py --trees branch=. main=/path/to/main-checkout [--no-peers]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import machine_line, save_results
from peer_bench import ensure_peers_venv

HERE = Path(__file__).resolve().parent
REPLY_TIMEOUT_S = 600.0


class Worker:
    """A system's process, spoken to in peer_driver.py's JSON lines."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> None:
        self.name = name
        self.log = log
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "ab"),  # noqa: SIM115
                                     text=True, env=env, cwd=cwd, start_new_session=True)  # fmt: skip
        self.hello = self.ask(None)

    def ask(self, cmd: dict[str, object] | None) -> dict[str, object]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if cmd is not None:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise RuntimeError(f"{self.name}: the worker gave no answer (see {self.log})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask({"cmd": "close"})
                self.proc.wait(60)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)


def memcpy_secs(size: int, batch: int, iters: int) -> float:
    src, dst = bytearray(os.urandom(size) * batch), bytearray(size * batch)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst[:] = src
    return time.perf_counter() - t0


def summary(nbytes: int, rounds: list[dict[str, object]]) -> dict[str, float]:
    """Median GB/s over rounds, the fast end (10th percentile of the round times), CPU per GB when reported."""
    secs = sorted(float(r["secs"]) for r in rounds)  # type: ignore[arg-type]
    out = {"gbs": statistics.median(nbytes / s / 1e9 for s in secs), "fast_gbs": nbytes / secs[len(secs) // 10] / 1e9}
    if "node_cpu" in rounds[0]:
        gb = nbytes / 1e9
        out["client_ms_per_gb"] = statistics.median(float(r["client_cpu"]) for r in rounds) / gb * 1e3  # type: ignore[arg-type]
        out["node_ms_per_gb"] = statistics.median(float(r["node_cpu"]) for r in rounds) / gb * 1e3  # type: ignore[arg-type]
    return out


def paired_ratio(ref: list[dict[str, object]], got: list[dict[str, object]]) -> float:
    """Median over rounds of (ref's time / got's time) in the same round: got's speed as a multiple of ref's, each
    round's pair run minutes apart at most seconds, so the machine's swings between rounds cancel."""
    return statistics.median(float(a["secs"]) / float(b["secs"]) for a, b in zip(ref, got, strict=True))  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs="+", default=[f"this={HERE.parent}"], help="NAME=PATH of kvstore checkouts")
    ap.add_argument("--sizes", default="1048576,4194304", help="page sizes in bytes, multiples of 8192")
    ap.add_argument("--batch", type=int, default=16, help="pages per call (default 16)")
    ap.add_argument("--rounds", type=int, default=30, help="rounds per size (default 30)")
    ap.add_argument("--iters", type=int, default=3, help="timed calls per system, op and round (default 3)")
    ap.add_argument("--ops", default="get,put", help="get, put or both (default get,put)")
    ap.add_argument("--no-peers", action="store_true", help="leave Mooncake out")
    ap.add_argument("--peers-venv", type=Path, default=HERE / ".peers-venv", help="the peers' venv (made if missing)")
    ap.add_argument("--out", type=Path, default=HERE / "out")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(s <= 0 or s % 8192 for s in sizes):
        ap.error("--sizes: each size must be a positive multiple of 8192")
    ops = args.ops.split(",")
    logdir = Path(tempfile.mkdtemp(prefix="shm-ab-"))
    workers: list[Worker] = []
    loads = [os.getloadavg()[0]]
    t_start = time.perf_counter()
    results: list[dict[str, object]] = []
    try:
        for spec in args.trees:
            name, _, path = spec.partition("=")
            tree = Path(path).resolve()
            if not (tree / "kvstore" / "__init__.py").exists():
                ap.error(f"--trees: {spec!r} does not name a kvstore checkout (NAME=PATH)")
            env = {**os.environ, "PYTHONPATH": str(tree)}
            # NOTE: run in the tree: the node is started with `python -m`, which puts the working directory first
            # on sys.path, so from any other checkout the node would run that checkout's code, not this tree's.
            w = Worker(name, [sys.executable, str(HERE / "shm_ab_worker.py")], env, logdir / f"{name}.log", tree)
            workers.append(w)
            if not Path(str(w.hello.get("kvstore"))).is_relative_to(tree):
                raise RuntimeError(f"{name}: the worker imported kvstore from {w.hello.get('kvstore')}, not {tree}")
        if not args.no_peers:
            python = ensure_peers_venv(args.peers_venv, logdir / "peers-venv.log")
            argv_peer = [str(python), str(HERE / "peer_driver.py"), "mooncake-local", str(logdir)]
            workers.append(Worker("Mooncake same host", argv_peer, dict(os.environ), logdir / "mooncake.log"))
        for size in sizes:
            for w in workers:
                w.ask({"cmd": "setup", "size": size, "batch": args.batch})
            nbytes = size * args.batch * args.iters
            rounds: dict[tuple[str, str], list[dict[str, object]]] = {}
            for r in range(args.rounds):
                order = workers[r % len(workers) :] + workers[: r % len(workers)]
                order = order[::-1] if r % 2 else order
                rounds.setdefault(("memcpy", "copy"), []).append({"secs": memcpy_secs(size, args.batch, args.iters)})
                for op in ops:
                    for w in order:
                        reply = w.ask({"cmd": op, "iters": args.iters})
                        if reply.get("verified") is False:
                            raise RuntimeError(f"{w.name}: a get left wrong bytes")
                        rounds.setdefault((w.name, op), []).append(reply)
                loads.append(os.getloadavg()[0])
            first = workers[0].name if workers else ""
            for (name, op), got in rounds.items():
                row = {"page_bytes": size, "system": name, "op": op, **summary(nbytes, got)}
                if (ref := rounds.get((first, op))) is not None:
                    row["paired"] = paired_ratio(ref, got)
                results.append(row)
    finally:
        for w in workers:
            w.close()
    wall = time.perf_counter() - t_start
    first = workers[0].name if workers else ""
    lines = [
        machine_line(),
        f"- Workload: {args.batch} pages per call, {args.rounds} rounds x {args.iters} calls per system and op, "
        f"alternated; load average (1 min) {min(loads):.1f}-{max(loads):.1f}; wall {wall:.0f} s",
        "",
        "| page | op | system | GB/s (median) | fast (p10) | vs memcpy | vs "
        + first
        + " (paired) | client ms/GB | node ms/GB |",
        "|--:|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for row in results:
        same = [x for x in results if x["page_bytes"] == row["page_bytes"]]
        mc = next(x["gbs"] for x in same if x["system"] == "memcpy")
        cpu = [f"{row[k]:.0f}" if k in row else "" for k in ("client_ms_per_gb", "node_ms_per_gb")]
        paired = f"{row['paired']:.2f}x" if "paired" in row else ""
        lines.append(f"| {int(row['page_bytes']) >> 10} KiB | {row['op']} | {row['system']} | {row['gbs']:.2f} | "  # type: ignore[operator]
                     f"{row['fast_gbs']:.2f} | {row['gbs'] / mc:.2f}x | "  # type: ignore[operator]
                     f"{paired} | {cpu[0]} | {cpu[1]} |")  # type: ignore[operator]  # fmt: skip
    save_results(args.out, "shm_ab", "\n".join(lines), args, rows=results, wall_s=wall, loads=loads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
