"""kvstore's data planes beside LMCache and Mooncake Store, memcpy and raw sockets, in one run.

Method. Per page size (default 256 KiB, 1 MiB, 4 MiB) and per system: batched put and get of `--batch`
pages per call (default 16); a phase is `iters` calls moving about `--phase-mib` MiB; GB/s (10^9 B/s)
is the median of `--runs` runs. Every run visits every system, in an order rotated per run, so drift
on a shared machine is spread over all of them; compare ratios within this run, not across runs.
Put keys are fresh per call (removed after, untimed); get reads `--batch` resident pages and checks
their bytes on the first call of each run (kvstore's clients also verify every page's XXH3).

Systems:
    memcpy          bytearray copy of the same bytes (the machine's own limit for one core)
    raw TCP         store_bench's reference: a server process, one TCP_NODELAY connection, reused buffers,
                    no framing or checksums (put = send to the server, get = receive from it)
    (info) raw TLS  the raw-TCP baseline over TLS (Python's ssl at both ends, OP_ENABLE_KTLS as the plane sets it):
                    what TLS costs a Python process at best; the TLS plane's floor, not a target
    (info) raw floor  the same connection moving `--batch` different pages each side, each after a 57-byte
                    header, hashed (XXH3) by sender and receiver as kvstore's planes do: what a framed, verified
                    plane costs at best in Python; not a target, it splits the gap to raw TCP in two
    kvstore gRPC    transport="grpc": Put/Get streams (the fallback plane)
    kvstore TCP     transport="tcp": the bulk TCP plane (remote clients' default); "get_into" receives
                    into caller buffers; "TLS" is the same plane with the node's certificate (TLS cost);
                    "(info) verify=False" is not a default: it shows what the client's XXH3 costs
    kvstore shm     transport="shm": the same-host shared-memory plane
    kvstore zero-copy  transport="shm" with `put_from`/`get_into` on pages in the client's `shared_buffer`:
                    the node copies each page once, between its slot and the caller's memory
    kvstore UCX     transport="ucx" (the node started with --ucx; UCX over TCP on `lo` here, as
                    UCX_NET_DEVICES=lo; on RDMA hosts UCX picks verbs): measured when ucxx is installed
    LMCache lm://   LMCache's own client stack against its lm:// server (remote)
    Mooncake remote Mooncake Store's zero-copy batch API over its TCP transfer engine, storage in another
                    process; "same host": the client mounts the segment itself (Mooncake's local path)
Every table carries the machine's 1-minute load average over the run; a system that could not be started or
measured is a "skipped: why" row, and the run goes on. `--only` picks systems by words of their labels.
kvstore is measured with library defaults (the client options a user gets without asking; this
process leaves glibc's malloc as it is, unlike the node, which tunes its own at start).

The peers live in a venv of their own (`--peers-venv`, default benchmarks/.peers-venv, gitignored),
created on first use (about 2 minutes from the pip cache) and driven by benchmarks/peer_driver.py in
subprocesses; `--no-peers` skips them. Writes benchmarks/out/peer_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from machine import LoadLog, machine_line, save_results
from store_bench import TcpClient, TcpServer, source_digest

from devkit.pki import DevPki, make_dev_pki
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.client import core as client_core
from kvstore.config import parse_size
from kvstore.layout import DType, PageLayout
from kvstore.pageformat import slot_bytes_for
from kvstore.security import ClientSecurity
from kvstore.wire.ucx import ucxx_installed

HERE = Path(__file__).resolve().parent
ZERO_COPY = "kvstore zero-copy (same host, put_from/get_into)"
NS = "bench/peers"
PEERS = {"lmcache": "LMCache lm://", "mooncake-remote": "Mooncake remote (zero-copy batch)",
         "mooncake-local": "Mooncake same host (zero-copy batch)"}  # fmt: skip
PEER_PACKAGES = [["torch==2.13.0"], ["mooncake-transfer-engine-non-cuda==0.3.13.post1"],
                 ["-c", "{constraints}", "lmcache==0.5.6", "hiredis"]]  # fmt: skip
PEER_DEBS = ["libibverbs1", "librdmacm1", "libnuma1"]  # Mooncake's wheel links them
REPLY_TIMEOUT_S = 600.0  # a peer driver silent this long is stopped and skipped (--reply-timeout)
NODE_START_S = 120.0  # a node has this long to serve (a busy machine starts Python slowly); tried twice


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def layout_for(size: int) -> PageLayout:
    # fp16, 2 kv heads, head dim 64, block 16: 8 KiB per layer, so the layer count sets the page size.
    return PageLayout(DType.FLOAT16, num_layers=size // 8192, num_kv_heads=2, head_dim=64, block_size=16)


class System:
    """One thing measured: `setup(size)` once per size, then put/get phases returning seconds."""

    label = ""

    def pids(self) -> list[int]:
        """The processes doing this system's work (client and servers): their CPU time is counted."""
        return [os.getpid()]

    def setup(self, size: int, batch: int) -> None: ...

    def put(self, iters: int) -> float:
        raise NotImplementedError

    def get(self, iters: int) -> tuple[float, bool]:
        raise NotImplementedError

    def close(self) -> None: ...


class Memcpy(System):
    label = "memcpy (same bytes, one core)"

    def setup(self, size: int, batch: int) -> None:
        self.src, self.dst = bytearray(os.urandom(size * batch)), bytearray(size * batch)

    def put(self, iters: int) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            self.dst[:] = self.src
        return time.perf_counter() - t0

    def get(self, iters: int) -> tuple[float, bool]:
        return self.put(iters), self.dst == self.src


class RawTcp(System):
    label = "raw TCP socket (no framing, no checksum)"

    def __init__(self, notes: list[str]) -> None:
        self.notes = notes
        self.server = self._server()
        self.client = self._client()

    def _server(self) -> TcpServer:
        return TcpServer().start()

    def _client(self) -> TcpClient:
        return TcpClient(self.server.port)

    def pids(self) -> list[int]:
        return [os.getpid(), self.server.proc.pid]  # type: ignore[list-item]

    def setup(self, size: int, batch: int) -> None:
        self.page, self.into, self.batch = memoryview(os.urandom(size)), memoryview(bytearray(size)), batch

    def _again(self, fn: Callable[[], None], iters: int) -> float:
        """`iters` calls of `fn`, timed; once more on a fresh connection (and a fresh server if it died)
        when one fails: on a busy machine the baseline's server can time out while the other systems run."""
        for attempt in range(2):
            try:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                return time.perf_counter() - t0
            except OSError as exc:
                if attempt:
                    raise
                self.notes.append(
                    f"{self.label}: a phase broke off ({type(exc).__name__}: {exc}); reconnected and measured again"
                )
                self._reconnect()
        raise AssertionError("unreachable")

    def _reconnect(self) -> None:
        with contextlib.suppress(OSError):
            self.client.close()
        if not self.server.proc.is_alive():
            self.server.stop()
            self.server = self._server()
        self.client = self._client()

    def put(self, iters: int) -> float:
        return self._again(lambda: self.client.send(self.page, self.batch), iters)

    def get(self, iters: int) -> tuple[float, bool]:
        return self._again(lambda: self.client.recv(self.into, self.batch), iters), True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.client.close(quit_server=True)
        self.server.stop()


class RawFramed(RawTcp):
    """What a framed, verified plane costs at best in Python: raw TCP moving `batch` different pages each way (into
    and out of pages of their own, as a node's slots and a client's buffers are), each after a 57-byte header, the
    receiver hashing each page as it lands and the sender hashing before it sends (as kvstore's client and node
    do). Not a target: it shows how much of the gap to raw TCP is memory and checksums, and how much is kvstore."""

    label = "(info) raw TCP, different pages each side, frame headers, XXH3 (a verified plane's floor)"

    def setup(self, size: int, batch: int) -> None:
        self.pages = [memoryview(os.urandom(size)) for _ in range(batch)]
        self.buffers = [memoryview(bytearray(size)) for _ in range(batch)]

    def put(self, iters: int) -> float:
        return self._again(lambda: self.client.send_framed(self.pages), iters)

    def get(self, iters: int) -> tuple[float, bool]:
        return self._again(lambda: self.client.recv_framed(self.buffers) and None, iters), True


class RawTls(RawTcp):
    """The raw-TCP baseline over TLS: Python's ssl (OpenSSL) at both ends, the same pages and calls as raw TCP (a
    TLS socket's sendall and recv_into; OP_ENABLE_KTLS set, so OpenSSL hands the records to the kernel where it
    has kTLS). Not a target: what TLS costs a Python process at best, beside what it costs the TCP plane."""

    label = "(info) raw TLS socket (Python's ssl, no framing, no checksum)"
    pki: DevPki | None = None  # set before the first one is made (main)

    def _server(self) -> TcpServer:
        assert self.pki is not None, "RawTls.pki is set first"
        return TcpServer(tls=(str(self.pki.node_cert), str(self.pki.node_key))).start()

    def _client(self) -> TcpClient:
        assert self.pki is not None, "RawTls.pki is set first"
        return TcpClient(self.server.port, tls_ca=str(self.pki.ca))


class Skipped(System):
    """A system that could not be started: reported as skipped, with why."""

    def __init__(self, label: str, reason: str) -> None:
        self.label, self.reason = label, reason

    def setup(self, size: int, batch: int) -> None:
        raise RuntimeError(self.reason)


def raw_tcp(notes: list[str], kind: type[RawTcp] = RawTcp) -> System:
    """A raw-TCP baseline, its server started twice if need be (spawning Python is slow on a busy machine)."""
    for attempt in range(2):
        try:
            return kind(notes)
        except (OSError, EOFError) as exc:  # TimeoutError included: the server did not report its port
            if attempt:
                return Skipped(kind.label, f"its server did not start ({exc})")
    raise AssertionError("unreachable")


class Ours(System):
    """A kvstore client on one plane, against a node started per page size."""

    def __init__(self, label: str, transport: str, node: Callable[[], NodeProcess],
                 security: ClientSecurity | None = None, into: bool = False, verify: bool = True,
                 zero_copy: bool = False) -> None:  # fmt: skip
        self.label, self.transport, self.node, self.security, self.into = label, transport, node, security, into
        self.verify = verify
        self.zero_copy = zero_copy  # put_from / get_into on views of a shared_buffer (same host)
        self.kv: KVStoreClient | None = None
        self.runs = 0

    def pids(self) -> list[int]:
        proc = self.node().proc
        return [os.getpid(), *([proc.pid] if proc is not None else [])]

    def setup(self, size: int, batch: int) -> None:
        self.close()
        self.kv = KVStoreClient(self.node().addr, transport=self.transport, security=self.security or ClientSecurity(),
                                verify=self.verify)  # fmt: skip
        self.layout, self.batch = layout_for(size), batch
        # Every plane reads the same resident pages (one set fits the node's DRAM beside a put's pages).
        self.page = random.Random(size).randbytes(size)
        self.resident = hashes(f"resident-{size}", batch)
        self.kv.put(NS, self.layout, self.resident, [self.page] * batch)
        if self.zero_copy:  # what an engine does: pages staged in memory the node can map
            self.shared = self.kv.shared_buffer(batch * size)
            self.buffers = self.shared.pages(size, batch)
            for b in self.buffers:
                b[:] = self.page
        else:
            self.buffers = [memoryview(bytearray(size)) for _ in range(batch)]
        if self.kv.plane != self.transport:
            raise RuntimeError(f"{self.label}: ran on {self.kv.plane}, not {self.transport}")

    def put(self, iters: int) -> float:
        assert self.kv is not None
        self.runs += 1
        secs = 0.0
        for i in range(iters):
            hs = hashes(f"put-{self.label}-{self.runs}-{i}", self.batch)
            t0 = time.perf_counter()
            if self.zero_copy:
                stored = self.kv.put_from(NS, self.layout, hs, self.buffers).stored
            else:
                stored = self.kv.put(NS, self.layout, hs, [self.page] * self.batch).stored
            secs += time.perf_counter() - t0
            self.kv.delete(NS, hs)
            if stored != self.batch:
                raise RuntimeError(f"{self.label}: stored {stored} of {self.batch}")
        return secs

    def get(self, iters: int) -> tuple[float, bool]:
        assert self.kv is not None
        ok = True
        t0 = time.perf_counter()
        for i in range(iters):
            if self.into or self.zero_copy:
                refs = self.kv.get_into(NS, self.resident, self.buffers)
                ok = ok and len(refs) == self.batch and (i or all(bytes(b) == self.page for b in self.buffers))
            else:
                pages = self.kv.get(NS, self.resident)
                ok = ok and len(pages) == self.batch and (i or all(bytes(p) == self.page for p in pages))
        return time.perf_counter() - t0, ok

    def close(self) -> None:
        if self.kv is not None:
            if self.zero_copy:
                self.buffers = []
                self.shared.close()
            self.kv.close()
            self.kv = None


class Peer(System):
    """A peer cache's client in its own venv (benchmarks/peer_driver.py), spoken to in JSON lines. A driver
    that gives no answer within `reply_timeout` seconds is stopped, and the peer is skipped from then on."""

    def __init__(self, python: Path, peer: str, logdir: Path, reply_timeout: float = REPLY_TIMEOUT_S) -> None:
        self.label = PEERS[peer]
        self.reply_timeout = reply_timeout
        self.dead = ""  # why this peer's driver is gone (it is then skipped)
        self.proc = subprocess.Popen([str(python), str(HERE / "peer_driver.py"), peer, str(logdir)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(logdir / f"{peer}.log", "ab"),  # noqa: SIM115
                                     text=True, start_new_session=True)  # fmt: skip
        self._servers = [int(p) for p in self._reply()["pids"]]  # type: ignore[union-attr]

    def pids(self) -> list[int]:
        return [self.proc.pid, *self._servers]  # this process only waits meanwhile

    def _call(self, **cmd: object) -> dict[str, object]:
        if self.dead:
            raise RuntimeError(f"{self.label}: skipped: {self.dead}")
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def _reply(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.reply_timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.dead = (
                f"its driver gave no answer within {self.reply_timeout:.0f} s (see its log)"
                if not ready
                else "its driver exited (see its log)"
            )
            self._stop()
            raise RuntimeError(f"{self.label}: {self.dead}")
        return json.loads(line)

    def _stop(self) -> None:
        """End the driver and everything it started (its own process group)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def setup(self, size: int, batch: int) -> None:
        self._call(cmd="setup", size=size, batch=batch)

    def put(self, iters: int) -> float:
        return float(self._call(cmd="put", iters=iters)["secs"])  # type: ignore[arg-type]

    def get(self, iters: int) -> tuple[float, bool]:
        r = self._call(cmd="get", iters=iters)
        return float(r["secs"]), bool(r["verified"])  # type: ignore[arg-type]

    def close(self) -> None:
        if self.proc.poll() is None and not self.dead:
            try:
                self._call(cmd="close")
                self.proc.wait(30)
            except Exception:
                self._stop()
        self._stop()


# -- the peers' venv --------------------------------------------------------------------------------


def ensure_peers_venv(venv: Path, log: Path) -> Path:
    """The peers' interpreter, creating their venv on first use (never kvstore's own)."""
    python = venv / "bin" / "python"
    stamp = venv / ".peers-installed"
    if stamp.exists():
        return python
    missing = [
        d for d in PEER_DEBS if subprocess.run(["dpkg", "-s", d], check=False, capture_output=True).returncode != 0
    ]
    if missing and os.geteuid() == 0:
        print(f"installing Debian packages for Mooncake: {' '.join(missing)}", flush=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=False, capture_output=True)
    print(f"creating the peers' venv in {venv} (LMCache, Mooncake; about 2 minutes)", flush=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text("torch==2.13.0\n")  # LMCache would otherwise pull a CUDA torch
    with open(log, "ab") as out:
        for pkgs in PEER_PACKAGES:
            args = [p.format(constraints=constraints) for p in pkgs]
            subprocess.run([str(python), "-m", "pip", "install", "-q", *args], check=True, stdout=out, stderr=out)
    stamp.touch()
    return python


def start_peers(args: argparse.Namespace, logdir: Path, notes: list[str]) -> list[System]:
    if args.no_peers:
        notes.append("Peers skipped (--no-peers).")
        return []
    try:
        python = ensure_peers_venv(args.peers_venv, logdir / "peers-venv.log")
    except (OSError, subprocess.CalledProcessError) as exc:
        notes.append(f"Peers skipped: their venv could not be created ({exc}); see {logdir}/peers-venv.log.")
        return []
    out: list[System] = []
    for peer, label in PEERS.items():
        try:
            out.append(Peer(python, peer, logdir, args.reply_timeout))
        except Exception as exc:
            notes.append(f"{label} skipped: {exc} (log: {logdir}/{peer}.log).")
    return out


# -- our planes -------------------------------------------------------------------------------------


class Nodes:
    """One plain node and one TLS node per page size (DRAM only), restarted when the size changes."""

    def __init__(self, pki_dir: Path) -> None:
        self.pki = make_dev_pki(pki_dir)
        self.plain: NodeProcess | None = None
        self.tls: NodeProcess | None = None

    def start(self, size: int, batch: int) -> None:
        self.stop()
        kw = {"dram_bytes": (2 * batch + 4) * slot_bytes_for(size), "max_page_bytes": size}
        ucx = ["--ucx"] if ucxx_installed() else []  # the UCX plane is opt-in on a node
        tls = ["--tls-cert", str(self.pki.node_cert), "--tls-key", str(self.pki.node_key)]
        self.plain = _started(lambda: NodeProcess(node_id="peer-bench", extra_args=ucx, **kw))  # type: ignore[arg-type]
        self.tls = _started(lambda: NodeProcess(node_id="peer-bench-tls", extra_args=tls, **kw))  # type: ignore[arg-type]

    def stop(self) -> None:
        for n in (self.plain, self.tls):
            if n is not None:
                n.close()
        self.plain = self.tls = None


def _started(make: Callable[[], NodeProcess]) -> NodeProcess:
    """A node that serves, started once more if the first start timed out (a busy machine)."""
    try:
        return make().start(NODE_START_S)
    except TimeoutError:
        return make().start(NODE_START_S)


def our_systems(nodes: Nodes, notes: list[str]) -> list[System]:
    plain = lambda: nodes.plain  # noqa: E731
    tls = ClientSecurity(ca_file=str(nodes.pki.ca))
    out: list[System] = [
        Ours("kvstore gRPC streams", "grpc", plain),  # type: ignore[arg-type]
        Ours("kvstore TCP plane", "tcp", plain),  # type: ignore[arg-type]
        Ours("kvstore TCP plane, get_into caller buffers", "tcp", plain, into=True),  # type: ignore[arg-type]
        # Not a default: what the client's own XXH3 of every received page costs (the node still verifies).
        Ours("(info) kvstore TCP get_into, client verify=False", "tcp", plain, into=True, verify=False),  # type: ignore[arg-type]
        Ours("kvstore TCP plane + TLS", "tcp", lambda: nodes.tls, security=tls),  # type: ignore[arg-type]
        Ours("kvstore shm (same host)", "shm", plain),  # type: ignore[arg-type]
        Ours(ZERO_COPY, "shm", plain, zero_copy=True),  # type: ignore[arg-type]
    ]
    if "ucx" in client_core.PLANES and ucxx_installed():
        out.append(Ours("kvstore UCX plane", "ucx", plain))  # type: ignore[arg-type]
    else:
        notes.append("kvstore UCX plane: ucxx is not installed here (the dev extras install it), not measured.")
    return out


# -- run and report ---------------------------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    """CPU time these processes have run so far: this one exactly (process_time), others from their
    live threads' schedstat (ns resolution, updated when they are switched out, which blocked I/O
    servers are all the time)."""
    total = 0.0
    for pid in pids:
        if pid == os.getpid():
            total += time.process_time()
            continue
        for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            try:
                total += int(stat.read_text().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):  # the thread ended meanwhile
                continue
    return total


Results = dict[str, dict[str, dict[str, list[float]]]]  # metric -> system label -> "<KiB>/<op>" -> runs


def measure(systems: list[System], sizes: list[int], args: argparse.Namespace, nodes: Nodes, notes: list[str],
            load: LoadLog) -> tuple[Results, dict[str, str]]:  # fmt: skip
    """Per run: GB/s of wall time ("gbs") and GB per CPU-second of the system's processes ("gb_per_cpu_s"); and,
    per system never measured, why (it is reported as skipped, the run goes on)."""
    res: Results = {"gbs": {s.label: {} for s in systems}, "gb_per_cpu_s": {s.label: {} for s in systems}}
    why: dict[str, str] = {}
    for size in sizes:
        try:
            nodes.start(size, args.batch)
        except Exception as exc:
            nodes.stop()
            reason = f"the node did not start at {size >> 10} KiB ({str(exc).splitlines()[0]})"
            notes.append(f"kvstore planes: {reason}; not measured at that size.")
            why.update({s.label: reason for s in systems if isinstance(s, Ours)})
        live = []
        for s in systems:
            if isinstance(s, Ours) and nodes.plain is None:
                continue
            try:
                s.setup(size, args.batch)
                s.put(1)  # warm-up, untimed: first-touch faults, connections, the peers' lazy set-up
                s.get(1)
                live.append(s)
            except Exception as exc:
                notes.append(f"{s.label} at {size >> 10} KiB: setup failed ({exc}); not measured.")
                why[s.label] = f"setup failed at {size >> 10} KiB ({str(exc).splitlines()[0][:120]})"
        nbytes = size * args.batch
        iters = max(2, (args.phase_mib << 20) // nbytes)
        for run in range(args.runs):
            k = run % max(1, len(live))
            for s in live[k:] + live[:k]:
                for op in ("put", "get"):
                    cpu0 = cpu_seconds(s.pids())
                    try:
                        secs, ok = (s.put(iters), True) if op == "put" else s.get(iters)
                    except Exception as exc:
                        notes.append(f"{s.label} {op} at {size >> 10} KiB failed: {exc}")
                        why[s.label] = f"{op} failed ({str(exc).splitlines()[0][:120]})"
                        continue
                    cpu = cpu_seconds(s.pids()) - cpu0
                    if not ok:
                        notes.append(f"{s.label} {op} at {size >> 10} KiB: returned wrong bytes (value dropped)")
                        continue
                    cell = f"{size >> 10}/{op}"
                    res["gbs"][s.label].setdefault(cell, []).append(iters * nbytes / secs / 1e9)
                    if cpu > 0:
                        res["gb_per_cpu_s"][s.label].setdefault(cell, []).append(iters * nbytes / cpu / 1e9)
            print(f"  {size >> 10} KiB run {run + 1}/{args.runs} done (load average {load.note():.1f})", flush=True)
    nodes.stop()
    return res, why


RATIOS = [  # (row, system a, system b): a / b
    ("kvstore TCP / LMCache lm://", "kvstore TCP plane", PEERS["lmcache"]),
    ("kvstore TCP get_into / LMCache lm://", "kvstore TCP plane, get_into caller buffers", PEERS["lmcache"]),
    ("kvstore TCP / Mooncake remote", "kvstore TCP plane", PEERS["mooncake-remote"]),
    ("kvstore TCP / kvstore gRPC", "kvstore TCP plane", "kvstore gRPC streams"),
    ("kvstore TCP+TLS / kvstore TCP (TLS cost)", "kvstore TCP plane + TLS", "kvstore TCP plane"),
    ("kvstore TCP / raw TCP", "kvstore TCP plane", "raw TCP socket (no framing, no checksum)"),
    ("kvstore TCP get_into / raw TCP", "kvstore TCP plane, get_into caller buffers", RawTcp.label),
    ("(info) raw floor / raw TCP", RawFramed.label, RawTcp.label),
    ("(info) kvstore TCP get_into / raw floor", "kvstore TCP plane, get_into caller buffers", RawFramed.label),
    ("(info) raw TLS / raw TCP", RawTls.label, RawTcp.label),
    ("(info) kvstore TCP+TLS / raw TLS", "kvstore TCP plane + TLS", RawTls.label),
    ("kvstore shm / memcpy", "kvstore shm (same host)", "memcpy (same bytes, one core)"),
    ("kvstore shm / Mooncake same host", "kvstore shm (same host)", PEERS["mooncake-local"]),
    ("kvstore zero-copy / memcpy", ZERO_COPY, "memcpy (same bytes, one core)"),
    ("kvstore zero-copy / Mooncake same host", ZERO_COPY, PEERS["mooncake-local"]),
    ("kvstore UCX / kvstore gRPC", "kvstore UCX plane", "kvstore gRPC streams"),
]


def med(runs: dict[str, dict[str, list[float]]], label: str, cell: str) -> float | None:
    vals = runs.get(label, {}).get(cell)
    return statistics.median(vals) if vals else None


def paired(runs: dict[str, dict[str, list[float]]], a: str, b: str, cell: str) -> float | None:
    """Median over runs of a/b within the same run (both measured seconds apart, so drift cancels)."""
    xs, ys = runs.get(a, {}).get(cell, []), runs.get(b, {}).get(cell, [])
    pairs = [x / y for x, y in zip(xs, ys, strict=False) if y]
    return statistics.median(pairs) if pairs and len(xs) == len(ys) else None


def table(runs: dict[str, dict[str, list[float]]], cells: list[str], head: str, title: str,
          why: dict[str, str]) -> list[str]:  # fmt: skip
    lines = ["", f"| {title} | {head} |", "|---|" + "--:|" * len(cells)]
    for label in runs:
        vals = [med(runs, label, c) for c in cells]
        if all(v is None for v in vals) and label in why:
            lines.append(f"| {label} | skipped: {why[label]} |" + " |" * (len(cells) - 1))
            continue
        lines.append(f"| {label} | " + " | ".join("—" if v is None else f"{v:.2f}" for v in vals) + " |")
    return lines


def report(res: Results, why: dict[str, str], sizes: list[int], args: argparse.Namespace, notes: list[str],
           wall: float, load: LoadLog) -> str:  # fmt: skip
    cells = [f"{s >> 10}/{op}" for s in sizes for op in ("put", "get")]
    head = " | ".join(f"{c.split('/')[0]} KiB {c.split('/')[1]}" for c in cells)
    lines = [
        machine_line() + f" | src {source_digest()} | {load.span()}",
        f"- Workload: batch {args.batch} pages per call, ~{args.phase_mib} MiB per phase, median of {args.runs} runs "
        f"(systems in rotating order), loopback; wall {wall:.0f} s. GB = 10^9 B.",
    ]
    lines += table(res["gbs"], cells, head, "GB/s (wall)", why)
    lines += table(res["gb_per_cpu_s"], cells, head, "GB per CPU-second, client + server processes", why)
    lines += ["", f"| same-run ratio: wall · CPU | {head} |", "|---|" + "--:|" * len(cells)]
    for name, a, b in RATIOS:
        both = [(paired(res["gbs"], a, b, c), paired(res["gb_per_cpu_s"], a, b, c)) for c in cells]
        if all(w is None for w, _ in both):
            continue
        lines.append(f"| {name} | " + " | ".join(
            "—" if w is None else f"{w:.2f}x · " + ("—" if e is None else f"{e:.2f}x") for w, e in both) + " |")  # fmt: skip
    if notes:
        lines += ["", *[f"- {n}" for n in dict.fromkeys(notes)]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    work = ap.add_argument_group("workload")
    work.add_argument("--sizes", default="256KiB,1MiB,4MiB", help="page sizes (multiples of 8 KiB)")
    work.add_argument("--batch", type=int, default=16, help="pages per call (default 16)")
    work.add_argument("--phase-mib", type=int, default=64, help="MiB moved per put or get phase (default 64)")
    work.add_argument("--runs", type=int, default=5, help="runs per cell; GB/s is the median (default 5)")
    peers = ap.add_argument_group("peers (LMCache, Mooncake)")
    peers.add_argument("--peers-venv", type=Path, default=HERE / ".peers-venv", help="their own venv (made if missing)")
    peers.add_argument("--no-peers", action="store_true", help="only kvstore and the baselines")
    peers.add_argument("--reply-timeout", type=float, default=REPLY_TIMEOUT_S,
                       help=f"seconds a peer's driver may take to answer before it is skipped (default {REPLY_TIMEOUT_S:.0f})")  # fmt: skip
    ap.add_argument("--only", default="", help="measure only the systems whose label contains one of these "
                    "comma-separated words (e.g. 'raw,TCP plane'); default: all")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="smoke run: 256 KiB, 1 run, 8 MiB phases, no peers")
    ap.add_argument("--out", type=Path, default=HERE / "out")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.runs, args.phase_mib, args.no_peers = "256KiB", 1, 8, True
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if any(s <= 0 or s % 8192 for s in sizes):
        ap.error("--sizes: each size must be a positive multiple of 8 KiB")
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    t0 = time.perf_counter()
    load = LoadLog()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # the node inherits it: UCX stays on loopback, as the tests
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="peer-bench-") as tmp:
        logdir = args.out / "peer_logs"
        logdir.mkdir(parents=True, exist_ok=True)
        nodes = Nodes(Path(tmp) / "pki")
        RawTls.pki = nodes.pki
        systems: list[System] = [Memcpy(), raw_tcp(notes), raw_tcp(notes, RawFramed), raw_tcp(notes, RawTls),
                                 *our_systems(nodes, notes)]  # fmt: skip
        if only:
            systems = [s for s in systems if any(w.lower() in s.label.lower() for w in only)]
        if not only or any(w.lower() in label.lower() for w in only for label in PEERS.values()):
            systems += start_peers(args, logdir, notes)
        try:
            res, why = measure(systems, sizes, args, nodes, notes, load)
        finally:
            for s in systems:
                try:
                    s.close()
                except Exception as exc:  # a system that broke must not take the figures with it
                    notes.append(f"{s.label}: closing it failed ({type(exc).__name__}: {exc})")
            nodes.stop()
    wall = time.perf_counter() - t0
    save_results(args.out, "peer_bench", report(res, why, sizes, args, notes, wall, load), args, results=res,
                 skipped=why, notes=notes, wall_s=wall, load_average=load.samples)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
