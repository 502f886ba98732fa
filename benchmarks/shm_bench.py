"""Same-host data planes compared in one run: gRPC streams vs the shared-memory plane vs memcpy.

Method: one real node (DRAM only) per page size, on loopback; two clients of it, one with
transport="grpc" and one with transport="shm". Per page size and plane: batched Put and Get GB/s of
`--batch` pages per call (median of `--runs` runs of `--iters` calls; fresh hashes per Put, deleted
after; the Get reads `--batch` resident pages). The planes alternate within each run. The machine's
own limit in the same run: single-threaded memcpy GB/s of the same bytes (bytearray slice copy, what
each plane ultimately does per page on each side), and 1/2 of it (a Get copies twice: slot -> segment
on the node, segment -> the caller's buffer). Writes benchmarks/out/shm_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from pathlib import Path

from machine import machine_line, save_results

from kvstore.client import KVStoreClient
from kvstore.launch import NodeProcess
from kvstore.layout import DType, PageLayout
from kvstore.memtune import tune_malloc_for_bulk_io
from kvstore.pageformat import slot_bytes_for
from kvstore.transport.shm import shm_available

NS = "bench/shm"
PLANES = ("grpc", "shm")


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def memcpy_gbs(nbytes: int, reps: int) -> float:
    src, dst = bytearray(b"\x5a" * nbytes), bytearray(nbytes)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst[:] = src
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def bench_size(kib: int, args: argparse.Namespace) -> list[dict[str, object]]:
    layout = PageLayout(DType.FLOAT16, num_layers=kib // 8, num_kv_heads=2, head_dim=64, block_size=16)
    page = bytes(range(256)) * (layout.page_bytes // 256)
    node = NodeProcess(dram_bytes=(3 * args.batch + 8) * slot_bytes_for(layout.page_bytes),
                       max_page_bytes=layout.page_bytes, node_id=f"bench-shm-{kib}").start()  # fmt: skip
    put: dict[str, list[float]] = {p: [] for p in PLANES}
    get: dict[str, list[float]] = {p: [] for p in PLANES}
    try:
        clients = {p: KVStoreClient(node.addr, pages_per_stream=max(256, args.batch), transport=p) for p in PLANES}
        try:
            moved = args.iters * args.batch * layout.page_bytes
            for run in range(args.runs):
                for plane in PLANES if run % 2 == 0 else PLANES[::-1]:
                    kv = clients[plane]
                    for i in range(args.warmup):
                        warm = hashes(f"warm-{plane}-{run}-{i}", args.batch)
                        kv.put(NS, layout, warm, [page] * args.batch)
                        kv.get(NS, warm)
                        kv.delete(NS, warm)
                    t0 = time.perf_counter()
                    for i in range(args.iters):
                        hs = hashes(f"put-{plane}-{run}-{i}", args.batch)
                        kv.put(NS, layout, hs, [page] * args.batch)
                        kv.delete(NS, hs)
                    put[plane].append(moved / (time.perf_counter() - t0) / 1e9)
                    resident = hashes(f"get-{plane}-{run}", args.batch)
                    kv.put(NS, layout, resident, [page] * args.batch)
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        assert len(kv.get(NS, resident)) == args.batch
                    get[plane].append(moved / (time.perf_counter() - t0) / 1e9)
                    kv.delete(NS, resident)
        finally:
            for c in clients.values():
                c.close()
    finally:
        node.close()
    copy = memcpy_gbs(args.batch * layout.page_bytes, 20)
    rows: list[dict[str, object]] = []
    for op, res in (("put", put), ("get", get)):
        g, s = statistics.median(res["grpc"]), statistics.median(res["shm"])
        rows.append({"page_kib": kib, "op": op, "grpc_gbs": g, "shm_gbs": s, "shm_vs_grpc": s / g,
                     "memcpy_gbs": copy, "shm_vs_memcpy": s / copy, "runs": {k: v for k, v in res.items()}})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-kib", default="256,1024,4096", help="page sizes in KiB, multiples of 8")
    ap.add_argument("--batch", type=int, default=16, help="pages per call (default 16)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per run (default 20)")
    ap.add_argument("--runs", type=int, default=5, help="runs per cell; GB/s is the median (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed put+get rounds per run (default 2)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 256 KiB only, 1 run, 3 calls")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    if not shm_available():
        print("no writable /dev/shm on this host: the shared-memory plane cannot run here")
        return 1
    if args.quick:
        args.sizes_kib, args.runs, args.iters, args.warmup = "256", 1, 3, 1
    sizes = [int(s) for s in args.sizes_kib.split(",")]
    if any(s <= 0 or s % 8 for s in sizes):
        ap.error("--sizes-kib: each size must be a positive multiple of 8")
    tune_malloc_for_bulk_io()
    t0 = time.perf_counter()
    rows = [r for kib in sizes for r in bench_size(kib, args)]
    wall = time.perf_counter() - t0
    lines = [
        machine_line(),
        f"- Workload: {args.batch} pages per call, {args.iters} calls x {args.runs} runs (median), DRAM-resident; "
        f"wall {wall:.0f} s",
        "",
        "| page | op | gRPC GB/s | shm GB/s | shm vs gRPC | memcpy GB/s (same run) | shm vs memcpy |",
        "|--:|---|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(f"| {r['page_kib']} KiB | {r['op']} | {r['grpc_gbs']:.2f} | {r['shm_gbs']:.2f} | "
                     f"{r['shm_vs_grpc']:.1f}x | {r['memcpy_gbs']:.1f} | {r['shm_vs_memcpy']:.2f} |")  # fmt: skip
    save_results(args.out, "shm_bench", "\n".join(lines), args, rows=rows, wall_s=wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
