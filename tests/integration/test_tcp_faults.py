"""Bad frames and faults on the TCP plane of a real node, through a raw socket that can break the format
in ways the client never does. Each gets a clear ERROR or a closed connection, leaves nothing stored
(the tiers' pages and bytes unchanged), and never holds up another client."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.pageformat import payload_checksum, wire_checksum
from kvstore.security import ClientSecurity
from kvstore.wire import PutOpen, tcp
from kvstore.wire.tcp import Kind
from tests.integration.conftest import LAYOUT, NS, PAGE, key, page, start_node

WRITE = "w-" + "f" * 30
READ = "r-" + "g" * 30
TIMEOUT_S = 1.5  # the node's tcp_timeout_seconds here: stalls are cut after this


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    d = tmp_path_factory.mktemp("tcp-faults")
    (d / "w").write_text(WRITE + "\n")
    (d / "r").write_text(READ + "\n")
    for name in ("w", "r"):
        (d / name).chmod(0o600)  # token files must be private
    n = start_node(d, name="faults", dram_pages=8, nvme_pages=0,
                   extra_args=["--auth-tokens-file", str(d / "w"), "--auth-read-tokens-file", str(d / "r")],
                   env={"KVSTORE_TCP_TIMEOUT_SECONDS": str(TIMEOUT_S)})  # fmt: skip
    yield n
    n.close()  # pytest runs this teardown whatever the tests did


@pytest.fixture(scope="module")
def kv(node: NodeProcess) -> Iterator[KVStoreClient]:
    with KVStoreClient(node.addr, timeout=30, transport="tcp", security=ClientSecurity(token=WRITE)) as c:
        yield c


def plane_port(kv: KVStoreClient) -> int:
    return int(next(p for p in kv.stats().planes if p.name == "tcp").address.rsplit(":", 1)[1])


class Raw:
    """A hand-driven connection to the TCP plane."""

    def __init__(self, port: int, token: str | None = WRITE) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if token is not None:
            self.send(tcp.hello(token))
            assert self.frame()[0] is Kind.WELCOME

    def send(self, *parts: bytes) -> None:
        for p in parts:
            self.sock.sendall(p)

    def exactly(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError(f"closed after {len(out)} of {n} bytes")
            out += chunk
        return bytes(out)

    def frame(self) -> tuple[Kind, bytes, bytes]:
        _, _, kind, meta_len, body_len = tcp.HEADER.unpack(self.exactly(tcp.HEADER_BYTES))
        return Kind(kind), self.exactly(meta_len), self.exactly(body_len)

    def error(self) -> tuple[str, str]:
        kind, meta, _ = self.frame()
        assert kind is Kind.ERROR, kind
        return tcp.parse_error(meta)

    def closed(self, within: float = 10.0) -> bool:
        """Whether the node closed the connection (EOF or reset) within `within` seconds."""
        self.sock.settimeout(within)
        try:
            while self.sock.recv(65536):
                pass
            return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


def put_open(n: int, ns: str = NS) -> bytes:
    return tcp.put(PutOpen(ns, LAYOUT), n)


def page_frame(h: bytes, data: bytes | None = None, checksum: int | None = None) -> bytes:
    data = page(h) if data is None else data
    return tcp.page_header(h, wire_checksum(NS, h, data) if checksum is None else checksum, len(data)) + data


def held(kv: KVStoreClient) -> list[tuple[int, int, int]]:
    """What the tiers hold: (tier, pages, used bytes)."""
    return [(int(t.tier), t.pages, t.used_bytes) for t in kv.stats().tiers]


def round_trip(kv: KVStoreClient, tag: str) -> None:
    hs = [key(i, tag) for i in range(2)]
    kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
    assert [bytes(p) for p in kv.get(NS, hs)] == [page(h) for h in hs]
    kv.delete(NS, hs)


def test_a_well_formed_raw_put_and_get(kv: KVStoreClient) -> None:
    raw = Raw(plane_port(kv))
    h = key(0, "raw")
    raw.send(put_open(1), page_frame(h))
    kind, meta, _ = raw.frame()
    assert kind is Kind.DONE and tcp.parse_done(meta) == (1, 0)
    raw.send(tcp.get(NS, [h, key(1, "raw")], True))
    kind, meta, body = raw.frame()
    assert kind is Kind.PAGE and body == page(h) and tcp.parse_page(meta)[1] == wire_checksum(NS, h, body)
    kind, meta, _ = raw.frame()
    assert kind is Kind.DONE and tcp.parse_done(meta) == (1, 0)  # the prefix ends at the missing page
    raw.close()
    kv.delete(NS, [h])


def test_a_client_of_frame_version_1_is_served_with_payload_checksums(kv: KVStoreClient) -> None:
    """Clients that predate keyed checksums speak version 1: the node answers them in version 1, with the
    payload's XXH3-64 alone, both ways (wire/tcp.py)."""
    raw = Raw(plane_port(kv), token=None)
    raw.send(tcp.hello(WRITE)[:2] + bytes([1]) + tcp.hello(WRITE)[3:])  # the same HELLO, in version 1
    head = tcp.HEADER.unpack(raw.exactly(tcp.HEADER_BYTES))
    assert head[1] == 1 and Kind(head[2]) is Kind.WELCOME
    raw.exactly(head[3])
    h = key(0, "v1")
    v1 = bytes([1])
    opening = put_open(1)
    frame_ = page_frame(h, checksum=payload_checksum(page(h)))
    raw.send(opening[:2] + v1 + opening[3:], frame_[:2] + v1 + frame_[3:])
    kind, meta, _ = raw.frame()
    assert kind is Kind.DONE and tcp.parse_done(meta) == (1, 0)
    get = tcp.get(NS, [h], True)
    raw.send(get[:2] + v1 + get[3:])
    kind, meta, body = raw.frame()
    assert kind is Kind.PAGE and body == page(h) and tcp.parse_page(meta)[1] == payload_checksum(body)
    raw.close()
    kv.delete(NS, [h])


def test_a_page_of_the_wrong_length_is_refused_and_the_connection_stays_usable(kv: KVStoreClient) -> None:
    before = held(kv)
    raw = Raw(plane_port(kv))
    a, b = key(0, "len"), key(1, "len")
    raw.send(put_open(2), page_frame(a), page_frame(b, data=page(b)[:-2]))
    status, msg = raw.error()
    assert status == "INVALID_ARGUMENT" and "page.payload_bytes" in msg
    assert held(kv) == before  # page a was staged, then released with the refused PUT
    raw.send(put_open(1), page_frame(a))  # the node consumed the refused request: the stream is in step
    assert raw.frame()[0] is Kind.DONE
    raw.close()
    kv.delete(NS, [a])


@pytest.mark.parametrize(("frame", "field"), [
    (b"XX" + tcp.pack_header(Kind.GET, 0)[2:], "frame.magic"),
    (tcp.HEADER.pack(tcp.MAGIC, 99, Kind.GET, 0, 0), "frame.version"),
    (tcp.HEADER.pack(tcp.MAGIC, tcp.VERSION, 42, 0, 0), "frame.kind"),
    (tcp.pack_header(Kind.GET, 1 << 30), "frame.meta_len"),  # refused before anything is allocated
    (tcp.pack_header(Kind.PAGE, tcp.PAGE_META_BYTES, 1 << 40), "frame.body_len"),
    (tcp.pack_header(Kind.GET, 0, 5), "frame.body_len"),  # only PAGE frames carry a body
    (tcp.frame(Kind.DONE, bytes(8)), "frame.kind"),  # not a request
    (tcp.pack_header(Kind.PUT, 10) + bytes(10), "frame.meta_len"),
    (put_open(0), "put.npages"),
])  # fmt: skip
def test_framing_errors_are_answered_then_the_connection_is_closed(kv: KVStoreClient, frame: bytes, field: str) -> None:
    before = held(kv)
    raw = Raw(plane_port(kv))
    raw.send(frame)
    status, msg = raw.error()
    assert status == "INVALID_ARGUMENT" and field in msg, msg
    assert raw.closed()
    assert held(kv) == before


def test_a_checksum_mismatch_stores_nothing(kv: KVStoreClient) -> None:
    before = held(kv)
    raw = Raw(plane_port(kv))
    a, b = key(0, "sum"), key(1, "sum")
    raw.send(put_open(2), page_frame(a), page_frame(b, checksum=wire_checksum(NS, b, page(b)) ^ 1))
    status, msg = raw.error()
    assert status == "DATA_LOSS" and "checksum" in msg
    assert held(kv) == before and kv.lookup(NS, [a, b]) == 0  # atomic: not even the good page
    raw.close()


def test_a_silent_client_is_cut_after_the_handshake_timeout(kv: KVStoreClient) -> None:
    raw = Raw(plane_port(kv), token=None)  # connects, sends nothing
    t0 = time.monotonic()
    round_trip(kv, "silent")  # served meanwhile
    assert raw.closed(within=TIMEOUT_S + 10)
    assert time.monotonic() - t0 >= TIMEOUT_S * 0.9


def test_a_stalled_or_vanished_client_mid_page_stores_nothing_and_blocks_no_one(kv: KVStoreClient) -> None:
    before = held(kv)
    port = plane_port(kv)
    a, b = key(0, "mid"), key(1, "mid")
    stalled, gone = Raw(port), Raw(port)
    stalled.send(put_open(2), page_frame(a), page_frame(b)[: PAGE // 2])  # then says nothing more
    gone.send(put_open(2), page_frame(a), page_frame(b)[: PAGE // 2])
    gone.close()  # disconnects mid-page
    round_trip(kv, "meanwhile")  # another client is served while one connection stalls mid-page
    assert stalled.closed(within=TIMEOUT_S + 10)  # cut by the stall timeout
    assert held(kv) == before and kv.lookup(NS, [a, b]) == 0


def test_unknown_tokens_and_read_tokens_on_writes(kv: KVStoreClient) -> None:
    port = plane_port(kv)
    for token in ("", "x" * 40):
        raw = Raw(port, token=None)
        raw.send(tcp.hello(token))
        status, msg = raw.error()
        assert status == "UNAUTHENTICATED", msg
        assert raw.closed()
    before = held(kv)
    ro = Raw(port, token=READ)
    h = key(0, "ro")
    ro.send(put_open(1), page_frame(h))
    status, msg = ro.error()
    assert status == "PERMISSION_DENIED" and "read-write token" in msg
    assert held(kv) == before
    kv.put(NS, LAYOUT, [h], [page(h)])
    ro.send(tcp.get(NS, [h], True))  # reads are allowed on the same connection
    assert ro.frame()[2] == page(h)
    ro.close()
    kv.delete(NS, [h])


def test_a_request_error_names_the_field(kv: KVStoreClient) -> None:
    raw = Raw(plane_port(kv))
    raw.send(tcp.get("never-used/ns", [key(0)], True))
    assert raw.error()[0] == "NOT_FOUND"
    raw.send(tcp.frame(Kind.GET, tcp.get(NS, [], True)[tcp.HEADER_BYTES :] + bytes(1)))  # sizes do not add up
    status, msg = raw.error()
    assert status == "INVALID_ARGUMENT" and "frame.meta_len" in msg
    raw.close()


def test_connections_over_the_limit_are_refused(tmp_path: Path) -> None:
    n = start_node(tmp_path, name="conns", env={"KVSTORE_TCP_MAX_CONNECTIONS": "2",
                                                "KVSTORE_TCP_MAX_CONNECTIONS_PER_TENANT": "2"})  # fmt: skip
    try:
        with KVStoreClient(n.addr, transport="tcp") as c:
            port = plane_port(c)
            held_open = [Raw(port, token=""), Raw(port, token="")]
            extra = Raw(port, token=None)
            extra.send(tcp.hello(""))
            status, msg = extra.error()
            assert status == "UNAVAILABLE" and "full (2 connections)" in msg
            for r in held_open:
                r.close()
            deadline = time.monotonic() + 10
            while True:  # the node notices the closed connections, then takes new ones again
                try:
                    round_trip(c, "after")
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
    finally:
        n.close()
