"""Benchmark of the Redis prefix-hash index (kvstore/index.py) against a real redis-server on loopback.

Method:
- A private redis-server (no persistence) on a free loopback port. Three publishers (node ids), each
  a real `IndexPublisher` on an asyncio loop, hold chains of 16, 64 and 256 blocks; every chain's
  first half is held by two nodes, so lookups return several holders per block.
- Lookup latency: `IndexReader.lookup` (one EVALSHA) over each chain length, N calls after warmup,
  p50/p99. Round trips are counted at the Redis client's socket send (a counting connection class), so
  "round trips per lookup" is exact, not inferred.
- References in the same run: a naive client-side lookup (one HGETALL per block until the first miss,
  then a pipelined GET of its holders' alive keys: two round trips per block), and a bare PING
  round trip (the floor for any one-round-trip lookup on this machine).
- Update throughput: `IndexPublisher.note()` for M distinct pages, timed until the publisher reports
  all of them flushed (pipelined HSETs in batches).

Writes benchmarks/out/index_bench.{json,md}; prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import redis
from machine import cpu_model

from kvstore.cli.redis_procs import RedisProcess
from kvstore.index import ALIVE_PREFIX, IndexReader, block_key
from kvstore.index.publisher import IndexPublisher
from kvstore.names import TierKind

NS = "bench/index"
CHAINS = (16, 64, 256)


class CountingConnection(redis.Connection):
    """Counts commands (or pipelines) sent: one send = one network round trip for a blocking client."""

    sends = 0

    def send_packed_command(self, command: object, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        super().send_packed_command(command, check_health)


def chain(n: int, tag: str) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


async def populate(url: str, chains: dict[int, list[bytes]]) -> list[IndexPublisher]:
    """Three publishers: n0 holds every chain, n1 the first half of each, n2 nothing (alive only)."""
    holdings = {
        "n0": [(NS, h, TierKind.DRAM) for c in chains.values() for h in c],
        "n1": [(NS, h, TierKind.NVME) for c in chains.values() for h in c[: len(c) // 2]],
        "n2": [],
    }
    pubs = []
    for node, held in holdings.items():
        pub = IndexPublisher(url, node, f"127.0.0.1:{len(pubs) + 1}", lambda held=held: held, lambda: {},
                             ttl_seconds=30.0)  # fmt: skip
        await pub.start()
        pubs.append(pub)
    for _ in range(400):  # bounded: resyncs finish in well under a second here
        if all(p.status().epoch and not p.status().resync_pending for p in pubs):
            break
        await asyncio.sleep(0.01)
    return pubs


def naive_lookup(r: redis.Redis, hashes: list[bytes]) -> int:
    """Client-side walk: per block, HGETALL then the holders' alive keys (pipelined): two round trips each."""
    matched = 0
    for h in hashes:
        fields = r.hgetall(block_key(NS, h))
        if not fields:
            break
        pipe = r.pipeline(transaction=False)
        for node in fields:
            pipe.get(ALIVE_PREFIX.encode() + node)
        epochs = pipe.execute()
        live = any(ep is not None and v.split(b":", 1)[0] == ep for v, ep in zip(fields.values(), epochs, strict=True))
        if not live:
            break
        matched += 1
    return matched


def time_calls(fn, n: int) -> tuple[list[float], float]:  # type: ignore[no-untyped-def]
    """Latencies of n calls and the round trips per call."""
    before = CountingConnection.sends
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return lat, (CountingConnection.sends - before) / n


async def update_throughput(url: str, pages: int) -> dict[str, float]:
    pub = IndexPublisher(url, "writer", "127.0.0.1:9", lambda: [], lambda: {}, ttl_seconds=30.0, batch=2000)
    await pub.start()
    for _ in range(400):
        if pub.status().epoch and not pub.status().resync_pending:
            break
        await asyncio.sleep(0.01)
    hashes = chain(pages, "upd")
    t0 = time.perf_counter()
    for h in hashes:
        pub.note(NS, h, TierKind.DRAM)
    deadline = time.monotonic() + 120
    while pub.status().flushed < pages and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    dt_s = time.perf_counter() - t0
    flushed = pub.status().flushed
    await pub.close()
    return {"pages": pages, "flushed": flushed, "seconds": dt_s, "updates_per_s": flushed / dt_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lookups", type=int, default=500, help="timed lookups per chain length (default 500)")
    ap.add_argument("--updates", type=int, default=100_000, help="pages for the update-throughput run")
    ap.add_argument("--quick", action="store_true", help="smoke run: 20 lookups, 5000 updates")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    n_lookups, n_updates = (20, 5000) if args.quick else (args.lookups, args.updates)
    cpu = cpu_model()
    meta = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu, "cpus": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(), "redis_py": redis.__version__}  # fmt: skip
    rows = []
    with RedisProcess() as server:
        meta["redis_server"] = server.binary
        chains = {n: chain(n, f"c{n}") for n in CHAINS}
        loop = asyncio.new_event_loop()
        pubs = loop.run_until_complete(populate(server.url, chains))
        pool = redis.ConnectionPool.from_url(server.url, connection_class=CountingConnection)
        client = redis.Redis(connection_pool=pool)
        reader = IndexReader(server.url, client=client)
        ping_lat, _ = time_calls(client.ping, n_lookups)
        for n, hashes in chains.items():
            res = reader.lookup(NS, hashes)  # warm up (first call may load the script)
            assert res.matched == n and len(res.holders[0]) == 2, (n, res.matched)
            for _ in range(10):
                reader.lookup(NS, hashes)
            lat, rt = time_calls(lambda hashes=hashes: reader.lookup(NS, hashes), n_lookups)
            nlat, nrt = time_calls(lambda hashes=hashes: naive_lookup(client, hashes), max(5, n_lookups // 10))
            assert naive_lookup(client, hashes) == n
            rows.append({"chain": n, "p50_ms": statistics.median(lat) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
                         "round_trips": rt, "naive_p50_ms": statistics.median(nlat) * 1e3,
                         "naive_round_trips": nrt, "ping_p50_ms": statistics.median(ping_lat) * 1e3})  # fmt: skip
        upd = loop.run_until_complete(update_throughput(server.url, n_updates))
        for p in pubs:
            loop.run_until_complete(p.close())
        loop.close()
        reader.close()
        pool.disconnect()
    lines = [f"- Machine: {meta['date']} | {meta['cpu']}, {meta['cpus']} CPUs | {meta['platform']} | "
             f"python {meta['python']}, redis-py {meta['redis_py']}, {meta['redis_server']}",
             f"- {n_lookups} timed lookups per chain (after warmup), 3 nodes, first half of each chain on 2 nodes; "
             f"naive = HGETALL then a pipelined GET of the holders' alive keys, per block (2 round trips per block); PING p50 {rows[0]['ping_p50_ms']:.3f} ms (round-trip floor)", "",
             "| chain (blocks) | lookup p50 ms | lookup p99 ms | round trips / lookup | naive p50 ms "
             "| naive round trips | p50 vs naive |", "|--:|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['chain']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['round_trips']:.2f} | "
                     f"{r['naive_p50_ms']:.3f} | {r['naive_round_trips']:.0f} | "
                     f"{r['naive_p50_ms'] / r['p50_ms']:.1f}x faster |")  # fmt: skip
    lines += ["", f"Index updates: {upd['flushed']:.0f} of {upd['pages']} placement changes written in "
                  f"{upd['seconds']:.2f} s = **{upd['updates_per_s']:,.0f} updates/s** (pipelined, batches of 2000)"]  # fmt: skip
    md = "\n".join(lines)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "index_bench.md").write_text(md + "\n")
    (args.out / "index_bench.json").write_text(json.dumps({"meta": meta, "lookups": rows, "updates": upd}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
