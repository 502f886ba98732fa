"""The bulk TCP data plane on real nodes: round trips through DRAM and NVMe, get_into, negotiation and
fallback, tokens and roles, TLS and mutual TLS. Bad frames and faults: test_tcp_faults.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import psutil
import pytest

from devkit.pki import DevPki, make_dev_pki
from kvstore.cli.launch import NodeProcess
from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.client import core as client_core
from kvstore.client.exchange import Blocking, Exchange, advance
from kvstore.client.planes.tcp import TcpPlane
from kvstore.errors import PermissionDenied, PlaneUnavailable, Unauthenticated, Unavailable
from kvstore.names import TierKind
from kvstore.security import ClientSecurity
from kvstore.stats import PlaneInfo
from kvstore.wire import tcp as tcp_frames
from tests.integration.conftest import LAYOUT, NS, PAGE, key, page, start_node

WRITE = "w-" + "t" * 30
READ = "r-" + "u" * 30
T = TypeVar("T")


@pytest.fixture(scope="module")
def tcp_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    n = start_node(tmp_path_factory.mktemp("tcp"), dram_pages=8, nvme_pages=512, name="tcp0")  # nothing evicted
    yield n
    n.close()  # pytest runs this teardown whatever the tests did


def tcp_client(node: NodeProcess, **kw: object) -> KVStoreClient:
    return KVStoreClient(node.addr, timeout=30, transport="tcp", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("writer", ["grpc", "shm", "tcp"])
def test_pages_cross_planes_bit_exact_through_dram_and_nvme(tcp_node: NodeProcess, writer: str) -> None:
    """Pages written on any plane read back over TCP bit-exact, from DRAM and from NVMe, with the tier
    each came from; a TCP put of them again finds them all present."""
    chain = [key(i, f"cross-{writer}") for i in range(20)]  # 8 DRAM slots: most of the chain lands on NVMe
    pages = {h: page(h) for h in chain}
    with KVStoreClient(tcp_node.addr, transport=writer) as w:
        assert w.put(NS, LAYOUT, chain, list(pages.values())).stored == len(chain)
    with tcp_client(tcp_node) as kv:
        placed = kv.lookup_detail(NS, chain).tiers
        fetched = kv.get_pages(NS, [*chain, key(999, "absent")], promote=False)  # the prefix ends there
        assert kv.plane == "tcp" and len(fetched) == len(chain)
        assert all(bytes(p.data) == pages[p.hash] for p in fetched)
        assert [p.tier for p in fetched] == placed and set(placed) == {TierKind.DRAM, TierKind.NVME}
        assert kv.put(NS, LAYOUT, chain, list(pages.values())).already_present == len(chain)


def test_get_into_lands_pages_in_caller_buffers(tcp_node: NodeProcess) -> None:
    chain = [key(i, "into") for i in range(12)]
    with tcp_client(tcp_node, pages_per_call=5) as kv:  # several calls: buffers are indexed across them
        kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
        arena = bytearray(13 * PAGE)
        bufs = [memoryview(arena)[i * PAGE : (i + 1) * PAGE] for i in range(13)]
        refs = kv.get_into(NS, [*chain, key(0, "missing")], bufs, promote=False)
        assert [r.hash for r in refs] == chain and all(r.nbytes == PAGE for r in refs)
        assert [bytes(b) for b in bufs[:12]] == [page(h) for h in chain] and not any(bufs[12])
        small = [memoryview(bytearray(PAGE - 1))]
        with pytest.raises(ValueError, match="cannot hold"):
            kv.get_into(NS, chain[:1], small, promote=False)
        assert [bytes(p) for p in kv.get(NS, chain[:2])] == [page(h) for h in chain[:2]]  # still serves


def test_a_page_corrupted_in_flight_is_refused(tcp_node: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    h = key(0, "in-flight")
    with tcp_client(tcp_node) as kv:
        kv.put(NS, LAYOUT, [h], [page(h)])
        real = tcp_frames.parse_page

        def flipped(meta: bytes) -> tuple[bytes, int, int]:  # this client reads every checksum off by one bit
            got, checksum, tier = real(meta)
            return got, checksum ^ 1, tier

        with monkeypatch.context() as m:
            m.setattr(tcp_frames, "parse_page", flipped)
            assert kv.get(NS, [h]) == []  # a miss: the damaged page is never handed out
        stats = kv.stats()
        assert (stats.corrupt_reports, stats.corrupt_confirmed) == (1, 0)  # reported; the node's copy is intact
        assert bytes(kv.get(NS, [h])[0]) == page(h)  # a fresh connection serves the next call


def test_asyncio_client_and_concurrent_calls_share_a_pool(tcp_node: NodeProcess) -> None:
    async def main() -> None:
        async with AsyncKVStoreClient(tcp_node.addr, transport="tcp") as kv:

            async def one(w: int) -> None:
                hs = [key(i, f"async{w}") for i in range(3)]
                await kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
                assert [bytes(p) for p in await kv.get(NS, hs)] == [page(h) for h in hs]

            await asyncio.gather(*(one(w) for w in range(6)))
            assert kv.plane == "tcp"
            port = int(next(p for p in (await kv.stats()).planes if p.name == "tcp").address.rsplit(":", 1)[1])
            # NOTE: seen from outside: this process's open connections to the node's TCP plane. Six calls at
            # once over a pool: reused, a few kept, not one per call left open.
            held = [c for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port]
            assert 1 <= len(held) <= 4, held

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_client_on_another_host_negotiates_tcp(tcp_node: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    # The choice rule itself is pure (tests/unit); here a real node and client agree on the plane.
    monkeypatch.setattr(client_core, "is_loopback", lambda target: False)
    monkeypatch.setattr(client_core, "host_id", lambda: "some-other-host")
    with KVStoreClient(tcp_node.addr) as kv:
        h = key(0, "remote")
        kv.put(NS, LAYOUT, [h], [page(h)])
        assert kv.plane == "tcp"
        tcp = next(p for p in kv.stats().planes if p.name == "tcp")
        assert tcp.address.startswith("127.0.0.1:") and not tcp.tls


def test_a_node_without_tcp_falls_back_or_refuses_as_asked(tmp_path: Path) -> None:
    node = start_node(tmp_path, name="notcp", extra_args=["--no-tcp", "--no-shm"])
    try:
        chain = [key(i, "fb") for i in range(3)]
        with tcp_client(node) as kv, pytest.raises(PlaneUnavailable, match="does not serve the tcp"):
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
        with KVStoreClient(node.addr) as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
            assert kv.plane == "grpc"
    finally:
        node.close()


def test_an_unreachable_tcp_plane_falls_back_to_grpc(tcp_node: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.cli.waits import free_port

    real = client_core.PLANES["tcp"].make
    closed = free_port()  # nothing listens there: the connection is refused before anything was sent

    def make(settings: client_core.ClientSettings, info: object) -> object:
        plane = real(settings, info)
        plane.port = closed  # type: ignore[attr-defined]
        return plane

    monkeypatch.setitem(client_core.PLANES, "tcp", client_core.PlaneSpec(make))
    monkeypatch.setattr(client_core, "is_loopback", lambda target: False)
    monkeypatch.setattr(client_core, "host_id", lambda: "some-other-host")
    with KVStoreClient(tcp_node.addr) as kv:
        h = key(0, "unreachable")
        kv.put(NS, LAYOUT, [h], [page(h)])
        assert kv.plane == "grpc" and bytes(kv.get(NS, [h])[0]) == page(h)


# -- tokens, roles, TLS --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return make_dev_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure_node(tmp_path_factory: pytest.TempPathFactory, pki: DevPki) -> Iterator[NodeProcess]:
    d = tmp_path_factory.mktemp("tcp-tls")
    (d / "w").write_text(WRITE + "\n")
    (d / "r").write_text(READ + "\n")
    for name in ("w", "r"):
        (d / name).chmod(0o600)  # token files must be private
    n = start_node(d, name="tcp-tls", extra_args=[
        "--tls-cert", str(pki.node_cert), "--tls-key", str(pki.node_key),
        "--auth-tokens-file", str(d / "w"), "--auth-read-tokens-file", str(d / "r")])  # fmt: skip
    yield n
    n.close()  # pytest runs this teardown whatever the tests did


def secure(node: NodeProcess, pki: DevPki, token: str | None, **tls: str) -> KVStoreClient:
    return tcp_client(node, security=ClientSecurity(token=token, ca_file=tls.pop("ca_file", str(pki.ca)), **tls))


def test_tls_and_tokens_on_the_tcp_plane(secure_node: NodeProcess, pki: DevPki) -> None:
    chain = [key(i, "sec") for i in range(3)]
    pages = [page(h) for h in chain]
    with secure(secure_node, pki, WRITE) as kv:
        assert next(p for p in kv.stats().planes if p.name == "tcp").tls
        assert kv.put(NS, LAYOUT, chain, pages).stored == 3
        assert [bytes(p) for p in kv.get(NS, chain)] == pages
        assert kv.plane == "tcp"
    with secure(secure_node, pki, READ) as ro:
        assert [bytes(p) for p in ro.get(NS, chain)] == pages
        other = [key(9, "ro")]
        with pytest.raises(PermissionDenied, match="read-write token"):
            ro.put(NS, LAYOUT, other, [page(other[0])])
        assert ro.lookup(NS, other) == 0  # nothing stored
        assert [bytes(p) for p in ro.get(NS, chain)] == pages  # the refusal left the connection usable
    info = tcp_info(secure_node, ClientSecurity(token=READ, ca_file=str(pki.ca)))
    with pytest.raises(Unauthenticated, match="unknown token"):  # checked in the handshake, before any request
        drive(direct_plane(info, secure_node, ClientSecurity(token="x" * 40, ca_file=str(pki.ca))).get(NS, chain, True))
    with pytest.raises(Unavailable, match="certificate failed verification"):  # a CA that did not sign the node
        drive(
            direct_plane(info, secure_node, ClientSecurity(token=WRITE, ca_file=str(pki.other_ca))).get(NS, chain, True)
        )
    with pytest.raises(PlaneUnavailable, match="no CA"):  # a plaintext client never sends pages in clear
        drive(direct_plane(info, secure_node, ClientSecurity(token=WRITE)).get(NS, chain, True))


def tcp_info(node: NodeProcess, security: ClientSecurity) -> PlaneInfo:
    with KVStoreClient(node.addr, timeout=30, security=security) as kv:
        return next(p for p in kv.stats().planes if p.name == "tcp")


def direct_plane(info: PlaneInfo, node: NodeProcess, security: ClientSecurity) -> TcpPlane:
    """The TCP plane alone, without the gRPC channel (which would refuse these credentials first)."""
    return TcpPlane(info, target=node.addr, pages_per_call=64, verify=True, security=security, timeout=10)


def drive(exchange: Exchange[T]) -> T:
    """Run a plane's exchange as the blocking client does (the TCP plane yields only Blocking ops)."""
    op, value = advance(exchange)
    while op is not None:
        assert isinstance(op, Blocking)
        try:
            op, value = advance(exchange, op.fn())
        except Exception as exc:
            op, value = advance(exchange, None, exc)
    return value  # type: ignore[return-value]


def test_mutual_tls_on_the_tcp_plane(tmp_path: Path, pki: DevPki) -> None:
    node = start_node(tmp_path, name="tcp-mtls", extra_args=[
        "--tls-cert", str(pki.node_cert), "--tls-key", str(pki.node_key), "--tls-client-ca", str(pki.ca)])  # fmt: skip
    try:
        cert = {"cert_file": str(pki.client_cert), "key_file": str(pki.client_key)}
        with secure(node, pki, None, **cert) as kv:
            h = key(0, "mtls")
            kv.put(NS, LAYOUT, [h], [page(h)])
            assert bytes(kv.get(NS, [h])[0]) == page(h) and kv.plane == "tcp"
    finally:
        node.close()
