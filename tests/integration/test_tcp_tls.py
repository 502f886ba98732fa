"""The TCP plane under TLS, where a reply outgrows the socket buffers: OpenSSL's socket path on the node (which hands
the record layer to the kernel where the kernel has kTLS), writes that must wait for room, a reader that stops, and
kTLS itself where this kernel offers it (skipped, with why, where it does not)."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.pki import DevPki, make_dev_pki
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.client.planes.tcp import client_tls_context
from kvstore.layout import DType, PageLayout
from kvstore.node.planes.tcp_io import kernel_tls_available, kernel_tls_tx
from kvstore.pageformat import slot_bytes_for
from kvstore.security import ClientSecurity
from kvstore.wire import tcp
from kvstore.wire.tcp import Kind
from tests.integration.conftest import key, page

BIG = PageLayout(DType.FLOAT16, num_layers=64, num_kv_heads=2, head_dim=64, block_size=16)  # 1 MiB pages
NS = "it/tls-big"
PAGES = 24  # 24 MiB in one reply: three times what the node's and the client's socket buffers hold together
STALL_S = 1.5  # the node's tcp_timeout_seconds here


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return make_dev_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_node(pki: DevPki) -> Iterator[NodeProcess]:
    n = NodeProcess(dram_bytes=(PAGES + 4) * slot_bytes_for(BIG.page_bytes), max_page_bytes=BIG.page_bytes,
                    node_id="tls-big", extra_args=["--tls-cert", str(pki.node_cert), "--tls-key", str(pki.node_key)],
                    env={"KVSTORE_TCP_TIMEOUT_SECONDS": str(STALL_S)}).start()  # fmt: skip
    yield n
    n.close()  # pytest runs this teardown whatever the tests did


@pytest.fixture(scope="module")
def stored(tls_node: NodeProcess, pki: DevPki) -> list[bytes]:
    chain = [key(i, "tls-big") for i in range(PAGES)]
    with KVStoreClient(tls_node.addr, timeout=60, transport="tcp", security=ClientSecurity(ca_file=str(pki.ca))) as kv:
        assert kv.put(NS, BIG, chain, [page(h, BIG.page_bytes) for h in chain]).stored == PAGES
    return chain


def test_a_reply_larger_than_the_socket_buffers_arrives_whole_and_verified(
    tls_node: NodeProcess, pki: DevPki, stored: list[bytes]
) -> None:
    with KVStoreClient(tls_node.addr, timeout=60, transport="tcp", security=ClientSecurity(ca_file=str(pki.ca))) as kv:
        for _ in range(2):  # the second on the pooled connection: the stream stayed in step
            got = kv.get(NS, stored)
            assert kv.plane == "tcp" and [bytes(p) for p in got] == [page(h, BIG.page_bytes) for h in stored]
        bufs = [memoryview(bytearray(BIG.page_bytes)) for _ in stored]
        assert len(kv.get_into(NS, stored, bufs)) == PAGES
        assert [bytes(b) for b in bufs] == [page(h, BIG.page_bytes) for h in stored]


def test_a_tls_reader_that_stops_is_cut_by_the_stall_timeout(
    tls_node: NodeProcess, pki: DevPki, stored: list[bytes]
) -> None:
    """The node's writes wait for room in the socket's buffer; a client that stops reading mid-reply makes no room,
    and the node closes the connection once nothing moved for tcp_timeout_seconds (its leases freed)."""
    with KVStoreClient(tls_node.addr, timeout=30, security=ClientSecurity(ca_file=str(pki.ca))) as kv:
        port = int(next(p for p in kv.stats().planes if p.name == "tcp").address.rsplit(":", 1)[1])
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    tls = client_tls_context(ClientSecurity(ca_file=str(pki.ca))).wrap_socket(raw, server_hostname="localhost")
    try:
        tls.sendall(tcp.hello(None))
        assert Kind(tcp.HEADER.unpack(tls.recv(tcp.HEADER_BYTES))[2]) is Kind.WELCOME
        tls.sendall(tcp.get(NS, stored, False))
        time.sleep(STALL_S + 3)  # read nothing meanwhile: the node's sends stall
        tls.settimeout(15)
        assert drain(tls) < PAGES * (tcp.PAGE_FRAME_HEAD_BYTES + BIG.page_bytes)  # what the buffers held, then EOF
    finally:
        tls.close()
    with KVStoreClient(tls_node.addr, timeout=60, transport="tcp", security=ClientSecurity(ca_file=str(pki.ca))) as kv:
        assert len(kv.get(NS, stored[:2])) == 2  # the node serves on, its leases of the cut reply released


def drain(tls: ssl.SSLSocket) -> int:
    """Bytes read until the peer closed the connection (EOF, a reset, or a close without TLS's close_notify);
    a time-out (the peer still open) fails the test."""
    total = 0
    try:
        while chunk := tls.recv(1 << 16):
            total += len(chunk)
    except (ConnectionResetError, ssl.SSLEOFError, ssl.SSLZeroReturnError):
        pass
    return total


@pytest.mark.skipif(not kernel_tls_available(), reason="this kernel has no kTLS (no 'tls' TCP upper-layer protocol)")
def test_where_the_kernel_has_ktls_openssl_hands_it_the_records(
    tls_node: NodeProcess, pki: DevPki, stored: list[bytes]
) -> None:
    with KVStoreClient(tls_node.addr, timeout=60, transport="tcp", security=ClientSecurity(ca_file=str(pki.ca))) as kv:
        assert [bytes(p) for p in kv.get(NS, stored[:4])] == [page(h, BIG.page_bytes) for h in stored[:4]]
        port = int(next(p for p in kv.stats().planes if p.name == "tcp").address.rsplit(":", 1)[1])
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    with client_tls_context(ClientSecurity(ca_file=str(pki.ca))).wrap_socket(raw, server_hostname="localhost") as tls:
        tls.sendall(tcp.hello(None))
        tls.recv(64)
        assert kernel_tls_tx(tls), f"OpenSSL did not hand {tls.version()} {tls.cipher()} to the kernel"


def test_the_ktls_probe_agrees_with_the_kernels_list() -> None:
    listed = Path("/proc/sys/net/ipv4/tcp_available_ulp")
    if listed.exists() and "tls" in listed.read_text().split():
        assert kernel_tls_available()
    a, b = socket.socketpair()
    with a, b:
        assert kernel_tls_tx(a) is False  # a socket without the "tls" layer: no kernel TLS
