"""Can a tenant time its way to another tenant's cache (DESIGN.md §10; SECURITY.md, round 3, finding 1)? Bob probes prefixes; some alice
cached ("cross": the miss bob gets is on a page alice holds), some nobody did ("cold"). Since the fix the
request path only notes a miss and the cross-tenant check runs later, off the path; this measures what
timing still tells bob, against the noise floor measured in the same run: two disjoint sets of cold
prefixes ("cold" and "cold2"), whose latencies differ by chance alone.

Over a real node (loopback, DRAM only; alice and bob tenants, bob holding a page of the namespace so
his probes run the reader and miss): Lookup latency over gRPC and Get
latency over the TCP plane, the three kinds interleaved at random, `--probes` each. In process (the
TierManager behind bob's TenantView, no RPC): `--micro` lookups of each kind, where nanoseconds show.
Reported: median and p90 per kind, and the cross - cold difference of medians next to cold2 - cold.
Writes benchmarks/out/tenant_oracle_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import tempfile
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
from kvstore.pageformat import slot_bytes_for
from kvstore.security import ClientSecurity
from kvstore.wire import PutOpen

NS = "bench/oracle"
ALICE = "bench-alice-" + "a" * 24
BOB = "bench-bob---" + "b" * 24
LAYOUT = PageLayout(DType.FLOAT16, num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 2 KiB pages
KINDS = ("cross", "cold", "cold2")


def chains(tag: str, n: int, length: int) -> list[list[bytes]]:
    return [[hashlib.sha256(f"{tag}-{c}-{i}".encode()).digest() for i in range(length)] for c in range(n)]


def summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"median_us": statistics.median(s) * 1e6, "p90_us": s[int(0.9 * (len(s) - 1))] * 1e6, "n": len(s)}


def probe_all(
    probe: Callable[[list[bytes]], object], sets: dict[str, list[list[bytes]]], n: int
) -> dict[str, list[float]]:
    """`n` timed probes of each kind, interleaved in a random order (drift favours no kind)."""
    order = [(k, i % len(sets[k])) for k in KINDS for i in range(n)]
    random.Random(7).shuffle(order)
    out: dict[str, list[float]] = {k: [] for k in KINDS}
    for kind, i in order:
        t0 = time.perf_counter()
        probe(sets[kind][i])
        out[kind].append(time.perf_counter() - t0)
    return out


def over_a_node(args: argparse.Namespace, sets: dict[str, list[list[bytes]]]) -> dict[str, dict]:
    d = Path(tempfile.mkdtemp(prefix="oracle-bench-"))
    (d / "rw").write_text(f"{ALICE} alice\n{BOB} bob\n")
    (d / "rw").chmod(0o600)
    page = bytes(LAYOUT.page_bytes)
    node = NodeProcess(dram_bytes=f"{args.dram_mib}MiB", max_page_bytes=LAYOUT.page_bytes, node_id="oracle",
                       extra_args=["--auth-tokens-file", str(d / "rw")]).start()  # fmt: skip
    try:
        with KVStoreClient(node.addr, timeout=30, security=ClientSecurity(token=ALICE)) as alice:
            for c in sets["cross"]:
                alice.put(NS, LAYOUT, c, [page] * len(c))
        results = {}
        with KVStoreClient(node.addr, timeout=30, security=ClientSecurity(token=BOB), transport="grpc") as bob:
            bob.put(NS, LAYOUT, [b"\x01" * 32], [page])  # bob knows NS: his probes run the reader and miss
            probe_all(lambda c: bob.lookup(NS, c), sets, 50)  # warm-up
            results["grpc Lookup"] = probe_all(lambda c: bob.lookup(NS, c), sets, args.probes)
        with KVStoreClient(node.addr, timeout=30, security=ClientSecurity(token=BOB), transport="tcp") as bob:
            probe_all(lambda c: bob.get(NS, c[:1]), sets, 50)
            results["tcp Get"] = probe_all(lambda c: bob.get(NS, c[:1]), sets, args.probes)
        return {k: {kind: summary(v) for kind, v in r.items()} for k, r in results.items()}
    finally:
        node.close()


def in_process(args: argparse.Namespace, sets: dict[str, list[list[bytes]]]) -> dict[str, dict]:
    cfg = NodeConfig(dram_bytes=slot_bytes_for(LAYOUT.page_bytes) * 4096, max_page_bytes=LAYOUT.page_bytes)
    mgr = TierManager(cfg)
    import asyncio

    async def fill() -> None:
        alice = TenantView(mgr, "alice")
        for c in sets["cross"]:
            txn = alice.begin_put(PutOpen(NS, LAYOUT))
            for h in c:
                view = await txn.add_page(h, LAYOUT.page_bytes, 0)
                if view is not None:
                    view[:] = bytes(len(view))
                    view.release()
            await txn.commit()
        bob = TenantView(mgr, "bob")
        txn = bob.begin_put(PutOpen(NS, LAYOUT))
        view = await txn.add_page(b"\x01" * 32, LAYOUT.page_bytes, 0)
        assert view is not None
        view[:] = bytes(len(view))
        view.release()
        await txn.commit()

    asyncio.run(fill())
    bob = TenantView(mgr, "bob")
    probe_all(lambda c: bob.lookup(NS, c), sets, 1000)
    got = probe_all(lambda c: bob.lookup(NS, c), sets, args.micro)
    getattr(mgr.tenants, "settle", lambda: 0)()  # (absent before the fix: the check ran inline)
    return {"in-process TenantView.lookup": {kind: summary(v) for kind, v in got.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probes", type=int, default=2000, help="timed probes of each kind over the node")
    ap.add_argument("--micro", type=int, default=100_000, help="timed in-process lookups of each kind")
    ap.add_argument("--chains", type=int, default=256, help="prefixes of each kind")
    ap.add_argument("--dram-mib", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("out"))
    args = ap.parse_args()
    sets = {k: chains(k, args.chains, 8) for k in KINDS}
    rows = {**over_a_node(args, sets), **in_process(args, sets)}
    lines = [
        "### Cross-tenant timing (DESIGN.md §10)",
        "",
        machine_line(),
        f"- {args.probes} probes of each kind over a node, {args.micro} in process; kinds interleaved at random",
        "",
        "| path | cross median / p90 (us) | cold median / p90 (us) | cold2 median / p90 (us) | cross - cold (us) | noise: cold2 - cold (us) |",
        "|---|---|---|---|---|---|",
    ]
    for path, r in rows.items():
        c, k, k2 = r["cross"], r["cold"], r["cold2"]
        lines.append(
            f"| {path} | {c['median_us']:.2f} / {c['p90_us']:.2f} | {k['median_us']:.2f} / {k['p90_us']:.2f} | "
            f"{k2['median_us']:.2f} / {k2['p90_us']:.2f} | {c['median_us'] - k['median_us']:+.3f} | "
            f"{k2['median_us'] - k['median_us']:+.3f} |"
        )
    save_results(args.out, "tenant_oracle_bench", "\n".join(lines), args, rows=rows)


if __name__ == "__main__":
    main()
