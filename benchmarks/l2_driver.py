"""One LMCache L2 adapter, built from its `--l2-adapter` JSON the way `lmcache server` builds it, driven
through LMCache's L2 interface (submit, wait on the event fd, pop): store, lookup-and-lock and load of
`--batch` objects per task at each size. Runs in whichever venv holds the adapter (the peers' own venv
for LMCache's built-in adapters; the project's for kvstore's), imports only LMCache, torch and the
standard library itself, and prints one JSON document on stdout.

    python l2_driver.py --spec '{"type": "fs", "base_path": "/tmp/x"}' --sizes 1048576 --batch 16 --rounds 8

Method, per size: objects are slices of one L1-like buffer (as LMCache's own `lmcache bench l2` makes
them) filled with random bytes. One untimed warm-up store + load. Store: `rounds` tasks of fresh keys
(a key already held could be skipped by an adapter), each timed from submit to its completion, then
deleted (untimed) except the last batch, so memory stays bounded; lookup: `rounds` lookup-and-lock tasks
of that batch (all hits), each unlocked after (untimed); load: `rounds` tasks into a second set of
objects, the first verified byte for byte. GB/s = batch x size / seconds (10^9), the median of rounds;
lookup latency p50 / p99 (ms) of the tasks.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import sys
import time
import traceback

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args()
    try:
        out = run(args)
    except Exception as exc:  # the adapter could not even be made: say why, as data
        out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    sys.stdout.write("L2RESULT " + json.dumps(out) + "\n")


def run(args: argparse.Namespace) -> dict:
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
    from lmcache.v1.platform import consume_fd

    parser = add_l2_adapters_args(argparse.ArgumentParser())
    cfg = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", args.spec]))
    adapter = create_l2_adapter(cfg.adapters[0])

    def wait(fd: int, deadline: float) -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            raise TimeoutError("the adapter signalled no completion in time")
        consume_fd(fd)

    def objects(size: int, seed: int | None) -> list:
        buf = torch.empty(args.batch * size, dtype=torch.uint8)
        if seed is not None:
            buf.copy_(
                torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
            )
        out = []
        for i in range(args.batch):
            t = buf[i * size : (i + 1) * size]
            md = MemoryObjMetadata(shape=torch.Size([size]), dtype=torch.uint8, address=i * size, phy_size=size,
                                   fmt=MemoryFormat.KV_2LTD, ref_count=1, shapes=[torch.Size([size])],
                                   dtypes=[torch.uint8])  # fmt: skip
            out.append(TensorMemoryObj(raw_data=t, metadata=md, parent_allocator=None))
        return out

    def keys(tag: str) -> list:
        return [ObjectKey(chunk_hash=f"{tag}-{i}".encode().ljust(16, b"."), model_name="bench/model", kv_rank=0)
                for i in range(args.batch)]  # fmt: skip

    def store(ks: list, objs: list) -> float:
        t0 = time.perf_counter()
        task = adapter.submit_store_task(ks, objs)
        deadline = time.monotonic() + args.timeout
        done: dict = {}
        while task not in done:
            wait(adapter.get_store_event_fd(), deadline)
            done.update(adapter.pop_completed_store_tasks())
        dt = time.perf_counter() - t0
        if not done[task].is_successful():
            raise RuntimeError("a store task failed")
        return dt

    def lookup(ks: list, desc: dict) -> tuple[float, int]:
        t0 = time.perf_counter()
        task = adapter.submit_lookup_and_lock_task(ks, desc)
        deadline = time.monotonic() + args.timeout
        while (bm := adapter.query_lookup_and_lock_result(task)) is None:
            wait(adapter.get_lookup_and_lock_event_fd(), deadline)
        return time.perf_counter() - t0, bm.popcount()

    def load(ks: list, objs: list) -> tuple[float, int]:
        t0 = time.perf_counter()
        task = adapter.submit_load_task(ks, objs)
        deadline = time.monotonic() + args.timeout
        while (bm := adapter.query_load_result(task)) is None:
            wait(adapter.get_load_event_fd(), deadline)
        return time.perf_counter() - t0, bm.popcount()

    results = []
    try:
        for size in args.sizes:
            src, dst = objects(size, seed=size), objects(size, seed=None)
            desc = {0: MemoryLayoutDesc(shapes=[torch.Size([size])], dtypes=[torch.uint8])}
            nbytes = args.batch * size
            warm = keys(f"warm-{size}")
            store(warm, src)
            load(warm, dst)
            adapter.delete(warm)
            puts = []
            for r in range(args.rounds):
                ks = keys(f"s{size}-r{r}")
                puts.append(store(ks, src))
                if r < args.rounds - 1:
                    adapter.delete(ks)
            looks, found = [], []
            for _ in range(args.rounds):
                dt, n = lookup(ks, desc)
                looks.append(dt)
                found.append(n)
                adapter.submit_unlock(ks)
            gets, got = [], []
            for r in range(args.rounds):
                dt, n = load(ks, dst)
                gets.append(dt)
                got.append(n)
                if r == 0:
                    exact = all(bytes(a.byte_array) == bytes(b.byte_array) for a, b in zip(src, dst, strict=True))
            adapter.delete(ks)
            looks_ms = sorted(x * 1e3 for x in looks)
            results.append({
                "size": size, "batch": args.batch, "rounds": args.rounds,
                "store_gbs": nbytes / statistics.median(puts) / 1e9,
                "load_gbs": nbytes / statistics.median(gets) / 1e9,
                "lookup_p50_ms": statistics.median(looks_ms),
                "lookup_p99_ms": looks_ms[min(len(looks_ms) - 1, int(0.99 * len(looks_ms)))],
                "lookup_found": min(found), "load_hits": min(got), "bit_exact": bool(exact),
            })  # fmt: skip
    finally:
        adapter.close()
    return {"results": results}


if __name__ == "__main__":
    main()
