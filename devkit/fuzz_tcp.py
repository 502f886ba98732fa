"""Fuzz cases for the TCP data plane (kvstore/wire/tcp): its own frames, valid ones with at most one
field broken, byte flips and raw bytes, each on a fresh connection to the node's TCP plane listener.

A case's code is the status of the node's answer: "OK" for DONE, the ERROR frame's status name, or
"CLOSED" when the node closed the connection without a word (a frame cut short by the client, which then
half-closes, is one). The runner's invariants hold as for every plane (devkit/fuzz.py): the expected
code, never INTERNAL/UNKNOWN, and Stats unchanged after every case that may not change state.
"""

from __future__ import annotations

import socket
import struct

from hypothesis import strategies as st

from devkit.fuzz import (
    ANY_HANDLED,
    INVALID,
    NOT_FOUND,
    OK,
    SERVICE,
    Case,
    FuzzTarget,
    content,
    fresh_namespaces,
    random_hashes,
)
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.layout import DType, PageLayout
from kvstore.pageformat import wire_checksum
from kvstore.wire import PutOpen, tcp
from kvstore.wire.answers import stats_from_pb
from kvstore.wire.tcp import Kind

CLOSED = "CLOSED"
READ_TIMEOUT_S = 30.0
PUT_MUTATIONS = ("valid", "no pages", "too many pages", "bad layout", "unknown tier", "namespace not UTF-8",
                 "page too short", "checksum mismatch", "fewer pages then close", "page without put",
                 "other layout", "byte flip")  # fmt: skip


def tcp_port(t: FuzzTarget) -> int:
    """The TCP plane's port, from the node's Stats (the fuzz node serves it on loopback)."""
    raw = t.channel.unary_unary(SERVICE + "Stats", request_serializer=None, response_deserializer=None)(b"", timeout=30)
    planes = stats_from_pb(pb.StatsResponse.FromString(raw)).planes
    return int(next(p for p in planes if p.name == "tcp").address.rsplit(":", 1)[1])


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def exchange(port: int, payload: bytes, hello: bool = True) -> str:
    """Connect, say HELLO (unless the payload is the whole conversation), send `payload`, half-close, and
    read frames until DONE, ERROR or the end of the stream."""
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S) as sock:
        sock.sendall((tcp.hello(None) if hello else b"") + payload)
        sock.shutdown(socket.SHUT_WR)
        for _ in range(10_000):  # bounded: a GET answers at most max_pages PAGE frames, then DONE
            try:
                head = _exactly(sock, tcp.HEADER_BYTES)
            except ConnectionResetError:
                return CLOSED
            if head is None:
                return CLOSED
            _, _, kind, meta_len, body_len = tcp.HEADER.unpack(head)
            meta = _exactly(sock, meta_len)
            if meta is None or _exactly(sock, body_len) is None:
                return CLOSED
            if kind == Kind.DONE:
                return OK
            if kind == Kind.ERROR:
                return tcp.parse_error(meta)[0]
        raise RuntimeError("the node kept sending frames")


def _flip(data: bytes, at: int, value: int) -> bytes:
    at %= len(data)
    return data[:at] + bytes([value if value != data[at] else value ^ 0xFF]) + data[at + 1 :]


class TcpPlane:
    """GET and PUT frames on the TCP plane, on fresh connections; HELLO cut short or garbled."""

    name = "tcp"

    def cases(self, t: FuzzTarget) -> st.SearchStrategy[Case]:
        port = tcp_port(t)
        flips = st.tuples(st.integers(0, 1 << 16), st.integers(0, 255))
        gets = st.sampled_from(("stored", "random", "unknown", "flip"))
        puts = st.sampled_from(PUT_MUTATIONS)
        return st.one_of(
            st.builds(self._get, st.just(t), st.just(port), gets, random_hashes, fresh_namespaces, flips),
            st.builds(self._put, st.just(t), st.just(port), puts, random_hashes, fresh_namespaces, flips),
            st.builds(self._hello, st.just(port), st.binary(max_size=64)),
        )

    def _hello(self, port: int, raw: bytes) -> Case:
        # Any bytes in place of HELLO: a framing error, or a stream cut short. (A 16-byte prefix that
        # happens to be a valid HELLO header is astronomically unlikely, and would be answered anyway.)
        return Case(self.name, "HELLO: raw bytes", lambda _t: exchange(port, raw, hello=False),
                    frozenset({INVALID, CLOSED, "UNAUTHENTICATED", "UNAVAILABLE"}), False)  # fmt: skip

    def _get(self, t: FuzzTarget, port: int, mut: str, h: bytes, fresh: str, flip: tuple[int, int]) -> Case:
        hashes = {"stored": t.stored[:4], "random": [h]}.get(mut, t.stored[:2])
        frame = tcp.get(fresh if mut == "unknown" else t.ns, hashes, promote=False)
        expect: frozenset[str] = frozenset({OK})
        if mut == "unknown":
            expect = frozenset({NOT_FOUND})
        elif mut == "flip":
            frame = _flip(frame, *flip)
            expect = ANY_HANDLED | {CLOSED}
        # Reads change hit counters: every GET may change Stats.
        return Case(self.name, f"GET: {mut}", lambda _t: exchange(port, frame), expect, True)

    def _put(self, t: FuzzTarget, port: int, mut: str, h: bytes, fresh: str, flip: tuple[int, int]) -> Case:
        layout = t.layout
        data = content(h, layout.page_bytes)
        npages = {"no pages": 0, "too many pages": 1 << 20, "fewer pages then close": 2}.get(mut, 1)
        # NOTE: stored pages go under a prefix of their own: other planes count on fuzz/unknown/* staying unknown.
        # A checksum mismatch gets a prefix no case stores into (a refused page is never stored): under t.ns or
        # fuzz/tcp/* its hash may be stored already (Hypothesis draws b"\0" * 32 and the same tail again), and a
        # page already present is answered OK with its bytes dropped, unverified.
        if mut in ("valid", "byte flip"):
            ns = fresh.replace("fuzz/unknown/", "fuzz/tcp/", 1)
        elif mut == "checksum mismatch":
            ns = fresh.replace("fuzz/unknown/", "fuzz/tcp-refused/", 1)
        else:
            ns = t.ns
        if mut == "other layout":
            layout = PageLayout(DType.FLOAT16, 2, 1, 32, 16)  # not the layout t.ns was stored with
            data = content(h, layout.page_bytes)
        head = tcp.put(PutOpen(ns, layout), npages)
        if mut == "bad layout":
            at = tcp.HEADER_BYTES + struct.calcsize(f"<BBBI{32}s")
            head = head[:at] + b"\xff" * tcp.LAYOUT_BYTES + head[at + tcp.LAYOUT_BYTES :]
        elif mut == "unknown tier":
            head = head[: tcp.HEADER_BYTES] + b"\x63" + head[tcp.HEADER_BYTES + 1 :]
        elif mut == "namespace not UTF-8":
            head = head[:-2] + b"\xff\xfe"
        checksum = wire_checksum(ns, h, data) ^ (1 if mut == "checksum mismatch" else 0)
        body = data[:-2] if mut == "page too short" else data
        page = tcp.page_header(h, checksum, len(body)) + body
        frames = page if mut == "page without put" else head + page
        expect = {"valid": OK, "other layout": "FAILED_PRECONDITION", "checksum mismatch": "DATA_LOSS",
                  "fewer pages then close": CLOSED}.get(mut, INVALID)  # fmt: skip
        expected = frozenset({expect})
        if mut == "byte flip":
            cut = len(head) + tcp.HEADER_BYTES + tcp.PAGE_META_BYTES  # header, PUT meta and PAGE meta: not the body
            frames = _flip(frames[:cut], *flip) + frames[cut:]
            expected = ANY_HANDLED | {CLOSED}
        return Case(
            self.name, f"PUT: {mut}", lambda _t: exchange(port, frames), expected, mut in ("valid", "byte flip")
        )
