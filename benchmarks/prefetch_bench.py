"""Prefetch benchmark: Get latency of an NVMe-resident chain with and without a Prefetch issued earlier.

Method: one real node (DRAM 96 pages, NVMe 512 pages, 256 KiB pages by default) on loopback. Before
every measured Get the chain of 64 pages is pushed to NVMe by putting 96 fresh filler pages (untimed)
and checked to be on NVMe. Then either the Get runs at once ("no prefetch"), or a Prefetch RPC for the
chain is sent and the Get follows N ms later (the caller busy elsewhere for N ms, e.g. computing the
uncached suffix). Reported per N: median and p90 Get latency over the repetitions, the chain's pages
found in DRAM by the Get (promoted by the prefetch in time), and the node's prefetch used/wasted
counters. Reference in the same run: a Get of the same chain when it is already in DRAM (the floor).

Writes benchmarks/out/prefetch_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

from machine import machine_line

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
from kvstore.memtune import tune_malloc_for_bulk_io
from kvstore.names import TierKind
from kvstore.pageformat import slot_bytes_for

NS = "bench/prefetch"
DRAM_PAGES, NVME_PAGES, CHAIN = 96, 512, 64


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-kib", type=int, default=256, help="page size in KiB (default 256)")
    ap.add_argument("--delays-ms", default="0,5,20,50,100,200", help="prefetch lead times to measure")
    ap.add_argument("--reps", type=int, default=7, help="measured Gets per configuration (default 7)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 reps, delays 0,50")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    reps = 2 if args.quick else args.reps
    delays = [0, 50] if args.quick else [int(x) for x in args.delays_ms.split(",")]
    size = args.page_kib * 1024
    layout = PageLayout(DType.UINT8, 1, 1, size // 2, 1)
    slot = slot_bytes_for(size)
    tune_malloc_for_bulk_io()
    chain = hashes("chain", CHAIN)
    data = os.urandom(size)
    filler_round = iter(range(10_000))
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvstore-prefetch-") as tmp:
        node = NodeProcess(dram_bytes=DRAM_PAGES * slot, nvme_path=Path(tmp) / "nvme", nvme_bytes=NVME_PAGES * slot,
                           max_page_bytes=size, node_id="bench-prefetch",
                           # NOTE: LRU so that the fillers push the chain to NVMe before every measured Get; the
                           # default (adaptive) soon refuses one-off fillers a place in DRAM, keeping the chain
                           # there, which is right for a cache and wrong for measuring a prefetch from NVMe.
                           extra_args=["--policy", "lru"])  # fmt: skip
        node.start()
        try:
            with KVStoreClient(node.addr, pages_per_call=256, transport="grpc") as kv:
                kv.put(NS, layout, chain, [data] * CHAIN)

                def push_to_nvme() -> None:
                    fill = hashes(f"fill{next(filler_round)}", DRAM_PAGES)
                    kv.put(NS, layout, fill, [data] * DRAM_PAGES)
                    kv.delete(NS, fill)  # keep NVMe from filling up with fillers
                    tiers = kv.lookup_detail(NS, chain).tiers
                    assert tiers == [TierKind.NVME] * CHAIN, "chain not on NVMe before the measured get"

                def measure(delay_ms: int | None) -> dict[str, object]:
                    lat, dram_hits = [], []
                    before = kv.stats()
                    for _ in range(reps):
                        push_to_nvme()
                        if delay_ms is not None:
                            kv.prefetch(NS, chain)
                            time.sleep(delay_ms / 1000)
                        t0 = time.perf_counter()
                        pages = kv.get_pages(NS, chain)
                        lat.append(time.perf_counter() - t0)
                        assert len(pages) == CHAIN
                        dram_hits.append(sum(p.tier is TierKind.DRAM for p in pages))
                    after = kv.stats()
                    return {"prefetch_lead_ms": delay_ms, "p50_ms": statistics.median(lat) * 1e3,
                            "p90_ms": sorted(lat)[min(len(lat), math.ceil(0.9 * len(lat))) - 1] * 1e3,
                            "pages_found_in_dram": statistics.median(dram_hits),
                            "prefetch_used": after.prefetch_used - before.prefetch_used,
                            "prefetch_wasted": after.prefetch_wasted - before.prefetch_wasted}  # fmt: skip

                kv.get_pages(NS, chain)  # warm up the channel
                floor = []
                for _ in range(reps):
                    kv.get_pages(NS, chain)  # promotes: the chain is in DRAM now
                    t0 = time.perf_counter()
                    kv.get_pages(NS, chain)
                    floor.append(time.perf_counter() - t0)
                rows.append(measure(None))
                for d in delays:
                    rows.append(measure(d))
        finally:
            node.close()
    floor_ms = statistics.median(floor) * 1e3
    base = rows[0]["p50_ms"]
    head = (f"{machine_line()}\n"
            f"- Chain of {CHAIN} pages x {args.page_kib} KiB on NVMe before every Get; {reps} Gets per row; "
            f"DRAM-resident floor p50 {floor_ms:.1f} ms\n")  # fmt: skip
    lines = [head, "| prefetch issued | Get p50 ms | Get p90 ms | vs no prefetch | pages found in DRAM | "
             "prefetch used | wasted |", "|---|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
    for r in rows:
        label = "no prefetch" if r["prefetch_lead_ms"] is None else f"{r['prefetch_lead_ms']} ms before"
        lines.append(f"| {label} | {r['p50_ms']:.1f} | {r['p90_ms']:.1f} | {base / r['p50_ms']:.2f}x | "
                     f"{r['pages_found_in_dram']:.0f}/{CHAIN} | {r['prefetch_used']} | {r['prefetch_wasted']} |")  # fmt: skip
    md = "\n".join(lines)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefetch_bench.md").write_text(md + "\n")
    (args.out / "prefetch_bench.json").write_text(json.dumps({"rows": rows, "floor_p50_ms": floor_ms}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
