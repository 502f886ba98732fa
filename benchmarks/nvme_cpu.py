"""Where a batched NVMe get's CPU goes, in process: the node's read path without any RPC or plane.

Method: a TierManager with a 4-slot DRAM tier and an NVMe tier in a temporary directory holds `--batch`
pages on NVMe. Cells take turns call by call: the same O_DIRECT reads of those slots from `--depth`
threads ("disk", no verification: the floor), `mgr.get(..., into=...)` into one page-aligned buffer
(what the same-host `get_into` asks of the node) and `mgr.get(...)` (a payload in a bounce buffer,
what the other planes send from). Per cell: wall GB/s (median) and CPU milliseconds per call of this
process, user and system (getrusage: every thread), and voluntary + involuntary context switches.
On a shared machine wall figures swing with the load; the CPU figures much less.

Run:  .venv/bin/python benchmarks/nvme_cpu.py [--sizes-kib 1024,4096] [--batch 16] [--iters 10]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import mmap
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from machine import machine_line

from kvstore.config import NodeConfig
from kvstore.layout import DType, PageLayout
from kvstore.manager import TierManager
from kvstore.names import TierKind
from kvstore.pageformat import slot_bytes_for
from kvstore.tiers.nvme import QUEUE_DEPTH
from kvstore.wire import PutOpen

NS = "bench/nvme-cpu"


async def bench_size(kib: int, args: argparse.Namespace, root: Path) -> list[str]:
    size = kib << 10
    slot = slot_bytes_for(size)
    layout = PageLayout(DType.UINT8, num_layers=1, num_kv_heads=1, head_dim=size // 2, block_size=1)
    keys = [hashlib.sha256(f"{kib}-{i}".encode()).digest() for i in range(args.batch + 8)]
    cfg = NodeConfig(dram_bytes=4 * slot, nvme_path=str(root / f"nvme-{kib}"), nvme_bytes=(args.batch + 12) * slot,
                     max_page_bytes=size)  # fmt: skip
    mgr = TierManager(cfg)
    await mgr.start()
    pool = ThreadPoolExecutor(args.depth)
    try:
        data = os.urandom(size)
        for k in keys:  # one page per Put: the DRAM tier holds 4, the rest go to NVMe
            txn = mgr.begin_put(PutOpen(NS, layout))
            view = await txn.add_page(k, size, 0)
            assert view is not None
            view[:] = data
            await txn.commit()
        on_nvme = [k for k in keys if (e := mgr.entry(NS, k)) is not None and e.tier is TierKind.NVME][: args.batch]
        if len(on_nvme) < args.batch:
            raise RuntimeError(f"only {len(on_nvme)} pages reached NVMe")
        slots = [e.slot for k in on_nvme if (e := mgr.entry(NS, k)) is not None]  # byte offsets in the tier
        segment = mgr.nvme_slot_location(0)[0]
        fd = os.open(segment, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        bufs = [mmap.mmap(-1, slot) for _ in slots]
        dest = mmap.mmap(-1, args.batch * size)
        into = [memoryview(dest)[i * size : (i + 1) * size] for i in range(args.batch)]
        loop = asyncio.get_running_loop()

        def disk_reads() -> None:
            for f in [pool.submit(os.preadv, fd, [bufs[i]], s) for i, s in enumerate(slots)]:
                if f.result() != slot:
                    raise OSError("short read")

        async def disk() -> None:
            await loop.run_in_executor(None, disk_reads)

        async def get_into() -> None:
            n = sum([1 async for _ in mgr.get(NS, on_nvme, promote=False, into=into)])
            if n != args.batch or into[0] != data:
                raise RuntimeError("get_into returned the wrong pages")

        async def get() -> None:
            n = 0
            async for lease in mgr.get(NS, on_nvme, promote=False):
                n += 1
                if n == 1 and lease.payload != data:
                    raise RuntimeError("get returned the wrong bytes")
            if n != args.batch:
                raise RuntimeError("get returned too few pages")

        cells: dict[str, Callable[[], Awaitable[None]]] = {"disk": disk, "get_into": get_into, "get": get}
        wall: dict[str, list[float]] = {k: [] for k in cells}
        usage = {k: [0.0, 0.0, 0] for k in cells}  # user s, system s, context switches
        for fn in cells.values():
            await fn()
        names = list(cells)
        for i in range(args.iters):
            for name in names[i % 3 :] + names[: i % 3]:
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                await cells[name]()
                wall[name].append(time.perf_counter() - t0)
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                u = usage[name]
                u[0] += r1.ru_utime - r0.ru_utime
                u[1] += r1.ru_stime - r0.ru_stime
                u[2] += r1.ru_nvcsw + r1.ru_nivcsw - r0.ru_nvcsw - r0.ru_nivcsw
        os.close(fd)
        nbytes = args.batch * size
        rows = []
        for name in cells:
            user, system, switches = usage[name]
            rows.append(
                f"| {kib} KiB | {name} | {nbytes / statistics.median(wall[name]) / 1e9:.2f} | "
                f"{(user + system) / args.iters * 1e3:.1f} | {user / args.iters * 1e3:.1f} | "
                f"{system / args.iters * 1e3:.1f} | {switches / args.iters:.0f} |"
            )
        return rows
    finally:
        pool.shutdown()
        await mgr.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-kib", default="1024,4096", help="page sizes in KiB, multiples of 4")
    ap.add_argument("--batch", type=int, default=16, help="pages per get (default 16)")
    ap.add_argument("--iters", type=int, default=10, help="timed calls per cell (default 10)")
    ap.add_argument("--depth", type=int, default=QUEUE_DEPTH, help=f"disk reads in flight (default {QUEUE_DEPTH})")
    ap.add_argument("--dir", type=Path, default=None, help="where the NVMe tier goes (default: TMPDIR)")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes_kib.split(",")]
    except ValueError:
        ap.error(f"--sizes-kib: {args.sizes_kib!r} is not a comma-separated list of integers")
    if any(s <= 0 or s % 4 for s in sizes) or args.batch < 1 or args.iters < 1 or args.depth < 1:
        ap.error("--sizes-kib must be positive multiples of 4; --batch, --iters and --depth at least 1")
    print(machine_line())
    print(f"- {args.batch} pages per call, {args.iters} calls per cell (turns), load average (1 min) "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    print(
        "\n| page | cell | GB/s | CPU ms/call | user | system | context switches/call |\n|--:|---|--:|--:|--:|--:|--:|"
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for kib in sizes:
            for row in asyncio.run(bench_size(kib, args, Path(tmp))):
                print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
