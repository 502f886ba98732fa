"""Multi-part pages (bundles, DESIGN.md §4.3) beside plain pages of the same bytes, per data plane.

Method: one real node on loopback (DRAM only, room for every page of the run), one client per plane. A page is
--page-kib KiB either as one plain page (v1: `put_from` / `get_into` of one buffer per page) or as a bundle of
three parts as a hybrid engine holds them, each in its own pool's memory: `kv` (3/4 of the bytes), `swa` (3/16)
and `mamba` (the rest) (v2: `put_bundle` / `get_bundle_into`, each part into its own buffer). Every buffer is plain
process memory (numpy), as an engine's pools are, not the client's registered memory. Per run, per plane, both
kinds store --pages fresh pages and read them back, in alternating order (drift on a shared machine favours
neither). Figure: GB/s (10^9) of page bytes, median of --runs runs; the reference is v1 of the same plane in the
same run, and the machine's memcpy of one call's bytes. Writes benchmarks/out/bundle_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from machine import machine_line, memcpy_gbs, save_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
from kvstore.pageformat import slot_bytes_for

PLANES = ("shm", "tcp", "grpc")


def layouts(page_bytes: int) -> tuple[PageLayout, PageLayout]:
    kv, swa = page_bytes * 3 // 4, page_bytes * 3 // 16
    mamba = page_bytes - kv - swa
    plain = PageLayout(DType.UINT8, 1, 1, page_bytes // 2, 1)
    parts = {n: PageLayout(DType.UINT8, 1, 1, b // 2, 1) for n, b in (("kv", kv), ("swa", swa), ("mamba", mamba))}
    return plain, PageLayout.bundle(parts, block_size=16)


def keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def one_run(kv: KVStoreClient, plane: str, run: int, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    plain, bundle = layouts(args.page_kib << 10)
    n, nbytes = args.pages, args.pages * plain.page_bytes
    rng = np.random.default_rng(run)
    src = [rng.integers(0, 256, plain.page_bytes, dtype=np.uint8) for _ in range(n)]
    spans = bundle.part_spans()
    parts = [{name: s[off : off + k].copy() for name, (off, k) in spans.items()} for s in src]
    out: dict[str, tuple[float, float]] = {}
    order = ("v1", "v2") if run % 2 == 0 else ("v2", "v1")
    for kind in order:
        hs = keys(f"{plane}-{kind}-{run}", n)
        if kind == "v1":
            dst = [np.empty(plain.page_bytes, np.uint8) for _ in range(n)]
            t0 = time.perf_counter()
            kv.put_from(f"bench/plain-{plane}", plain, hs, src)
            t1 = time.perf_counter()
            got = kv.get_into(f"bench/plain-{plane}", hs, dst)
            t2 = time.perf_counter()
            assert len(got) == n and all((a == b).all() for a, b in zip(src, dst, strict=True))
        else:
            dst_parts = [{name: np.empty(k, np.uint8) for name, (_, k) in spans.items()} for _ in range(n)]
            t0 = time.perf_counter()
            kv.put_bundle(f"bench/bundle-{plane}", bundle, hs, parts)
            t1 = time.perf_counter()
            got = kv.get_bundle_into(f"bench/bundle-{plane}", bundle, hs, dst_parts)
            t2 = time.perf_counter()
            assert len(got) == n and all(
                (a[name] == b[name]).all() for a, b in zip(parts, dst_parts, strict=True) for name in spans
            )
        out[kind] = (nbytes / (t1 - t0) / 1e9, nbytes / (t2 - t1) / 1e9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--page-kib", type=int, default=512)
    ap.add_argument("--planes", default=",".join(PLANES))
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args()
    planes = [p for p in args.planes.split(",") if p]
    page = args.page_kib << 10
    slots = args.runs * 2 * args.pages * len(planes) + 16
    node = NodeProcess(dram_bytes=slots * slot_bytes_for(page), max_page_bytes=page, node_id="bundle-bench").start()
    figures: dict[str, dict[str, list[tuple[float, float]]]] = {p: {"v1": [], "v2": []} for p in planes}
    try:
        clients = {p: KVStoreClient(node.addr, timeout=120, transport=p) for p in planes}
        for run in range(args.runs):
            for p in planes:
                for kind, fig in one_run(clients[p], p, run, args).items():
                    figures[p][kind].append(fig)
        for c in clients.values():
            c.close()
    finally:
        node.close()
    limit = memcpy_gbs(args.pages * page, 5)
    rows = [
        f"## Bundles beside plain pages (`bundle_bench.py`)\n\n{machine_line()}\n",
        f"{args.pages} pages of {args.page_kib} KiB per call; v2 = 3 parts (kv 3/4, swa 3/16, mamba 1/16) in their own "
        f"buffers; median of {args.runs} runs; memcpy of one call's bytes {limit:.2f} GB/s.\n",
        "| plane | v1 put / get GB/s | v2 put / get GB/s | v2 / v1 |",
        "|---|--:|--:|--:|",
    ]
    payload = {}
    for p in planes:
        med = {k: tuple(statistics.median(f[i] for f in figures[p][k]) for i in (0, 1)) for k in ("v1", "v2")}
        payload[p] = med
        (p1, g1), (p2, g2) = med["v1"], med["v2"]
        rows.append(f"| {p} | {p1:.2f} / {g1:.2f} | {p2:.2f} / {g2:.2f} | {p2 / p1:.2f}x / {g2 / g1:.2f}x |")
    save_results(args.out, "bundle_bench", "\n".join(rows), args, figures=payload, memcpy_gbs=limit)


if __name__ == "__main__":
    main()
