"""A plain client, as a new user writes it, against LMCache's lm:// server, alternated in one run (DESIGN.md §13).

Method. Per page size (default 1 MiB and 4 MiB), `--rounds` rounds (default 2), each running, in turn:
- kvstore: a *fresh process* doing what a new user writes: `KVStoreClient(addr, transport=T)`, put 16 random
  pages, then `kv.get(ns, hashes)` in a loop for `--seconds` (0.8 s), three times; its GB/s (10^9 B/s) is the
  median of the three. Library defaults only. T is "tcp" (what a client on another host gets) and, as a
  second row, "auto" on the node's host (the same-host plane);
- LMCache lm://: LMCache's own client stack against its lm:// server (benchmarks/peer_driver.py in the peers'
  venv), batch 16, the same 0.8 s loops, three times, median.
The ratio is ours / lm:// per round; the table gives the median over rounds. GB per CPU-second counts the
client's and the node's (or LMCache's client's and server's) CPU time over the get loops.
Writes benchmarks/out/plain_client_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import machine_line, save_results
from peer_bench import Peer, cpu_seconds, ensure_peers_venv, layout_for

from kvstore.cli.launch import NodeProcess
from kvstore.pageformat import slot_bytes_for

HERE = Path(__file__).resolve().parent
BATCH = 16

# What a new user writes (run in a fresh interpreter): put 16 random pages, get them in a loop.
USER_SCRIPT = r"""
import json, os, statistics, sys, time, hashlib
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
addr, transport, size, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
layout = PageLayout(DType.FLOAT16, num_layers=size // 8192, num_kv_heads=2, head_dim=64, block_size=16)
ns = f"bench/plain/{os.getpid()}"  # each process its own pages: an earlier run stored other random bytes
hashes = [hashlib.sha256(f"plain-{size}-{i}".encode()).digest() for i in range(16)]
pages = [os.urandom(size) for _ in hashes]
with KVStoreClient(addr, transport=transport) as kv:
    kv.put(ns, layout, hashes, pages)
    assert [bytes(p) for p in kv.get(ns, hashes)] == pages
    rates, cpus, total = [], [], 0
    for _ in range(3):
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            got = kv.get(ns, hashes)
            n += sum(len(p) for p in got)
            del got
        rates.append(n / (time.perf_counter() - t0) / 1e9)
        cpus.append(time.process_time() - c0)
        total += n
    print(json.dumps({"gbs": statistics.median(rates), "plane": kv.plane, "client_cpu": sum(cpus),
                      "bytes": total}))
"""


def node_cpu(node: NodeProcess) -> float:
    assert node.proc is not None
    return cpu_seconds([node.proc.pid])


def ours(node: NodeProcess, transport: str, size: int, seconds: float) -> dict[str, float | str]:
    """One fresh user process; returns its median GB/s and the GB per CPU-second of client + node."""
    n0 = node_cpu(node)
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", USER_SCRIPT, node.addr, transport, str(size), str(seconds)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the {transport} user process failed:\n{out.stderr[-4000:]}")
    wall = time.perf_counter() - t0
    r = json.loads(out.stdout.strip().splitlines()[-1])
    node_seconds = node_cpu(node) - n0
    moved = r["bytes"] / 1e9  # GB moved in the timed loops
    return {
        "gbs": r["gbs"],
        "plane": r["plane"],
        "gb_per_cpu_s": moved / (r["client_cpu"] + node_seconds),
        "wall": wall,
    }


def lmcache(peer: Peer, size: int, seconds: float) -> dict[str, float]:
    """LMCache's lm:// server through LMCache's client stack, batch 16: three timed loops, median."""
    peer.setup(size, BATCH)
    peer.get(1)  # warm (and verify)
    rates, cpu, moved = [], 0.0, 0.0
    for _ in range(3):
        c0 = cpu_seconds(peer.pids())
        iters, secs = 1, 0.0
        while secs < seconds:  # grow the call count until one timed call fills the loop time
            secs, ok = peer.get(iters)
            if not ok:
                raise RuntimeError("LMCache returned wrong bytes")
            if secs < seconds:
                iters = max(iters * 2, int(iters * seconds / max(secs, 1e-6)) + 1)
        rates.append(iters * BATCH * size / secs / 1e9)
        cpu += cpu_seconds(peer.pids()) - c0
        moved += iters * BATCH * size / 1e9
    return {"gbs": statistics.median(rates), "gb_per_cpu_s": moved / cpu if cpu else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 4 << 20])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=0.8)
    p.add_argument("--peers-venv", type=Path, default=HERE / ".peers-venv")
    p.add_argument("--out", type=Path, default=HERE / "out")
    args = p.parse_args(argv)
    started = time.perf_counter()
    logdir = Path(tempfile.mkdtemp(prefix="plain-bench-"))
    python = ensure_peers_venv(args.peers_venv, logdir / "peers-venv.log")
    peer = Peer(python, "lmcache", logdir)
    rows: list[dict[str, object]] = []
    try:
        for size in args.sizes:
            layout = layout_for(size)
            slot = slot_bytes_for(layout.page_bytes)
            node = NodeProcess(dram_bytes=4 * BATCH * slot, max_page_bytes=layout.page_bytes, node_id="plain").start()
            try:
                runs: dict[str, list[dict[str, float | str]]] = {"tcp": [], "auto": [], "lm": []}
                for _ in range(args.rounds):
                    runs["tcp"].append(ours(node, "tcp", size, args.seconds))
                    runs["lm"].append(lmcache(peer, size, args.seconds))
                    runs["auto"].append(ours(node, "auto", size, args.seconds))
            finally:
                node.close()
            lm = [float(r["gbs"]) for r in runs["lm"]]
            for kind in ("tcp", "auto"):
                gbs = [float(r["gbs"]) for r in runs[kind]]
                rows.append({
                    "size": size,
                    "client": f"KVStoreClient(transport={kind!r}) -> {runs[kind][0]['plane']}",
                    "gbs": statistics.median(gbs),
                    "lm_gbs": statistics.median(lm),
                    "ratio": statistics.median(a / b for a, b in zip(gbs, lm, strict=True)),
                    "gb_per_cpu_s": statistics.median(float(r["gb_per_cpu_s"]) for r in runs[kind]),
                    "lm_gb_per_cpu_s": statistics.median(float(r["gb_per_cpu_s"]) for r in runs["lm"]),
                })  # fmt: skip
    finally:
        peer.close()
    lines = [
        "## Plain client get vs LMCache lm:// (benchmarks/plain_client_bench.py)",
        "",
        machine_line(),
        f"- Fresh process per measurement, put 16 random pages, `kv.get` loop {args.seconds} s x3, median; "
        f"LMCache lm:// through its own client stack, batch 16; {args.rounds} alternated rounds; ratio = median of "
        f"per-round ratios. GB = 10^9 B. CPU: client + server processes over the loops.",
        "",
        "| page | client | GB/s | lm:// GB/s | ratio | GB per CPU-s | lm:// GB per CPU-s |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {int(r['size']) >> 10} KiB | {r['client']} | {r['gbs']:.2f} | {r['lm_gbs']:.2f} | "  # type: ignore[str-bytes-safe]
            f"{r['ratio']:.2f}x | {r['gb_per_cpu_s']:.2f} | {r['lm_gb_per_cpu_s']:.2f} |"
        )
    lines.append(f"\nWall {time.perf_counter() - started:.0f} s.")
    save_results(args.out, "plain_client_bench", "\n".join(lines), args, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
