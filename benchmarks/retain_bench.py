"""What retention hints cost (DESIGN.md §6.5): the manager's hint path per event, and a Get's latency while a
storm of hints arrives at a real node.

What is measured
    1. In process (policy_bench-style): a TierManager on real media (an mmap DRAM slab, NVMe segment files in a
       temp dir) holding --pages pages, --sessions sessions of --session-pages pages each. Then, --events times
       each: a priority update (raise or lower), a lease update, naming one more page (retained at once), releasing
       one page, and a storm mixing them (10% of it lease updates that also change the mode, which walks the
       session's pages); through `TenantView.retain` (what the servicer calls: namespace scoping, validation,
       the manager, the response's session state). Per event = the loop's time / events, less the same loop
       over a call that does nothing; beside it, a one-page Lookup through the same view timed in the same runs
       (the ratio holds better than the µs on a shared machine). Also: the placement listener's cost for a page nobody named (every Put and
       move pays it), and ending a session of --session-pages pages (the sweeper's expiry pays the same).
    2. Against a node (a child process, defaults but --dram): one client thread Gets --get-pages pages in a loop
       (a plain `get`, the client's default plane) for --seconds; first alone, then while another process
       sends Retain updates (priority and lease of --sessions sessions, round-robin) from --storm-threads
       threads as fast as they can, paced to at most --storm-rate per second. Reported: Get p50 / p99 / max
       latency in both phases and the hint rate the storm reached (the node's gRPC handling, not the manager,
       bounds it on a small machine).

Method
    time.perf_counter; median and best of --runs (default 5) of part 1 (the best is the code's cost with the least
    interference on a shared machine), garbage collection off while timing; part 2 one
    phase of each, alternated baseline / storm / baseline, the baseline figures pooled.

Run:  flock /tmp/kvstore-bench.lock .venv/bin/python benchmarks/retain_bench.py [--runs 5] [--events 10000]
          [--seconds 10] [--storm-rate 10000] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from machine import machine_line, save_results

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.config import NodeConfig
from kvstore.layout import DType, PageLayout
from kvstore.manager import TierManager
from kvstore.manager.views import TenantView
from kvstore.names import RetainMode, RetainOp
from kvstore.pageformat import slot_bytes_for
from kvstore.wire import PutOpen

DEFAULT_OUT = Path(__file__).resolve().parent / "out"
LAYOUT = PageLayout(DType.UINT8, 1, 1, 2048, 1)  # 4 KiB pages: the manager's cost, not the copies
NS = "bench/retain"


def key(i: int) -> bytes:
    return hashlib.sha256(b"retain-bench" + i.to_bytes(8, "little")).digest()


async def fill(mgr: TierManager, n: int) -> None:
    for a in range(0, n, 512):
        txn = mgr.begin_put(PutOpen(NS, LAYOUT))
        for i in range(a, min(n, a + 512)):
            view = await txn.add_page(key(i), LAYOUT.page_bytes, 0)
            if view is not None:
                view[:] = bytes(LAYOUT.page_bytes)
        await txn.commit()


def timed(fn: Callable[[int], object], events: int) -> float:
    gc.disable()
    try:
        t0 = time.perf_counter()
        for i in range(events):
            fn(i)
        return time.perf_counter() - t0
    finally:
        gc.enable()


async def in_process(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Part 1: µs per event of each kind of hint, through the tenant view: (median, best) of the runs."""
    slot = slot_bytes_for(LAYOUT.page_bytes)
    with tempfile.TemporaryDirectory(prefix="retain-bench-") as tmp:
        cfg = NodeConfig(dram_bytes=(args.pages + 64) * slot, nvme_path=tmp, nvme_bytes=(2 * args.pages) * slot,
                         max_page_bytes=LAYOUT.page_bytes, retain_fraction=1.0, scrub_bytes_per_second=0)  # fmt: skip
        mgr = TierManager(cfg)
        await mgr.start()
        try:
            await fill(mgr, args.pages)
            view = TenantView(mgr, "default")
            per = args.session_pages
            names = [f"s{j}" for j in range(args.sessions)]
            for j, s in enumerate(names):
                hs = [key((j * per + i) % args.pages) for i in range(per)]
                view.retain(s, RetainOp.RETAIN, NS, hs, ttl_seconds=3600.0, priority=50, mode=RetainMode.DEMOTE)
            rng = random.Random(0)
            extra = [key(args.pages + i) for i in range(args.events)]  # named, not stored: pending pages
            count = {"n": 0}

            def nothing(i: int) -> None:
                count["n"] += 1

            def priority(i: int) -> None:
                view.retain(names[i % len(names)], RetainOp.UPDATE, "", [], priority=i % 101)

            def lease(i: int) -> None:
                view.retain(names[i % len(names)], RetainOp.UPDATE, "", [], ttl_seconds=600.0 + i % 7)

            def name_one(i: int) -> None:
                view.retain(names[i % len(names)], RetainOp.RETAIN, NS, [extra[i]])

            def release_one(i: int) -> None:
                view.retain(names[i % len(names)], RetainOp.RELEASE, NS, [extra[i]])

            def updates(i: int) -> None:
                s = names[i % len(names)]
                if i % 2:
                    view.retain(s, RetainOp.UPDATE, "", [], priority=rng.randrange(101))
                else:
                    view.retain(s, RetainOp.UPDATE, "", [], ttl_seconds=rng.uniform(60, 600))

            def storm(i: int) -> None:
                r = rng.random()
                s = names[i % len(names)]
                if r < 0.45:
                    view.retain(s, RetainOp.UPDATE, "", [], priority=rng.randrange(101))
                elif r < 0.9:
                    view.retain(s, RetainOp.UPDATE, "", [], ttl_seconds=rng.uniform(60, 600))
                else:  # a mode change walks the session's pages
                    mode = RetainMode.HOLD if rng.random() < 0.5 else RetainMode.DEMOTE
                    view.retain(s, RetainOp.UPDATE, "", [], mode=mode, priority=50)

            def listener(i: int) -> None:
                mgr.retention.on_change(NS, extra[i], None, None)  # a page nobody named: one dict lookup

            one = [[key(i % args.pages)] for i in range(args.events)]

            def lookup(i: int) -> None:  # same-run reference: what a one-page Lookup costs the manager
                view.lookup(NS, one[i])

            kinds: dict[str, Callable[[int], None]] = {
                "reference: a one-page Lookup": lookup,
                "priority update": priority,
                "lease update": lease,
                "name one page": name_one,
                "release one page": release_one,
                "storm: lease and priority updates, alternated": updates,
                f"storm: 45% priority, 45% lease, 10% mode changes (walk {per} pages)": storm,
                "placement listener, unnamed page": listener,
            }
            samples: dict[str, list[float]] = {k: [] for k in kinds}
            empty: list[float] = []
            for _ in range(args.runs):
                empty.append(timed(nothing, args.events))
                for k, fn in kinds.items():
                    samples[k].append(timed(fn, args.events))
            base, floor = statistics.median(empty), min(empty)
            out = {
                k: (max(0.0, statistics.median(v) - base) / args.events * 1e6, max(0.0, min(v) - floor) / args.events * 1e6)
                for k, v in samples.items()
            }  # fmt: skip
            ends = []
            for j in range(min(args.runs, len(names))):
                t0 = time.perf_counter()
                view.retain(names[j], RetainOp.END, "", [])
                ends.append(time.perf_counter() - t0)
            out[f"end a session of {per} pages"] = (statistics.median(ends) * 1e6, min(ends) * 1e6)
            return out
        finally:
            await mgr.close()


def storm_main(addr: str, sessions: int, rate: float, seconds: float, threads: int) -> None:
    """The storm process: Retain updates as fast as `threads` threads go, paced to at most `rate` per second."""
    kv = KVStoreClient(addr, timeout=30, transport="grpc")
    names = [f"storm-{j}" for j in range(sessions)]
    for s in names:
        kv.retain(s, NS, [key(0)], ttl_seconds=3600)
    sent = [0] * threads
    stop = time.monotonic() + seconds
    per_thread = rate / threads

    def run(t: int) -> None:
        rng = random.Random(t)
        start = time.monotonic()
        while (now := time.monotonic()) < stop:
            ahead = sent[t] - (now - start) * per_thread
            if ahead > 0:
                time.sleep(ahead / per_thread)
                continue
            s = names[(t * 7919 + sent[t]) % len(names)]
            if sent[t] % 2:
                kv.update_session(s, priority=rng.randrange(101))
            else:
                kv.update_session(s, ttl_seconds=rng.uniform(60, 600))
            sent[t] += 1

    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    t0 = time.monotonic()
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    print(f"STORM {sum(sent)} {time.monotonic() - t0:.3f}", flush=True)
    kv.close()


def get_phase(kv: KVStoreClient, hashes: list[bytes], seconds: float) -> list[float]:
    lat: list[float] = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        t0 = time.perf_counter()
        got = kv.get(NS, hashes)
        lat.append(time.perf_counter() - t0)
        assert len(got) == len(hashes)
    return lat


def against_node(args: argparse.Namespace) -> dict[str, object]:
    """Part 2: a Get's latency alone and while a storm of hints arrives."""
    layout = PageLayout(DType.UINT8, 1, 1, args.page_bytes // 2, 1)
    node = NodeProcess(dram_bytes=args.dram, max_page_bytes=args.page_bytes, node_id="retain-bench").start()
    try:
        with KVStoreClient(node.addr, timeout=30) as kv:
            hashes = [key(i) for i in range(args.get_pages)]
            kv.put(NS, layout, hashes, [os.urandom(args.page_bytes) for _ in hashes])
            get_phase(kv, hashes, 1.0)  # warm-up: the plane negotiated, the pages hot
            base = get_phase(kv, hashes, args.seconds / 2)
            cmd = [sys.executable, __file__, "--storm", node.addr, str(args.sessions), str(args.storm_rate),
                   str(args.seconds), str(args.storm_threads)]  # fmt: skip
            storm = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ})
            try:
                time.sleep(1.0)  # the storm's sessions created, its threads running
                loaded = get_phase(kv, hashes, args.seconds - 2.0)
                out, _ = storm.communicate(timeout=args.seconds + 60)
            finally:
                if storm.poll() is None:
                    storm.kill()
                    storm.wait()
            base += get_phase(kv, hashes, args.seconds / 2)
            plane = kv.plane
            calls = kv.stats().retention.calls
        line = next(ln for ln in out.splitlines() if ln.startswith("STORM "))
        sent, took = int(line.split()[1]), float(line.split()[2])
    finally:
        node.close()

    def pct(v: list[float], q: float) -> float:
        return sorted(v)[min(len(v) - 1, int(q * len(v)))] * 1e3

    return {
        "plane": plane,
        "hint_rate": sent / took,
        "node_retain_calls": calls,
        "base": {"gets": len(base), "p50": pct(base, 0.5), "p99": pct(base, 0.99), "max": max(base) * 1e3},
        "storm": {"gets": len(loaded), "p50": pct(loaded, 0.5), "p99": pct(loaded, 0.99), "max": max(loaded) * 1e3},
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--storm":
        addr, sessions, rate, seconds, threads = sys.argv[2:7]
        storm_main(addr, int(sessions), float(rate), float(seconds), int(threads))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--events", type=int, default=10_000)
    ap.add_argument("--pages", type=int, default=20_000)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--session-pages", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--storm-rate", type=float, default=10_000.0)
    ap.add_argument("--storm-threads", type=int, default=4)
    ap.add_argument("--get-pages", type=int, default=4)
    ap.add_argument("--page-bytes", type=int, default=256 << 10)
    ap.add_argument("--dram", default="256MiB")
    ap.add_argument("--part", choices=["all", "process", "node"], default="all")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    lines = [f"# retain_bench ({machine_line().removeprefix('- Machine: ')})", ""]
    payload: dict[str, object] = {"load_before": os.getloadavg()}
    if args.part in ("all", "process"):
        per_event = asyncio.run(in_process(args))
        payload["in_process_us"] = per_event
        lines += [f"Hint path in process: {args.pages} pages, {args.sessions} sessions of {args.session_pages} pages, "
                  f"{args.events} events per kind, median of {args.runs}, less an empty loop", "",
                  "| event | µs per event (median) | µs per event (best run) | x a one-page Lookup (median) |",
                  "|---|--:|--:|--:|"]  # fmt: skip
        ref = per_event["reference: a one-page Lookup"][0]
        lines += [f"| {k} | {med:.2f} | {best:.2f} | {med / ref:.2f}x |" for k, (med, best) in per_event.items()]
        lines.append("")
    if args.part in ("all", "node"):
        res = against_node(args)
        payload["node"] = res
        b, s = res["base"], res["storm"]  # type: ignore[index]
        lines += [f"A {args.get_pages} x {args.page_bytes // 1024} KiB Get ({res['plane']} plane) against a node, "
                  f"alone and while hints arrive at {res['hint_rate']:,.0f}/s (asked for {args.storm_rate:,.0f}/s "
                  f"from {args.storm_threads} threads of another process)", "",
                  "| phase | Gets | p50 ms | p99 ms | max ms |", "|---|--:|--:|--:|--:|",
                  f"| alone | {b['gets']} | {b['p50']:.2f} | {b['p99']:.2f} | {b['max']:.1f} |",
                  f"| hint storm | {s['gets']} | {s['p50']:.2f} | {s['p99']:.2f} | {s['max']:.1f} |", ""]  # type: ignore[index]  # fmt: skip
    payload["load_after"] = os.getloadavg()
    lines.append("Load average (1, 5, 15 min) before / after: {:.2f} {:.2f} {:.2f} / {:.2f} {:.2f} {:.2f}".format(
        *payload["load_before"], *payload["load_after"]))  # type: ignore[misc]  # fmt: skip
    save_results(args.out, "retain_bench", "\n".join(lines), args, **payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
