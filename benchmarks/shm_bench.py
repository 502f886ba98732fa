"""Same-host data planes compared in one run: gRPC streams, the shared-memory plane, zero-copy, memcpy.

Method: one real node (DRAM only) per page size, on loopback, and clients of it in this process:
- "gRPC": transport="grpc", `put` / `get`;
- "shm": transport="shm", `put` / `get` (pages copied through the client's scratch segments);
- "zero-copy": transport="shm", `put_from` / `get_into` with pages in a `shared_buffer` (the node copies
  each page once, straight between its slot and the caller's buffer; one checksum, at the tier read).
Per page size and plane: batched Put and Get GB/s of `--batch` pages per call (median of `--runs` runs
of `--iters` calls; fresh hashes per Put, deleted after each call untimed; the Get reads `--batch`
resident pages). The machine's own limit, in the same runs: single-threaded memcpy of the same bytes
(one `--batch`-page buffer into another, bytearray slice copy), timed like a plane. Within a run the
cells take turns call by call (a rotating order), so load from elsewhere on a shared machine hits them
alike. Writes benchmarks/out/shm_bench.{json,md}.

Run:  .venv/bin/python benchmarks/shm_bench.py [--quick] [--sizes-kib 256,1024,4096]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import statistics
import time
from collections.abc import Callable

from interleave import Column, add_run_options, round_robin, save_table, start
from machine import machine_line

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
from kvstore.pageformat import slot_bytes_for

NS = "bench/shm"
PLANES = ("grpc", "shm", "zc")
LABEL = {"grpc": "gRPC", "shm": "shm", "zc": "zero-copy"}


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def bench_size(kib: int, args: argparse.Namespace) -> list[dict[str, object]]:
    layout = PageLayout(DType.FLOAT16, num_layers=kib // 8, num_kv_heads=2, head_dim=64, block_size=16)
    size = layout.page_bytes
    page = os.urandom(size)
    nbytes = args.batch * size
    node = NodeProcess(dram_bytes=(len(PLANES) * args.batch + 2 * args.batch + 8) * slot_bytes_for(size), max_page_bytes=size,
                       node_id=f"bench-shm-{kib}").start()  # fmt: skip
    res: dict[str, list[float]] = {}
    counter = itertools.count()
    try:
        per_call = max(256, args.batch)
        clients = {"grpc": KVStoreClient(node.addr, pages_per_call=per_call, transport="grpc"),
                   "shm": KVStoreClient(node.addr, pages_per_call=per_call, transport="shm")}  # fmt: skip
        clients["zc"] = clients["shm"]
        try:
            staging = clients["zc"].shared_buffer(args.batch * slot_bytes_for(size))
            views = staging.pages(size, args.batch)
            for v in views:
                v[:] = page
            src, dst = bytearray(page * args.batch), bytearray(nbytes)
            resident = {p: hashes(f"get-{p}", args.batch) for p in PLANES}
            for p in ("grpc", "shm"):
                clients[p].put(NS, layout, resident[p], [page] * args.batch)
            clients["zc"].put_from(NS, layout, resident["zc"], views)

            def put_cell(plane: str) -> Callable[[], Callable[[], None]]:
                kv = clients[plane]

                def call() -> Callable[[], None]:
                    hs = hashes(f"put-{plane}-{next(counter)}", args.batch)
                    stored = (kv.put_from(NS, layout, hs, views) if plane == "zc" else
                              kv.put(NS, layout, hs, [page] * args.batch)).stored  # fmt: skip
                    if stored != args.batch:
                        raise RuntimeError(f"{plane} put stored {stored} of {args.batch}")

                    def cleanup() -> None:
                        if kv.delete(NS, hs).deleted != args.batch:
                            raise RuntimeError(f"{plane}: delete after the put missed pages")

                    return cleanup

                return call

            def get_cell(plane: str) -> Callable[[], None]:
                kv = clients[plane]

                def call() -> None:
                    n = (len(kv.get_into(NS, resident[plane], views)) if plane == "zc" else
                         len(kv.get(NS, resident[plane])))  # fmt: skip
                    if n != args.batch:
                        raise RuntimeError(f"{plane} get returned {n} of {args.batch} pages")

                return call

            def memcpy() -> None:
                dst[:] = src

            cells: dict[str, Callable[[], object]] = {"memcpy": memcpy}
            for p in PLANES:
                cells[f"{p}_put"] = put_cell(p)
                cells[f"{p}_get"] = get_cell(p)
            res = {name: [] for name in cells}
            for _ in range(args.runs):
                for name, gbs in round_robin(cells, args.iters, args.warmup, nbytes).items():
                    res[name].append(gbs)
            if bytes(views[-1]) != page:
                raise RuntimeError("get_into left wrong bytes in the caller's buffer")
        finally:
            clients["grpc"].close()
            clients["shm"].close()
    finally:
        node.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    rows: list[dict[str, object]] = []
    for op in ("put", "get"):
        row: dict[str, object] = {"page_kib": kib, "op": op, "memcpy_gbs": med["memcpy"]}
        for p in PLANES:
            row[f"{p}_gbs"] = med[f"{p}_{op}"]
            row[f"{p}_vs_memcpy"] = med[f"{p}_{op}"] / med["memcpy"]
        row["runs"] = {k: v for k, v in res.items() if k.endswith(op) or k == "memcpy"}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_options(ap, iters=20, warmup=2, quick="256 KiB only, 1 run, 3 calls")
    args, sizes = start(ap, argv, quick_iters=3)
    t0 = time.perf_counter()
    rows = [r for kib in sizes for r in bench_size(kib, args)]
    wall = time.perf_counter() - t0
    preamble = [
        machine_line(),
        f"- Workload: {args.batch} pages per call, {args.iters} calls x {args.runs} runs (median), DRAM-resident; "
        f"load average (1 min) at the end {os.getloadavg()[0]:.1f}; wall {wall:.0f} s",
    ]
    columns: list[Column] = [("page", lambda r: f"{r['page_kib']} KiB"), ("op", lambda r: str(r["op"]))]
    columns += [(f"{LABEL[p]} GB/s", lambda r, p=p: f"{r[f'{p}_gbs']:.2f}") for p in PLANES]
    columns.append(("memcpy GB/s (same runs)", lambda r: f"{r['memcpy_gbs']:.1f}"))
    columns += [(f"{LABEL[p]} vs memcpy", lambda r, p=p: f"{r[f'{p}_vs_memcpy']:.2f}") for p in PLANES]
    save_table(args, "shm_bench", preamble, columns, rows, wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
