"""LMCache's own client stack storing into kvstore through the plugin, against LMCache's `lm://` server.

Method: one process drives LMCache 0.5.6's remote tier exactly as its storage manager does:
LocalCPUBackend (allocator of the MemoryObj buffers) + RemoteBackend + a connector, remote_serde
naive, chunk_size 256, uint8 chunks of `size` bytes (kv_shape (1, 2, 256, 1, size/512), the shape
the peer scripts in ../shared/peers use). Peers, each on loopback, started here and stopped by PID:

    kvstore          our plugin (remote_storage_plugins) -> a real `kvstore serve` node (DRAM only),
                     plugin defaults: transport "auto" = the shared-memory plane on this host
    kvstore (tcp)    the same with `transport: tcp`: what an engine on another host gets by default (the
                     bulk TCP plane; on this host the benchmark forces it)
    kvstore (grpc)   the same with `transport: grpc`: the fallback plane (a node without the TCP plane)
    lm://            `python -m lmcache.v1.server 127.0.0.1 PORT cpu` (LMCache's own server; a dict
                     in RAM, PUT without a reply) through LMCache's LMCServerConnector

Put: `batched_submit_put_task` of `--batch` chunks, timed until LMCache's completion callback fired
for every key (kvstore: the node acknowledged; lm://: handed to the socket, so each put phase ends
with an EXISTS round trip that the clock includes). Every put is a real write: kvstore gets fresh keys
(a key it holds would be skipped as already present; the node's DRAM evicts the oldest), lm:// cycles
over a bounded key set (it overwrites, and has no eviction). Get: `batched_get_blocking` of `--batch`
resident chunks (one sample per run verified byte for byte). GB/s (10^9) = bytes / wall time of
`--iters` calls; the median of `--runs` runs, peers in rotating order per run. The machine's own
limit in the same run: one memcpy of a batch. Writes benchmarks/out/lmcache_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from machine import (
    machine_line,
    memcpy_gbs,  # the machine's own limit, measured the same way in every benchmark
    save_results,
)

from kvstore.cli.launch import NodeProcess
from kvstore.cli.waits import free_port
from kvstore.pageformat import slot_bytes_for

PEERS = ("kvstore", "kvstore-tcp", "kvstore-grpc", "lm")
LABELS = {"kvstore": "kvstore plugin (auto: shm)", "kvstore-tcp": "kvstore plugin (tcp)",
          "kvstore-grpc": "kvstore plugin (grpc)", "lm": "LMCache lm://"}  # fmt: skip
CHUNK = 256
MiB = 1 << 20


def parse_size(text: str) -> int:
    t = text.strip().lower()
    for suffix, mult in (("mib", MiB), ("kib", 1024)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


class LmServer:
    """LMCache's own server in a child process, stopped by PID."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(self.port), "cpu"],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"lmcache server exited with {self.proc.returncode}; see {log}") from None
                time.sleep(0.1)
        self.stop()
        raise TimeoutError("lmcache server did not listen within 60 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class Stack:
    """LMCache's client stack for one peer and chunk size: LocalCPUBackend + RemoteBackend + connector."""

    def __init__(self, peer: str, size: int, target: str, batch: int) -> None:
        import torch
        from lmcache.v1.check.utils import EventLoopManager
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        common: dict[str, Any] = {"chunk_size": CHUNK, "local_cpu": False, "remote_serde": "naive",
                                  "max_local_cpu_size": (3 * batch + 8) * size / 1e9}  # fmt: skip
        if peer == "lm":
            cfg = LMCacheEngineConfig.from_defaults(remote_url=target, **common)
            plugin = None
        else:
            extra = {"remote_storage_plugin.kvstore.module_path": "kvstore.integrations.lmcache",
                     "remote_storage_plugin.kvstore.class_name": "KVStoreConnectorAdapter",
                     "remote_storage_plugin.kvstore.url": target}  # fmt: skip
            if peer in ("kvstore-grpc", "kvstore-tcp"):
                extra["remote_storage_plugin.kvstore.transport"] = peer.split("-")[1]
            cfg = LMCacheEngineConfig.from_defaults(remote_storage_plugins=["kvstore"], extra_config=extra, **common)
            plugin = "kvstore"
        cfg.validate()
        meta = LMCacheMetadata(model_name=f"bench-{peer}", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.uint8, kv_shape=(1, 2, CHUNK, 1, size // 512),
                               chunk_size=CHUNK)  # fmt: skip
        self.loop = EventLoopManager()
        self.loop.start()
        self.cpu = LocalCPUBackend(config=cfg, metadata=meta, dst_device="cpu")
        self.remote = RemoteBackend(config=cfg, metadata=meta, loop=self.loop.get_loop(), local_cpu_backend=self.cpu,
                                    dst_device="cpu", plugin_name=plugin)  # fmt: skip
        if self.remote.connection is None:
            raise RuntimeError(f"{peer}: LMCache could not connect to {target}")
        conn = self.remote.connection.getWrappedConnector()
        self.objs = []
        for i in range(batch):
            obj = self.cpu.allocate(conn.meta_shapes, conn.meta_dtypes, conn.meta_fmt)
            assert obj is not None and obj.get_size() == size
            obj.byte_array.cast("B")[:] = os.urandom(64) * (size // 64)
            obj.byte_array.cast("B")[:8] = i.to_bytes(8, "little")
            self.objs.append(obj)

    def put(self, keys: list[Any]) -> None:
        done = threading.Semaphore(0)
        self.remote.batched_submit_put_task(
            keys, self.objs[: len(keys)], on_complete_callback=lambda _k: done.release()
        )
        for _ in keys:
            if not done.acquire(timeout=30):
                raise TimeoutError("a batched put did not complete within 30 s")

    def get(self, keys: list[Any], verify: bool) -> int:
        got = self.remote.batched_get_blocking(keys)
        if any(o is None for o in got):
            raise AssertionError(f"{sum(o is None for o in got)} of {len(keys)} resident chunks missing")
        if verify and [bytes(o.byte_array) for o in got] != [bytes(o.byte_array) for o in self.objs[: len(keys)]]:
            raise AssertionError("a chunk came back different from what was put")
        for o in got:
            o.ref_count_down()
        return len(got)

    def close(self) -> None:
        self.remote.close()
        self.loop.stop()
        for o in self.objs:
            o.ref_count_down()
        if hasattr(self.cpu, "close"):
            self.cpu.close()


def keys_for(peer: str, tag: str, n: int) -> list[Any]:
    import torch
    from lmcache.v1.check.utils import create_test_key

    return [create_test_key(f"bench-{peer}", f"{tag}-{i}", kv_dtype=torch.uint8) for i in range(n)]


def run_cell(stack: Stack, peer: str, size: int, run: int, args: argparse.Namespace) -> tuple[float, float]:
    b = args.batch
    moved = args.iters * b * size
    cycle = 4  # lm:// overwrites a bounded key set of 4 batches; kvstore gets fresh keys every call
    batches = [keys_for(peer, f"{size}-{run}-{i if peer != 'lm' else i % cycle}", b) for i in range(args.iters)]
    stack.put(keys_for(peer, f"warm-{size}-{run}", b))  # warm-up (connection, segments, allocator)
    t0 = time.perf_counter()
    for ks in batches:
        stack.put(ks)
    if peer == "lm":  # its PUT has no reply: the phase ends when the server answers for the last key
        deadline = time.monotonic() + 10
        while not stack.remote.contains(batches[-1][-1]) and time.monotonic() < deadline:
            time.sleep(0.001)
    put = moved / (time.perf_counter() - t0) / 1e9
    resident = batches[-1]
    stack.get(resident, verify=True)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        stack.get(resident, verify=False)
    return put, moved / (time.perf_counter() - t0) / 1e9


def bench_size(size: int, args: argparse.Namespace, logs: Path) -> list[dict[str, object]]:
    node = NodeProcess(dram_bytes=max(64 * MiB, (args.batch * (args.iters + 4)) * slot_bytes_for(size)),
                       max_page_bytes=size, node_id=f"bench-lmcache-{size}",
                       log_path=logs / f"lmcache_bench_node_{size}.log").start()  # fmt: skip
    lm = LmServer(logs / f"lmcache_bench_lm_{size}.log")
    stacks: dict[str, Stack] = {}
    res: dict[str, dict[str, list[float]]] = {p: {"put": [], "get": []} for p in PEERS}
    try:
        for peer in PEERS:
            target = f"lm://127.0.0.1:{lm.port}" if peer == "lm" else f"kvstore://{node.addr}"
            stacks[peer] = Stack(peer, size, target, args.batch)
        for run in range(args.runs):
            order = PEERS[run % len(PEERS) :] + PEERS[: run % len(PEERS)]
            for peer in order:
                put, get = run_cell(stacks[peer], peer, size, run, args)
                res[peer]["put"].append(put)
                res[peer]["get"].append(get)
    finally:
        for s in stacks.values():
            s.close()
        lm.stop()
        node.close()
    copy = memcpy_gbs(args.batch * size, 10)
    rows: list[dict[str, object]] = []
    for op in ("put", "get"):
        lm_med = statistics.median(res["lm"][op])
        for peer in PEERS:
            med = statistics.median(res[peer][op])
            rows.append({"size": size, "op": op, "peer": peer, "gbs": med, "vs_lm": med / lm_med,
                         "memcpy_gbs": copy, "runs": res[peer][op]})  # fmt: skip
    return rows


def table(rows: list[dict[str, object]], args: argparse.Namespace, wall: float) -> str:
    """The results entry: machine line, workload line, one markdown row per (chunk size, op, peer)."""
    head = [machine_line(),
            f"- Workload: LMCache 0.5.6 RemoteBackend, batch {args.batch}, {args.iters} calls x {args.runs} runs "
            f"(median), chunk_size {CHUNK}, remote_serde naive; wall {wall:.0f} s", "",
            "| chunk | op | peer | GB/s | vs lm:// | memcpy GB/s (same run) |", "|--:|---|---|--:|--:|--:|"]  # fmt: skip
    body = [f"| {size_label(int(r['size']))} | {r['op']} | {LABELS[str(r['peer'])]} | {r['gbs']:.2f} | "  # type: ignore[call-overload]
            f"{r['vs_lm']:.2f}x | {r['memcpy_gbs']:.1f} |" for r in rows]  # fmt: skip
    return "\n".join(head + body)


def size_label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // 1024} KiB"


OPTIONS: tuple[tuple[str, type, object, str], ...] = (
    ("--sizes", str, "1MiB,4MiB", "chunk sizes (default 1MiB,4MiB); multiples of 512 B"),
    ("--batch", int, 16, "chunks per batched call (default 16)"),
    ("--iters", int, 8, "timed calls per run and phase (default 8)"),
    ("--runs", int, 5, "runs per cell; GB/s is the median (default 5)"),
    ("--out", Path, Path(__file__).resolve().parent / "out", "where lmcache_bench.{json,md} go"),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, kind, default, text in OPTIONS:
        ap.add_argument(flag, type=kind, default=default, help=text)
    ap.add_argument("--quick", action="store_true", help="smoke run: 256KiB only, 1 run, 2 calls")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.runs, args.iters = "256KiB", 1, 2
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if any(s <= 0 or s % 512 for s in sizes):
        ap.error("--sizes: each size must be a positive multiple of 512 bytes")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = [r for s in sizes for r in bench_size(s, args, args.out)]
    wall = time.perf_counter() - t0
    save_results(args.out, "lmcache_bench", table(rows, args, wall), args, rows=rows, wall_s=wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
