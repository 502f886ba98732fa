"""The UCX plane against gRPC streams and memcpy, in one run, on loopback (UCX_NET_DEVICES=lo by default).

Method: one real node (DRAM only) per page size; clients of it with transport="grpc" and with
transport="ucx" in three ways of connecting (kvstore/transport/ucx/client.py):
- ucx-listener: through the node's UCX listener (a sockaddr connection: TCP here);
- ucx-address: by the node's advertised worker address, peer-failure detection on (the default; UCX
  picks the lanes both workers have that can report a dead peer: TCP here, RDMA on an IB/RoCE host);
- ucx-address-noeh: worker address, error handling off (UCX may then pick shared memory on one host;
  a trusted-benchmark setting, not a default).
Per page size and client: batched Put and Get GB/s of `--batch` pages per call, median of `--runs` runs
of `--iters` calls (fresh hashes per Put, deleted after; the Get reads `--batch` resident pages);
clients alternate within each run. The machine's own limit in the same run: single-threaded memcpy of
the same bytes. Checksums are verified as always (client on Get, node on Put). Writes
benchmarks/out/ucx_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import statistics
import time
from pathlib import Path

from machine import machine_line, save_results
from shm_bench import memcpy_gbs

from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.launch import NodeProcess
from kvstore.layout import DType, PageLayout
from kvstore.memtune import tune_malloc_for_bulk_io
from kvstore.pageformat import slot_bytes_for
from kvstore.transport.ucx import ucxx_installed

NS = "bench/ucx"
# name -> (transport, client environment while its connections open)
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "grpc": ("grpc", {}),
    "ucx-listener": ("ucx", {"KVSTORE_UCX_CONNECT": "listener"}),
    "ucx-address": ("ucx", {"KVSTORE_UCX_CONNECT": "worker", "KVSTORE_UCX_ERROR_HANDLING": "1"}),
    "ucx-address-noeh": ("ucx", {"KVSTORE_UCX_CONNECT": "worker", "KVSTORE_UCX_ERROR_HANDLING": "0"}),
}


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def open_client(addr: str, name: str, batch: int) -> KVStoreClient:
    """A client whose pooled UCX connection is opened (warmed) under the variant's environment."""
    transport, env = VARIANTS[name]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    kv = KVStoreClient(addr, pages_per_stream=max(256, batch), transport=transport)
    try:
        with contextlib.suppress(KVStoreError):  # NOT_FOUND: nothing stored yet; the connection is open
            kv.get(NS, hashes("connect", 1))  # opens the connection now, under this environment
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return kv


def bench_size(kib: int, args: argparse.Namespace, names: list[str]) -> list[dict[str, object]]:
    layout = PageLayout(DType.FLOAT16, num_layers=kib // 8, num_kv_heads=2, head_dim=64, block_size=16)
    page = bytes(range(256)) * (layout.page_bytes // 256)
    node = NodeProcess(dram_bytes=(3 * args.batch + 8) * slot_bytes_for(layout.page_bytes),
                       max_page_bytes=layout.page_bytes, node_id=f"bench-ucx-{kib}").start()  # fmt: skip
    put: dict[str, list[float]] = {n: [] for n in names}
    get: dict[str, list[float]] = {n: [] for n in names}
    try:
        clients = {n: open_client(node.addr, n, args.batch) for n in names}
        try:
            moved = args.iters * args.batch * layout.page_bytes
            for run in range(args.runs):
                for name in names if run % 2 == 0 else names[::-1]:
                    kv = clients[name]
                    for i in range(args.warmup):
                        warm = hashes(f"warm-{name}-{run}-{i}", args.batch)
                        kv.put(NS, layout, warm, [page] * args.batch)
                        kv.get(NS, warm)
                        kv.delete(NS, warm)
                    t0 = time.perf_counter()
                    for i in range(args.iters):
                        hs = hashes(f"put-{name}-{run}-{i}", args.batch)
                        kv.put(NS, layout, hs, [page] * args.batch)
                        kv.delete(NS, hs)
                    put[name].append(moved / (time.perf_counter() - t0) / 1e9)
                    resident = hashes(f"get-{name}-{run}", args.batch)
                    kv.put(NS, layout, resident, [page] * args.batch)
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        assert len(kv.get(NS, resident)) == args.batch
                    get[name].append(moved / (time.perf_counter() - t0) / 1e9)
                    kv.delete(NS, resident)
            assert all(c.plane == VARIANTS[n][0] for n, c in clients.items()), "a client fell back to another plane"
        finally:
            for c in clients.values():
                c.close()
    finally:
        node.close()
    copy = memcpy_gbs(args.batch * layout.page_bytes, 20)
    return [{"page_kib": kib, "op": op, "memcpy_gbs": copy, **{n: statistics.median(res[n]) for n in names},
             "runs": res} for op, res in (("put", put), ("get", get))]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-kib", default="1024,4096", help="page sizes in KiB, multiples of 8")
    ap.add_argument("--batch", type=int, default=16, help="pages per call (default 16)")
    ap.add_argument("--iters", type=int, default=10, help="timed calls per run (default 10)")
    ap.add_argument("--runs", type=int, default=3, help="runs per cell; GB/s is the median (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed put+get rounds per run (default 1)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    ap.add_argument("--quick", action="store_true", help="smoke run: 256 KiB only, 1 run, 2 calls")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    if not ucxx_installed():
        print("ucxx is not installed: pip install 'kvstore[ucx]'")
        return 1
    if args.quick:
        args.sizes_kib, args.runs, args.iters, args.warmup = "256", 1, 2, 1
    names = args.variants.split(",")
    if unknown := set(names) - set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(unknown)}")
    sizes = [int(s) for s in args.sizes_kib.split(",")]
    if any(s <= 0 or s % 8 for s in sizes):
        ap.error("--sizes-kib: each size must be a positive multiple of 8")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # the node inherits it: loopback only, as the tests
    tune_malloc_for_bulk_io()
    t0 = time.perf_counter()
    rows = [r for kib in sizes for r in bench_size(kib, args, names)]
    wall = time.perf_counter() - t0
    lines = [
        machine_line(),
        f"- Workload: {args.batch} pages per call, {args.iters} calls x {args.runs} runs (median), DRAM-resident, "
        f"UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']}; wall {wall:.0f} s",
        "",
        "| page | op | " + " | ".join(f"{n} GB/s" for n in names) + " | memcpy GB/s (same run) | best UCX vs gRPC |",
        "|--:|---|" + "--:|" * (len(names) + 2),
    ]
    for r in rows:
        ucx = max(float(r[n]) for n in names if n.startswith("ucx")) if any(n.startswith("ucx") for n in names) else 0
        ratio = f"{ucx / float(r['grpc']):.1f}x" if "grpc" in names else "-"
        lines.append(f"| {r['page_kib']} KiB | {r['op']} | " + " | ".join(f"{float(r[n]):.2f}" for n in names)
                     + f" | {float(r['memcpy_gbs']):.1f} | {ratio} |")  # fmt: skip
    save_results(args.out, "ucx_bench", "\n".join(lines), args, rows=rows, wall_s=wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
