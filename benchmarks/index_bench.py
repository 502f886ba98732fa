"""Benchmark of the Redis prefix-hash index (kvstore/index/) on one Redis and on a Redis Cluster of 3
masters, all on loopback: what one shard sustains and what the cluster does.

Method:
- Deployments, each fresh: one redis-server; a Redis Cluster of 3 masters (no replicas: a replica
  costs its master CPU for writes only, and this machine has 2 cores); and, as the reference measured
  in the same run, one redis-server holding the layout before this change (v1: one HASH per page,
  node -> "epoch:tier", read by one Lua script that walks the chain and checks each holder's alive key),
  written and read exactly as kvstore did at git 3ca0c07 (the script and keys are copied below).
- Entries are published by real `IndexPublisher`s (v2) on an asyncio loop: n0 holds every chain, n1
  also holds the "2 holders" chains. 64 distinct chains per (length, holders), lookups cycle over them.
- Lookups: `IndexReader.lookup` with its defaults, one client thread, for `--seconds` per cell, of
  chains of 16, 64 and 280 blocks, fully indexed (hit) or never published (cold). Per cell: client
  latency p50/p99, round trips per lookup (counted in the reader: the view of who is alive is re-read
  every 0.5 s, so a little over 1), and **Redis CPU per lookup**: the servers' own CPU time (INFO cpu,
  used_cpu_user + used_cpu_sys, summed over the masters) over the cell, divided by the lookups. Redis
  runs one thread per server, so 1 / (CPU per lookup) is the lookups per second one server core
  sustains; a cluster's masters share the load evenly (a namespace's entries are spread over 32
  slots), so the cluster sustains about masters times that.
- Memory: `--pages` pages published by one node, then the same pages by a second node; the growth of
  used_memory (summed over the masters) per page, for the first holder and for a second one.
- Update throughput: `IndexPublisher.note()` for `--updates` distinct pages, timed until flushed.

Writes benchmarks/out/index_bench.{json,md}; prints the tables.
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
from machine import cpu_model

from kvstore.cli.redis_procs import RedisClusterGroup, RedisProcess
from kvstore.index import IndexReader
from kvstore.index.publisher import IndexPublisher
from kvstore.names import TierKind

NS = "bench/index"
MEM_NS = "bench/index-memory"
CHAINS = (16, 64, 280)
VARIANTS = 64  # distinct chains per (length, holders)

# -- the v1 layout, as kvstore wrote and read it at git 3ca0c07 (the reference)

V1_PREFIX = "kvs:v1:"
V1_LOOKUP = """
local alive_prefix = ARGV[1]
local epochs = {}
local out = {}
for i = 1, #KEYS do
  local fields = redis.call('HGETALL', KEYS[i])
  local holders = {}
  for j = 1, #fields, 2 do
    local node = fields[j]
    local ep = epochs[node]
    if ep == nil then
      ep = redis.call('GET', alive_prefix .. node) or false
      epochs[node] = ep
    end
    if ep then
      local sep = string.find(fields[j + 1], ':', 1, true)
      if sep and string.sub(fields[j + 1], 1, sep - 1) == ep then
        holders[#holders + 1] = node
        holders[#holders + 1] = string.sub(fields[j + 1], sep + 1)
      end
    end
  end
  if #holders == 0 then break end
  out[#out + 1] = holders
end
return out
"""


def v1_key(namespace: str, h: bytes) -> str:
    return f"{V1_PREFIX}b:{hashlib.sha256(namespace.encode()).hexdigest()[:16]}:{h.hex()}"


class V1Index:
    """The v1 index on one Redis: HSET per (page, node) to write, one EVALSHA per lookup to read."""

    def __init__(self, url: str) -> None:
        self.r = redis.Redis.from_url(url, socket_timeout=10)
        self.script = self.r.register_script(V1_LOOKUP)
        self.trips = 0

    def publish(self, node: str, namespace: str, hashes: Sequence[bytes]) -> None:
        self.r.set(f"{V1_PREFIX}alive:{node}", "1")
        for start in range(0, len(hashes), 2000):
            pipe = self.r.pipeline(transaction=False)
            for h in hashes[start : start + 2000]:
                pipe.hset(v1_key(namespace, h), node, f"1:{int(TierKind.DRAM)}")
            pipe.execute()

    def lookup(self, namespace: str, hashes: Sequence[bytes]) -> int:
        self.trips += 1
        return len(self.script(keys=[v1_key(namespace, h) for h in hashes], args=[f"{V1_PREFIX}alive:"]))


class CountingReader(IndexReader):
    """An IndexReader that counts its round trips (each `_round_trip` writes every request before it
    reads any reply: one round trip to one Redis, or to every master it needs at once)."""

    trips = 0

    def _round_trip(self, commands: list[tuple[str, ...]]) -> list[Any]:
        self.trips += 1
        return super()._round_trip(commands)


# -- servers


def server_cpu(servers: Sequence[RedisProcess]) -> float:
    """CPU seconds the servers have used so far (their own account: INFO cpu)."""
    total = 0.0
    for s in servers:
        with redis.Redis(s.host, s.port, username="default", password=s.password, socket_timeout=10) as c:
            info = c.info("cpu")
        total += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return total


def used_memory(servers: Sequence[RedisProcess]) -> int:
    total = 0
    for s in servers:
        with redis.Redis(s.host, s.port, username="default", password=s.password, socket_timeout=10) as c:
            total += int(c.info("memory")["used_memory"])
    return total


@contextmanager
def deployment(kind: str) -> Iterator[tuple[str, list[RedisProcess]]]:
    """(admin URL, the servers that hold data) of a fresh deployment of `kind`."""
    if kind == "cluster":
        group = RedisClusterGroup("bench-" + "p" * 20, masters=3, replicas=0, node_timeout_ms=5000).start()
        try:
            yield group.url, group.masters
        finally:
            group.close()
    else:
        server = RedisProcess(password="bench-" + "p" * 20).start()
        try:
            yield server.url, [server]
        finally:
            server.close()


def chain(n: int, tag: str) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


# -- measurements


async def publish(url: str, holdings: dict[str, list[tuple[str, bytes, TierKind]]]) -> list[IndexPublisher]:
    """One IndexPublisher per node id, each holding its list; returned once all are registered."""
    pubs = []
    for node, held in holdings.items():
        pub = IndexPublisher(url, node, f"127.0.0.1:{len(pubs) + 1}", lambda held=held: held, lambda: {},
                             ttl_seconds=600.0)  # fmt: skip
        await pub.start()
        pubs.append(pub)
    for pub in pubs:
        assert await pub.wait_registered(600), pub.status()
    return pubs


def measure(
    fn: Callable[[list[bytes]], int],
    chains: list[list[bytes]],
    expect: int,
    seconds: float,
    servers: Sequence[RedisProcess],
    trips: Callable[[], int],
) -> dict[str, float]:
    """Lookups of `chains` in turn for `seconds`: latency, round trips and Redis CPU per lookup."""
    for c in chains[:8]:  # warm up (connections, the view of who is alive)
        assert fn(c) == expect, (fn(c), expect)
    lat: list[float] = []
    t0_trips, cpu0 = trips(), server_cpu(servers)
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        c = chains[i % len(chains)]
        t0 = time.perf_counter()
        got = fn(c)
        lat.append(time.perf_counter() - t0)
        assert got == expect, (got, expect)
        i += 1
    cpu = server_cpu(servers) - cpu0
    n = len(lat)
    return {"lookups": n, "p50_ms": statistics.median(lat) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
            "round_trips": (trips() - t0_trips) / n, "redis_cpu_us": cpu / n * 1e6,
            "lookups_per_redis_core": n / cpu if cpu > 0 else float("inf")}  # fmt: skip


async def update_throughput(url: str, pages: int, servers: Sequence[RedisProcess]) -> dict[str, float]:
    pub = IndexPublisher(url, "writer", "127.0.0.1:9", lambda: [], lambda: {}, ttl_seconds=600.0, batch=2000)
    await pub.start()
    assert await pub.wait_registered(60)
    hashes = chain(pages, "upd")
    cpu0 = server_cpu(servers)
    t0 = time.perf_counter()
    for h in hashes:
        pub.note(NS, h, TierKind.DRAM)
    deadline = time.monotonic() + 300
    while pub.status().flushed < pages and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    dt_s = time.perf_counter() - t0
    cpu = server_cpu(servers) - cpu0
    flushed = pub.status().flushed
    await pub.close()
    return {"pages": pages, "flushed": flushed, "seconds": dt_s, "updates_per_s": flushed / dt_s,
            "redis_cpu_us_per_update": cpu / max(1, flushed) * 1e6}  # fmt: skip


def run_v2(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": kind, "cells": []}
    loop = asyncio.new_event_loop()
    with deployment(kind) as (url, servers):
        # Memory: one holder, then a second one, of the same pages (a namespace of their own).
        mem_pages = [(MEM_NS, h, TierKind.DRAM) for h in chain(args.pages, "mem")]
        base = used_memory(servers)
        pubs = loop.run_until_complete(publish(url, {"m0": mem_pages}))
        one = used_memory(servers)
        pubs += loop.run_until_complete(publish(url, {"m1": mem_pages}))
        two = used_memory(servers)
        out["memory"] = {"pages": args.pages, "bytes_per_page": (one - base) / args.pages,
                         "bytes_per_second_holder": (two - one) / args.pages}  # fmt: skip
        chains = {(n, k): [chain(n, f"c{n}-{k}-{v}") for v in range(VARIANTS)] for n in CHAINS for k in (1, 2)}
        held0 = [(NS, h, TierKind.DRAM) for cs in chains.values() for c in cs for h in c]
        held1 = [(NS, h, TierKind.NVME) for (_, k), cs in chains.items() if k == 2 for c in cs for h in c]
        pubs += loop.run_until_complete(publish(url, {"n0": held0, "n1": held1}))
        reader = CountingReader(url)
        for (n, k), cs in chains.items():
            cell = measure(lambda c: reader.lookup(NS, c).matched, cs, n, args.seconds, servers,
                           lambda: reader.trips)  # fmt: skip
            out["cells"].append({"chain": n, "holders": k, "hit": True, **cell})
        for n in CHAINS:
            cold = [chain(n, f"cold{n}-{v}") for v in range(VARIANTS)]
            cell = measure(lambda c: reader.lookup(NS, c).matched, cold, 0, args.seconds / 2, servers,
                           lambda: reader.trips)  # fmt: skip
            out["cells"].append({"chain": n, "holders": 0, "hit": False, **cell})
        reader.close()
        out["updates"] = loop.run_until_complete(update_throughput(url, args.updates, servers))
        for p in pubs:
            loop.run_until_complete(p.close(deregister=False))
    loop.close()
    out["masters"] = len(servers)
    return out


def run_v1(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": "v1 (reference)", "cells": []}
    with deployment("one") as (url, servers):
        v1 = V1Index(url)
        upd = chain(args.updates, "upd")
        cpu0, t0 = server_cpu(servers), time.perf_counter()
        v1.publish("writer", NS, upd)
        dt_s, cpu = time.perf_counter() - t0, server_cpu(servers) - cpu0
        out["updates"] = {"pages": args.updates, "flushed": args.updates, "seconds": dt_s,
                          "updates_per_s": args.updates / dt_s, "redis_cpu_us_per_update": cpu / args.updates * 1e6}  # fmt: skip
        mem = chain(args.pages, "mem")
        base = used_memory(servers)
        v1.publish("m0", MEM_NS, mem)
        one = used_memory(servers)
        v1.publish("m1", MEM_NS, mem)
        two = used_memory(servers)
        out["memory"] = {"pages": args.pages, "bytes_per_page": (one - base) / args.pages,
                         "bytes_per_second_holder": (two - one) / args.pages}  # fmt: skip
        chains = {(n, k): [chain(n, f"c{n}-{k}-{v}") for v in range(VARIANTS)] for n in CHAINS for k in (1, 2)}
        for (_, k), cs in chains.items():
            for c in cs:
                v1.publish("n0", NS, c)
                if k == 2:
                    v1.publish("n1", NS, c)
        for (n, k), cs in chains.items():
            cell = measure(lambda c: v1.lookup(NS, c), cs, n, args.seconds, servers, lambda: v1.trips)
            out["cells"].append({"chain": n, "holders": k, "hit": True, **cell})
        for n in CHAINS:
            cold = [chain(n, f"cold{n}-{v}") for v in range(VARIANTS)]
            cell = measure(lambda c: v1.lookup(NS, c), cold, 0, args.seconds / 2, servers, lambda: v1.trips)
            out["cells"].append({"chain": n, "holders": 0, "hit": False, **cell})
        v1.r.close()
    out["masters"] = 1
    return out


def report(runs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"- Machine: {meta['date']} | {meta['cpu']}, {meta['cpus']} CPUs | {meta['platform']} | python "
        f"{meta['python']}, redis-py {meta['redis_py']}, {meta['redis_version']} | load average before "
        f"{meta['load_before']}",
        f"- {meta['seconds']} s of lookups per cell (half that for cold ones), one client thread, {VARIANTS} "
        "distinct chains per cell; Redis CPU = the servers' own CPU time (INFO cpu) per lookup, summed over "
        "the masters; lookups/s per Redis core = 1 / that",
        "",
        "| index | chain | holders | Redis CPU µs / lookup | lookups/s per Redis core | whole index, lookups/s "
        "(cores × that) | p50 ms | p99 ms | round trips / lookup |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for run in runs:
        for c in run["cells"]:
            holders = str(c["holders"]) if c["hit"] else "cold (0)"
            lines.append(
                f"| {run['kind']} | {c['chain']} | {holders} | {c['redis_cpu_us']:.0f} | "
                f"{c['lookups_per_redis_core']:,.0f} | {c['lookups_per_redis_core'] * run['masters']:,.0f} | "
                f"{c['p50_ms']:.3f} | {c['p99_ms']:.3f} | {c['round_trips']:.3f} |"
            )
    lines += ["", "| index | Redis memory per indexed page (1 holder) | per second holder | pages | index "
              "updates/s (one node) | Redis CPU µs / update |", "|---|--:|--:|--:|--:|--:|"]  # fmt: skip
    for run in runs:
        m, u = run["memory"], run["updates"]
        lines.append(f"| {run['kind']} | {m['bytes_per_page']:.0f} B | {m['bytes_per_second_holder']:.0f} B | "
                     f"{m['pages']:,} | {u['updates_per_s']:,.0f} | {u['redis_cpu_us_per_update']:.1f} |")  # fmt: skip
    lines.append("")
    lines.append(
        "Updates: v2 through `IndexPublisher.note()` until flushed (one script call per stripe and batch); "
        "v1 as its publisher wrote them (pipelined HSETs, batches of 2000), without the publisher's queue."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds of lookups per cell (default 3)")
    ap.add_argument("--pages", type=int, default=100_000, help="pages published for the memory figure")
    ap.add_argument("--updates", type=int, default=100_000, help="pages for the update-throughput run")
    ap.add_argument("--quick", action="store_true", help="smoke run: 0.2 s per cell, 5000 pages and updates")
    ap.add_argument("--no-v1", action="store_true", help="skip the v1 reference")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.pages, args.updates = 0.2, 5000, 5000
    with RedisProcess() as probe, redis.Redis(probe.host, probe.port) as c:
        version = f"redis-server {c.info('server')['redis_version']}"
    meta = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_model(),
            "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "redis_py": redis.__version__, "redis_version": version, "seconds": args.seconds,
            "load_before": " ".join(f"{x:.1f}" for x in os.getloadavg())}  # fmt: skip
    runs = [
        run_v2("one Redis", args) | {"kind": "v2, one Redis"},
        run_v2("cluster", args) | {"kind": "v2, Redis Cluster of 3"},
    ]
    if not args.no_v1:
        runs.append(run_v1(args))
    meta["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    md = report(runs, meta)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "index_bench.md").write_text(md + "\n")
    (args.out / "index_bench.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
