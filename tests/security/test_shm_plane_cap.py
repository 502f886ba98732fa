"""The same-host plane's connection cap under attack (SECURITY.md, round 4, finding 4), with raw sockets against
real nodes.

Before: the plane reused `tcp_max_connections` and counted every accepted socket against it, so sockets that
never said HELLO, or a reader's idle connections (still open past the idle limit), turned same-host clients
away with `Unavailable: too many connections`, and those clients did not fall back to another plane. Now, as
on the TCP plane (kvstore/node/planes/tcp_limits.py): handshakes have a bounded room of their own and a short
deadline, authenticated connections are shared out per caller and per tenant, idle ones expire, and a client
the plane refuses falls back (PlaneUnavailable before anything was sent) and comes back later.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.errors import PlaneUnavailable
from kvstore.security import ClientSecurity
from kvstore.wire import shm
from kvstore.wire.shm import Kind
from tests.integration.conftest import LAYOUT, NS, key, page, start_node
from tests.integration.test_shm import Raw, socket_of
from tests.security.conftest import READ, WRITE, private_file, token_args, wait_for

pytestmark = pytest.mark.skipif(not shm.shm_available(), reason="needs memfd_create and Unix sockets")

ALICE = "alice-shm-" + "a" * 24
BOB = "bob-shm---" + "b" * 24


def cap_node(tmp_path: Path, name: str, tokens: list[str] | None = None, **env: object) -> NodeProcess:
    """A node whose same-host plane has the limits given (as KVSTORE_<NAME> settings)."""
    args = token_args(tmp_path)
    if tokens is not None:
        rw = private_file(tmp_path / f"{name}.tokens", "".join(f"{t}\n" for t in tokens))
        args = ["--auth-tokens-file", str(rw), "--auth-read-tokens-file", args[3]]
    return start_node(tmp_path, name=name, nvme_pages=0, extra_args=args,
                      env={f"KVSTORE_{k.upper()}": str(v) for k, v in env.items()})  # fmt: skip


def client(node: NodeProcess, token: str, transport: str = "auto") -> KVStoreClient:
    return KVStoreClient(node.addr, timeout=30, transport=transport, security=ClientSecurity(token=token))


def chain_of(tag: str, n: int = 3) -> list[bytes]:
    return [key(i, tag) for i in range(n)]


def served(kv: KVStoreClient, hs: list[bytes]) -> bool:
    return [bytes(p) for p in kv.get(NS, hs)] == [page(h) for h in hs]


@contextlib.contextmanager
def silent_sockets(path: str, n: int) -> Iterator[list[socket.socket]]:
    """`n` connections to the node's socket that never send a byte, a few milliseconds apart."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(5)
            with contextlib.suppress(OSError):  # a full backlog may refuse some: the flood goes on
                s.connect(path)
            socks.append(s)
            time.sleep(0.003)
        yield socks
    finally:
        for s in socks:
            s.close()


def closed_by_node(raw: Raw, within: float) -> bool:
    """Whether the node closes `raw` within `within` seconds (a bounded wait, not a timing claim)."""
    raw.sock.settimeout(within)
    try:
        while raw.sock.recv(shm.MAX_MESSAGE_BYTES):  # an ERROR first, then the close
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


def test_sockets_that_never_say_hello_leave_same_host_clients_served(tmp_path: Path) -> None:
    """55 sockets that never say HELLO against a cap of 50: a client already connected goes on on the same-host
    plane, and every new client is served (on that plane once there is room, else on the next one), 20 of
    them in a row (before, most of them failed with Unavailable: the refusal raced the client's HELLO)."""
    node = cap_node(tmp_path, "flood", tcp_max_connections=50, shm_max_connections=50)
    try:
        chain = chain_of("flood")
        with client(node, WRITE) as early:
            early.put(NS, LAYOUT, chain, [page(h) for h in chain])  # early's same-host connection is pooled
            assert early.plane == "shm"
            with silent_sockets(socket_of(node), 55):
                for _ in range(20):
                    with client(node, WRITE) as late:
                        assert served(late, chain) and late.plane in ("shm", "tcp")
                    assert served(early, chain) and early.plane == "shm"  # its connection kept serving
    finally:
        node.close()


def test_a_silent_connection_gets_only_the_hello_deadline(tmp_path: Path) -> None:
    node = cap_node(tmp_path, "hello", shm_hello_timeout_seconds=1.0, tcp_timeout_seconds=60)
    try:
        raw = Raw(socket_of(node), token=None)
        try:
            assert closed_by_node(raw, within=15)  # cut by the HELLO deadline (1 s)
        finally:
            raw.close()
    finally:
        node.close()


def test_a_readers_idle_connections_expire_and_never_hold_the_plane(tmp_path: Path) -> None:
    """A reader opens authenticated connections until refused: it holds at most its share, a writer is served on
    the same-host plane meanwhile, and the reader's connections close once idle for shm_idle_seconds."""
    node = cap_node(tmp_path, "idle", tcp_max_connections=8, shm_max_connections=8, shm_idle_seconds=3.0)
    held: list[Raw] = []
    try:
        path = socket_of(node)
        refusal = None
        for _ in range(12):
            raw = Raw(path, token=None)
            kind, body = raw.call(Kind.HELLO, READ.encode())
            if kind is not Kind.WELCOME:
                refusal = shm.parse_error(body)
                raw.close()
                break
            held.append(raw)
        assert refusal is not None and len(held) <= 4, (len(held), refusal)  # half of 8
        assert refusal[0] == "UNAVAILABLE" and "same-host" in refusal[1], refusal
        chain = chain_of("idle")
        with client(node, WRITE) as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
            assert served(kv, chain) and kv.plane == "shm"
        assert all(closed_by_node(r, within=20) for r in held)  # idle past 3 s: closed
        with client(node, READ, "shm") as kv:  # and the reader is welcome again
            assert served(kv, chain)
    finally:
        for r in held:
            r.close()
        node.close()


def test_a_refused_client_falls_back_and_comes_back(tmp_path: Path) -> None:
    node = cap_node(tmp_path, "share", tokens=[f"{ALICE} alice", f"{BOB} bob"], shm_max_connections=8)
    held: list[Raw] = []
    try:
        chain = chain_of("share")
        with client(node, ALICE, "grpc") as a:
            a.put(NS, LAYOUT, chain, [page(h) for h in chain])
        path = socket_of_token(node, ALICE)
        held = [Raw(path, token=ALICE) for _ in range(4)]  # alice holds her tenant's whole share
        with client(node, BOB) as bob:  # bob, another tenant, still gets the plane
            bob.put(NS, LAYOUT, chain, [page(h) for h in chain])
            assert bob.plane == "shm"
        with client(node, ALICE, "shm") as only_shm, pytest.raises(PlaneUnavailable, match="refused a connection"):
            only_shm.get(NS, chain)
        with client(node, ALICE) as auto:
            assert served(auto, chain) and auto.plane == "tcp"  # refused before anything was sent: the next plane
            for r in held:
                r.close()
            held = []

            def back_on_shm() -> bool:
                assert served(auto, chain)
                return auto.plane == "shm"

            wait_for(back_on_shm, timeout=30, what="the client back on the same-host plane")
    finally:
        for r in held:
            r.close()
        node.close()


def socket_of_token(node: NodeProcess, token: str) -> str:
    with client(node, token, "grpc") as kv:
        return next(p.address for p in kv.stats().planes if p.name == "shm")
