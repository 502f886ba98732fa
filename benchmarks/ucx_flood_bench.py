"""A node's memory under a flood of unmatched tagged UCX messages from an endpoint that never says HELLO
(SECURITY.md, round 3, finding 2: 200k x 64 B took a node from 89 to 310 MiB, not released after 35 s).

Method: one real node (`--ucx`, UCX_NET_DEVICES=lo); its RSS once it settled; then an attacker process opens
an endpoint to the node's advertised worker address (or its listener) and sends `--count` tagged messages of
`--size` bytes under random tags, in waves of 2,000 posted at once, without ever sending a HELLO; the node's
RSS once it settled again, and `--hold` seconds later (was anything released?), while the attacker stays
connected. Then a client does a UCX put and get (does the node still serve?).

The node runs the `kvstore` of the directory the script is run from (`python -m` puts it first): to
compare with the code before a fix, copy this script, benchmarks/machine.py and devkit/ucx_stranger.py
into a checkout of that code and run it there, on the same machine. Writes
benchmarks/out/ucx_flood_bench.{md,json}.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import random
import time
from pathlib import Path
from typing import Any

from machine import machine_line, save_results

from devkit.ucx_stranger import settle, stranger
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
from kvstore.wire.ucx import ucxx_installed

WAVE = 2_000  # sends the attacker keeps posted at once
LAYOUT = PageLayout(DType.FLOAT16, num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def settled_rss_mib(pid: int, seconds: float = 5.0) -> float:
    """RSS once two readings half a second apart differ by less than 1 MiB (or after `seconds`)."""
    last, deadline = rss_mib(pid), time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = rss_mib(pid)
        if abs(now - last) < 1:
            return now
        last = now
    return last


def flood(address: str, path: str, count: int, size: int, q: Any) -> None:
    """Child process: an endpoint that never says HELLO sends `count` messages under random tags."""
    ucx, worker, ep = stranger(address, path)
    from ucxx._lib.arr import Array

    payload = Array(bytearray(b"x" * size))
    rng = random.Random(7)
    sent, t0 = 0, time.monotonic()
    while sent < count and time.monotonic() - t0 < 300:
        wave = [ep.tag_send(payload, ucx.UCXXTag(rng.getrandbits(64))) for _ in range(min(WAVE, count - sent))]
        sent += settle(worker, wave, 5.0)
    q.put((sent, time.monotonic() - t0))
    q.get(timeout=300)  # stay connected until the parent has measured


def round_trip(addr: str) -> bool:
    hs = [hashlib.sha256(f"flood-{i}".encode()).digest() for i in range(4)]
    pages = [bytes([i]) * LAYOUT.page_bytes for i in range(4)]
    try:
        with KVStoreClient(addr, transport="ucx", timeout=30) as kv:
            kv.put("bench/flood", LAYOUT, hs, pages)
            return [bytes(p) for p in kv.get("bench/flood", hs)] == pages
    except Exception as exc:  # the figure to report is "still serving or not", with why
        print(f"round trip failed: {exc}")
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=200_000, help="messages the attacker sends (default 200000)")
    ap.add_argument("--size", type=int, default=64, help="bytes per message (default 64)")
    ap.add_argument("--path", choices=("worker", "listener"), default="worker", help="how the attacker connects")
    ap.add_argument("--hold", type=float, default=10.0, help="seconds to watch the RSS after the flood")
    ap.add_argument("--label", default="", help="what code the node ran (for the results file)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    if not ucxx_installed():
        print("ucxx is not installed: pip install 'kvstore[ucx]'")
        return 1
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import kvstore

    with NodeProcess(node_id="flood", extra_args=["--ucx"]) as node:
        assert node.proc is not None
        ok_before = round_trip(node.addr)
        with KVStoreClient(node.addr, transport="grpc") as c:
            address = next(p.address for p in c.stats().planes if p.name == "ucx")
        before = settled_rss_mib(node.proc.pid)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=flood, args=(address, args.path, args.count, args.size, q))
        proc.start()
        try:
            sent, secs = q.get(timeout=330)
            after = settled_rss_mib(node.proc.pid)
            time.sleep(args.hold)
            held = rss_mib(node.proc.pid)
            ok_after = round_trip(node.addr)
        finally:
            q.put("go")
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        log_kib = Path(node.log_path).stat().st_size / 1024
    row = {"code": args.label or kvstore.__file__, "path": args.path, "count": args.count, "size": args.size,
           "sent": sent, "send_seconds": round(secs, 1), "rss_before_mib": round(before, 1),
           "rss_after_mib": round(after, 1), f"rss_after_{args.hold:.0f}s_mib": round(held, 1),
           "grown_mib": round(after - before, 1), "served_before": ok_before, "served_after": ok_after,
           "node_log_kib": round(log_kib, 1)}  # fmt: skip
    text = "\n".join([machine_line(), "", *(f"- {k}: {v}" for k, v in row.items())])
    save_results(args.out, "ucx_flood_bench", text, args, rows=[row])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
