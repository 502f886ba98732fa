"""Batched NVMe gets against the disk's own O_DIRECT read rate, in one run.

Method: per page size (default 256 KiB, 1 MiB, 4 MiB) one real node (`kvstore serve`, 4 DRAM slots, an
NVMe tier in a temporary directory) holds `--batch` pages on NVMe: put one by one, pushed out of DRAM by
filler pages, and read with `promote=False` so they stay there. Per run, the cells below take turns
call by call (a rotating order), so load from elsewhere on a shared machine hits them alike:
- kvstore: one batched get of the `--batch` pages per call, over the same-host planes: `get_into`
  (zero-copy, into a shared buffer) and `get` (the shm plane's copy-out), and over gRPC streams;
- disk: `--batch` O_DIRECT reads of whole slots (header + payload, what the node reads) of the node's
  own segment file, the very slots holding the pages the gets read (found by their headers), from this
  process: one at a time from one thread ("1-deep"), and all in flight from `--depth` threads
  ("16-deep", the node's NVMe queue depth: the target's reference); and, for comparison, the same
  slots read the way the node reads them now: adjacent slots as one request of up to RUN_BYTES, all
  requests in flight ("runs"). The preamble says how many runs of adjacent slots the batch forms.
GB/s (10^9 B/s) counts payload bytes; the figure is the median of `--runs` runs of `--iters` calls.
Every kvstore call is checked: all pages returned, all from NVMe, and the bytes of one page compared.
Each kvstore figure is given as a ratio to the 16-deep disk rate of the same run. GB per CPU-second:
payload bytes over the CPU time of the processes doing the work (for kvstore this process and the
node, for the disk this process; warm-up calls included), a figure that a loaded machine skews less.

Limits: "NVMe" is whatever backs the temporary directory (printed); a hypervisor cache may sit under
O_DIRECT, and it serves the kvstore reads and the disk reads alike. Writes benchmarks/out/nvme_bench.*.

Run:  .venv/bin/python benchmarks/nvme_bench.py [--quick] [--sizes-kib 256,1024,4096] [--dir PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from interleave import Column, add_run_options, round_robin, save_table, start
from machine import machine_line
from peer_bench import cpu_seconds

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
from kvstore.names import TierKind
from kvstore.pageformat import HEADER_BYTES, HeaderError, PageHeader, slot_bytes_for
from kvstore.tiers.nvme import QUEUE_DEPTH, RUN_BYTES, SEGMENT_FMT

NS = "bench/nvme"
DRAM_SLOTS = 4
PLANES = ("get_into", "shm_get", "grpc_get")


def layout_for(size: int) -> PageLayout:
    """A uint8 layout whose page is exactly `size` bytes."""
    return PageLayout(DType.UINT8, num_layers=1, num_kv_heads=1, head_dim=size // 2, block_size=1)


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


class Disk:
    """O_DIRECT reads of whole slots (header + payload, what the node reads) of the node's own NVMe
    segment file: the very slots holding the benchmark's pages, read by this process beside the node."""

    def __init__(self, segment: Path, slots: list[int], slot_bytes: int, depth: int) -> None:
        self.slot, self.slots = slot_bytes, slots
        try:
            self.fd = os.open(segment, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            self.direct = hasattr(os, "O_DIRECT")
        except OSError:
            self.fd = os.open(segment, os.O_RDONLY)
            self.direct = False
        self.bufs = [mmap.mmap(-1, slot_bytes) for _ in slots]  # page aligned, as O_DIRECT needs
        self.pool = ThreadPoolExecutor(depth)
        self.runs = runs_of(slots, slot_bytes)
        self.run_bufs = [mmap.mmap(-1, n * slot_bytes) for _, n in self.runs]

    def read(self, i: int) -> None:
        if os.preadv(self.fd, [self.bufs[i]], self.slots[i] * self.slot) != self.slot:
            raise OSError(f"short read of slot {self.slots[i]}")

    def one_deep(self) -> None:
        for i in range(len(self.slots)):
            self.read(i)

    def deep(self) -> None:
        for f in [self.pool.submit(self.read, i) for i in range(len(self.slots))]:
            f.result()

    def coalesced(self) -> None:
        def one(i: int) -> None:
            first, n = self.runs[i]
            if os.preadv(self.fd, [self.run_bufs[i]], first * self.slot) != n * self.slot:
                raise OSError(f"short read of slots {first}-{first + n - 1}")

        for f in [self.pool.submit(one, i) for i in range(len(self.runs))]:
            f.result()

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)
        for b in self.bufs + self.run_bufs:
            b.close()


def runs_of(slots: list[int], slot_bytes: int) -> list[tuple[int, int]]:
    """(first slot, count) of each run of adjacent slots, in order, each within RUN_BYTES not counting
    header blocks (as the node groups a batch's reads of whole slots)."""
    runs: list[tuple[int, int]] = []
    for s in slots:
        if runs and s == sum(runs[-1]) and (runs[-1][1] + 1) * (slot_bytes - HEADER_BYTES) <= RUN_BYTES:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((s, 1))
    return runs


def slots_holding(segment: Path, slot_bytes: int, wanted: list[bytes]) -> list[int]:
    """The slots of the node's segment file whose headers name the pages `wanted`, in that order."""
    found: dict[bytes, int] = {}
    with open(segment, "rb") as f:
        for slot in range(segment.stat().st_size // slot_bytes):
            f.seek(slot * slot_bytes)
            block = f.read(HEADER_BYTES)
            if block[:4] == b"KVPG":
                with contextlib.suppress(HeaderError):
                    found[PageHeader.unpack(block).hash] = slot
    missing = [h for h in wanted if h not in found]
    if missing:
        raise RuntimeError(f"{len(missing)} pages not found in {segment}")
    return [found[h] for h in wanted]


def fill_nvme(kv: KVStoreClient, layout: PageLayout, pages: list[bytes], tag: str) -> list[bytes]:
    """Put the pages one per call, then push them out of DRAM with fillers; returns their hashes."""
    hs = hashes(tag, len(pages))
    for h, p in zip(hs, pages, strict=True):
        kv.put(NS, layout, [h], [p])
    for round_ in range(4):  # bounded: normally the first round of fillers is enough
        kv.put(NS, layout, hashes(f"{tag}-filler-{round_}", DRAM_SLOTS), [pages[0]] * DRAM_SLOTS)
        if all(t is TierKind.NVME for t in kv.lookup_detail(NS, hs).tiers):
            return hs
    raise RuntimeError("pages did not all reach NVMe; the benchmark needs them there")


def bench_size(kib: int, args: argparse.Namespace, root: Path) -> list[dict[str, object]]:
    size = kib << 10
    layout = layout_for(size)
    slot = slot_bytes_for(size)
    pages = [os.urandom(size) for _ in range(args.batch)]
    nbytes = args.batch * size
    node = NodeProcess(dram_bytes=DRAM_SLOTS * slot, nvme_path=root / f"nvme-{kib}",
                       nvme_bytes=(args.batch + 4 * DRAM_SLOTS + 4) * slot, max_page_bytes=size,
                       node_id=f"bench-nvme-{kib}").start()  # fmt: skip
    res: dict[str, list[float]] = {k: [] for k in (*PLANES, "disk_1", "disk_deep", "disk_runs")}
    cpu: dict[str, list[float]] = {}  # cell -> [CPU seconds of its processes, calls]
    disk: Disk | None = None
    try:
        fast = KVStoreClient(node.addr, pages_per_call=max(256, args.batch), transport="shm")
        slow = KVStoreClient(node.addr, pages_per_call=max(256, args.batch), transport="grpc")
        try:
            hs = fill_nvme(fast, layout, pages, f"nvme-{kib}")
            segment = root / f"nvme-{kib}" / SEGMENT_FMT.format(0)
            disk = Disk(segment, slots_holding(segment, slot, hs), slot, args.depth)
            staging = fast.shared_buffer(args.batch * slot)
            views = staging.pages(size, args.batch)

            def check(tiers: list[TierKind], first: bytes | memoryview) -> None:
                if len(tiers) != args.batch or any(t is not TierKind.NVME for t in tiers) or first != pages[0]:
                    raise RuntimeError(f"a get returned {len(tiers)} pages, tiers {set(tiers)}, or wrong bytes")

            def get_into() -> None:
                refs = fast.get_into(NS, hs, views, promote=False)
                check([r.tier for r in refs], views[0])

            def shm_get() -> None:
                got = fast.get_pages(NS, hs, promote=False)
                check([p.tier for p in got], bytes(got[0].data))

            def grpc_get() -> None:
                got = slow.get_pages(NS, hs, promote=False)
                check([p.tier for p in got], bytes(got[0].data))

            cells: dict[str, Callable[[], None]] = {"get_into": get_into, "shm_get": shm_get, "grpc_get": grpc_get,
                                                    "disk_1": disk.one_deep, "disk_deep": disk.deep,
                                                    "disk_runs": disk.coalesced}  # fmt: skip
            assert node.proc is not None
            pids = {k: [os.getpid()] + ([node.proc.pid] if k in PLANES else []) for k in cells}
            cells = {k: metered(fn, pids[k], cpu.setdefault(k, [0.0, 0])) for k, fn in cells.items()}
            for _ in range(args.runs):
                for name, gbs in round_robin(cells, args.iters, args.warmup, nbytes).items():
                    res[name].append(gbs)
            staging.close()
        finally:
            fast.close()
            slow.close()
    finally:
        if disk is not None:
            disk.close()
        node.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    deep = med["disk_deep"]
    return [{"page_kib": kib, "batch": args.batch, **{f"{k}_gbs": v for k, v in med.items()},
             **{f"{k}_vs_disk_deep": med[k] / deep for k in PLANES}, "o_direct": disk is not None and disk.direct,
             "slot_runs": len(disk.runs) if disk is not None else 0, "runs": res,
             **{f"{k}_gb_per_cpu_s": n * nbytes / c / 1e9 for k, (c, n) in cpu.items() if c > 0}}]  # fmt: skip


def metered(fn: Callable[[], None], pids: list[int], acc: list[float]) -> Callable[[], None]:
    """`fn`, adding the CPU seconds the processes `pids` spent during each call, and the call, to acc."""

    def cell() -> None:
        c0 = cpu_seconds(pids)
        fn()
        acc[0] += cpu_seconds(pids) - c0
        acc[1] += 1

    return cell


def mount_of(path: Path) -> str:
    """'device (fstype) on mountpoint' of the filesystem holding path, from /proc/mounts."""
    best = ("", "", "")
    target = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mnt, fstype = line.split()[:3]
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
            best = (dev, mnt, fstype)
    return f"{best[0]} ({best[2]}) on {best[1]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_options(ap, iters=10, warmup=1, quick="256 KiB only, 1 run, 2 calls")
    ap.add_argument("--depth", type=int, default=QUEUE_DEPTH, help=f"disk reads in flight (default {QUEUE_DEPTH})")
    ap.add_argument("--dir", type=Path, default=None, help="where the NVMe tier and the disk file go (default: TMPDIR)")
    args, sizes = start(ap, argv, quick_iters=2)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        backing = mount_of(root)
        rows = [r for kib in sizes for r in bench_size(kib, args, root)]
    wall = time.perf_counter() - t0
    deep = f"{args.depth}-deep"
    preamble = [
        machine_line(),
        f"- NVMe tier on {backing} (the disk baseline reads its own segment file); O_DIRECT: "
        f"{all(r['o_direct'] for r in rows)}; load average "
        f"(1 min) at the end {os.getloadavg()[0]:.1f}",
        f"- Workload: {args.batch} pages per get, promote=False (pages stay on NVMe), {args.iters} calls x "
        f"{args.runs} runs (median); wall {wall:.0f} s",
        "- Runs of adjacent slots in a batch (disk runs: that many requests): "
        + ", ".join(f"{r['page_kib']} KiB: {r['slot_runs']}" for r in rows),
    ]
    columns: list[Column] = [("page", lambda r: f"{r['page_kib']} KiB")]
    columns += [(f"{label} GB/s", lambda r, k=k: f"{r[f'{k}_gbs']:.2f}")
                for k, label in (("get_into", "get_into"), ("shm_get", "shm get"), ("grpc_get", "gRPC get"),
                                 ("disk_1", "disk 1-deep"), ("disk_deep", f"disk {deep}"),
                                 ("disk_runs", "disk runs"))]  # fmt: skip
    columns += [
        (f"{label} vs {deep}", lambda r, k=k: f"{r[f'{k}_vs_disk_deep']:.2f}")
        for k, label in (("get_into", "get_into"), ("shm_get", "shm get"), ("grpc_get", "gRPC"))
    ]
    columns += [
        (f"{label} GB/CPU-s", lambda r, k=k: f"{r.get(f'{k}_gb_per_cpu_s', 0.0):.2f}")
        for k, label in (("get_into", "get_into"), ("shm_get", "shm get"), ("disk_deep", f"disk {deep}"))
    ]
    save_table(args, "nvme_bench", preamble, columns, rows, wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
