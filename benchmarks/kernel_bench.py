"""Achieved bandwidth of the kvstore kernels (kernels/), against the device's own limits.

What is measured
    - decode attention (`kernels.paged_attention_decode`), a batch x context grid, one query token per
      sequence; bytes = the K and V rows every sequence reads, plus query and output;
    - gather / scatter of whole pages (`kernels.gather_pages` / `kernels.scatter_pages`), all layers in
      one call; bytes = 2 x page bytes (each byte is read once and written once);
    - fp8 quantize / dequantize of pages; bytes = input read + output written (+ the scales);
    - on a GPU, H2D and D2H copies of the same pages between pinned host memory and the device
      (`Tensor.copy_(non_blocking=True)`); bytes = page bytes.
    Model shape: Llama-3-8B-like layers (32 query heads, 8 kv heads, head_dim 128, block_size 16,
    fp16), 32 layers per page: one page is 2 MiB.

Reference (same run)
    - GPU: % of the HBM peak of the datasheet (table below, by device name), and the ratio to a
      device-to-device `copy_` of 1 GiB measured in the same run (what the memory system really gives;
      counted as read + write). H2D/D2H: % of the PCIe link's peak per direction (generation and width
      from nvidia-smi; 128b/130b encoding), when nvidia-smi answers.
    - CPU host (no CUDA): the torch references are timed instead, labelled "CPU reference", against a
      host `copy_` of 256 MiB in the same run. These say nothing about the GPU kernels: the GPU figures
      need a GPU.

Method
    Per cell: `--warmup` untimed calls, then `--runs` runs of a fixed number of calls decided before
    the cell starts (min(--max-iters, max(1, --budget-mib / bytes per call)), never from measured time).
    GPU: one CUDA event pair per run around its calls, on the current stream; CPU: time.perf_counter.
    Time per call = run time / calls; the figure reported is the median over runs (every run is in the
    JSON). GB/s = 10^9 bytes/s. On a GPU, each decode run also records host time per call: a cell
    whose host time per call is >= 90% of its device time is marked "host-bound" (Python validation
    and launch overhead, not the kernel, set its rate). No result is asserted.

Run:  .venv/bin/python benchmarks/kernel_bench.py [--quick] [--device auto|cpu|cuda] [--out DIR]
Writes benchmarks/out/kernel_bench.json (every run, machine, settings) and kernel_bench.md (the tables).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import kernels

NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
NUM_LAYERS = 32
DTYPE = torch.float16
HOST_BOUND_FRACTION = 0.9  # host time per call at or above this share of device time: "host-bound"
GIB = 1 << 30
MIB = 1 << 20

# Datasheet HBM bandwidth, GB/s (10^9 B/s), by a substring of torch.cuda.get_device_name(); first match wins.
HBM_PEAK_GBPS: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("A100-SXM4-80GB", 2039.0),
    ("A100-PCIE-80GB", 1935.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40 GB parts
    ("L40S", 864.0),
    ("A10G", 600.0),
    ("L4", 300.0),
)
# PCIe payload bandwidth per lane and direction, GB/s, after line encoding (gen 3+: 128b/130b).
PCIE_LANE_GBPS = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


# ------------------------------------------------------------------------------------------ plumbing


@dataclass(frozen=True, slots=True)
class Plan:
    runs: int
    warmup: int
    max_iters: int
    budget_bytes: int

    def calls(self, bytes_per_call: int) -> int:
        return max(1, min(self.max_iters, self.budget_bytes // max(bytes_per_call, 1)))


@dataclass(slots=True)
class Cell:
    """One measured configuration."""

    group: str  # "decode", "pages", "fp8", "pcie", "reference copy"
    label: str
    bytes_per_call: int
    calls_per_run: int
    run_seconds_per_call: list[float] = field(default_factory=list)
    host_seconds_per_call: list[float] = field(default_factory=list)
    notes: str = ""

    @property
    def seconds(self) -> float:
        return statistics.median(self.run_seconds_per_call)

    @property
    def gbps(self) -> float:
        return self.bytes_per_call / self.seconds / 1e9

    @property
    def host_bound(self) -> bool:
        if not self.host_seconds_per_call:
            return False
        return statistics.median(self.host_seconds_per_call) >= HOST_BOUND_FRACTION * self.seconds


class Timer:
    """Times `calls` back-to-back calls per run: CUDA events on the current stream, or perf_counter."""

    def __init__(self, device: torch.device, plan: Plan) -> None:
        self.device = device
        self.plan = plan

    def measure(self, cell: Cell, fn: Callable[[], object]) -> Cell:
        for _ in range(self.plan.warmup):
            fn()
        self._sync()
        for _ in range(self.plan.runs):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                host0 = time.perf_counter()
                for _ in range(cell.calls_per_run):
                    fn()
                host = time.perf_counter() - host0
                end.record()
                end.synchronize()
                cell.run_seconds_per_call.append(start.elapsed_time(end) / 1e3 / cell.calls_per_run)
                cell.host_seconds_per_call.append(host / cell.calls_per_run)
            else:
                t0 = time.perf_counter()
                for _ in range(cell.calls_per_run):
                    fn()
                cell.run_seconds_per_call.append((time.perf_counter() - t0) / cell.calls_per_run)
        return cell

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# ------------------------------------------------------------------------------------------ machine


def machine_info(device: torch.device) -> dict[str, object]:
    info: dict[str, object] = {
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1min_start": round(os.getloadavg()[0], 2),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = torch.cuda.get_device_name(device)
        info |= {
            "gpu": name,
            "sms": props.multi_processor_count,
            "gpu_memory_gib": round(props.total_memory / GIB, 1),
            "hbm_peak_gbps": next((peak for key, peak in HBM_PEAK_GBPS if key in name), None),
            "pcie": pcie_link(device),
        }
        try:
            import cupy

            info["cupy"] = cupy.__version__
        except ImportError:
            info["cupy"] = None
    return info


def pcie_link(device: torch.device) -> dict[str, object] | None:
    """Max PCIe generation and width of the GPU from nvidia-smi, and the per-direction peak in GB/s."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = "pcie.link.gen.max,pcie.link.width.max"
    try:
        out = subprocess.run(
            [smi, f"--id={device.index or 0}", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip()  # fmt: skip
        gen, width = (int(v) for v in out.split(","))
    except (subprocess.SubprocessError, ValueError, OSError):
        return None
    lane = PCIE_LANE_GBPS.get(gen)
    return {"gen": gen, "width": width, "peak_gbps": lane * width if lane else None}


# ------------------------------------------------------------------------------------------ cells


def copy_reference(timer: Timer, plan: Plan, device: torch.device) -> Cell:
    """A plain copy_ of a large buffer: the memory system's practical rate in this run (read + write)."""
    size = GIB if device.type == "cuda" else 256 * MIB
    src = torch.ones(size // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    cell = Cell("reference copy", f"copy_ {size // MIB} MiB", 2 * size, plan.calls(2 * size))
    return timer.measure(cell, lambda: dst.copy_(src))


def decode_cells(
    timer: Timer,
    plan: Plan,
    device: torch.device,
    grid: list[tuple[int, int]],
    kv_budget: int,
    *,
    num_heads: int = NUM_HEADS,
    head_tiles: tuple[int | None, ...] = (None,),
) -> list[Cell]:
    """Decode cells over a (batch, context) grid. `head_tiles`: None is the default entry point
    (kernels.paged_attention_decode); an int forces that head tile through the CUDA launcher."""
    cells = []
    item = torch.tensor([], dtype=DTYPE).element_size()
    token_bytes = 2 * NUM_KV_HEADS * HEAD_DIM * item  # K and V of one token, all kv heads
    gen = torch.Generator().manual_seed(0)  # tables and queries; caches are filled on the device
    for batch, context in grid:
        if batch * context * token_bytes > kv_budget:
            continue
        blocks_per_seq = math.ceil(context / BLOCK_SIZE)
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        key_cache = torch.randn(shape, device=device, dtype=DTYPE)
        value_cache = torch.randn(shape, device=device, dtype=DTYPE)
        tables = torch.randperm(num_blocks, generator=gen).reshape(batch, blocks_per_seq).int().to(device)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        query = torch.randn(batch, num_heads, HEAD_DIM, generator=gen).to(device=device, dtype=DTYPE)
        scale = 1.0 / math.sqrt(HEAD_DIM)
        nbytes = batch * context * token_bytes + 2 * query.numel() * item + tables.numel() * 4
        args = (query, key_cache, value_cache, tables, lens, scale)
        for tile in head_tiles:
            label = f"batch {batch} x context {context}"
            if num_heads != NUM_HEADS:
                label += f", {num_heads} heads (GQA {num_heads // NUM_KV_HEADS})"
            if tile is None:
                fn = functools.partial(kernels.paged_attention_decode, *args, max_seq_len=context)
            else:
                from kernels import cuda

                label += f", {tile}-head tiles"
                fn = functools.partial(
                    cuda.paged_attention_decode, *args, max_seq_len=context, partition_size=None, heads_per_block=tile
                )
            cells.append(timer.measure(Cell("decode", label, nbytes, plan.calls(nbytes)), fn))
        del key_cache, value_cache
    return cells


def page_cells(
    timer: Timer, plan: Plan, device: torch.device, page_counts: list[int]
) -> tuple[list[Cell], dict[int, torch.Tensor]]:
    cells = []
    pages_by_count: dict[int, torch.Tensor] = {}
    for count in page_counts:
        num_blocks = 2 * count
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        caches = [
            (torch.full(shape, 1.0, dtype=DTYPE, device=device), torch.full(shape, 2.0, dtype=DTYPE, device=device))
            for _ in range(NUM_LAYERS)
        ]
        ids = torch.arange(0, num_blocks, 2, device=device)  # every other block: scattered, not one run
        pages = kernels.gather_pages(caches, ids)
        page_bytes = pages.numel() * pages.element_size()
        cells.append(
            timer.measure(
                Cell("pages", f"gather {count} pages", 2 * page_bytes, plan.calls(2 * page_bytes)),
                lambda c=caches, i=ids, p=pages: kernels.gather_pages(c, i, out=p),
            )
        )
        cells.append(
            timer.measure(
                Cell("pages", f"scatter {count} pages", 2 * page_bytes, plan.calls(2 * page_bytes)),
                lambda c=caches, i=ids, p=pages: kernels.scatter_pages(p, c, i),
            )
        )
        pages_by_count[count] = pages
        del caches
    return cells, pages_by_count


def fp8_cells(timer: Timer, plan: Plan, pages_by_count: dict[int, torch.Tensor]) -> list[Cell]:
    cells = []
    for count, pages in pages_by_count.items():
        q, scales = kernels.quantize_fp8(pages)
        moved = pages.numel() * (pages.element_size() + 1) + scales.numel() * 4
        cells.append(
            timer.measure(
                Cell("fp8", f"quantize {count} pages", moved, plan.calls(moved)),
                lambda p=pages: kernels.quantize_fp8(p),
            )
        )
        cells.append(
            timer.measure(
                Cell("fp8", f"dequantize {count} pages", moved, plan.calls(moved)),
                lambda q=q, s=scales: kernels.dequantize_fp8(q, s, DTYPE),
            )
        )
    return cells


def pcie_cells(timer: Timer, plan: Plan, pages_by_count: dict[int, torch.Tensor]) -> list[Cell]:
    cells = []
    for count, pages in pages_by_count.items():
        host = torch.empty(pages.shape, dtype=pages.dtype, pin_memory=True)
        nbytes = pages.numel() * pages.element_size()
        cells.append(
            timer.measure(
                Cell("pcie", f"H2D {count} pages (pinned)", nbytes, plan.calls(nbytes)),
                lambda h=host, p=pages: p.copy_(h, non_blocking=True),
            )
        )
        cells.append(
            timer.measure(
                Cell("pcie", f"D2H {count} pages (pinned)", nbytes, plan.calls(nbytes)),
                lambda h=host, p=pages: h.copy_(p, non_blocking=True),
            )
        )
    return cells


# ------------------------------------------------------------------------------------------ report


def render(info: dict[str, object], settings: dict[str, object], cells: list[Cell], wall: float) -> str:
    cuda_run = info["device"] != "cpu"
    copy = next(c for c in cells if c.group == "reference copy")
    peak = info.get("hbm_peak_gbps") if cuda_run else None
    pcie = info.get("pcie") if cuda_run else None
    pcie_peak = pcie.get("peak_gbps") if isinstance(pcie, dict) else None
    lines = [
        f"## {info['date_utc']} — `kernel_bench.py`, "
        + (f"{info.get('gpu')}" if cuda_run else "CPU reference timings (no GPU)"),
        "",
    ]
    machine = ", ".join(f"{k}={v}" for k, v in info.items() if k != "date_utc")
    lines += [f"- Machine: {machine}", f"- Settings: {settings}; wall time {wall:.0f} s"]
    lines += [
        f"- Model shape: {NUM_HEADS} heads / {NUM_KV_HEADS} kv heads / head_dim {HEAD_DIM} / block_size {BLOCK_SIZE} / "
        f"{str(DTYPE).removeprefix('torch.')}; a page = {NUM_LAYERS} layers = "
        f"{NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2 // MIB} MiB.",
        f"- Method: median of {settings['runs']} runs of a fixed number of calls; GB/s = 10^9 B/s; "
        f"same-run reference: `{copy.label}` at {copy.gbps:.1f} GB/s (read + write).",
    ]
    if not cuda_run:
        lines += [
            "- **These are CPU timings of the torch references (kernels/reference.py), not of the CUDA kernels.** "
            "The GPU figures (GB/s and % of HBM / PCIe peak) need a GPU: run this script on a CUDA host with CuPy installed.",
            f"- {info['torch_threads']} torch thread(s) (`--threads`; one by default on a CPU run, since a shared "
            "small VM stalls a multi-thread pool at every op); the copy_ reference runs with the same setting.",
        ]
    elif peak is None:
        lines.append("- HBM peak unknown for this device name: only the ratio to the measured copy is given.")
    header = (
        "| group | cell | calls/run | time/call | GB/s | vs copy_ | " + ("% HBM peak | " if cuda_run else "") + "note |"
    )
    lines += ["", header, "|" + "---|" * (header.count("|") - 1)]
    for c in cells:
        note = c.notes
        if c.host_bound:
            note = (note + "; " if note else "") + "host-bound"
        pct = ""
        if cuda_run:
            if c.group == "pcie":
                pct = f"{100 * c.gbps / pcie_peak:.0f}% of PCIe" if pcie_peak else "PCIe peak unknown"
            elif peak:
                pct = f"{100 * c.gbps / peak:.0f}%"
            pct += " | "
        lines.append(
            f"| {c.group} | {c.label} | {c.calls_per_run} | {_fmt_time(c.seconds)} | {c.gbps:.2f} | "
            f"{c.gbps / copy.gbps:.2f}× | {pct}{note} |"
        )
    if not cuda_run:
        lines.append("\nH2D / D2H through pinned memory: not measured (no GPU).")
    return "\n".join(lines) + "\n"


def _fmt_time(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="smoke run: a few small cells, 2 runs")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 on a CPU run, torch's default with CUDA)",
    )
    args = parser.parse_args(argv)

    use_cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible to torch")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    runs = 2 if args.quick else args.runs
    # NOTE: the CPU references issue many small ops; on a small shared VM a multi-thread OpenMP pool
    # stalls at every op whenever another process holds a core (timings varied 50x between runs), so
    # CPU runs default to one thread and say so.
    threads = args.threads if args.threads is not None else (None if use_cuda else 1)
    if threads is not None:
        torch.set_num_threads(threads)
    if use_cuda:
        plan = Plan(runs=runs, warmup=args.warmup, max_iters=50, budget_bytes=4 * GIB)
        grid = [
            (1, 8192),
            (1, 65536),
            (8, 2048),
            (8, 8192),
            (8, 32768),
            (32, 2048),
            (32, 8192),
            (32, 32768),
            (128, 2048),
            (128, 8192),
        ]
        page_counts = [16, 128, 512]
        kv_budget = 16 * GIB
        gqa8_grid = [(1, 65536), (8, 8192), (32, 8192)]
    else:
        plan = Plan(runs=runs, warmup=1, max_iters=5, budget_bytes=256 * MIB)
        grid = [(1, 1024), (1, 8192), (4, 1024), (4, 4096), (16, 1024)]
        page_counts = [8, 32]
        kv_budget = 512 * MIB
        gqa8_grid = []
    if args.quick:
        grid, page_counts = grid[:2], page_counts[:1]
        gqa8_grid = gqa8_grid[:1] if use_cuda else []

    torch.manual_seed(0)
    t0 = time.perf_counter()
    info = machine_info(device)
    timer = Timer(device, plan)
    print(f"kernel_bench on {info.get('gpu', 'CPU (torch references; GPU figures need a GPU)')}", flush=True)
    cells = [copy_reference(timer, plan, device)]
    cells += decode_cells(timer, plan, device, grid, kv_budget)
    if use_cuda:
        # GQA 8 (Llama-3-70B-like heads): 4-head tiles (the default) against 8-head tiles, see
        # kernels/planning.py DEFAULT_MAX_HEADS_PER_BLOCK.
        cells += decode_cells(timer, plan, device, gqa8_grid, kv_budget, num_heads=64, head_tiles=(4, 8))
    page_results, pages_by_count = page_cells(timer, plan, device, page_counts)
    cells += page_results
    cells += fp8_cells(timer, plan, pages_by_count)
    if use_cuda:
        cells += pcie_cells(timer, plan, pages_by_count)
    wall = time.perf_counter() - t0
    info["load_avg_1min_end"] = round(os.getloadavg()[0], 2)

    settings = {
        "runs": plan.runs,
        "warmup": plan.warmup,
        "max_iters": plan.max_iters,
        "budget_mib": plan.budget_bytes // MIB,
        "quick": args.quick,
    }
    markdown = render(info, settings, cells, wall)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "machine": info,
        "settings": settings,
        "wall_seconds": wall,
        "cells": [asdict(c) | {"median_seconds": c.seconds, "gbps": c.gbps, "host_bound": c.host_bound} for c in cells],
    }
    (args.out / "kernel_bench.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / "kernel_bench.md").write_text(markdown)
    print(markdown)
    print(f"wrote {args.out / 'kernel_bench.json'} and {args.out / 'kernel_bench.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
