"""Benchmark of a cluster whose data is distributed (DESIGN.md §7.3): a hot shared prefix read from several hosts,
a node killed under it, with replication by heat (the default) and without it, in one run.

Method:
- One redis-server and `--nodes` real nodes on loopback, each playing its own host (KVSTORE_HOST_ID=h<i>: a client
  of that "host" reaches its node over the same-host plane, every other node over TCP), all with their defaults
  but the index TTL (`--ttl`, default 10 s: the default) and the DRAM size. Mode `repl` runs them as shipped
  (replication on); mode `off` with `--no-replication` (pages stay where they were put; reads still spread over
  whatever holders exist, and puts still go by room and load).
- The workload of the issue that asked for it: 256 KiB pages; `--convs` conversations, each a shared 64-page
  prefix (the same for all) and 16 private pages. One process per host writes its share of the conversations
  through a `ClusterClient` (the prefix once, by the first writer; every suffix with `parent_chain` = the prefix)
  and then reads its own conversations (prefix + suffix, 80 pages) in a loop, recording per get how many prefix
  and suffix pages came back.
- Timeline: `--warm` s of reads, then `--steady` s measured (bytes each node served to clients, from Stats:
  max/mean across nodes; copy bytes taken by all nodes as a share of the bytes served; prefix hit rate), then
  SIGKILL of the node that served the most, then `--after` s: prefix pages served per prefix page asked for
  (all hosts, the killed node's included: its host's reads go elsewhere), and the time until every prefix page
  has two live holders again (the index polled every 0.2 s; 0 when it never had fewer). Mode `stop` is `repl`
  with SIGSTOP instead of SIGKILL (a hung node, resumed at the end): the slowest get after it (the clients'
  timeout is `--timeout`, 5 s) and the 99th percentile of the gets that started 2 s or more after it.

Targets (DESIGN.md §13): a kill -9 of one node loses <= 5% of hot-prefix hits; served bytes max/mean <= 1.5;
copy traffic <= 10% of served bytes in steady state.

`--quick` (the smoke test's run, about 30 s): 3 nodes, 6 conversations, 64 MiB DRAM, TTL 3 s, 1 s warm-up, 3 s
measured, 4 s after, mode `repl` only; its figures show the run works, not what a cluster sustains.

Run:  .venv/bin/python benchmarks/cluster_bench.py [--quick] [--modes repl,off,stop] [--out-dir DIR]
Writes benchmarks/out/cluster_bench.{json,md} (or DIR's); prints the table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import machine_line, save_results

from kvstore.cli.launch import NodeProcess
from kvstore.cli.redis_procs import RedisProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout

LAYOUT = PageLayout(DType.FLOAT16, num_layers=8, num_kv_heads=8, head_dim=64, block_size=16)  # 256 KiB
NS = "bench/cluster"
PREFIX, SUFFIX = 64, 16


def h(tag: str, i: int) -> bytes:
    return hashlib.sha256(f"{tag}/{i}".encode()).digest()


def prefix_chain() -> list[bytes]:
    return [h("prefix", i) for i in range(PREFIX)]


def suffix_chain(conv: int) -> list[bytes]:
    return [h(f"conv{conv}", i) for i in range(SUFFIX)]


def content(key: bytes) -> bytes:
    return key * (LAYOUT.page_bytes // len(key))


# -- one host: write its conversations, then read them until told to stop


def host_main(args: argparse.Namespace) -> None:
    from kvstore.client.cluster import ClusterClient

    convs = [int(c) for c in args.convs.split(",") if c]
    prefix = prefix_chain()
    records: list[tuple[float, int, int, float]] = []
    errors = 0
    with ClusterClient(args.redis, timeout=args.timeout, seed=int(args.host[1:])) as cc:
        if args.first:
            cc.put(NS, LAYOUT, prefix, [content(k) for k in prefix])
        deadline = time.time() + 60
        while cc.lookup(NS, prefix).matched < PREFIX and time.time() < deadline:
            time.sleep(0.1)
        for c in convs:
            suffix = suffix_chain(c)
            cc.put(NS, LAYOUT, suffix, [content(k) for k in suffix], parent_chain=prefix)
        Path(args.out + ".ready").write_text("1")
        i = 0
        stop = Path(args.out + ".stop")  # NOTE: the run ends `--after` s after the kill, however long setup took
        while time.time() < args.until and convs and not stop.exists():
            chain = prefix + suffix_chain(convs[i % len(convs)])
            i += 1
            started = time.time()
            try:
                got = len(cc.get(NS, chain))
            except Exception:  # the benchmark counts what a caller would see: an error is a miss
                errors += 1
                got = 0
            records.append((started, min(got, PREFIX), max(0, got - PREFIX), time.time() - started))
        local_copies = cc.local_copy_requests
    Path(args.out).write_text(json.dumps({"records": records, "errors": errors, "local_copies": local_copies}))


# -- the run


def node_stats(nodes: dict[str, NodeProcess]) -> dict[str, Any]:
    out = {}
    for name, n in nodes.items():
        if n.proc is None:
            continue
        with KVStoreClient(n.addr, timeout=30) as kv:
            r = kv.stats().replication
        out[name] = {"served": r.served_bytes if r else 0, "copy_in": r.copy_bytes_in if r else 0}
    return out


def live_holders(url: str, dead: str) -> list[int]:
    from kvstore.index import IndexReader

    with IndexReader(url) as idx:
        return [len(set(b) - {dead}) for b in idx.holders(NS, prefix_chain())]


def run_mode(mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    redis_proc = RedisProcess().start()
    nodes: dict[str, NodeProcess] = {}
    hosts: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(args.nodes):
            name = f"n{i}"
            extra = ["--index-ttl", str(args.ttl), *(["--no-replication"] if mode == "off" else [])]
            nodes[name] = NodeProcess(
                dram_bytes=args.dram_mib << 20, max_page_bytes=LAYOUT.page_bytes, node_id=name,
                redis_url=redis_proc.url, extra_args=extra, env={"KVSTORE_HOST_ID": f"h{i}"},
                log_path=work / f"{mode}-{name}.log",
            ).start()  # fmt: skip
        t_start = time.time()
        until = t_start + args.setup + args.warm + args.steady + args.after
        outs = []
        for i in range(args.nodes):
            convs = ",".join(str(c) for c in range(args.convs) if c % args.nodes == i)
            out = work / f"{mode}-h{i}.json"
            outs.append(out)
            cmd = [sys.executable, __file__, "--role", "host", "--host", f"h{i}", "--redis", redis_proc.url,
                   "--convs", convs, "--until", str(until), "--out", str(out), "--timeout", str(args.timeout),
                   *(["--first"] if i == 0 else [])]  # fmt: skip
            hosts.append(subprocess.Popen(cmd, env={**os.environ, "KVSTORE_HOST_ID": f"h{i}"}))
        ready_by = time.time() + args.setup
        while time.time() < ready_by and not all(Path(str(o) + ".ready").exists() for o in outs):
            time.sleep(0.2)
        t_warm = time.time()
        time.sleep(args.warm)
        t1, s1 = time.time(), node_stats(nodes)
        time.sleep(args.steady)
        t2, s2 = time.time(), node_stats(nodes)
        served = {n: s2[n]["served"] - s1[n]["served"] for n in nodes}
        copied = sum(s2[n]["copy_in"] - s1[n]["copy_in"] for n in nodes)
        hottest = max(served, key=lambda n: served[n])
        victim = nodes[hottest]
        if mode == "stop":
            assert victim.proc is not None
            os.kill(victim.proc.pid, signal.SIGSTOP)
        else:
            victim.kill()
        t_kill, load_at_kill = time.time(), os.getloadavg()[0]
        until = min(until, t_kill + args.after)
        two_again: float | None = None
        fewest_after = PREFIX
        while time.time() < until:
            counts = live_holders(redis_proc.url, hottest)
            fewest_after = min(fewest_after, *counts)
            if two_again is None and min(counts) >= 2:
                two_again = time.time() - t_kill
            time.sleep(0.2)
        for o in outs:
            Path(str(o) + ".stop").write_text("1")
        for p in hosts:
            p.wait(timeout=120)
        if mode == "stop" and victim.proc is not None:
            os.kill(victim.proc.pid, signal.SIGCONT)
        records: list[tuple[float, int, int, float]] = []
        errors = local_copies = 0
        for o in outs:
            doc = json.loads(o.read_text())
            records += [tuple(r) for r in doc["records"]]  # type: ignore[misc]
            errors += doc["errors"]
            local_copies += doc["local_copies"]
    finally:
        for p in hosts:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for n in nodes.values():
            if n.proc is not None and n.proc.poll() is None:
                os.kill(n.proc.pid, signal.SIGCONT)  # a node stopped by mode `stop` (harmless for the others)
            n.close()
        redis_proc.close()

    def hit(a: float, b: float) -> tuple[float, int]:
        sel = [r for r in records if a <= r[0] < b]
        return (sum(r[1] for r in sel) / (PREFIX * len(sel)) if sel else 0.0), len(sel)

    steady_hit, steady_gets = hit(t1, t2)
    after_hit, after_gets = hit(t_kill, until)
    after = [r[3] for r in records if r[0] >= t_kill]
    later = sorted(r[3] for r in records if r[0] >= t_kill + 2.0)
    slowest = max([r[3] for r in records if r[0] + r[3] >= t_kill], default=0.0)
    mean = sum(served.values()) / len(served)
    total = sum(served.values())
    return {
        "mode": mode,
        "served_bytes": served,
        "max_over_mean": max(served.values()) / mean if mean else 0.0,
        "copy_share": copied / total if total else 0.0,
        "steady_prefix_hit": steady_hit,
        "steady_gets": steady_gets,
        "killed": hottest,
        "after_prefix_hit": after_hit,
        "after_gets": after_gets,
        "prefix_hits_lost": 1.0 - after_hit / steady_hit if steady_hit else 1.0,
        "seconds_to_two_copies": two_again,
        "fewest_live_copies_after": fewest_after,
        "errors": errors,
        "slowest_get_after": slowest,
        "p99_get_2s_after": later[int(0.99 * (len(later) - 1))] if later else None,
        "gets_after": len(after),
        "local_copy_requests": local_copies,
        "warm_started": t_warm - t_start,
        "load_1m_at_kill": load_at_kill,
    }


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    rows = [
        f"- {args.nodes} nodes (hosts h0..h{args.nodes - 1}) on loopback, {args.convs} conversations (64-page shared "
        f"prefix + 16 private pages, 256 KiB pages), {args.dram_mib} MiB DRAM per node, index TTL {args.ttl:g} s; "
        f"{args.warm:g} s warm-up, {args.steady:g} s measured, {args.after:g} s after SIGKILL of the busiest node.",
        machine_line(),
        "",
        "| mode | served max/mean (target <= 1.5) | copy bytes / served (<= 10%) | prefix hit, steady | prefix hit "
        "after kill -9 (stop: SIGSTOP) | hits lost (<= 5%) | s until 2 live copies | fewest live copies after | "
        "slowest get after | p99 get from 2 s after | errors | load avg (1 min) at the kill |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        two = "never" if r["seconds_to_two_copies"] is None else f"{r['seconds_to_two_copies']:.1f}"
        rows.append(
            f"| {r['mode']} | {r['max_over_mean']:.2f} | {100 * r['copy_share']:.1f}% | "
            f"{100 * r['steady_prefix_hit']:.1f}% ({r['steady_gets']} gets) | {100 * r['after_prefix_hit']:.1f}% "
            f"({r['after_gets']} gets) | {100 * r['prefix_hits_lost']:.1f}% | {two} | {r['fewest_live_copies_after']} | "
            f"{r['slowest_get_after']:.2f} s | "
            + ("-" if r["p99_get_2s_after"] is None else f"{1000 * r['p99_get_2s_after']:.0f} ms")
            + f" | {r['errors']} | {r['load_1m_at_kill']:.1f} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="main", choices=["main", "host"])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--convs", default="32")
    ap.add_argument("--dram-mib", type=int, default=128)
    ap.add_argument("--ttl", type=float, default=10.0)
    ap.add_argument("--setup", type=float, default=60.0, help="seconds the writers get before reads are measured")
    ap.add_argument("--warm", type=float, default=20.0)
    ap.add_argument("--steady", type=float, default=20.0)
    ap.add_argument("--after", type=float, default=25.0)
    ap.add_argument("--modes", default="repl,off,stop")
    ap.add_argument("--timeout", type=float, default=5.0, help="the readers' client timeout (s)")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "out")
    ap.add_argument("--quick", action="store_true", help="smoke run (module docstring): overrides the sizes above")
    # a host process's own arguments
    ap.add_argument("--host")
    ap.add_argument("--redis")
    ap.add_argument("--until", type=float)
    ap.add_argument("--out")
    ap.add_argument("--first", action="store_true")
    args = ap.parse_args()
    if args.role == "host":
        host_main(args)
        return
    args.convs = int(args.convs)
    if args.quick:
        args.nodes, args.convs, args.dram_mib, args.ttl = 3, 6, 64, 3.0
        args.setup, args.warm, args.steady, args.after, args.modes = 30.0, 1.0, 3.0, 4.0, "repl"
    work = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    results = [run_mode(m, args, work) for m in args.modes.split(",")]
    save_results(args.out_dir, "cluster_bench", table(results, args), args, results=results)


if __name__ == "__main__":
    main()
