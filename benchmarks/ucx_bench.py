"""The UCX plane against gRPC streams and memcpy, in one run, on loopback (UCX_NET_DEVICES=lo by default).

Method: one real node (DRAM only) per page size; clients of it with transport="grpc" and with
transport="ucx" in three ways of connecting (kvstore/client/planes/ucx.py):
- ucx-listener: through the node's UCX listener (a sockaddr connection: TCP here);
- ucx-address: by the node's advertised worker address, data endpoints in peer-failure mode (the
  default; UCX picks the lanes both workers have that can report a dead peer: TCP here, RDMA on an
  IB/RoCE host; its shared-memory transports have no peer-failure handler);
- ucx-address-noeh: worker address, data endpoints without peer-failure mode
  (KVSTORE_UCX_ERROR_HANDLING=0: UCX picks shared memory on one host; the listener endpoint stays open to
  report a vanished peer; a trusted single-host setting, not a default: see kvstore/client/planes/ucx.py).
Per page size and client: batched Put and Get GB/s of `--batch` pages per call: the bytes of one call
over the median time of `--runs` x `--iters` timed calls (fresh hashes per Put, deleted after, untimed;
the Get reads `--batch` resident pages); clients alternate between runs. The machine's own limit in the same run: single-threaded memcpy of
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

from machine import machine_line, memcpy_gbs, save_results

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.layout import DType, PageLayout
from kvstore.memtune import tune_malloc_for_bulk_io
from kvstore.pageformat import slot_bytes_for
from kvstore.wire.ucx import ucxx_installed

NS = "bench/ucx"
# name -> (transport, client environment while its connections open)
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "grpc": ("grpc", {}),
    "tcp": ("tcp", {}),
    "ucx-listener": ("ucx", {"KVSTORE_UCX_CONNECT": "listener"}),
    "ucx-address": ("ucx", {"KVSTORE_UCX_CONNECT": "worker", "KVSTORE_UCX_ERROR_HANDLING": "1"}),
    "ucx-address-noeh": ("ucx", {"KVSTORE_UCX_CONNECT": "worker", "KVSTORE_UCX_ERROR_HANDLING": "0"}),
}


OPTIONS: dict[str, tuple[type, object, str]] = {  # flag -> (type, default, help)
    "--sizes-kib": (str, "1024,4096", "page sizes in KiB, multiples of 8"),
    "--batch": (int, 16, "pages per call"),
    "--iters": (int, 10, "timed calls per run"),
    "--runs": (int, 3, "runs per cell (variants alternate between runs)"),
    "--warmup": (int, 1, "untimed put+get calls per run"),
    "--variants": (str, ",".join(VARIANTS), "comma-separated subset of the variants"),
    "--out": (Path, Path(__file__).resolve().parent / "out", "where the .md and .json results go"),
}
QUICK = {"sizes_kib": "256", "runs": 1, "iters": 2, "warmup": 1}


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def open_client(addr: str, name: str, batch: int) -> KVStoreClient:
    """A client whose pooled UCX connection is opened (warmed) under the variant's environment."""
    transport, env = VARIANTS[name]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    kv = KVStoreClient(addr, pages_per_call=max(256, batch), transport=transport)
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


def call_times(kv: KVStoreClient, layout: PageLayout, page: bytes, args: argparse.Namespace,
               tag: str) -> tuple[list[float], list[float]]:  # fmt: skip
    """Seconds of each timed Put call (fresh hashes, deleted after, untimed) and Get call (resident pages)."""
    puts, gets = [], []
    for i in range(args.iters):
        hs = hashes(f"{tag}-put-{i}", args.batch)
        t0 = time.perf_counter()
        kv.put(NS, layout, hs, [page] * args.batch)
        puts.append(time.perf_counter() - t0)
        kv.delete(NS, hs)
    resident = hashes(f"{tag}-get", args.batch)
    kv.put(NS, layout, resident, [page] * args.batch)
    for _ in range(args.iters):
        t0 = time.perf_counter()
        got = kv.get(NS, resident)
        gets.append(time.perf_counter() - t0)
        assert len(got) == args.batch
    kv.delete(NS, resident)
    return puts, gets


def bench_size(kib: int, args: argparse.Namespace, names: list[str]) -> list[dict[str, object]]:
    """GB/s per variant and op: the bytes of one call over the median call time, all runs pooled."""
    layout = PageLayout(DType.FLOAT16, num_layers=kib // 8, num_kv_heads=2, head_dim=64, block_size=16)
    page = bytes(range(256)) * (layout.page_bytes // 256)
    times: dict[tuple[str, str], list[float]] = {(n, op): [] for n in names for op in ("put", "get")}
    with contextlib.ExitStack() as stack:  # closes the clients, then stops the node, whatever happens
        node = stack.enter_context(NodeProcess(dram_bytes=(3 * args.batch + 8) * slot_bytes_for(layout.page_bytes),
                                               max_page_bytes=layout.page_bytes, node_id=f"bench-ucx-{kib}",
                                               extra_args=["--ucx"]))  # fmt: skip
        clients = {n: stack.enter_context(open_client(node.addr, n, args.batch)) for n in names}
        for run in range(args.runs):  # variants alternate, so drift in the machine's load hits all alike
            for name in names if run % 2 == 0 else names[::-1]:
                call_times(clients[name], layout, page, argparse.Namespace(iters=args.warmup, batch=args.batch),
                           f"warm-{name}-{run}")  # fmt: skip
                puts, gets = call_times(clients[name], layout, page, args, f"{name}-{run}")
                times[name, "put"] += puts
                times[name, "get"] += gets
        assert all(c.plane == VARIANTS[n][0] for n, c in clients.items()), "a client fell back to another plane"
    copy = memcpy_gbs(args.batch * layout.page_bytes, 20)
    call_bytes = args.batch * layout.page_bytes
    return [{"page_kib": kib, "op": op, "memcpy_gbs": copy,
             **{n: call_bytes / statistics.median(times[n, op]) / 1e9 for n in names},
             "call_seconds": {n: times[n, op] for n in names}} for op in ("put", "get")]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, (kind, default, text) in OPTIONS.items():
        ap.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")
    ap.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    args = ap.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    if not ucxx_installed():
        print("ucxx is not installed: pip install 'kvstore[ucx]'")
        return 1
    names = args.variants.split(",")
    sizes = [int(s) for s in args.sizes_kib.split(",")]
    problems = [f"--variants: unknown {sorted(set(names) - set(VARIANTS))}"] * bool(set(names) - set(VARIANTS))
    problems += ["--sizes-kib: each size must be a positive multiple of 8"] * any(s <= 0 or s % 8 for s in sizes)
    if problems:
        ap.error("; ".join(problems))
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # the node inherits it: loopback only, as the tests
    tune_malloc_for_bulk_io()
    t0 = time.perf_counter()
    rows = [r for kib in sizes for r in bench_size(kib, args, names)]
    wall = time.perf_counter() - t0
    lines = [
        machine_line(),
        f"- Workload: {args.batch} pages per call, median of {args.iters} calls x {args.runs} runs, DRAM-resident, "
        f"UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']}; wall {wall:.0f} s",
        "",
        "| page | op | "
        + " | ".join(f"{n} GB/s" for n in names)
        + " | memcpy GB/s (same run) | best UCX vs gRPC | ucx-address (default) / -noeh vs TCP plane |",
        "|--:|---|" + "--:|" * (len(names) + 3),
    ]
    for r in rows:
        ucx = max(float(r[n]) for n in names if n.startswith("ucx")) if any(n.startswith("ucx") for n in names) else 0
        ratio = f"{ucx / float(r['grpc']):.1f}x" if "grpc" in names else "-"
        vs_tcp = (
            " / ".join(
                f"{float(r[n]) / float(r['tcp']):.2f}x"
                for n in ("ucx-address", "ucx-address-noeh")
                if "tcp" in names and n in names
            )
            or "-"
        )
        lines.append(f"| {r['page_kib']} KiB | {r['op']} | " + " | ".join(f"{float(r[n]):.2f}" for n in names)
                     + f" | {float(r['memcpy_gbs']):.1f} | {ratio} | {vs_tcp} |")  # fmt: skip
    save_results(args.out, "ucx_bench", "\n".join(lines), args, rows=rows, wall_s=wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
