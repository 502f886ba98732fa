"""Soak: many concurrent clients, mixed Lookup / Get / Put / Prefetch across DRAM and NVMe, for minutes.

Method: one real node on loopback with a DRAM budget smaller than the working set (so Gets hit both
DRAM and NVMe, Puts demote, Prefetches promote) and an NVMe budget larger than it (nothing is dropped).
`--clients` asyncio clients (each its own AsyncKVStoreClient, so its own channel and plane: defaults,
shared memory on loopback) run in one process, each looping: pick a chain of the working set (Zipf-like:
a few hot system prompts, a long tail), then Lookup (40%), Get of its stored prefix (30%), Put of the
chain (20%: the first Put of a chain stores it, later ones find it present), or Prefetch (10%). Every
page a Get returns is checked byte for byte against the bytes put under its key. Reported per window:
requests, p50 / p99 latency per op, errors, and the node's RSS (VmRSS, sampled every second) against
its budget: DRAM slab + a stated overhead for the interpreter, gRPC and in-flight buffers.

Pass: 0 errors, 0 wrong pages, max RSS <= dram budget + overhead. Writes benchmarks/out/soak.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from machine import machine_line, save_results

from kvstore.cli.launch import NodeProcess
from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.layout import DType, PageLayout
from kvstore.pageformat import slot_bytes_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from devkit.faults import rss_now

NS = "bench/soak"
LAYOUT = PageLayout(DType.FLOAT16, num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)  # 32 KiB pages
OPS = (("lookup", 0.4), ("get", 0.3), ("put", 0.2), ("prefetch", 0.1))
OVERHEAD_MIB = 192  # interpreter + grpc + OpenTelemetry + Put/Get buffers in flight, on top of the DRAM slab


SIZES: dict[str, tuple[type, float, float | None, str]] = {  # option: (type, default, --quick, what)
    "seconds": (float, 600.0, 20.0, "duration in seconds"),
    "clients": (int, 64, 8, "concurrent clients"),
    "dram_mib": (int, 32, None, "node DRAM budget in MiB"),
    "chains": (int, 256, None, "working set: chains of --chain-len pages"),
    "chain_len": (int, 8, None, "pages per chain"),
    "window": (float, 30.0, 5.0, "seconds per reported window"),
}


def chain_keys(c: int, length: int) -> list[bytes]:
    return [hashlib.sha256(f"soak-{c}-{i}".encode()).digest() for i in range(length)]


def content(h: bytes) -> bytes:
    return hashlib.shake_256(h).digest(LAYOUT.page_bytes)


@dataclass
class Window:
    lat: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op, _ in OPS})
    errors: int = 0
    wrong_pages: int = 0


class Soak:
    def __init__(self, addr: str, clients: int, chains: int, chain_len: int, window_s: float, seed: int) -> None:
        self.addr = addr
        self.clients = clients
        self.chains = [chain_keys(c, chain_len) for c in range(chains)]
        self.window_s = window_s
        self.windows: list[Window] = []
        self.rng = random.Random(seed)
        self.error_samples: list[str] = []
        self.t0 = 0.0

    def window(self) -> Window:
        i = int((time.monotonic() - self.t0) // self.window_s)
        while len(self.windows) <= i:
            self.windows.append(Window())
        return self.windows[i]

    def pick_chain(self, rng: random.Random) -> list[bytes]:
        # Zipf-like: index ~ N * u^3 puts most picks on the first chains (hot shared prefixes).
        return self.chains[int(len(self.chains) * rng.random() ** 3)]

    async def client(self, n: int, deadline: float) -> None:
        rng = random.Random(n)
        ops, weights = zip(*OPS, strict=True)
        async with AsyncKVStoreClient(self.addr, timeout=60) as kv:
            while time.monotonic() < deadline:
                op = rng.choices(ops, weights)[0]
                chain = self.pick_chain(rng)
                t = time.perf_counter()
                w = self.window()
                try:
                    if op == "lookup":
                        await kv.lookup(NS, chain)
                    elif op == "get":
                        pages = await kv.get_pages(NS, chain)
                        w.wrong_pages += sum(bytes(p.data) != content(h) for h, p in zip(chain, pages, strict=False))
                    elif op == "put":
                        await kv.put(NS, LAYOUT, chain, [content(h) for h in chain])
                    else:
                        await kv.prefetch(NS, chain)
                except Exception as exc:  # counted, and a few kept for the report
                    if "is not known to this node" in str(exc) and op in ("get", "prefetch"):
                        pass  # before the first Put of the namespace: a miss, not an error
                    else:
                        w.errors += 1
                        if len(self.error_samples) < 10:
                            self.error_samples.append(f"{op}: {type(exc).__name__}: {exc}"[:300])
                w.lat[op].append(time.perf_counter() - t)

    async def run(self, seconds: float) -> None:
        self.t0 = time.monotonic()
        deadline = self.t0 + seconds
        await asyncio.gather(*(self.client(n, deadline) for n in range(self.clients)))


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3 if s else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, (kind, full, quick, what) in SIZES.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=kind, default=full,
                        help=f"{what} (default {full}" + (f", --quick {quick})" if quick is not None else ")"))  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="smoke run: 20 s, 8 clients, 5 s windows")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    for name, (_, _, quick, _) in SIZES.items():
        if args.quick and quick is not None:
            setattr(args, name, quick)
    slot = slot_bytes_for(LAYOUT.page_bytes)
    working_set = args.chains * args.chain_len
    nvme_pages = 2 * working_set
    rss: list[tuple[float, int]] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-soak-") as tmp:
        node = NodeProcess(dram_bytes=args.dram_mib << 20, nvme_path=Path(tmp) / "nvme", nvme_bytes=nvme_pages * slot,
                           max_page_bytes=LAYOUT.page_bytes, node_id="soak")  # fmt: skip
        node.start(timeout=120)
        assert node.proc is not None
        pid = node.proc.pid
        stop = threading.Event()

        def sample() -> None:
            t0 = time.monotonic()
            while not stop.wait(1.0):
                rss.append((time.monotonic() - t0, rss_now(pid)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        # Same-run reference: one client alone, so the soak's latencies read against the node's unloaded ones.
        ref_s = min(30.0, max(5.0, args.seconds / 20))
        ref = Soak(node.addr, 1, args.chains, args.chain_len, ref_s, seed=1)
        soak = Soak(node.addr, args.clients, args.chains, args.chain_len, args.window, seed=0)
        try:
            asyncio.run(ref.run(ref_s))
            wall = time.monotonic()
            asyncio.run(soak.run(args.seconds))
        finally:
            stop.set()
            sampler.join(5)
            wall = time.monotonic() - wall
            with KVStoreClient(node.addr, timeout=60) as kv:
                tiers = {t.tier.label: t.counters for t in kv.stats().tiers if t.available}
            code = node.stop()
            node.close()
    budget = (args.dram_mib + OVERHEAD_MIB) << 20
    lines = [
        f"## soak: {args.clients} clients, {args.seconds:.0f} s, DRAM {args.dram_mib} MiB, "
        f"working set {working_set} pages of {LAYOUT.page_bytes >> 10} KiB ({working_set * LAYOUT.page_bytes >> 20} MiB)",
        "", machine_line(), "",
        "| window (s) | requests | errors | wrong pages | lookup p50/p99 ms | get p50/p99 ms | put p50/p99 ms "
        "| prefetch p50/p99 ms | node RSS max (MiB) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]  # fmt: skip
    ref_w = ref.windows[0] if ref.windows else Window()
    cells = " | ".join(f"{pct(ref_w.lat[op], 0.5):.1f} / {pct(ref_w.lat[op], 0.99):.1f}" for op, _ in OPS)
    n = sum(len(v) for v in ref_w.lat.values())
    lines.append(
        f"| reference: 1 client, {ref_s:.0f} s before | {n} | {ref_w.errors} | {ref_w.wrong_pages} | {cells} | — |"
    )
    for i, w in enumerate(soak.windows):
        lo, hi = i * args.window, (i + 1) * args.window
        rss_w = max((r for t, r in rss if lo <= t < hi), default=0)
        cells = " | ".join(f"{pct(w.lat[op], 0.5):.1f} / {pct(w.lat[op], 0.99):.1f}" for op, _ in OPS)
        n = sum(len(v) for v in w.lat.values())
        lines.append(f"| {lo:.0f}-{hi:.0f} | {n} | {w.errors} | {w.wrong_pages} | {cells} | {rss_w / 2**20:.0f} |")
    total = sum(sum(len(v) for v in w.lat.values()) for w in soak.windows)
    errors = sum(w.errors for w in soak.windows)
    wrong = sum(w.wrong_pages for w in soak.windows)
    peak = max((r for _, r in rss), default=0)
    after_warmup = [r for t, r in rss if t > min(60.0, args.seconds / 4)]
    growth = (after_warmup[-1] - after_warmup[0]) if len(after_warmup) > 1 else 0
    ok = errors == 0 and wrong == 0 and peak <= budget and code == 0
    lines += [
        "",
        f"- Total: {total} requests in {wall:.0f} s ({total / wall:.0f}/s), {errors} errors, {wrong} wrong pages; node "
        f"exit code {code} after SIGTERM. With {args.clients} requests always in flight the mean latency is clients / "
        f"rate (Little's law): {1e3 * args.clients * wall / max(total, 1):.0f} ms.",
        f"- Node RSS: peak {peak / 2**20:.0f} MiB against a budget of {budget >> 20} MiB (DRAM {args.dram_mib} MiB + "
        f"{OVERHEAD_MIB} MiB overhead); {growth / 2**20:+.1f} MiB from after warm-up to the end.",
        "- Node counters: " + "; ".join(f"{k}: {c.hits} hits, {c.promotions} promotions in, {c.demotions} demotions in, "
                                       f"{c.dropped} dropped, {c.checksum_failures} checksum failures"
                                       for k, c in tiers.items()) + ".",
        f"- Median window p99 (all ops): {statistics.median(pct([x for v in w.lat.values() for x in v], 0.99) for w in soak.windows):.1f} ms.",
        f"- {'PASS' if ok else 'FAIL'}" + (f"; first errors: {soak.error_samples}" if soak.error_samples else ""),
    ]  # fmt: skip
    save_results(args.out, "soak", "\n".join(lines), args, rss=rss, passed=ok, errors=soak.error_samples)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
