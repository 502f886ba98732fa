"""Throughput and latency of one kvstore cache node over gRPC on loopback, against raw TCP.

What is measured
    For each page size (default 256 KiB, 1 MiB, 4 MiB) a real `kvstore serve` child process is started
    (kvstore.cli.launch.NodeProcess, one node per page size with max_page_bytes = page size) and driven by
    the blocking `KVStoreClient` from this process:

    - put          fresh hashes on every call (a put of a stored hash is a no-op); after each timed call
                   the pages are deleted again, untimed, so the node never evicts during the cell;
    - get DRAM     pages resident in DRAM (node without NVMe, DRAM large enough for everything);
    - get NVMe     a second node with 4 DRAM slots and an NVMe tier: the pages are put one by one and
                   pushed out of DRAM by filler pages, then read with `get_pages(promote=False)` so they
                   stay on NVMe; the tier each page came from is checked and the NVMe fraction reported;
    - get NVMe (shm get_into)  the same NVMe pages over the same-host plane's zero-copy `get_into` into
                   a registered buffer (the node copies each page from its NVMe read straight into it).

    Each in two modes: "single" (one page per call) and "batched" (`--batch` pages per call, one stream).
    NVMe gets are also compared with the disk itself: O_DIRECT reads of whole slots on the same
    filesystem, 1-deep in single mode and 16-deep (the node's NVMe queue depth) in batched mode.
    Every page read is XXH3-verified by the server and again by the client (`verify=True`, the
    default), and every put is XXH3-summed by the client and re-verified by the server: that work is
    part of the measured cost, as it is in production.

Reference (same run, same sizes)
    A plain TCP server in a separate process on 127.0.0.1, TCP_NODELAY on both ends, one persistent
    connection. "send": the client sends a 13-byte header plus `count` pages of N bytes, the server
    reads them into a reused buffer and replies a 1-byte ack (the put direction). "recv": the client
    sends a header, the server sends `count` pages of N bytes, the client reads them into a reused
    buffer (the get direction). No checksums, no framing beyond the header, no per-page allocation:
    the best a Python process does over loopback on this machine. Every kvstore figure is also given
    as a ratio to the raw-TCP figure of the same size, mode and direction.

Method
    Per cell: `--warmup` untimed calls, then `--runs` runs of a fixed number of calls, decided before
    the cell starts: min(--iters, max(8, --budget-mib / bytes per call)). A call's latency is the
    wall time (time.perf_counter) of one put/get call (a whole batch in batched mode). GB/s
    (10^9 bytes/s) of a run = bytes moved / sum of its call latencies; the figure reported is the
    median over runs (every run's value is in the JSON). p50/p99 are over all timed calls of the
    cell, linear interpolation between ranks (with fewer than 100 calls p99 is close to the maximum).
    No timing is asserted; correctness is checked (page counts, tiers, stored counts) and reported.
    A call the server fails (a gRPC error) is counted, not timed, and retried (bounded); the table
    says how many. The node processes inherit this process's environment (e.g. GLIBC_TUNABLES, which
    is recorded in the output when set).

Limits
    Loopback only: no NIC, no RDMA. "NVMe" is whatever device backs the temporary directory (named in
    the output; O_DIRECT is used when the filesystem supports it, so a hypervisor cache may still sit
    underneath). The HBM tier is not measured unless CUDA is present, and this script never asks for it.

Run:  .venv/bin/python benchmarks/store_bench.py [--quick] [--sizes 256KiB,1MiB,4MiB] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import hashlib
import itertools
import json
import math
import mmap
import multiprocessing as mp
import os
import platform
import socket
import ssl
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib import metadata
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
from machine import cpu_model

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.config import parse_size
from kvstore.errors import KVStoreError
from kvstore.layout import DType, PageLayout
from kvstore.memtune import tune_malloc_for_bulk_io
from kvstore.names import TierKind
from kvstore.pageformat import checksum_in_steps, payload_checksum, slot_bytes_for
from kvstore.tiers.nvme import QUEUE_DEPTH
from kvstore.wire.shm import shm_available
from kvstore.wire.tcp import OP_ENABLE_KTLS

NAMESPACE = "bench"
MIN_CALLS = 8  # calls per run never go below this (unless --iters is smaller)
MAX_ATTEMPTS = 20  # tries per timed call when the server fails the RPC
NVME_NODE_DRAM_SLOTS = 4
# op (b"P" send-to-server, b"G" get-from-server, b"E" / b"D" send / get distinct framed pages, b"Q" quit),
# count, size
TCP_HEADER = struct.Struct("<cIQ")
FRAME_HEAD = 57  # what "E" and "D" send before each page: as long as a kvstore PAGE frame's header and metadata
FRAME_HEAD_STRUCT = struct.Struct("<49xQ")  # the page's checksum in its last 8 bytes, as a PAGE frame has it
TCP_SERVER_MAX_SECONDS = 3600.0  # the raw-TCP server exits on its own after this, whatever happens
TCP_IO_TIMEOUT = 120.0

TIER_LABEL = {TierKind.HBM: "HBM", TierKind.DRAM: "DRAM", TierKind.NVME: "NVMe"}
OP_ORDER = {"put": 0, "get_dram": 1, "get_nvme": 2, "get_nvme_zc": 3}
MODE_ORDER = {"single": 0, "batched": 1}

# One cleanup action (untimed) returned by a timed call, or None.
Cleanup = Callable[[], None] | None


# ---------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True, slots=True)
class Plan:
    """How many calls each cell makes; fixed before any cell runs (never depends on measured time)."""

    runs: int
    iters: int
    warmup: int
    budget_bytes: int
    quick: bool = False  # smoke run: exactly `iters` calls per run, whatever the size

    def describe(self) -> str:
        if self.quick:
            calls = f"calls/run = {self.iters} (--quick)"
        else:
            calls = f"calls/run = min({self.iters}, max({MIN_CALLS}, {self.budget_bytes >> 20} MiB / bytes per call))"
        return f"{self.runs} run(s) per cell, {self.warmup} warmup call(s), {calls}"

    def calls_per_run(self, bytes_per_call: int) -> int:
        if self.quick:
            return self.iters
        by_budget = max(MIN_CALLS, self.budget_bytes // max(1, bytes_per_call))
        return max(1, min(self.iters, by_budget))


@dataclass(slots=True)
class Cell:
    """One measured combination: system x op x mode x page size."""

    system: str  # "kvstore" or "tcp"
    op: str  # put, get_dram, get_nvme (kvstore); send, recv (tcp)
    mode: str  # single or batched
    page_bytes: int
    pages_per_call: int
    runs: int
    calls_per_run: int
    warmup: int
    gbps_runs: list[float] = field(default_factory=list)
    gbps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    mean_ms: float = 0.0
    min_ms: float = 0.0
    max_ms: float = 0.0
    check: str = ""  # what was verified, e.g. "NVMe 100%"
    check_ok: bool = True
    attempts: int = 0  # calls made, warmup and failed ones included
    errors: int = 0  # calls the server failed (retried, not timed)
    first_error: str = ""
    failed: str = ""  # set when a call failed MAX_ATTEMPTS times in a row: the cell has no figures


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) of an ascending sequence, linear interpolation between ranks."""
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def measure(cell: Cell, call: Callable[[], Cleanup]) -> Cell:
    """Warm up, then time cell.runs x cell.calls_per_run calls of `call`; fill in the cell's figures.

    A call that raises a KVStoreError (the server failed the RPC) is counted in cell.errors, not
    timed, and tried again, at most MAX_ATTEMPTS times per timed call. If every attempt fails the
    cell is marked failed (cell.failed) and the benchmark goes on with the next cell.
    """
    bytes_per_call = cell.page_bytes * cell.pages_per_call
    latencies: list[float] = []
    try:
        for _ in range(cell.warmup):
            _timed_call(cell, call)
        for _ in range(cell.runs):
            gc.collect()
            run = [_timed_call(cell, call) for _ in range(cell.calls_per_run)]
            cell.gbps_runs.append(bytes_per_call * len(run) / sum(run) / 1e9)
            latencies.extend(run)
    except KVStoreError as exc:
        cell.failed = f"{MAX_ATTEMPTS} attempts in a row failed: {type(exc).__name__}: {exc}"[:300]
        nan = float("nan")
        cell.gbps = cell.p50_ms = cell.p99_ms = cell.mean_ms = cell.min_ms = cell.max_ms = nan
        return cell
    latencies.sort()
    cell.gbps = statistics.median(cell.gbps_runs)
    cell.p50_ms = percentile(latencies, 50) * 1e3
    cell.p99_ms = percentile(latencies, 99) * 1e3
    cell.mean_ms = statistics.fmean(latencies) * 1e3
    cell.min_ms = latencies[0] * 1e3
    cell.max_ms = latencies[-1] * 1e3
    return cell


def _timed_call(cell: Cell, call: Callable[[], Cleanup]) -> float:
    """Seconds one successful call took (its untimed cleanup runs after); raises after MAX_ATTEMPTS."""
    for attempt in range(MAX_ATTEMPTS):
        cell.attempts += 1
        t0 = time.perf_counter()
        try:
            cleanup = call()
        except KVStoreError as exc:
            cell.errors += 1
            if not cell.first_error:
                cell.first_error = f"{type(exc).__name__}: {exc}"[:300]
            if attempt == MAX_ATTEMPTS - 1:
                raise
            continue
        elapsed = time.perf_counter() - t0
        if cleanup is not None:
            cleanup()
        return elapsed
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------------- raw TCP baseline


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):  # each pass makes progress or raises; the socket has a timeout
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _send_parts(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """Send every byte of `parts` in order, one sendmsg for all of them as far as the socket takes them."""
    views = [memoryview(p) for p in parts]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if views and sent:
            views[0] = views[0][sent:]


def _recv_hashed(sock: socket.socket, dst: memoryview) -> int:
    """Fill `dst` from `sock`, hashing each HOT_CHUNK as it lands (checksum_in_steps); its XXH3-64."""

    def receive(off: int, k: int) -> memoryview:
        _recv_exact_into(sock, dst[off : off + k])
        return dst[off : off + k]

    return checksum_in_steps(len(dst), receive)


def _serve_tcp_connection(sock: socket.socket, deadline: float) -> bool:
    """Serve one client until it quits (returns True) or disconnects or stalls mid-request (returns False)."""
    header = bytearray(TCP_HEADER.size)
    buffers: dict[int, memoryview] = {}
    distinct: dict[tuple[int, int], list[memoryview]] = {}
    while True:  # ends on quit, EOF, a stall, or the server's deadline
        # NOTE: between requests the client may be measuring other systems for minutes on a busy machine
        # (peer_bench rotates through them all): only the server's own deadline bounds that wait. Once a
        # request started, TCP_IO_TIMEOUT bounds every wait.
        sock.settimeout(max(1.0, deadline - time.monotonic()))
        try:
            _recv_exact_into(sock, memoryview(header))
            sock.settimeout(TCP_IO_TIMEOUT)
            op, count, size = TCP_HEADER.unpack(header)
            if op == b"Q":
                return True
            buf = buffers.get(size)
            if buf is None:
                buf = buffers[size] = memoryview(bytearray(os.urandom(size)))
            if op == b"P":
                for _ in range(count):
                    _recv_exact_into(sock, buf)
                sock.sendall(b"A")
            elif op == b"G":
                for _ in range(count):
                    sock.sendall(buf)
            elif op == b"E":  # `count` different pages, each after a frame header, hashed as they land
                pages = distinct.get((count, size))
                if pages is None:
                    pages = distinct[(count, size)] = [memoryview(bytearray(os.urandom(size))) for _ in range(count)]
                head = memoryview(bytearray(FRAME_HEAD))
                for page in pages:
                    _recv_exact_into(sock, head)
                    _recv_hashed(sock, page)
                sock.sendall(b"A")
            elif op == b"D":  # `count` different pages, each after a frame header: what a node's reply is
                pages = distinct.get((count, size))
                if pages is None:
                    pages = distinct[(count, size)] = [memoryview(bytearray(os.urandom(size))) for _ in range(count)]
                head = bytes(FRAME_HEAD)
                for page in pages:
                    _send_parts(sock, [head, page])
            else:
                raise ValueError(f"unknown op {op!r}")
        except (ConnectionError, TimeoutError):  # the client went away or stalled: wait for the next one
            return False


def raw_tls_context(server: tuple[str, str] | None = None, ca_file: str | None = None) -> ssl.SSLContext:
    """The raw-TLS baseline's context: Python's ssl defaults (TLS 1.3 here), a server's certificate or a client's CA,
    and OP_ENABLE_KTLS as kvstore's TCP plane sets it (so where the kernel has kTLS, OpenSSL hands it the records
    here too); no session tickets."""
    if server is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(*server)
        ctx.num_tickets = 0
    else:
        ctx = ssl.create_default_context(cafile=ca_file)
    ctx.options |= OP_ENABLE_KTLS
    return ctx


def tcp_server_main(conn: Connection, tls: tuple[str, str] | None = None) -> None:
    """Entry point of the raw-TCP server process: report the port on `conn`, serve until told to quit. With `tls`
    (certificate and key files) every connection is a TLS one (the raw-TLS baseline)."""
    deadline = time.monotonic() + TCP_SERVER_MAX_SECONDS
    ctx = raw_tls_context(server=tls) if tls else None
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.settimeout(1.0)
        conn.send(srv.getsockname()[1])
        while time.monotonic() < deadline:
            try:
                sock, _ = srv.accept()
            except TimeoutError:
                continue
            with sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    if ctx is not None:
                        sock.settimeout(TCP_IO_TIMEOUT)
                        sock = ctx.wrap_socket(sock, server_side=True)
                    if _serve_tcp_connection(sock, deadline):
                        return
                except OSError:  # a handshake or a TLS record that failed: that connection ends, not the server
                    continue


class TcpServer:
    """The raw-TCP reference server in a child process (spawned, so it shares no GIL with the client)."""

    def __init__(self, tls: tuple[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=tcp_server_main, args=(child, tls), name="raw-tcp-server", daemon=True)
        self.port = 0

    def start(self, timeout: float = 120.0) -> TcpServer:
        self.proc.start()
        if not self._parent.poll(timeout):
            self.stop()
            raise TimeoutError("raw TCP server did not report its port")
        self.port = int(self._parent.recv())
        return self

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.join(2.0)  # a client that sent Q lets it exit by itself
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
        self._parent.close()


class TcpClient:
    """One persistent TCP_NODELAY connection to the reference server (TLS, verified against `tls_ca`, when the
    server was started with a certificate; only `send` and `recv` then: the framed ones use sendmsg)."""

    def __init__(self, port: int, tls_ca: str | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TCP_IO_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls_ca is not None:
            self.sock = raw_tls_context(ca_file=tls_ca).wrap_socket(self.sock, server_hostname="localhost")
        self._ack = memoryview(bytearray(1))

    def send(self, page: memoryview, count: int) -> None:
        """Client -> server: `count` pages of len(page) bytes, then wait for a 1-byte ack."""
        self.sock.sendall(TCP_HEADER.pack(b"P", count, len(page)))
        for _ in range(count):
            self.sock.sendall(page)
        _recv_exact_into(self.sock, self._ack)

    def recv(self, into: memoryview, count: int) -> None:
        """Server -> client: `count` pages of len(into) bytes, each read into `into`."""
        self.sock.sendall(TCP_HEADER.pack(b"G", count, len(into)))
        for _ in range(count):
            _recv_exact_into(self.sock, into)

    def send_framed(self, pages: list[memoryview]) -> None:
        """Client -> server: different pages, each hashed, then sent after a 57-byte frame header (one sendmsg per
        page, as kvstore's TCP client does); the server receives each into a page of its own, hashing as it lands."""
        self.sock.sendall(TCP_HEADER.pack(b"E", len(pages), len(pages[0])))
        for page in pages:
            _send_parts(self.sock, [FRAME_HEAD_STRUCT.pack(payload_checksum(page)), page])
        _recv_exact_into(self.sock, self._ack)

    def recv_framed(self, into: list[memoryview]) -> list[int]:
        """Server -> client: len(into) different pages, each after a 57-byte frame header, page i received into
        into[i] and hashed as it lands (checksum_in_steps, as kvstore's TCP client does); their XXH3-64s."""
        self.sock.sendall(TCP_HEADER.pack(b"D", len(into), len(into[0])))
        head = memoryview(bytearray(FRAME_HEAD))
        sums = []
        for dst in into:
            _recv_exact_into(self.sock, head)
            sums.append(_recv_hashed(self.sock, dst))
        return sums

    def close(self, quit_server: bool = False) -> None:
        try:
            if quit_server:
                self.sock.sendall(TCP_HEADER.pack(b"Q", 0, 0))
        finally:
            self.sock.close()


def bench_tcp(tcp: TcpClient, size: int, mode: str, count: int, plan: Plan) -> list[Cell]:
    page = memoryview(os.urandom(size))
    into = memoryview(bytearray(size))
    cells = []
    for op, fn in (("send", lambda: tcp.send(page, count)), ("recv", lambda: tcp.recv(into, count))):
        cell = Cell("tcp", op, mode, size, count, plan.runs, plan.calls_per_run(size * count), plan.warmup)

        def call(fn: Callable[[], None] = fn) -> Cleanup:
            fn()
            return None

        cells.append(measure(cell, call))
    return cells


def bench_disk(root: Path, size: int, mode: str, count: int, plan: Plan) -> Cell:
    """The disk's own limit for NVMe gets: O_DIRECT reads of whole slots (header + payload, as the node
    reads them) from a file on the same filesystem, `count` slots per call; in batched mode with up to
    QUEUE_DEPTH reads in flight (one thread each, as the node's NVMe tier reads a batch), else one at
    a time. GB/s counts payload bytes, like the kvstore cells."""
    slot = slot_bytes_for(size)
    n_slots = max(4 * count, 16)
    path = root / f"disk-baseline-{size}"
    with open(path, "wb") as f:
        for _ in range(n_slots):
            f.write(os.urandom(slot))
        f.flush()
        os.fsync(f.fileno())
    buf = mmap.mmap(-1, slot)  # page aligned, as O_DIRECT needs
    view = memoryview(buf)
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    cursor = itertools.count()
    cell = Cell("disk", "read", mode, size, count, plan.runs, plan.calls_per_run(size * count), plan.warmup)
    depth = min(count, QUEUE_DEPTH)
    extra = [mmap.mmap(-1, slot) for _ in range(depth - 1)]  # one buffer per read in flight
    views = [view, *(memoryview(b) for b in extra)]
    pool = ThreadPoolExecutor(depth)

    def call() -> Cleanup:
        if depth == 1:
            for _ in range(count):
                os.preadv(fd, [view], (next(cursor) % n_slots) * slot)
            return None
        for f in [pool.submit(os.preadv, fd, [views[i % depth]], (next(cursor) % n_slots) * slot)
                  for i in range(count)]:  # fmt: skip
            f.result()
        return None

    try:
        cell.check = f"{depth}-deep"
        return measure(cell, call)
    finally:
        pool.shutdown()
        os.close(fd)
        for v in views:
            v.release()
        for b in [buf, *extra]:
            b.close()
        path.unlink()


# ------------------------------------------------------------------------------------------- kvstore


def layout_for(size: int) -> PageLayout:
    """A uint8 layout whose page is exactly `size` bytes (1 layer, K and V of size/2 bytes each)."""
    return PageLayout(DType.UINT8, num_layers=1, num_kv_heads=1, head_dim=size // 2, block_size=1)


class HashSource:
    """Distinct 32-byte hashes, never repeated within a run."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._counter = itertools.count()

    def take(self, n: int) -> list[bytes]:
        return [hashlib.sha256(f"{self.tag}-{next(self._counter)}".encode()).digest() for _ in range(n)]


def bench_put(kv: KVStoreClient, layout: PageLayout, page: bytes, mode: str, count: int, plan: Plan,
              hashes: HashSource) -> Cell:  # fmt: skip
    size = layout.page_bytes
    cell = Cell("kvstore", "put", mode, size, count, plan.runs, plan.calls_per_run(size * count), plan.warmup)
    pages = [page] * count
    tally = {"sent": 0, "stored": 0, "deleted": 0}

    def call() -> Cleanup:
        hs = hashes.take(count)
        res = kv.put(NAMESPACE, layout, hs, pages)
        tally["sent"] += count
        tally["stored"] += res.stored

        def cleanup() -> None:
            tally["deleted"] += kv.delete(NAMESPACE, hs).deleted

        return cleanup

    measure(cell, call)
    cell.check_ok = tally["stored"] == tally["sent"] == tally["deleted"]
    cell.check = f"stored {100 * tally['stored'] / max(1, tally['sent']):.0f}%"
    return cell


def bench_get(kv: KVStoreClient, size: int, resident: list[bytes], op: str, want: TierKind, *, mode: str,
              count: int, plan: Plan, promote: bool) -> Cell:  # fmt: skip
    """Read `count` pages per call from `resident` (cycling in single mode); tally the tiers served."""
    cell = Cell("kvstore", op, mode, size, count, plan.runs, plan.calls_per_run(size * count), plan.warmup)
    cursor = itertools.count()
    tally = {"asked": 0, "got": 0, "in_tier": 0, "bad_len": 0}

    def call() -> Cleanup:
        if count == len(resident):
            hs = resident
        else:
            start = next(cursor) * count % len(resident)
            hs = [resident[(start + j) % len(resident)] for j in range(count)]
        got = kv.get_pages(NAMESPACE, hs, promote=promote)
        tally["asked"] += count
        tally["got"] += len(got)
        tally["in_tier"] += sum(1 for p in got if p.tier is want)
        tally["bad_len"] += sum(1 for p in got if len(p.data) != size)
        return None

    measure(cell, call)
    frac = tally["in_tier"] / max(1, tally["asked"])
    cell.check_ok = tally["got"] == tally["asked"] == tally["in_tier"] and tally["bad_len"] == 0
    cell.check = f"{TIER_LABEL[want]} {100 * frac:.0f}%"
    if tally["got"] != tally["asked"]:
        cell.check += f", {tally['asked'] - tally['got']} missing"
    return cell


def bench_get_into(kv: KVStoreClient, size: int, resident: list[bytes], mode: str, count: int,
                   plan: Plan) -> Cell:  # fmt: skip
    """Like bench_get for NVMe pages, but over the same-host plane's zero-copy `get_into`: the node copies
    each page from its NVMe read straight into a registered buffer of this process."""
    cell = Cell("kvstore", "get_nvme_zc", mode, size, count, plan.runs, plan.calls_per_run(size * count), plan.warmup)
    staging = kv.shared_buffer(count * slot_bytes_for(size))
    views = staging.pages(size, count)
    cursor = itertools.count()
    tally = {"asked": 0, "got": 0, "in_tier": 0}

    def call() -> Cleanup:
        start = next(cursor) * count % len(resident)
        hs = resident if count == len(resident) else [resident[(start + j) % len(resident)] for j in range(count)]
        refs = kv.get_into(NAMESPACE, hs, views, promote=False)
        tally["asked"] += count
        tally["got"] += len(refs)
        tally["in_tier"] += sum(1 for r in refs if r.tier is TierKind.NVME)
        return None

    try:
        measure(cell, call)
    finally:
        staging.close()
    cell.check_ok = tally["got"] == tally["asked"] == tally["in_tier"]
    cell.check = f"NVMe {100 * tally['in_tier'] / max(1, tally['asked']):.0f}%"
    return cell


def fill_nvme(
    kv: KVStoreClient, layout: PageLayout, page: bytes, hashes: HashSource, n: int
) -> tuple[list[bytes], str]:
    """Put n pages one per call, then push them out of DRAM with filler pages; returns (hashes, note)."""
    targets = hashes.take(n)
    for h in targets:  # one page per stream, so no stream needs more DRAM slots than the node has
        kv.put(NAMESPACE, layout, [h], [page])
    for _ in range(4):  # bounded: normally the first round of fillers is enough
        kv.put(NAMESPACE, layout, hashes.take(NVME_NODE_DRAM_SLOTS), [page] * NVME_NODE_DRAM_SLOTS)
        tiers = kv.lookup_detail(NAMESPACE, targets).tiers
        if len(tiers) == n and all(t is TierKind.NVME for t in tiers):
            return targets, f"all {n} pages on NVMe before reading"
    on = sum(1 for t in tiers if t is TierKind.NVME)
    return targets, f"only {on}/{n} pages on NVMe before reading"


@dataclass(slots=True)
class SizeResult:
    size: int
    cells: list[Cell]
    notes: list[str]
    node_stats: dict[str, object]


def tier_summary(kv: KVStoreClient) -> dict[str, object]:
    st = kv.stats()
    return {
        t.tier.name: {
            "available": t.available, "detail": t.detail, "slots_total": t.slots_total, "pages": t.pages,
            "hits": t.counters.hits, "misses": t.counters.misses, "promotions": t.counters.promotions,
            "demotions": t.counters.demotions, "evictions": t.counters.evictions,
            "checksum_failures": t.counters.checksum_failures, "dropped": t.counters.dropped,
        }
        for t in st.tiers
    }  # fmt: skip


def bench_size(size: int, batch: int, plan: Plan, tcp: TcpClient, nvme_root: Path) -> SizeResult:
    """Every cell of one page size: raw TCP, then a DRAM node, then an NVMe node (both stopped after)."""
    layout = layout_for(size)
    slot = slot_bytes_for(size)
    page = os.urandom(size)
    notes: list[str] = []
    cells: list[Cell] = []
    stats: dict[str, object] = {}
    modes = (("single", 1), ("batched", batch))
    for mode, count in modes:
        cells += bench_tcp(tcp, size, mode, count, plan)
        cells.append(bench_disk(nvme_root, size, mode, count, plan))

    # DRAM node: room for the resident get set (batch pages), one put batch, and slack; no NVMe, so
    # nothing can be demoted (an eviction here would be a drop, which the get check would catch).
    dram_node = NodeProcess(dram_bytes=(2 * batch + 8) * slot, max_page_bytes=size, node_id=f"bench-dram-{size}")
    try:
        dram_node.start()
        with KVStoreClient(dram_node.addr, pages_per_call=max(256, batch), transport="grpc") as kv:
            kv.wait_ready()
            hashes = HashSource(f"dram-{size}")
            resident = hashes.take(batch)
            kv.put(NAMESPACE, layout, resident, [page] * batch)
            for mode, count in modes:
                cells.append(bench_put(kv, layout, page, mode, count, plan, hashes))
                cells.append(
                    bench_get(
                        kv, size, resident, "get_dram", TierKind.DRAM, mode=mode, count=count, plan=plan, promote=True
                    )
                )
            stats["dram_node"] = tier_summary(kv)
    finally:
        dram_node.close()

    # NVMe node: 4 DRAM slots, NVMe for the read set plus fillers; reads with promote=False.
    nvme_dir = nvme_root / f"nvme-{size}"
    nvme_node = NodeProcess(dram_bytes=NVME_NODE_DRAM_SLOTS * slot, nvme_path=nvme_dir,
                            nvme_bytes=(batch + 4 * NVME_NODE_DRAM_SLOTS + 4) * slot, max_page_bytes=size,
                            node_id=f"bench-nvme-{size}")  # fmt: skip
    try:
        nvme_node.start()
        with KVStoreClient(nvme_node.addr, pages_per_call=max(256, batch), transport="grpc") as kv:
            kv.wait_ready()
            targets, note = fill_nvme(kv, layout, page, HashSource(f"nvme-{size}"), batch)
            notes.append(note)
            for mode, count in modes:
                cells.append(
                    bench_get(
                        kv, size, targets, "get_nvme", TierKind.NVME, mode=mode, count=count, plan=plan, promote=False
                    )
                )
            if shm_available():
                with KVStoreClient(nvme_node.addr, pages_per_call=max(256, batch), transport="shm") as zc:
                    for mode, count in modes:
                        cells.append(bench_get_into(zc, size, targets, mode, count, plan))
            stats["nvme_node"] = tier_summary(kv)
    finally:
        nvme_node.close()
    return SizeResult(size, cells, notes, stats)


# ------------------------------------------------------------------------------------------- report


def size_label(n: int) -> str:
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"


def mount_of(path: Path) -> str:
    """'device (fstype) on mountpoint' of the filesystem holding path, from /proc/mounts."""
    best = ("", "", "")
    target = str(path.resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype)
    except OSError:
        return "unknown"
    return f"{best[0]} ({best[2]}) on {best[1]}" if best[1] else "unknown"


def source_digest() -> str:
    """Short SHA-256 over the kvstore package's .py files: which code was measured (the tree may be dirty)."""
    import kvstore

    root = Path(kvstore.__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def machine_info() -> dict[str, object]:
    try:
        kv_version = metadata.version("kvstore")
    except metadata.PackageNotFoundError:
        kv_version = "unknown"
    try:
        pb_version = metadata.version("protobuf")
    except metadata.PackageNotFoundError:
        pb_version = "unknown"
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "processor": platform.processor() or "(empty)",
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "protobuf": pb_version,
        "kvstore": kv_version,
        "kvstore_src": source_digest(),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
        "malloc_env": {k: v for k, v in os.environ.items() if k == "GLIBC_TUNABLES" or k.startswith("MALLOC_")},
    }


def machine_line(meta: dict[str, object]) -> str:
    return (
        f"{meta['date']} | cpu: {meta['cpu_model']} (platform.processor()={meta['processor']!s}), "
        f"os.cpu_count()={meta['cpu_count']} | {meta['platform']} | python {meta['python']}, "
        f"grpcio {meta['grpc']}, protobuf {meta['protobuf']}, kvstore {meta['kvstore']} (src {meta['kvstore_src']})"
        + (f" | env {meta['malloc_env']}" if meta["malloc_env"] else "")
        + f" | client malloc tuned: {meta.get('client_malloc_tuned', False)}"
    )


OP_LABEL = {"put": "put", "get_dram": "get DRAM", "get_nvme": "get NVMe", "get_nvme_zc": "get NVMe (shm get_into)"}
TCP_DIRECTION = {"put": "send", "get_dram": "recv", "get_nvme": "recv", "get_nvme_zc": "recv"}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b > 0 else "n/a"


def build_rows(cells: list[Cell]) -> list[dict[str, object]]:
    """One row per kvstore cell, joined with the raw-TCP cell of the same size, mode and direction."""
    tcp = {(c.page_bytes, c.mode, c.op): c for c in cells if c.system == "tcp"}
    disk = {(c.page_bytes, c.mode): c for c in cells if c.system == "disk"}
    rows = []
    for c in sorted(cells, key=lambda c: (c.page_bytes, MODE_ORDER[c.mode], OP_ORDER.get(c.op, -1))):
        if c.system != "kvstore":
            continue
        t = tcp.get((c.page_bytes, c.mode, TCP_DIRECTION[c.op]))
        d = disk.get((c.page_bytes, c.mode)) if c.op.startswith("get_nvme") else None
        rows.append({
            "size": size_label(c.page_bytes), "page_bytes": c.page_bytes, "mode": c.mode, "op": c.op,
            "pages_per_call": c.pages_per_call, "calls": c.runs * c.calls_per_run,
            "gbps": c.gbps, "p50_ms": c.p50_ms, "p99_ms": c.p99_ms,
            "tcp_direction": t.op if t else None, "tcp_gbps": t.gbps if t else None,
            "tcp_p50_ms": t.p50_ms if t else None, "tcp_p99_ms": t.p99_ms if t else None,
            "gbps_ratio": c.gbps / t.gbps if t and t.gbps else None,
            "disk_gbps": d.gbps if d else None,
            "disk_ratio": c.gbps / d.gbps if d and d.gbps else None,
            "p50_ratio": c.p50_ms / t.p50_ms if t and t.p50_ms else None,
            "p99_ratio": c.p99_ms / t.p99_ms if t and t.p99_ms else None,
            "check": c.check, "check_ok": c.check_ok, "attempts": c.attempts, "errors": c.errors,
            "first_error": c.first_error, "failed": c.failed,
        })  # fmt: skip
    return rows


def check_text(c: Cell) -> str:
    if c.failed:
        return f"CELL FAILED¹ ({c.errors} of {c.attempts} calls failed)"
    text = c.check if c.check_ok else f"{c.check} (CHECK FAILED)"
    if c.errors:
        text += f"; {c.errors} of {c.attempts} calls failed on the server, retried¹"
    return text


def markdown_table(cells: list[Cell]) -> str:
    head = (
        "| page | mode | op | pages/call | calls | GB/s (vs TCP) | p50 ms (vs TCP) | p99 ms (vs TCP) "
        "| TCP dir | TCP GB/s | TCP p50 ms | TCP p99 ms | disk O_DIRECT GB/s, 1-deep single / 16-deep batched "
        "(kvstore vs disk) | check |\n"
        "|---|---|---|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|---|"
    )
    tcp = {(c.page_bytes, c.mode, c.op): c for c in cells if c.system == "tcp"}
    disk = {(c.page_bytes, c.mode): c for c in cells if c.system == "disk"}
    lines = [head]
    for c in sorted(cells, key=lambda c: (c.page_bytes, MODE_ORDER[c.mode], OP_ORDER.get(c.op, -1))):
        if c.system != "kvstore":
            continue
        t = tcp.get((c.page_bytes, c.mode, TCP_DIRECTION[c.op]))
        tg, t50, t99 = (t.gbps, t.p50_ms, t.p99_ms) if t else (0.0, 0.0, 0.0)
        d = disk.get((c.page_bytes, c.mode)) if c.op.startswith("get_nvme") else None
        disk_text = f"{d.gbps:.3f} ({ratio(c.gbps, d.gbps)})" if d else "-"
        lines.append(
            f"| {size_label(c.page_bytes)} | {c.mode} | {OP_LABEL[c.op]} | {c.pages_per_call} | "
            f"{c.runs * c.calls_per_run} | {c.gbps:.3f} ({ratio(c.gbps, tg)}) | "
            f"{c.p50_ms:.2f} ({ratio(c.p50_ms, t50)}) | {c.p99_ms:.2f} ({ratio(c.p99_ms, t99)}) | "
            f"{t.op if t else '-'} | {tg:.3f} | {t50:.2f} | {t99:.2f} | {disk_text} | "
            f"{check_text(c)} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main


def json_safe(obj: object) -> object:
    """NaN (a failed cell's figures) becomes null, so the file is strict JSON."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def parse_sizes(text: str) -> list[int]:
    sizes = []
    for part in text.split(","):
        n = parse_size(part.strip())
        if n <= 0 or n % 2:
            raise argparse.ArgumentTypeError(f"page size {part!r} must be a positive even number of bytes")
        sizes.append(n)
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--sizes", type=parse_sizes, default=parse_sizes("256KiB,1MiB,4MiB"),
                    help="comma-separated page sizes (default 256KiB,1MiB,4MiB)")  # fmt: skip
    ap.add_argument("--iters", type=int, default=100, help="max timed calls per run (default 100)")
    ap.add_argument("--runs", type=int, default=5, help="runs per cell; GB/s is their median (default 5)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before each cell (default 3)")
    ap.add_argument("--budget-mib", type=int, default=256,
                    help="bytes per run, in MiB, that set the calls per run: "
                         f"min(iters, max({MIN_CALLS}, budget / bytes per call)) (default 256)")  # fmt: skip
    ap.add_argument("--batch", type=int, default=16, help="pages per call in batched mode (default 16)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 run, few calls, 1 warmup")
    ap.add_argument("--no-tune-client", action="store_true",
                    help="leave this (client) process's malloc untuned; the node always tunes its own")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                    help="directory for store_bench.json and store_bench.md (default benchmarks/out)")  # fmt: skip
    args = ap.parse_args(argv)
    if not 1 <= args.batch <= 1024:
        ap.error("--batch must be in [1, 1024]")
    if args.iters < 1 or args.runs < 1 or args.warmup < 0 or args.budget_mib < 1:
        ap.error("--iters, --runs and --budget-mib must be >= 1, --warmup >= 0")
    plan = Plan(runs=args.runs, iters=args.iters, warmup=args.warmup, budget_bytes=args.budget_mib << 20)
    if args.quick:
        plan = Plan(runs=1, iters=min(args.iters, 4), warmup=1, budget_bytes=0, quick=True)

    client_tuned = False if args.no_tune_client else tune_malloc_for_bulk_io()
    meta = machine_info()
    meta["client_malloc_tuned"] = client_tuned
    t_start = time.perf_counter()
    print(f"# kvstore store_bench — {machine_line(meta)}", flush=True)
    sizes = ", ".join(size_label(s) for s in args.sizes)
    print(f"plan: {plan.describe()}; batch={args.batch}; sizes {sizes}", flush=True)

    results: list[SizeResult] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        nvme_root = Path(tmp)
        nvme_backing = mount_of(nvme_root)
        print(f"NVMe tier backed by {nvme_backing} (temporary directory {nvme_root})", flush=True)
        server = TcpServer().start()
        tcp: TcpClient | None = None
        try:
            tcp = TcpClient(server.port)
            for size in args.sizes:
                t0 = time.perf_counter()
                res = bench_size(size, args.batch, plan, tcp, nvme_root)
                results.append(res)
                print(f"  {size_label(size)}: {len(res.cells)} cells in {time.perf_counter() - t0:.1f}s; "
                      + "; ".join(res.notes), flush=True)  # fmt: skip
        finally:
            if tcp is not None:
                tcp.close(quit_server=True)
            server.stop()
    wall = time.perf_counter() - t_start

    cells = [c for r in results for c in r.cells]
    nvme_detail = ""
    for r in results:
        nvme = r.node_stats.get("nvme_node", {}).get("NVME", {})  # type: ignore[union-attr]
        if nvme:
            nvme_detail = str(nvme.get("detail", ""))
    hbm_note = "HBM tier not measured (no CUDA device; the nodes ran with hbm_bytes=0)"
    table = markdown_table(cells)
    header = [
        f"Machine: {machine_line(meta)}",
        f"Plan: {plan.describe()}; batched = {args.batch} pages per call, one stream. GB/s = 10^9 B/s, "
        f"median of runs; p50/p99 per call. Wall time {wall:.0f}s; 1-min load average "
        f"{meta['loadavg_1m_at_start']} at start, {os.getloadavg()[0]:.2f} at end.",
        f"NVMe: {nvme_backing}; node reports: {nvme_detail or 'n/a'}. {hbm_note}.",
        "Reads are XXH3-verified on the server and on the client; puts are summed by the client and "
        "verified by the server. Raw TCP: a separate server process on 127.0.0.1, TCP_NODELAY on both ends, "
        "one connection, reused buffers, no checksums; send = put direction (client sends, 1-byte ack), "
        "recv = get direction. (vs TCP) = kvstore / raw TCP of the same size, mode and direction.",
    ]
    errored = [c for c in cells if c.errors]
    footer = ""
    if errored:
        total = sum(c.errors for c in errored)
        attempts = sum(c.attempts for c in errored)
        footer = (
            f"\n¹ {total} of {attempts} call(s) in {len(errored)} cell(s) failed on the server; each failed call "
            f"was retried (up to {MAX_ATTEMPTS} times) and only successful calls are timed. First error: "
            f"{errored[0].first_error}\n"
        )
    md = "\n\n".join(["\n".join(f"- {h}" for h in header), table]) + "\n" + footer
    print()
    print(md)
    print(f"wall time {wall:.1f}s")

    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": {**meta, "loadavg_1m_at_end": round(os.getloadavg()[0], 2), "wall_seconds": wall, "nvme_backing": nvme_backing, "nvme_detail": nvme_detail,
                 "hbm": hbm_note, "argv": sys.argv[1:]},
        "plan": {**asdict(plan), "min_calls": MIN_CALLS, "batch": args.batch, "quick": args.quick,
                 "sizes": args.sizes},
        "rows": build_rows(cells),
        "cells": [asdict(c) for c in cells],
        "per_size": [{"size": r.size, "notes": r.notes, "node_stats": r.node_stats} for r in results],
    }  # fmt: skip
    (args.out / "store_bench.json").write_text(json.dumps(json_safe(doc), indent=2, allow_nan=False) + "\n")
    (args.out / "store_bench.md").write_text(md)
    print(f"wrote {args.out / 'store_bench.json'} and {args.out / 'store_bench.md'}")
    failed = [c for c in cells if c.failed or not c.check_ok]
    for c in failed:
        why = c.failed or c.check
        print(f"FAILED: {c.system} {c.op} {c.mode} {size_label(c.page_bytes)}: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
