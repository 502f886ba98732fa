"""The HBM tier on a CUDA host: what a get of pages held in GPU memory costs, beside the same pages in DRAM and
the device's own copy rate, in one run.

Method. One node (`--hbm-bytes`, `--dram-bytes`, no NVMe) on loopback. Per page size: `--pages` pages put with
target tier HBM (staged in DRAM, promoted to HBM in the background: the script waits until Lookup reports every
one in HBM), and as many put to DRAM. Then, per plane (TCP, the same-host plane's plain get and zero-copy
`get_into`), timed gets of `--batch` pages per call without promotion, `--runs` runs, median GB/s (10^9 B/s):
HBM-resident beside DRAM-resident pages. References measured in the same run: CuPy's device-to-host copy into
pinned memory (the PCIe/C2C ceiling of a read out of HBM) and a host memcpy (the machine's own limit).

Every page read out of HBM is verified by the node (DESIGN.md §8.3: the node verifies what it copies out of
device memory); the clients verify what crosses their plane as always. Prints a markdown table and writes
benchmarks/out/hbm_bench.{md,json}. Needs CuPy and a CUDA device: without one it says so and exits 2.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

from machine import machine_line, memcpy_gbs, save_results

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
from kvstore.names import TierKind
from kvstore.tiers.hbm import cuda_unavailable_reason

HERE = Path(__file__).resolve().parent
NS = "bench/hbm"


def d2h_gbs(nbytes: int, reps: int) -> float:
    """CuPy device-to-host copy of `nbytes` into pinned host memory: best of `reps`, GB/s."""
    import cupy

    dev = cupy.zeros(nbytes, dtype=cupy.uint8)
    host = cupy.cuda.alloc_pinned_memory(nbytes)
    stream = cupy.cuda.Stream(non_blocking=True)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        cupy.cuda.runtime.memcpyAsync(host.ptr, dev.data.ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        stream.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def layout_for(page_bytes: int) -> PageLayout:
    return PageLayout(DType.UINT8, 1, 1, page_bytes // 2, 1)  # K and V: 2 x head_dim bytes


def wait_in(kv: KVStoreClient, hashes: list[bytes], tier: TierKind, seconds: float) -> float:
    """Seconds until Lookup reports every page in `tier` (bounded)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        res = kv.lookup_detail(NS, hashes)
        if res.matched == len(hashes) and all(t is tier for t in res.tiers):
            return time.monotonic() - t0
        time.sleep(0.05)
    raise TimeoutError(f"pages not all in {tier.label} after {seconds} s: {kv.lookup_detail(NS, hashes).tiers[:8]}")


def timed_gets(kv: KVStoreClient, hashes: list[bytes], batch: int, into: list[memoryview] | None) -> float:
    """GB/s of one pass over `hashes` in calls of `batch` pages (verified by the client as always)."""
    n = 0
    t0 = time.perf_counter()
    for i in range(0, len(hashes), batch):
        part = hashes[i : i + batch]
        if into is None:
            got = kv.get(NS, part, promote=False)
            n += sum(len(p) for p in got)
        else:
            refs = kv.get_into(NS, part, into[: len(part)], promote=False)
            n += sum(r.nbytes for r in refs)
    return n / (time.perf_counter() - t0) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1048576,4194304", help="page sizes in bytes, comma separated")
    ap.add_argument("--pages", type=int, default=256, help="pages per tier and size (default 256)")
    ap.add_argument("--batch", type=int, default=16, help="pages per get call (default 16)")
    ap.add_argument("--runs", type=int, default=5, help="passes per cell; the median is reported (default 5)")
    ap.add_argument("--out", type=Path, default=HERE / "out")
    args = ap.parse_args()
    reason = cuda_unavailable_reason()
    if reason is not None:
        print(f"hbm_bench: skipped: {reason}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: list[str] = []
    data: list[dict[str, object]] = []
    for size in sizes:
        need = 2 * args.pages * (size + (8 << 10)) + (64 << 20)
        node = NodeProcess(dram_bytes=need, max_page_bytes=size, node_id="hbm-bench",
                           extra_args=["--hbm-bytes", str(need)]).start()  # fmt: skip
        try:
            lay = layout_for(size)
            rng = random.Random(size)
            hbm = [rng.randbytes(32) for _ in range(args.pages)]
            dram = [rng.randbytes(32) for _ in range(args.pages)]
            payload = os.urandom(size)
            with KVStoreClient(node.addr, timeout=120, transport="grpc") as kv:
                stats = kv.stats()
                hbm_tier = next(t for t in stats.tiers if t.tier is TierKind.HBM)
                if not hbm_tier.available:
                    print(f"hbm_bench: the node has no HBM tier: {hbm_tier.detail}", file=sys.stderr)
                    return 2
                for i in range(0, args.pages, 64):
                    kv.put(NS, lay, hbm[i : i + 64], [payload] * len(hbm[i : i + 64]), target_tier=TierKind.HBM)
                    kv.put(NS, lay, dram[i : i + 64], [payload] * len(dram[i : i + 64]))
                promoted_s = wait_in(kv, hbm, TierKind.HBM, 120)
                wait_in(kv, dram, TierKind.DRAM, 10)
            for plane, zero_copy in (("tcp", False), ("shm", False), ("shm", True)):
                with KVStoreClient(node.addr, timeout=120, transport=plane) as kv:
                    into = None
                    if zero_copy:
                        buf = kv.shared_buffer(args.batch * size)
                        into = buf.pages(size, args.batch)
                    kv.get(NS, hbm[:1], promote=False)  # negotiate the plane
                    cells = {}
                    for name, keys in (("HBM", hbm), ("DRAM", dram)):
                        cells[name] = statistics.median(
                            timed_gets(kv, keys, args.batch, into) for _ in range(args.runs)
                        )
                    label = f"{plane} {'get_into' if zero_copy else 'get'}"
                    data.append({"page_bytes": size, "plane": label, **cells})
                    rows.append(f"| {size >> 10} KiB | {label} | {cells['HBM']:.2f} | {cells['DRAM']:.2f} | "
                                f"{cells['HBM'] / cells['DRAM']:.2f}x |")  # fmt: skip
            d2h = d2h_gbs(args.batch * size, 20)
            mem = memcpy_gbs(args.batch * size, 5)
            rows.append(
                f"| {size >> 10} KiB | (reference) CuPy D2H into pinned / host memcpy | {d2h:.2f} | {mem:.2f} | |"
            )
            data.append({"page_bytes": size, "d2h_gbs": d2h, "memcpy_gbs": mem, "promoted_s": promoted_s})
        finally:
            node.close()
    text = "\n".join(
        [
            machine_line(),
            f"- {args.pages} pages per tier and size, gets of {args.batch} pages per call, no promotion, "
            f"median of {args.runs} passes",
            "",
            "| page | plane | HBM-resident GB/s | DRAM-resident GB/s | HBM / DRAM |",
            "|---|---|--:|--:|--:|",
            *rows,
        ]
    )
    save_results(args.out, "hbm_bench", text, args, rows=data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
