"""The TCP plane's connection cap under attack (SECURITY.md, round 3, finding 5), with raw sockets against real nodes.

Before: 55 connections that never said HELLO against a cap of 50 turned every remote client away
(Unavailable instead of a fallback to gRPC); at the default cap of 1,024, ~1,100 idle sockets failed
7 of 83 gets; a stall inside a frame header after HELLO held its connection past tcp_timeout_seconds;
idle authenticated connections never expired, so one tenant could hold the whole cap. Now handshakes
have their own bounded room and a short deadline, authenticated callers keep theirs, a partial header
is a stall like any other, idle connections expire, each tenant holds at most its share, and a client
the plane refuses falls back to gRPC (PlaneUnavailable before anything was sent) and comes back later.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.errors import PlaneUnavailable
from kvstore.security import ClientSecurity
from kvstore.wire import tcp
from kvstore.wire.tcp import Kind
from tests.integration.conftest import LAYOUT, NS, key, page, start_node
from tests.integration.test_tcp_faults import Raw
from tests.security.conftest import private_file, wait_for

ALICE = "alice-tcp-" + "a" * 24
BOB = "bob-tcp---" + "b" * 24


def cap_node(tmp_path: Path, name: str, extra: list[str] | None = None, **env: object) -> NodeProcess:
    """A node whose clients on this host use the TCP plane (no shm), with two tenants' tokens."""
    rw = private_file(tmp_path / f"{name}.tokens", f"{ALICE} alice\n{BOB} bob\n")
    return start_node(tmp_path, name=name, nvme_pages=0,
                      extra_args=["--no-shm", "--auth-tokens-file", str(rw), *(extra or [])],
                      env={f"KVSTORE_{k.upper()}": str(v) for k, v in env.items()})  # fmt: skip


def client(node: NodeProcess, token: str, transport: str = "auto", **kw: object) -> KVStoreClient:
    return KVStoreClient(node.addr, timeout=30, transport=transport, security=ClientSecurity(token=token, **kw))  # type: ignore[arg-type]


def port_of(kv: KVStoreClient) -> int:
    return int(next(p for p in kv.stats().planes if p.name == "tcp").address.rsplit(":", 1)[1])


@contextlib.contextmanager
def silent_sockets(port: int, n: int) -> Iterator[list[socket.socket]]:
    """`n` connections to the plane that never send a byte, a few milliseconds apart (so the node accepts
    each before the next: a burst all accepted at once is refused by the old code's own count)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.settimeout(5)
            with contextlib.suppress(OSError):  # a full backlog may refuse some: the flood goes on
                s.connect(("127.0.0.1", port))
            socks.append(s)
            time.sleep(0.003)
        yield socks
    finally:
        for s in socks:
            s.close()


def chain_of(tag: str, n: int = 3) -> list[bytes]:
    return [key(i, tag) for i in range(n)]


@pytest.mark.parametrize(("cap", "flood"), [(50, 55), (None, 1100)], ids=["cap-50", "default-cap"])
def test_connections_that_never_say_hello_leave_authenticated_callers_served(
    tmp_path: Path, cap: int | None, flood: int
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < flood + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, flood + 1024), hard))
    node = cap_node(tmp_path, "flood", **({"tcp_max_connections": cap} if cap else {}))
    try:
        chain = chain_of("flood")
        with client(node, ALICE) as early, client(node, ALICE) as late:
            early.put(NS, LAYOUT, chain, [page(h) for h in chain])  # early's TCP connection is open and pooled
            assert early.plane == "tcp"
            with silent_sockets(port_of(early), flood):
                gets = [(early.get(NS, chain), late.get(NS, chain)) for _ in range(83)]
                # Every get is served: early on its authenticated connection, late (whose new connection
                # met a full handshake room) by gRPC streams after PlaneUnavailable.
                assert all([bytes(p) for p in g] == [page(h) for h in chain] for pair in gets for g in pair)
                assert early.plane == "tcp"
                assert late.plane in ("tcp", "grpc")
    finally:
        node.close()


def test_a_tls_plane_flooded_with_handshakes_also_falls_back(tmp_path: Path) -> None:
    from devkit.pki import make_dev_pki

    pki = make_dev_pki(tmp_path / "pki")
    tls = ["--tls-cert", str(pki.node_cert), "--tls-key", str(pki.node_key)]
    node = cap_node(tmp_path, "tlsflood", tls, tcp_max_connections=16, tcp_max_handshakes=4)
    try:
        chain = chain_of("tls")
        with client(node, ALICE, ca_file=str(pki.ca)) as kv:
            kv.put(NS, LAYOUT, chain[:1], [page(chain[0])])
            port = port_of(kv)
            kv.close()
        with silent_sockets(port, 40), client(node, ALICE, ca_file=str(pki.ca)) as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])  # refused in the TLS handshake: gRPC
            assert [bytes(p) for p in kv.get(NS, chain)] == [page(h) for h in chain]
            assert kv.plane == "grpc"
    finally:
        node.close()


def test_a_silent_connection_gets_only_the_hello_deadline(tmp_path: Path) -> None:
    node = cap_node(tmp_path, "hello", tcp_hello_timeout_seconds=1.0, tcp_timeout_seconds=30)
    try:
        with client(node, ALICE) as kv:
            raw = Raw(port_of(kv), token=None)
            assert raw.closed(within=15)  # cut by the HELLO deadline (1 s), not the 30 s stall timeout
            raw.close()
    finally:
        node.close()


def test_a_partial_header_after_hello_is_a_stall_and_idle_connections_expire(tmp_path: Path) -> None:
    node = cap_node(tmp_path, "stall", tcp_timeout_seconds=1.0, tcp_idle_seconds=4.0)
    try:
        with client(node, ALICE) as kv:
            port = port_of(kv)
            h = key(0, "stall")
            kv.put(NS, LAYOUT, [h], [page(h)])
            partial, idle = Raw(port, token=ALICE), Raw(port, token=ALICE)
            partial.send(tcp.get(NS, [h], True)[: tcp.HEADER_BYTES - 3])  # a header, short by 3 bytes
            assert partial.closed(within=3.5)  # the stall timeout (1 s), well before the idle one (4 s)
            idle.send(tcp.get(NS, [h], True))  # the idle one is still open and served...
            assert idle.frame()[0] is Kind.PAGE and idle.frame()[0] is Kind.DONE
            assert idle.closed(within=15)  # ...until it idles for tcp_idle_seconds
            for r in (partial, idle):
                r.close()
            # A client whose pooled connection expired reopens one and stays on the TCP plane.
            kv.get(NS, [h])
            time.sleep(5.0)
            assert [bytes(p) for p in kv.get(NS, [h])] == [page(h)] and kv.plane == "tcp"
    finally:
        node.close()


def test_one_tenant_cannot_hold_the_whole_plane(tmp_path: Path) -> None:
    node = cap_node(tmp_path, "share", tcp_max_connections=8)  # a tenant's share: half, 4
    held: list[Raw] = []
    try:
        chain = chain_of("share")
        with client(node, ALICE, "grpc") as a:
            a.put(NS, LAYOUT, chain, [page(h) for h in chain])
            port = port_of(a)
        held = [Raw(port, token=ALICE) for _ in range(4)]  # alice holds her whole share
        extra = Raw(port, token=None)
        extra.send(tcp.hello(ALICE))
        status, msg = extra.error()
        assert status == "UNAVAILABLE" and "'alice' holds 4" in msg
        assert extra.closed()
        with client(node, BOB) as bob:  # bob, another tenant, still gets the plane
            bob.put(NS, LAYOUT, chain, [page(h) for h in chain])
            assert bob.plane == "tcp"
        # Alice's refused client: PlaneUnavailable reached the client before anything was sent, so auto
        # mode served the call by gRPC, stored once; asked for TCP alone, the refusal surfaces as such.
        with client(node, ALICE, "tcp") as only_tcp, pytest.raises(PlaneUnavailable, match="refused a connection"):
            only_tcp.get(NS, chain)
        with client(node, ALICE) as auto:
            more = chain_of("share-more")
            assert auto.put(NS, LAYOUT, more, [page(h) for h in more]).stored == 3
            assert [bytes(p) for p in auto.get(NS, more)] == [page(h) for h in more]
            assert auto.plane == "grpc"
            for r in held:  # alice lets go: after its retry interval her client is back on the TCP plane
                r.close()
            held = []

            def back_on_tcp() -> bool:
                assert [bytes(p) for p in auto.get(NS, more)] == [page(h) for h in more]
                return auto.plane == "tcp"

            wait_for(back_on_tcp, timeout=30, what="the client back on the TCP plane")
    finally:
        for r in held:
            r.close()
        node.close()
