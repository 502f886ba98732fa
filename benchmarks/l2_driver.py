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
from collections.abc import Callable
from typing import Any

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
    ap.add_argument("--registered", action="store_true",
                    help="(info, kvstore only) LMCache's objects in memory registered with the node: the in-place path")  # fmt: skip
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

    spec = json.loads(args.spec)
    if spec.get("type") == "mooncake_py":
        adapter = MooncakePyAdapter(spec)
    else:
        parser = add_l2_adapters_args(argparse.ArgumentParser())
        cfg = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", args.spec]))
        adapter = create_l2_adapter(cfg.adapters[0])

    def wait(fd: int, deadline: float) -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            raise TimeoutError("the adapter signalled no completion in time")
        consume_fd(fd)

    windows: list = []

    def objects(size: int, seed: int | None) -> list:
        if args.registered:  # (info) the objects in memory registered with the adapter's node client: in place
            win = adapter.store._data.shared_buffer(args.batch * size)
            windows.append(win)
            buf = torch.frombuffer(win.view, dtype=torch.uint8)
        else:
            buf = torch.empty(args.batch * size, dtype=torch.uint8)
        if isinstance(adapter, MooncakePyAdapter):
            adapter.register(buf)
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

    def finished(submit: Callable[[], int], query: Callable[[int], Any], fd: int) -> tuple[float, int]:
        """Seconds from submit to the task's bitmap, and how many keys it has set."""
        t0 = time.perf_counter()
        task = submit()
        deadline = time.monotonic() + args.timeout
        while (bm := query(task)) is None:
            wait(fd, deadline)
        return time.perf_counter() - t0, bm.popcount()

    def lookup(ks: list, desc: dict) -> tuple[float, int]:
        return finished(lambda: adapter.submit_lookup_and_lock_task(ks, desc), adapter.query_lookup_and_lock_result,
                        adapter.get_lookup_and_lock_event_fd())  # fmt: skip

    def load(ks: list, objs: list) -> tuple[float, int]:
        return finished(lambda: adapter.submit_load_task(ks, objs), adapter.query_load_result,
                        adapter.get_load_event_fd())  # fmt: skip

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


class MooncakePyAdapter:
    """Mooncake Store behind LMCache's L2 task interface, in Python, for this benchmark only: LMCache's own
    mooncake_store adapter needs its `lmcache_mooncake` extension, which LMCache 0.5.6's wheel does not
    ship. It does what that adapter does with Mooncake's client: zero-copy batch_put_from / batch_get_into
    on registered L1 memory, batch_is_exist for lookups (no lock: Mooncake has no pins), on 4 threads."""

    def __init__(self, spec: dict) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from lmcache.v1.platform import create_event_notifier
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", spec["metadata_server"], 0, 256 << 20, "tcp", "", spec["master"])
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        self.pool = ThreadPoolExecutor(4)
        self.fds = {k: create_event_notifier() for k in ("store", "lookup", "load")}
        self.done: dict[str, dict] = {k: {} for k in self.fds}
        self.next_id = 0
        self.registered: list = []

    def register(self, buf: object) -> None:
        if self.store.register_buffer(buf.data_ptr(), buf.nbytes) != 0:  # type: ignore[attr-defined]
            raise RuntimeError("Mooncake register_buffer failed")
        self.registered.append(buf)

    @staticmethod
    def _key(k: object) -> str:
        return f"{k.model_name}@{k.kv_rank:08x}@{k.object_group_id:x}@{k.chunk_hash.hex()}"  # type: ignore[attr-defined]

    def _submit(self, kind: str, fn: object, *args: object) -> int:
        task, self.next_id = self.next_id, self.next_id + 1

        def run() -> None:
            self.done[kind][task] = fn(*args)  # type: ignore[operator]
            self.fds[kind].notify()

        self.pool.submit(run)
        return task

    def _store(self, keys: list, objs: list) -> object:
        from lmcache.v1.distributed.internal_api import L2StoreResult

        rcs = self.store.batch_put_from([self._key(k) for k in keys], [o.data_ptr for o in objs],
                                        [o.get_size() for o in objs])  # fmt: skip
        return L2StoreResult(all(r == 0 for r in rcs), sum(o.get_size() for o in objs))

    def _bits(self, flags: list) -> object:
        from lmcache.lmcache_native import Bitmap

        bm = Bitmap(len(flags))
        for i, ok in enumerate(flags):
            if ok:
                bm.set(i)
        return bm

    def submit_store_task(self, keys: list, objs: list) -> int:
        return self._submit("store", self._store, keys, objs)

    def pop_completed_store_tasks(self) -> dict:
        done, self.done["store"] = self.done["store"], {}
        return done

    def submit_lookup_and_lock_task(self, keys: list, descs: object) -> int:
        return self._submit(
            "lookup", lambda: self._bits([r == 1 for r in self.store.batch_is_exist([self._key(k) for k in keys])])
        )

    def query_lookup_and_lock_result(self, task: int) -> object:
        return self.done["lookup"].pop(task, None)

    def submit_unlock(self, keys: list) -> None:
        pass

    def submit_load_task(self, keys: list, objs: list) -> int:
        def load() -> object:
            got = self.store.batch_get_into([self._key(k) for k in keys], [o.data_ptr for o in objs],
                                            [o.get_size() for o in objs])  # fmt: skip
            return self._bits([n == o.get_size() for n, o in zip(got, objs, strict=True)])

        return self._submit("load", load)

    def query_load_result(self, task: int) -> object:
        return self.done["load"].pop(task, None)

    def get_store_event_fd(self) -> int:
        return self.fds["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self.fds["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self.fds["load"].fileno()

    def delete(self, keys: list) -> None:
        for k in keys:
            self.store.remove(self._key(k))

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.store.close()


if __name__ == "__main__":
    main()
