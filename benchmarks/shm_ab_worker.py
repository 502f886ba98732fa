"""One kvstore source tree's same-host zero-copy path, driven by benchmarks/shm_ab.py over stdin/stdout.

Run with PYTHONPATH set to the tree measured: it uses only the public client API and NodeProcess, so any
checkout of this project can be measured by the same script. Speaks benchmarks/peer_driver.py's JSON lines
(setup / get / put / close), and adds each command's CPU seconds of this process (the client) and of its
node, every thread counted (/proc/PID/task/*/schedstat, nanoseconds).

    setup  {"size", "batch"}  a node (DRAM only) and a client (transport="shm"), `batch` resident pages in a
                              SharedBuffer; a fresh node per size
    get    {"iters"}          `iters` get_into calls of the resident pages (timed); verified after the last
    put    {"iters"}          `iters` put_from calls of fresh keys (timed), each call's deleted after it (untimed)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable

import kvstore
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
from kvstore.pageformat import slot_bytes_for

NS = "bench/shm-ab"


def cpu_seconds(pid: int) -> float:
    """CPU seconds of every live thread of `pid` so far."""
    total = 0
    task_dir = f"/proc/{pid}/task"
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return total / 1e9


class Tree:
    def __init__(self) -> None:
        self.node: NodeProcess | None = None
        self.kv: KVStoreClient | None = None
        self.counter = 0
        self.written: list[list[bytes]] = []

    def setup(self, size: int, batch: int) -> None:
        self.close()
        self.size, self.batch = size, batch
        self.layout = PageLayout(DType.FLOAT16, num_layers=size // 8192, num_kv_heads=2, head_dim=64, block_size=16)
        slots = (2 * batch + 8) * slot_bytes_for(size)  # the resident pages, one put's and room to spare
        self.node = NodeProcess(dram_bytes=slots, max_page_bytes=size, node_id="shm-ab").start()
        self.kv = KVStoreClient(self.node.addr, transport="shm")
        self.buf = self.kv.shared_buffer(batch * slot_bytes_for(size))
        self.views = self.buf.pages(size, batch)
        self.value = os.urandom(size)
        for v in self.views:
            v[:] = self.value
        self.resident = [hashlib.sha256(f"resident-{size}-{i}".encode()).digest() for i in range(batch)]
        if self.kv.put_from(NS, self.layout, self.resident, self.views).stored != batch:
            raise RuntimeError("the resident pages were not all stored")

    def timed(
        self, iters: int, call: Callable[[], float], after: Callable[[], None] | None = None
    ) -> dict[str, object]:
        """`iters` calls of `call` (which returns its own timed seconds), `after` once after each, untimed; CPU
        counted around each call only (a put's delete, a gRPC call, is left out of it)."""
        assert self.node is not None and self.node.proc is not None
        node_pid, me = self.node.proc.pid, os.getpid()
        secs, client_cpu, node_cpu = [], 0.0, 0.0
        for _ in range(iters):
            c0, n0 = cpu_seconds(me), cpu_seconds(node_pid)
            secs.append(call())
            client_cpu += cpu_seconds(me) - c0
            node_cpu += cpu_seconds(node_pid) - n0
            if after is not None:
                after()
        return {"secs": sum(secs), "calls": secs, "client_cpu": client_cpu, "node_cpu": node_cpu}

    def get(self, iters: int) -> dict[str, object]:
        kv = self.kv
        assert kv is not None

        def one() -> float:
            t0 = time.perf_counter()
            n = len(kv.get_into(NS, self.resident, self.views))
            spent = time.perf_counter() - t0
            if n != self.batch:
                raise RuntimeError(f"get_into returned {n} of {self.batch} pages")
            return spent

        out = self.timed(iters, one)
        out["verified"] = all(bytes(v) == self.value for v in (self.views[0], self.views[-1]))
        return out

    def put(self, iters: int) -> dict[str, object]:
        kv = self.kv
        assert kv is not None

        def one() -> float:
            self.counter += 1
            hs = [hashlib.sha256(f"put-{self.counter}-{i}".encode()).digest() for i in range(self.batch)]
            t0 = time.perf_counter()
            stored = kv.put_from(NS, self.layout, hs, self.views).stored
            spent = time.perf_counter() - t0
            if stored != self.batch:
                raise RuntimeError(f"put_from stored {stored} of {self.batch} pages")
            self.written.append(hs)
            return spent

        def delete() -> None:
            # NOTE: after each call, so the DRAM tier never fills and evicts the resident pages the gets read
            # (a put on a stored key would be a no-op, so each call writes fresh keys).
            for hs in self.written:
                if kv.delete(NS, hs).deleted != self.batch:
                    raise RuntimeError("a delete after a put missed pages")
            self.written.clear()

        return self.timed(iters, one, delete)

    def close(self) -> None:
        if self.kv is not None:
            self.kv.close()
            self.kv = None
        if self.node is not None:
            self.node.close()
            self.node = None


def main() -> None:
    argparse.ArgumentParser(
        prog="shm_ab_worker.py", description=(__doc__ or "").split("\n\n")[0], epilog="commands: JSON lines on stdin"
    ).parse_args()  # no options: --help says what it is
    out = sys.stdout
    sys.stdout = sys.stderr  # only replies go to the real stdout
    tree = Tree()
    out.write(json.dumps({"ok": True, "pids": [], "kvstore": kvstore.__file__}) + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "setup":
                tree.setup(cmd["size"], cmd["batch"])
                reply: dict[str, object] = {"ok": True}
            elif cmd["cmd"] in ("get", "put"):
                reply = getattr(tree, cmd["cmd"])(cmd["iters"])
            else:
                out.write(json.dumps({"ok": True}) + "\n")
                out.flush()
                return
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        tree.close()


if __name__ == "__main__":
    main()  # NOTE: malloc left as it is: a user's process with the library's defaults
