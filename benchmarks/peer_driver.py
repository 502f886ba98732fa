"""One peer cache's client, driven by benchmarks/peer_bench.py over stdin/stdout (JSON lines).

Runs inside the peers' own venv (LMCache and Mooncake are never installed into kvstore's), started by
peer_bench.py, which sends commands and reads one JSON reply per command:

    {"cmd": "setup", "size": B, "batch": N}   -> {"ok": true}      values of B bytes, N per call
    {"cmd": "put", "iters": K}                 -> {"secs": s}       K batched puts of fresh keys
    {"cmd": "get", "iters": K}                 -> {"secs": s, "verified": bool}
    {"cmd": "close"}                           -> {"ok": true}      and the process exits
The first line, once the peer is up, is {"ok": true, "pids": [...]}: its servers' pids (their CPU time
is counted with this process's).

Peers (each server started here on 127.0.0.1, a free port, and stopped by PID):
    lmcache          `python -m lmcache.v1.server HOST PORT cpu` (LMCache's lm:// server), driven through
                     LMCache's own client stack: LocalCPUBackend + RemoteBackend (remote_serde naive), the
                     path LMCache's StorageManager takes for remote_url=lm://. Its PUT has no reply, so a put
                     phase ends with an EXISTS round trip on the last key (inside the timing).
    mooncake-remote  mooncake_master (built-in HTTP metadata) + the mooncake_client storage process; this
                     process mounts nothing, so every byte crosses Mooncake's TCP transfer engine.
                     Zero-copy batch API: batch_put_from / batch_get_into on registered buffers.
    mooncake-local   the same, but this process mounts the segment itself: Mooncake's same-host path.
Library defaults throughout, as a user would run them. Timing excludes cleanup (Mooncake keys are
removed after each put call, untimed: a put on an existing key is a silent no-op there).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # advertise loopback, not the first NIC
os.environ.setdefault("GLOG_minloglevel", "1")

HOST = "127.0.0.1"
WAIT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {HOST}:{port} after {timeout}s")


class Children:
    """Server processes this driver started; stopped by PID, never by name."""

    def __init__(self, logdir: str) -> None:
        self.logdir = logdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], log: str) -> None:
        with open(os.path.join(self.logdir, log), "ab") as f:
            self.procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))

    def stop(self) -> None:
        """SIGTERM each (newest first), SIGKILL what is still running 5 s later."""
        for p in reversed(self.procs):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if p.poll() is None:
                    p.send_signal(sig)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(5)
        self.procs.clear()


def value(size: int, seed: int) -> bytes:
    return random.Random(seed * 1_000_003 + size).randbytes(size)


class LMCache:
    def __init__(self, children: Children) -> None:
        self.port = free_port()
        children.start([sys.executable, "-m", "lmcache.v1.server", HOST, str(self.port), "cpu"], "lmcache_server.log")
        wait_port(self.port)
        from lmcache.v1.check.utils import EventLoopManager

        self.loop = EventLoopManager()
        self.loop.start()
        self.backend = None

    def setup(self, size: int, batch: int) -> None:
        import torch
        from lmcache.v1.check.utils import create_test_key
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        self.teardown()
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=False, max_local_cpu_size=2.0,
                                                remote_url=f"lm://{HOST}:{self.port}", remote_serde="naive",
                                                save_unfull_chunk=False)  # fmt: skip
        cfg.validate()
        # A chunk of 256 tokens whose uint8 KV is exactly `size` bytes: [2, 1, 256, size/512].
        meta = LMCacheMetadata(model_name="peerbench", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.uint8, kv_shape=(1, 2, 256, 1, size // 512),
                               chunk_size=256)  # fmt: skip
        self.local = LocalCPUBackend(config=cfg, metadata=meta, dst_device="cpu")
        self.backend = RemoteBackend(config=cfg, metadata=meta, loop=self.loop.get_loop(),
                                     local_cpu_backend=self.local, dst_device="cpu")  # fmt: skip
        conn = self.backend.connection
        inner = conn.getWrappedConnector() if hasattr(conn, "getWrappedConnector") else conn
        self.size, self.batch = size, batch
        self.val = value(size, 1)
        src = torch.frombuffer(bytearray(self.val), dtype=torch.uint8)
        self.objs = []
        for _ in range(batch):
            m = self.local.allocate(inner.meta_shapes, inner.meta_dtypes, inner.meta_fmt)
            assert m is not None and m.get_size() == size, (m, size)
            m.ref_count_up()
            m.tensor.view(torch.uint8).view(-1).copy_(src)
            self.objs.append(m)
        self.keys = [create_test_key("peerbench", f"{size}-{i}", kv_dtype=torch.uint8) for i in range(2 * batch)]
        self.resident = self.keys[batch:]
        self._put(self.resident)
        self._barrier(self.resident[-1])

    def _put(self, keys: list) -> None:
        done = threading.Semaphore(0)
        self.backend.batched_submit_put_task(
            keys, self.objs[: len(keys)], on_complete_callback=lambda _k: done.release()
        )
        for _ in keys:
            if not done.acquire(timeout=30):
                raise TimeoutError("LMCache batched put did not complete")

    def _barrier(self, key: object) -> None:
        for _ in range(300):  # bounded: <= 30 s
            if self.backend.contains(key):
                return
            time.sleep(0.1)
        raise TimeoutError("LMCache: the last key was not visible after its put")

    def put(self, iters: int) -> float:
        # The same `batch` keys are overwritten every call (the lm server has no delete).
        t0 = time.perf_counter()
        for _ in range(iters):
            self._put(self.keys[: self.batch])
        self._barrier(self.keys[self.batch - 1])
        return time.perf_counter() - t0

    def get(self, iters: int) -> tuple[float, bool]:
        ok = True
        secs = 0.0
        for i in range(iters):
            t0 = time.perf_counter()
            res = self.backend.batched_get_blocking(self.resident)
            secs += time.perf_counter() - t0
            ok = ok and all(r is not None for r in res)
            if i == 0 and ok:
                ok = all(bytes(r.byte_array) == self.val for r in res)
            for r in res:
                if r is not None:
                    r.ref_count_down()
        return secs, ok

    def teardown(self) -> None:
        if self.backend is None:
            return
        for m in self.objs:
            m.ref_count_down()
            m.ref_count_down()
        self.backend.close()
        if hasattr(self.local, "close"):
            self.local.close()
        self.backend = None

    def close(self) -> None:
        self.teardown()
        self.loop.stop()


class Mooncake:
    SEGMENT_BYTES = 4 << 30
    MAX_BYTES = 16 * (4 << 20)  # one batch of the largest size, per registered buffer

    def __init__(self, children: Children, local: bool) -> None:
        import mooncake
        from mooncake.store import MooncakeDistributedStore

        pkg = os.path.dirname(mooncake.__file__)
        mport, hport, aport = free_port(), free_port(), free_port()
        children.start([os.path.join(pkg, "mooncake_master"), f"--rpc_address={HOST}", f"--rpc_port={mport}",
                        "--enable_http_metadata_server=true", f"--http_metadata_server_host={HOST}",
                        f"--http_metadata_server_port={hport}", f"--metrics_host={HOST}", f"--metrics_port={aport}",
                        "--rpc_thread_num=2"], "mooncake_master.log")  # fmt: skip
        wait_port(mport)
        wait_port(hport)
        meta, master = f"http://{HOST}:{hport}/metadata", f"{HOST}:{mport}"
        if not local:
            cport = free_port()
            children.start([os.path.join(pkg, "mooncake_client"), f"--host={HOST}", "--global_segment_size=4 GB",
                            f"--master_server_address={master}", f"--metadata_server={meta}", f"--port={cport}",
                            "--protocol=tcp"], "mooncake_storage.log")  # fmt: skip
            wait_port(cport)
            time.sleep(1.0)  # it mounts its segment with the master after it listens
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(HOST, meta, self.SEGMENT_BYTES if local else 0, 256 << 20, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        self.wbuf, self.rbuf = mmap.mmap(-1, self.MAX_BYTES), mmap.mmap(-1, self.MAX_BYTES)
        self.waddr = ctypes.addressof(ctypes.c_char.from_buffer(self.wbuf))
        self.raddr = ctypes.addressof(ctypes.c_char.from_buffer(self.rbuf))
        for addr in (self.waddr, self.raddr):
            if self.store.register_buffer(addr, self.MAX_BYTES) != 0:
                raise RuntimeError("Mooncake register_buffer failed")
        self.counter = 0

    def setup(self, size: int, batch: int) -> None:
        self.store.remove_all(True)
        self.size, self.batch = size, batch
        self.val = value(size, 2)
        for j in range(batch):
            self.wbuf[j * size : (j + 1) * size] = self.val
        self.resident = self._keys()
        self._put(self.resident)

    def _keys(self) -> list[str]:
        self.counter += 1
        return [f"pb-{self.size}-{self.counter}-{j}" for j in range(self.batch)]

    def _put(self, keys: list[str]) -> None:
        rcs = self.store.batch_put_from(keys, [self.waddr + j * self.size for j in range(len(keys))],
                                        [self.size] * len(keys))  # fmt: skip
        if any(r != 0 for r in rcs):
            raise RuntimeError(f"Mooncake batch_put_from returned {rcs[:4]}")

    def put(self, iters: int) -> float:
        secs = 0.0
        for _ in range(iters):
            keys = self._keys()
            t0 = time.perf_counter()
            self._put(keys)
            secs += time.perf_counter() - t0
            for k in keys:  # untimed: a put on an existing key would be a no-op
                self.store.remove(k)
        return secs

    def get(self, iters: int) -> tuple[float, bool]:
        n, addrs = self.size, [self.raddr + j * self.size for j in range(self.batch)]
        ok, secs = True, 0.0
        for i in range(iters):
            t0 = time.perf_counter()
            res = self.store.batch_get_into(self.resident, addrs, [n] * self.batch)
            secs += time.perf_counter() - t0
            ok = ok and all(r == n for r in res)
            if i == 0 and ok:
                ok = all(self.rbuf[j * n : (j + 1) * n] == self.val for j in range(self.batch))
        return secs, ok

    def close(self) -> None:
        self.store.remove_all(True)
        for addr in (self.waddr, self.raddr):
            self.store.unregister_buffer(addr)
        self.store.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="peer_driver.py", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("peer", choices=["lmcache", "mooncake-remote", "mooncake-local"], help="which peer's client")
    ap.add_argument("logdir", nargs="?", help="where the peer servers' logs go (default: a new temporary folder)")
    args = ap.parse_args(argv)
    peer = args.peer
    logdir = args.logdir or tempfile.mkdtemp(prefix="peer-driver-")
    children = Children(logdir)
    out = sys.stdout
    sys.stdout = sys.stderr  # libraries print; only replies go to the real stdout
    try:
        client: LMCache | Mooncake = (
            LMCache(children) if peer == "lmcache" else Mooncake(children, peer.endswith("local"))
        )
        out.write(json.dumps({"ok": True, "pids": [p.pid for p in children.procs]}) + "\n")
        out.flush()
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "setup":
                client.setup(cmd["size"], cmd["batch"])
                reply: dict[str, object] = {"ok": True}
            elif cmd["cmd"] == "put":
                reply = {"secs": client.put(cmd["iters"])}
            elif cmd["cmd"] == "get":
                secs, ok = client.get(cmd["iters"])
                reply = {"secs": secs, "verified": ok}
            else:
                client.close()
                out.write(json.dumps({"ok": True}) + "\n")
                out.flush()
                return
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        children.stop()


if __name__ == "__main__":
    main()
