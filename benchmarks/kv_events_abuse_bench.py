"""What KV-event subscribers that never read, and one that re-joins every second, cost a node and its callers.

One real node (DRAM only, loopback, `--kv-events-endpoint`) holding `--pages` pages of 1 KiB in 256-page
chains. Another client's Lookup of 16 blocks is timed (one every 5 ms) while idle, then while `--subscribers`
SUB sockets that connect, subscribe to everything and never read (RCVHWM 1, a 4 KiB receive buffer) sit on
the feed and one more subscriber connects, subscribes and leaves every `--rejoin` seconds, for `--seconds`.
Reported: the Lookup's p50 / p99 / max in both phases, the node's RSS (VmRSS) before, at its peak, and
`--settle` seconds after the subscribers left, and how many snapshots the node sent. The reference is the
same node's idle phase, measured in the same run. Run it in a checkout of main before the fix to get the
"before" row (RESULTS.md). Writes benchmarks/out/kv_events_abuse_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import threading
import time
from pathlib import Path

import zmq
from machine import machine_line, save_results

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout

LAYOUT = PageLayout(DType.FLOAT16, num_layers=1, num_kv_heads=1, head_dim=16, block_size=16)  # 1 KiB pages
SLOT = 8192  # a 4 KiB header block and the payload, 4 KiB aligned
NS = "bench/kv-events"
MiB = 1 << 20


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def percentiles(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {"p50": statistics.median(s), "p99": s[max(0, int(len(s) * 0.99) - 1)], "max": s[-1], "n": len(s)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=20480, help="pages the node holds (default 20480)")
    ap.add_argument("--subscribers", type=int, default=20, help="subscribers that never read (default 20)")
    ap.add_argument("--rejoin", type=float, default=1.0, help="seconds between re-joins (default 1)")
    ap.add_argument("--seconds", type=float, default=40.0, help="length of the loaded phase (default 40)")
    ap.add_argument("--settle", type=float, default=20.0, help="seconds after the subscribers left (default 20)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2,048 pages, 3 subscribers, 2 s, 1 s settle")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    if args.quick:
        args.pages, args.subscribers, args.seconds, args.settle = 2048, 3, 2.0, 1.0
    node = NodeProcess(dram_bytes=(args.pages + 64) * SLOT, max_page_bytes=LAYOUT.page_bytes, node_id="ev",
                       extra_args=["--kv-events-endpoint", "tcp://127.0.0.1:0", "--no-tcp", "--no-shm"])  # fmt: skip
    node.start()
    try:
        pid = node.proc.pid  # type: ignore[union-attr]
        with KVStoreClient(node.addr, timeout=60, transport="grpc") as kv:
            for c in range(args.pages // 256):
                chain = [hashlib.sha256(f"{c}/{i}".encode()).digest() for i in range(256)]
                kv.put(NS, LAYOUT, chain, [h * 32 for h in chain])
            events = kv.stats().kv_events
            assert events is not None
            endpoint = events.endpoint
            probe = [hashlib.sha256(f"0/{i}".encode()).digest() for i in range(16)]

            def timed(n: int) -> list[float]:
                out = []
                for _ in range(n):
                    t = time.perf_counter()
                    kv.lookup(NS, probe)
                    out.append((time.perf_counter() - t) * 1000)
                    time.sleep(0.005)
                return out

            idle = timed(400)
            time.sleep(1.0)
            rss_before = rss(pid)
            snapshots_before = kv.stats().kv_events.snapshots  # type: ignore[union-attr]
            ctx = zmq.Context()
            stuck = []
            for _ in range(args.subscribers):
                s = ctx.socket(zmq.SUB)
                s.setsockopt(zmq.RCVHWM, 1)
                s.setsockopt(zmq.RCVBUF, 4096)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(endpoint)
                s.setsockopt(zmq.SUBSCRIBE, b"")
                stuck.append(s)
            stop = threading.Event()

            def rejoin() -> None:
                while not stop.is_set():
                    j = ctx.socket(zmq.SUB)
                    j.setsockopt(zmq.LINGER, 0)
                    j.connect(endpoint)
                    j.setsockopt(zmq.SUBSCRIBE, b"kv@")
                    stop.wait(args.rejoin)
                    j.close()

            joiner = threading.Thread(target=rejoin, daemon=True)
            joiner.start()
            loaded: list[float] = []
            peak = rss_before
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.seconds:
                loaded += timed(50)
                peak = max(peak, rss(pid))
            stop.set()
            joiner.join(10)
            snapshots = kv.stats().kv_events.snapshots - snapshots_before  # type: ignore[union-attr]
            for s in stuck:
                s.close()
            ctx.term()
            time.sleep(args.settle)
            rss_after = rss(pid)
    finally:
        node.close()
    row = {"pages": args.pages, "subscribers": args.subscribers, "rejoin_s": args.rejoin, "seconds": args.seconds,
           "idle": percentiles(idle), "loaded": percentiles(loaded), "snapshots": snapshots,
           "rss_before": rss_before, "rss_peak": peak, "rss_after": rss_after}  # fmt: skip
    i, ld = row["idle"], row["loaded"]
    lines = [machine_line(), "",
             "| pages | never-reading subs | re-join every | Lookup p50 / p99 / max ms idle | same, loaded | snapshots "
             "| RSS before → peak → after they left MiB |",
             "|--:|--:|--:|---|---|--:|---|",
             f"| {args.pages} | {args.subscribers} | {args.rejoin:g} s | {i['p50']:.2f} / {i['p99']:.2f} / "
             f"{i['max']:.1f} | {ld['p50']:.2f} / {ld['p99']:.2f} / {ld['max']:.1f} | {snapshots} in "
             f"{args.seconds:g} s | {rss_before / MiB:.0f} → {peak / MiB:.0f} (+{(peak - rss_before) / MiB:.0f}) → "
             f"{rss_after / MiB:.0f} (+{(rss_after - rss_before) / MiB:.0f}) |"]  # fmt: skip
    save_results(args.out, "kv_events_abuse_bench", "\n".join(lines), args, rows=[row])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
