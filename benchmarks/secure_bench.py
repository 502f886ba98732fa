"""What the secured cache plane and metrics cost: the same node and workload in four modes, one run.

Modes (one real node each, DRAM only, on loopback):
    plain        no TLS, no tokens, no metrics endpoint (the peer every other mode is compared with)
    metrics      + the Prometheus endpoint and the per-RPC latency histogram
    tokens       + bearer-token auth (read-write token on every call)
    tls+tokens   + TLS (EC P-256, a throwaway CA from devkit.pki) and tokens and metrics

Bytes move on gRPC streams in every mode by default (transport="grpc"), so TLS encrypts them all; with
`--transport tcp` they move on the bulk TCP plane (TLS there: OpenSSL, handing the records to the kernel
where it has kTLS). The shared-memory plane (benchmarks/shm_bench.py) sends only control messages over the channel.
Per mode: batched Put and Get GB/s of `--batch` pages of `--page-kib` KiB (median of `--runs` runs of
`--iters` calls), and Lookup p50/p99 latency of a 64-block chain over `--lookups` calls. The modes run
in rotating order per run so drift on the machine does not favour one. Writes
benchmarks/out/secure_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

from machine import LoadLog, machine_line, save_results

from devkit.pki import make_dev_pki
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
from kvstore.memtune import tune_malloc_for_bulk_io
from kvstore.pageformat import slot_bytes_for
from kvstore.security import ClientSecurity

NS = "bench/secure"
TOKEN = "bench-token-" + "0" * 24
MODES = ("plain", "metrics", "tokens", "tls+tokens")


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-kib", type=int, default=1024, help="page size in KiB (default 1024)")
    ap.add_argument("--batch", type=int, default=16, help="pages per Put/Get call (default 16)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per run (default 20)")
    ap.add_argument("--runs", type=int, default=5, help="runs per mode; GB/s is the median (default 5)")
    ap.add_argument("--lookups", type=int, default=500, help="timed Lookups per run (default 500)")
    ap.add_argument(
        "--transport", choices=["grpc", "tcp"], default="grpc", help="the plane pages move on (default grpc)"
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 run, 3 calls, 50 lookups")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.iters, args.lookups = 1, 3, 50
    tune_malloc_for_bulk_io()
    if args.page_kib <= 0 or args.page_kib % 8:
        ap.error("--page-kib must be a positive multiple of 8")
    # fp16, 2 kv heads, head dim 64, block 16: 8 KiB per layer, so the layer count sets the page size.
    layout = PageLayout(DType.FLOAT16, num_layers=args.page_kib // 8, num_kv_heads=2, head_dim=64, block_size=16)
    slot = slot_bytes_for(layout.page_bytes)
    page = bytes(range(256)) * (layout.page_bytes // 256)
    t_start = time.perf_counter()
    load = LoadLog()
    with tempfile.TemporaryDirectory(prefix="kvstore-secure-bench-") as tmp:
        pki = make_dev_pki(Path(tmp) / "pki")
        tokens = Path(tmp) / "rw.tokens"
        tokens.write_text(TOKEN + "\n")
        tokens.chmod(0o600)  # a node refuses token files other users can read
        node_args = {
            "plain": [],
            "metrics": ["--metrics-port", "0"],
            "tokens": ["--metrics-port", "0", "--auth-tokens-file", str(tokens)],
            "tls+tokens": ["--metrics-port", "0", "--auth-tokens-file", str(tokens),
                           "--tls-cert", str(pki.node_cert), "--tls-key", str(pki.node_key)],
        }  # fmt: skip
        security = {
            "plain": ClientSecurity(), "metrics": ClientSecurity(), "tokens": ClientSecurity(token=TOKEN),
            "tls+tokens": ClientSecurity(token=TOKEN, ca_file=str(pki.ca)),
        }  # fmt: skip
        nodes = {m: NodeProcess(dram_bytes=(4 * args.batch + 8) * slot, max_page_bytes=layout.page_bytes,
                                node_id=f"bench-{m}", extra_args=node_args[m]).start() for m in MODES}  # fmt: skip
        clients = {m: KVStoreClient(nodes[m].addr, pages_per_call=max(256, args.batch), security=security[m],
                                transport=args.transport)
                   for m in MODES}  # fmt: skip
        put_gbs: dict[str, list[float]] = {m: [] for m in MODES}
        get_gbs: dict[str, list[float]] = {m: [] for m in MODES}
        lookup_s: dict[str, list[float]] = {m: [] for m in MODES}
        try:
            chain = hashes("chain", 64)
            for m in MODES:  # the first blocks of a 64-block chain stay resident for the Lookups
                clients[m].put(NS, layout, chain[: args.batch], [page] * args.batch)
            for run in range(args.runs):
                load.note()
                order = MODES[run % len(MODES) :] + MODES[: run % len(MODES)]
                for m in order:
                    kv = clients[m]
                    t0 = time.perf_counter()
                    for i in range(args.iters):  # fresh hashes every call: real stores, not no-ops
                        hs = hashes(f"put-{run}-{i}", args.batch)
                        kv.put(NS, layout, hs, [page] * args.batch)
                        kv.delete(NS, hs)
                    dt_put = time.perf_counter() - t0
                    put_gbs[m].append(args.iters * args.batch * layout.page_bytes / dt_put / 1e9)
                    resident = hashes(f"get-{run}", args.batch)
                    kv.put(NS, layout, resident, [page] * args.batch)
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        got = kv.get(NS, resident)
                        assert len(got) == args.batch
                    dt_get = time.perf_counter() - t0
                    get_gbs[m].append(args.iters * args.batch * layout.page_bytes / dt_get / 1e9)
                    kv.delete(NS, resident)
                    for _ in range(args.lookups):
                        t0 = time.perf_counter()
                        kv.lookup(NS, chain)
                        lookup_s[m].append(time.perf_counter() - t0)
        finally:
            for c in clients.values():
                c.close()
            for n in nodes.values():
                n.close()
    wall = time.perf_counter() - t_start

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    rows = []
    base_put, base_get = statistics.median(put_gbs["plain"]), statistics.median(get_gbs["plain"])
    for m in MODES:
        p, g = statistics.median(put_gbs[m]), statistics.median(get_gbs[m])
        rows.append({"mode": m, "put_gbs": p, "get_gbs": g, "put_vs_plain": p / base_put, "get_vs_plain": g / base_get,
                     "lookup_p50_ms": pct(lookup_s[m], 0.5) * 1e3, "lookup_p99_ms": pct(lookup_s[m], 0.99) * 1e3})  # fmt: skip
    lines = [
        machine_line(),
        f"- Workload: {args.batch} x {args.page_kib} KiB pages per call, {args.iters} calls x {args.runs} runs "
        f"(median), {args.lookups} Lookups of 64 blocks per run, pages on the {args.transport} plane; wall {wall:.0f} s; "
        f"{load.span()}",
        "",
        "| mode | put GB/s | get GB/s | put vs plain | get vs plain | lookup p50 ms | lookup p99 ms |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['put_gbs']:.2f} | {r['get_gbs']:.2f} | {r['put_vs_plain']:.2f}x | "
                     f"{r['get_vs_plain']:.2f}x | {r['lookup_p50_ms']:.2f} | {r['lookup_p99_ms']:.2f} |")  # fmt: skip
    save_results(args.out, "secure_bench", "\n".join(lines), args, rows=rows, wall_s=wall, load_average=load.samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
