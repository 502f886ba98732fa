"""Engine doors (DESIGN.md §7.2, §9.1): what KV events cost the node, the SGLang HiCache door's throughput, and the
doors' store accounting.

Part 1, KV events (kvstore/node/kv_events.py). One real node per mode, loopback, DRAM only and full, so every Put
page evicts one (two events per page: a store and a removal). Modes, rotated per run so drift on a shared
machine favours none:
    off      no --kv-events-endpoint (the reference)
    on       events on, one subscriber reading everything
    stuck    events on, one subscriber that connected and never reads (receive buffer of one message)
Figure: Put pages/s (median of --runs runs of --iters calls of --batch pages of --page-kib KiB, gRPC plane), and
the node's own event counters (sent, dropped) after the run.

Part 2, SGLang HiCache door (kvstore/integrations/sglang_hicache.py). A host pool shaped as SGLang 0.5.23's
MHATokenToKVPoolHost `page_first` ([2, tokens, layers, heads, head_dim], bf16), 32 layers x 8 KV heads x 128
(Llama-3.1-8B's), --page-tokens tokens per page (two regions per page: K and V). Per plane: `batch_set_v1` and
`batch_get_v1` of --sgl-batch pages (GB/s of page bytes, median of --runs), beside the client's own
`put_from`/`get_into` of the same regions (what the door adds) and the machine's memcpy of one batch (its limit).
Part 4 (`--only vllm`), vLLM's offloading tier (kvstore/integrations/vllm_offload.py) through vLLM 0.32's own
TieringOffloadingSpec in the engine venv (benchmarks/vllm_tier_driver.py): store (cascade) and load (promotion)
jobs of --sgl-batch chunk rows of each --tier-rows size, beside the tier's own client on the same rows; a row
saying why when the engine venv is missing.
Part 3, the per-page store accounting every door reports by (kvstore/integrations/outcome.py). Fast path (the Put's
counts cover the call): RemoteStore's outcome of a --acct-batch page Put, in process (no I/O: what the accounting
itself costs per call), and RemoteStore.put of --acct-batch x --page-kib KiB pages beside the bare KVStoreClient.put
of the same pages on a roomy node, interleaved (gRPC plane), median ms per call. Slow path: a DRAM-only node that is
full and refuses first sights (`--policy second-sight`); every call stores --acct-batch pages, every other one seen
before (admitted) and the rest new (refused), so half are refused in an alternating pattern, the worst case for
the Lookups that find them: RemoteStore.put (which finds them) beside the bare client's put of the same pattern
(which cannot), and the node's own count of Lookups per call.
Writes benchmarks/out/doors_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import zmq
from machine import LoadLog, machine_line, memcpy_gbs, save_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
from kvstore.pageformat import slot_bytes_for

NS = "bench/events"
MODES = ("off", "on", "stuck")
NODE_START_S = 120.0  # a node has this long to serve: Python starts slowly on a busy machine


def page_keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def events_part(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    layout = PageLayout(DType.UINT8, 1, 1, args.page_kib * 512, 1)
    slots = 2 * args.batch
    dram = slots * slot_bytes_for(layout.page_bytes)
    nodes: dict[str, NodeProcess] = {}
    ctx = zmq.Context()
    subs: list[zmq.Socket] = []
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    counters: dict[str, Any] = {}
    try:
        for mode in MODES:
            extra = [] if mode == "off" else ["--kv-events-endpoint", "tcp://127.0.0.1:0"]
            nodes[mode] = NodeProcess(dram_bytes=dram, max_page_bytes=layout.page_bytes, node_id=f"ev-{mode}",
                                      extra_args=[*extra, "--policy", "lru"]).start(NODE_START_S)  # fmt: skip
        clients = {m: KVStoreClient(n.addr, timeout=60, transport="grpc") for m, n in nodes.items()}
        for mode in ("on", "stuck"):
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            if mode == "stuck":
                s.setsockopt(zmq.RCVHWM, 1)
                s.setsockopt(zmq.RCVBUF, 4096)
            s.connect(clients[mode].stats().kv_events.endpoint)
            s.setsockopt_string(zmq.SUBSCRIBE, "")
            subs.append(s)
        reader = subs[0]
        payload = bytes(layout.page_bytes)
        seq = 0
        for run in range(args.runs):
            order = MODES[run % 3 :] + MODES[: run % 3]
            for mode in order:
                kv = clients[mode]
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    hs = page_keys(f"{mode}-{seq}", args.batch)
                    seq += 1
                    kv.put(NS, layout, hs, [payload] * args.batch, chain=False)
                    if mode == "on":
                        while reader.poll(0):  # the reading subscriber keeps up between calls
                            reader.recv_multipart()
                rates[mode].append(args.iters * args.batch / (time.perf_counter() - t0))
        for mode, kv in clients.items():
            counters[mode] = kv.stats().kv_events
            kv.close()
    finally:
        for s in subs:
            s.close()
        ctx.term()
        for n in nodes.values():
            n.close()
    base = statistics.median(rates["off"])
    lines = ["| mode | Put pages/s (median) | vs off | events sent | dropped |", "|---|--:|--:|--:|--:|"]
    for mode in MODES:
        med = statistics.median(rates[mode])
        c = counters.get(mode)
        sent, dropped = (c.sent_events, c.dropped_events) if c is not None else ("-", "-")
        lines.append(f"| {mode} | {med:,.0f} | {med / base:.2f}x | {sent} | {dropped} |")
    return lines, {"rates": rates, "counters": {m: str(c) for m, c in counters.items()}}


def indices(pages: list[int], page: int) -> Any:
    """SGLang's host_indices: `page` token indices per page."""
    import torch

    return torch.cat([torch.arange(p * page, (p + 1) * page, dtype=torch.int64) for p in pages])


class _Pool:
    """SGLang 0.5.23's MHATokenToKVPoolHost, page_first, Llama-3.1-8B's KV geometry (see the module docstring)."""

    def __init__(self, pages: int, page: int) -> None:
        import torch

        self.layout, self.page_size, self.dtype = "page_first", page, torch.bfloat16
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = 32, 8, 128, 128
        self.size = pages * page
        self.kv_buffer = torch.zeros((2, self.size, 32, 8, 128), dtype=self.dtype)

    def get_page_buffer_meta(self, idx: Any) -> tuple[list[int], list[int]]:
        item, base, ix = 2, self.kv_buffer.data_ptr(), idx.tolist()
        v_off = 32 * self.size * 8 * 128 * item
        ptrs = []
        for i in range(0, len(ix), self.page_size):
            k = base + ix[i] * 32 * 8 * 128 * item
            ptrs += [k, k + v_off]
        return ptrs, [32 * item * self.page_size * 8 * 128] * len(ptrs)

    def get_dummy_flat_data_page(self) -> Any:
        import torch

        return torch.zeros(2 * 32 * self.page_size * 8 * 128, dtype=self.dtype)


def sglang_part(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    import torch

    from kvstore.integrations.sglang_hicache import KVStoreHiCacheStorage, region_hashes

    n = args.sgl_batch
    pool = _Pool(2 * n, args.page_tokens)
    pool.kv_buffer.copy_(torch.randint(-100, 100, pool.kv_buffer.shape, dtype=torch.int16).view(torch.bfloat16))
    page_bytes = 2 * 32 * args.page_tokens * 8 * 128 * 2
    region = page_bytes // 2
    node = NodeProcess(
        dram_bytes=4 * n * (region + 8192) + (64 << 20), max_page_bytes=region, node_id="sgl-bench"
    ).start(NODE_START_S)
    out: dict[str, Any] = {}
    lines = ["| plane | batch_set_v1 GB/s | batch_get_v1 GB/s | client put_from GB/s | client get_into GB/s |",
             "|---|--:|--:|--:|--:|"]  # fmt: skip
    try:
        for plane in ("tcp", "shm"):
            extra = {"backend_name": "kvstore", "interface_v1": 1, "url": f"kvstore://{node.addr}", "transport": plane}
            cfg = SimpleNamespace(extra_config=extra, tp_rank=0, tp_size=1, is_mla_model=False, model_name="bench")
            be = KVStoreHiCacheStorage(cfg, {})
            be.register_mem_pool_host(pool)
            w, r, cw, cr = [], [], [], []
            for run in range(args.runs):
                keys = [hashlib.sha256(f"{plane}-{run}-{i}".encode()).hexdigest() for i in range(n)]
                src, dst = indices(list(range(n)), args.page_tokens), indices(list(range(n, 2 * n)), args.page_tokens)
                t0 = time.perf_counter()
                assert all(be.batch_set_v1(keys, src, SimpleNamespace(prefix_keys=[])))
                w.append(n * page_bytes / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                assert all(be.batch_get_v1(keys, dst))
                r.append(n * page_bytes / (time.perf_counter() - t0) / 1e9)
                # The client alone on the same regions (what the door adds on top of it).
                views = be._region_views(src, n)
                hs = [h for k in keys for h in region_hashes(k + "c", 2)]
                ns, lay = be._segments()
                store = be.store
                t0 = time.perf_counter()
                assert store.put_from(ns, lay, hs, views).ok
                cw.append(n * page_bytes / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                assert len(store.get_into(ns, hs, be._region_views(dst, n))) == len(hs)
                cr.append(n * page_bytes / (time.perf_counter() - t0) / 1e9)
            be.close()
            med = [statistics.median(x) for x in (w, r, cw, cr)]
            out[plane] = {"set": w, "get": r, "client_put": cw, "client_get": cr}
            lines.append(f"| {plane} | " + " | ".join(f"{x:.2f}" for x in med) + " |")
    finally:
        node.close()
    mem = memcpy_gbs(n * page_bytes, 5)
    lines.append(f"| memcpy of one batch ({n * page_bytes >> 20} MiB) | {mem:.2f} | {mem:.2f} | | |")
    out["memcpy_gbs"] = mem
    return lines, out


def accounting_part(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    import timeit

    from kvstore.client import PutResult
    from kvstore.integrations.lmcache_mapping import PluginSettings, Target
    from kvstore.integrations.remote import RemoteStore

    layout = PageLayout(DType.UINT8, 1, 1, args.page_kib * 512, 1)
    n, payload = args.acct_batch, [bytes(layout.page_bytes)] * args.acct_batch
    slot = slot_bytes_for(layout.page_bytes)
    quiet = logging.getLogger("doors_bench.accounting")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    out: dict[str, Any] = {}
    roomy = NodeProcess(dram_bytes=(args.runs * args.iters * 2 + 8) * n * slot, max_page_bytes=layout.page_bytes,
                        node_id="acct-roomy").start(NODE_START_S)  # fmt: skip
    full = NodeProcess(dram_bytes=n * slot, max_page_bytes=layout.page_bytes, node_id="acct-full",
                       extra_args=["--policy", "second-sight"]).start(NODE_START_S)  # fmt: skip
    try:
        door = RemoteStore(PluginSettings(Target(addr=roomy.addr), timeout=60, transport="grpc"), quiet)
        hs0 = page_keys("outcome", n)
        res = PutResult(n, 0)
        per_call = min(timeit.repeat(lambda: door._outcome("bench/acct", hs0, (None, res)), number=10000, repeat=5))
        out["outcome_us"] = per_call / 10000 * 1e6
        bare = KVStoreClient(roomy.addr, timeout=60, transport="grpc")
        ms: dict[str, list[float]] = {"door": [], "bare": []}
        seq = 0
        for run in range(args.runs):
            for who in ("door", "bare") if run % 2 == 0 else ("bare", "door"):
                for _ in range(args.iters):
                    hs = page_keys(f"acct-{seq}", n)
                    seq += 1
                    t0 = time.perf_counter()
                    if who == "door":
                        assert door.put("bench/acct", layout, hs, payload).ok
                    else:
                        assert bare.put("bench/acct", layout, hs, payload).stored == n
                    ms[who].append((time.perf_counter() - t0) * 1e3)
        door.close()
        bare.close()
        fast = {k: statistics.median(v) for k, v in ms.items()}
        out["fast_ms"] = fast

        door = RemoteStore(PluginSettings(Target(addr=full.addr), timeout=60, transport="grpc"), quiet)
        bare = KVStoreClient(full.addr, timeout=60, transport="grpc")
        bare.put("bench/full", layout, page_keys("fill", 2 * n), payload * 2)  # DRAM full (the rest refused)
        slow: dict[str, list[float]] = {"door": [], "bare": []}
        lookups, refused = [], []
        for run in range(args.runs * args.iters):
            for who in ("door", "bare"):
                seen = page_keys(f"seen-{who}-{run}", n // 2)
                assert bare.put("bench/full", layout, seen, payload[: n // 2]).stored == 0  # first sight: refused
                new = page_keys(f"new-{who}-{run}", n // 2)
                mixed = [h for pair in zip(seen, new, strict=True) for h in pair]
                before = bare.stats().lookups
                t0 = time.perf_counter()
                if who == "door":
                    done = door.put("bench/full", layout, mixed, payload)
                    slow[who].append((time.perf_counter() - t0) * 1e3)
                    refused.append(len(done) - done.count)
                    lookups.append(bare.stats().lookups - before)  # Stats counts Lookup RPCs only
                else:
                    bare.put("bench/full", layout, mixed, payload)
                    slow[who].append((time.perf_counter() - t0) * 1e3)
        door.close()
        bare.close()
        slow_med = {k: statistics.median(v) for k, v in slow.items()}
        out.update(slow_ms=slow_med, lookups=lookups, refused=refused)
    finally:
        roomy.close()
        full.close()
    lines = [
        "| path | door (RemoteStore.put) ms | bare client put ms | door - bare | Lookups per call | pages reported failed |",
        "|---|--:|--:|--:|--:|--:|",
        f"| fast: every page stored ({n} pages) | {fast['door']:.2f} | {fast['bare']:.2f} | "
        f"{fast['door'] - fast['bare']:+.2f} | 0 | 0 |",
        f"| slow: every other page refused ({n} pages) | {slow_med['door']:.2f} | {slow_med['bare']:.2f} | "
        f"{slow_med['door'] - slow_med['bare']:+.2f} | {statistics.median(lookups):.0f} | "
        f"{statistics.median(refused):.0f} |",
        "",
        f"- the accounting itself on the fast path (RemoteStore._outcome of a {n}-page Put, in process): "
        f"{out['outcome_us']:.2f} us per call",
    ]  # fmt: skip
    return lines, out


def vllm_part(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """vLLM's offloading tier (kvstore/integrations/vllm_offload.py) through vLLM's own objects, in the engine venv
    (benchmarks/vllm_tier_driver.py); a row saying why when that venv is missing or the driver fails."""
    import subprocess

    from devkit.engines import engine_env, engine_python

    py = engine_python()
    lines = ["| chunk row | plane | store job GB/s | load job GB/s | client put_from GB/s | client get_into GB/s |",
             "|--:|---|--:|--:|--:|--:|"]  # fmt: skip
    if not py.exists():
        return [*lines, f"| skipped: no engine venv at {py} (tools/vllm_venv.sh makes it) | | | | | |"], {}
    largest = max(args.tier_rows)
    node = NodeProcess(dram_bytes=(2 * args.sgl_batch + 4) * slot_bytes_for(largest), max_page_bytes=largest,
                       node_id="vllm-tier-bench").start()  # fmt: skip
    try:
        cmd = [str(py), str(Path(__file__).with_name("vllm_tier_driver.py")), "--url", f"kvstore://{node.addr}",
               "--row-bytes", *map(str, args.tier_rows), "--batch", str(args.sgl_batch), "--rounds", str(args.runs)]  # fmt: skip
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800, env=engine_env())
    finally:
        node.close()
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("TIERRESULT ")]
    if not found:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return [*lines, f"| skipped: the driver failed ({why}) | | | | | |"], {"stderr": proc.stderr[-4000:]}
    res = json.loads(found[-1].removeprefix("TIERRESULT "))
    for r in res["results"]:
        lines.append(f"| {r['row_bytes'] >> 20} MiB | {r['plane']} | {r['store_gbs']:.2f} | {r['load_gbs']:.2f} | "
                     f"{r['client_put_gbs']:.2f} | {r['client_get_gbs']:.2f} |")  # fmt: skip
    return lines, res


def _part(
    name: str,
    head: str,
    run: Callable[[], tuple[list[str], dict[str, Any]]],
    payload: dict[str, Any],
    load: LoadLog,
) -> list[str]:
    """One part's lines: its table, with the load average while it ran; a part that fails (a node that did not
    start in time on a busy machine, a call that timed out) says "skipped" and why, and the others still run."""
    load0 = load.note()
    try:
        lines, payload[name] = run()
    except Exception as exc:
        payload[name] = {"skipped": f"{type(exc).__name__}: {exc}"}
        why = str(exc).splitlines()[0][:300] if str(exc) else ""
        return [head, "", f"skipped: {type(exc).__name__}: {why} (load average {load0:.1f}-{load.note():.1f})", ""]
    return [f"{head}; load average {load0:.1f}-{load.note():.1f}", "", *lines, ""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--page-tokens", type=int, default=16, help="SGLang page size (tokens)")
    ap.add_argument("--sgl-batch", type=int, default=32, help="pages per SGLang batch call")
    ap.add_argument("--acct-batch", type=int, default=32, help="pages per store call in the accounting part")
    ap.add_argument("--tier-rows", type=int, nargs="+", default=[2 << 20, 16 << 20],
                    help="vLLM tier: chunk row bytes (one kvstore page each)")  # fmt: skip
    ap.add_argument("--only", choices=["events", "sglang", "vllm", "accounting"], help="run one part")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = ap.parse_args()
    t0 = time.time()
    load = LoadLog()
    parts: list[str] = [machine_line()]
    payload: dict[str, Any] = {}
    if args.only in (None, "events"):
        head = (
            f"- KV events: Put of {args.batch} x {args.page_kib} KiB pages into a full DRAM tier (every page evicts "
            f"one), {args.iters} calls x {args.runs} runs per mode, gRPC plane"
        )
        parts += _part("events", head, lambda: events_part(args), payload, load)
    if args.only in (None, "sglang"):
        head = (
            f"- SGLang door: page_first pool, 32 layers x 8 KV heads x 128, bf16, {args.page_tokens}-token pages "
            f"({2 * 32 * args.page_tokens * 8 * 128 * 2 >> 10} KiB, 2 regions), {args.sgl_batch} pages per call, "
            f"median of {args.runs}"
        )
        parts += _part("sglang", head, lambda: sglang_part(args), payload, load)
    if args.only in (None, "vllm"):
        head = (
            f"- vLLM offloading tier: store (cascade) and load (promotion) jobs of {args.sgl_batch} chunk rows through "
            f"vLLM 0.32's TieringOffloadingSpec, beside the tier's own client on the same rows, median of {args.runs}"
        )
        parts += _part("vllm", head, lambda: vllm_part(args), payload, load)
    if args.only in (None, "accounting"):
        head = (
            f"- Store accounting (every door): {args.acct_batch} x {args.page_kib} KiB pages per call, gRPC plane, "
            f"median of {args.runs} x {args.iters} calls per path"
        )
        parts += _part("accounting", head, lambda: accounting_part(args), payload, load)
    payload["load_average"] = load.samples
    text = "\n".join([*parts, f"- wall {time.time() - t0:.0f} s; {load.span()}"])
    save_results(args.out, "doors_bench", text, args, **payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
