"""What a local caller can hold of a node through its same-host socket, and what the others still get
(SECURITY.md, "Review round 4"; DESIGN.md §12). Real nodes on this host, raw sockets, the public client:

    descriptors   a node started at a 1,024-descriptor limit; a reader registers one 4 KiB memfd 255 times on
                  each of 4 connections (1,020 registrations): how many the node took, its open descriptors
                  before and after, and whether a new gRPC, TCP-plane and same-host client is then served
    silent flood  55 sockets that never say HELLO against a cap of 50 (tcp_max_connections and
                  shm_max_connections 50): of 20 new same-host clients in a row, how many are served and on
                  which plane, how many fail
    reader conns  cap 8: how many authenticated connections a reader's token holds before it is refused, and
                  whether a writer's client is then served on the same-host plane
    mapping room  shm_max_mapped_bytes 1 TiB: how many sparse 128 GiB memfds one reader maps before it is
                  refused, and whether a writer's client is then served on the same-host plane

Each is one run (outcomes, not timings). The same script run in a checkout of the code before the fix (main
fa51591) gives the "before" column of SECURITY.md. Writes benchmarks/out/shm_host_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import fcntl
import hashlib
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from machine import machine_line, save_results

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
from kvstore.security import ClientSecurity
from kvstore.wire import shm
from kvstore.wire.shm import Kind

READ = "ro-bench-" + "r" * 24
WRITE = "rw-bench-" + "w" * 24
LAYOUT = PageLayout(DType.FLOAT16, num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
NS = "bench/shm-host"
PER_CONNECTION = 255  # registrations per connection (a connection may hold 256)


class Raw:
    """A hand-driven connection to the node's socket."""

    def __init__(self, path: str, token: str | None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.welcomed = token is not None and self.call(Kind.HELLO, token.encode())[0] is Kind.WELCOME

    def call(self, kind: Kind, body: bytes = b"", fds: list[int] | None = None) -> tuple[Kind, bytes]:
        msg = shm.frame(kind, 1, body)
        try:
            if fds:
                self.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                self.sock.send(msg)
            reply = self.sock.recv(shm.MAX_MESSAGE_BYTES)
        except OSError:
            return Kind.ERROR, b""
        if not reply:
            return Kind.ERROR, b""
        got, _, payload = shm.unframe(reply)
        return got, bytes(payload)


def memfd(size: int) -> int:
    fd = os.memfd_create("bench", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


@contextlib.contextmanager
def node(tmp: Path, name: str, nofile: int | None = None, **env: object) -> Iterator[NodeProcess]:
    files = []
    for fname, tok in ((f"{name}.rw", WRITE), (f"{name}.ro", READ)):
        f = tmp / fname
        f.write_text(tok + "\n")
        f.chmod(0o600)
        files.append(str(f))
    n = NodeProcess(dram_bytes="64MiB", max_page_bytes=LAYOUT.page_bytes, node_id=name,
                    extra_args=["--auth-tokens-file", files[0], "--auth-read-tokens-file", files[1]],
                    env={f"KVSTORE_{k.upper()}": str(v) for k, v in env.items()})  # fmt: skip
    if nofile is not None:
        n.args = ["prlimit", f"--nofile={nofile}:{nofile}", "--", *n.args]
    n.start()
    try:
        yield n
    finally:
        n.close()


def socket_of(n: NodeProcess) -> str:
    with KVStoreClient(n.addr, transport="grpc", security=ClientSecurity(token=WRITE)) as kv:
        return next(p.address for p in kv.stats().planes if p.name == "shm")


def served(n: NodeProcess, token: str, transport: str = "auto", tag: str = "x") -> str:
    """The plane a put and a get of two pages were served on, or "failed: <error>"."""
    hs = [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(2)]
    data = [bytes([i]) * LAYOUT.page_bytes for i in range(2)]
    try:
        with KVStoreClient(n.addr, transport=transport, timeout=15, security=ClientSecurity(token=token)) as kv:
            if token == WRITE:
                kv.put(NS, LAYOUT, hs, data)
            got = kv.get(NS, hs)
            if token == WRITE and [bytes(p) for p in got] != data:
                return "failed: wrong bytes"
            return kv.plane or "?"
    except Exception as exc:
        return f"failed: {type(exc).__name__}"


def fds_of(n: NodeProcess) -> int:
    return len(os.listdir(f"/proc/{n.proc.pid}/fd"))  # type: ignore[union-attr]


def descriptors(tmp: Path) -> dict[str, object]:
    with node(tmp, "fds", nofile=1024) as n:
        path = socket_of(n)
        before = fds_of(n)
        conns = [Raw(path, READ) for _ in range(4)]
        fd = memfd(4096)
        oks = sum(
            c.call(Kind.REGISTER, shm.REGISTER.pack(i + 1), [fd])[0] is Kind.OK
            for c in conns
            for i in range(PER_CONNECTION)
        )
        after = fds_of(n)
        planes = [served(n, WRITE, t, f"fds-{t}") for t in ("grpc", "tcp", "shm")]
        for c in conns:
            c.sock.close()
        os.close(fd)
    return {"registered": oks, "fds_before": before, "fds_after": after, "new_clients": planes}


def silent_flood(tmp: Path) -> dict[str, object]:
    with node(tmp, "flood", tcp_max_connections=50, shm_max_connections=50) as n:
        path = socket_of(n)
        socks = []
        for _ in range(55):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with contextlib.suppress(OSError):
                s.connect(path)
            socks.append(s)
            time.sleep(0.003)
        outcomes = [served(n, WRITE, tag=f"flood-{i}") for i in range(20)]
        for s in socks:
            s.close()
    return {f"{o}": outcomes.count(o) for o in sorted(set(outcomes))}


def reader_connections(tmp: Path) -> dict[str, object]:
    with node(tmp, "conns", tcp_max_connections=8, shm_max_connections=8) as n:
        path = socket_of(n)
        held = []
        for _ in range(12):
            r = Raw(path, READ)
            if not r.welcomed:
                r.sock.close()
                break
            held.append(r)
        writer = served(n, WRITE, tag="conns")
        for r in held:
            r.sock.close()
    return {"reader_holds": len(held), "writer": writer}


def mapping_room(tmp: Path) -> dict[str, object]:
    with node(tmp, "room") as n:
        path = socket_of(n)
        raws = [Raw(path, READ) for _ in range(2)]
        fds = []
        mapped = 0
        for i in range(1, 20):
            fds.append(memfd(128 << 30))
            if raws[i % 2].call(Kind.REGISTER, shm.REGISTER.pack(i), [fds[-1]])[0] is not Kind.OK:
                break
            mapped += 128 << 30
        writer = served(n, WRITE, tag="room")
        for r in raws:
            r.sock.close()
        for fd in fds:
            os.close(fd)
    return {"reader_mapped_gib": mapped >> 30, "writer": writer}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvstore-shm-host-") as t:
        tmp = Path(t)
        rows = {
            "descriptors": descriptors(tmp),
            "silent flood": silent_flood(tmp),
            "reader conns": reader_connections(tmp),
            "mapping room": mapping_room(tmp),
        }
    lines = [machine_line(), "", "| scenario | outcome |", "|---|---|"]
    lines += [f"| {k} | {', '.join(f'{a}: {b}' for a, b in v.items())} |" for k, v in rows.items()]
    save_results(args.out, "shm_host_bench", "\n".join(lines), args, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
