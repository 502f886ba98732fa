"""Fuzz cases for the same-host plane (kvstore/wire/shm.py): its own messages on the node's Unix socket, valid
ones with at most one field broken, registrations of every kind of descriptor, and raw bytes, each on a
fresh connection (HELLO, then the case).

A case's code is the status of the node's answer: "OK", the ERROR's status name, or "CLOSED" when the node
closed the connection without a word. The runner's invariants hold as for every plane (devkit/fuzz.py): the
expected code, never INTERNAL/UNKNOWN, and Stats unchanged after every case that may not change state.
"""

from __future__ import annotations

import array
import fcntl
import mmap
import os
import socket

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
from kvstore.wire import shm
from kvstore.wire.answers import stats_from_pb
from kvstore.wire.shm import Kind
from kvstore.wire.streams import layout_to_pb

CLOSED = "CLOSED"
MUTATIONS = (
    "put: valid", "put: no open", "put: no pages", "put: unregistered buffer", "put: slice past end",
    "get: valid", "get: unknown namespace", "get: target past end", "get: target too small",
    "get: overlapping targets", "get: unregistered buffer", "register: pipe", "register: unsealed memfd",
    "register: no descriptor", "request before hello", "unknown kind",
)  # fmt: skip
BUFFER = 1  # the id every case registers its memfd under
PAGES = 8  # pages the case memfd holds


def socket_path(t: FuzzTarget) -> str:
    """The node's same-host socket, from its Stats."""
    raw = t.channel.unary_unary(SERVICE + "Stats", request_serializer=None, response_deserializer=None)(b"", timeout=30)
    return next(p.address for p in stats_from_pb(pb.StatsResponse.FromString(raw)).planes if p.name == "shm")


def _memfd(size: int, sealed: bool = True) -> int:
    fd = os.memfd_create("fuzz", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def exchange(path: str, messages: list[tuple[bytes, list[int]]], hello: bool = True) -> str:
    """Connect, say HELLO (unless told not to), send each message (with its descriptors) and read its reply;
    the code of the last reply (or the first ERROR, or CLOSED)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(30)
        sock.connect(path)
        if hello:
            messages = [(shm.frame(Kind.HELLO, 0, b""), []), *messages]
        code = OK
        for msg, fds in messages:
            if fds:
                sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                sock.send(msg)
            reply = sock.recv(shm.MAX_MESSAGE_BYTES)
            if not reply:
                return CLOSED
            kind, _, body = shm.unframe(reply)
            if kind is Kind.ERROR:
                return shm.parse_error(body)[0]
            code = OK
        return code


class ShmPlane:
    """The same-host plane's messages against a real node (see the module docstring)."""

    name = "shm"

    def cases(self, t: FuzzTarget) -> st.SearchStrategy[Case]:
        path = socket_path(t)
        return st.one_of(
            st.builds(self._case, st.just(t), st.just(path), st.sampled_from(MUTATIONS), random_hashes, fresh_namespaces),
            st.builds(self._raw, st.just(path), st.sampled_from([Kind.PUT, Kind.GET, Kind.REGISTER]), st.binary(max_size=64)),
        )  # fmt: skip

    def _raw(self, path: str, kind: Kind, body: bytes) -> Case:
        def send(tg: FuzzTarget) -> str:
            tg.sent += 1
            return exchange(path, [(shm.frame(kind, 1, body), [])])

        return Case(self.name, f"{kind.name}: raw body", send, ANY_HANDLED | {CLOSED}, True)

    def _case(self, t: FuzzTarget, path: str, mut: str, h: bytes, fresh: str) -> Case:
        n = t.layout.page_bytes
        size = PAGES * n

        def register(fd: int) -> tuple[bytes, list[int]]:
            return shm.frame(Kind.REGISTER, 1, shm.REGISTER.pack(BUFFER)), [fd]

        if mut.startswith("register") or mut in ("request before hello", "unknown kind"):
            expect = INVALID

            def send(tg: FuzzTarget) -> str:
                tg.sent += 1
                if mut == "request before hello":
                    return exchange(path, [(shm.frame(Kind.LAYOUT, 1, bytes(32) + t.ns.encode()), [])], hello=False)
                if mut == "unknown kind":
                    return exchange(path, [(shm.frame(Kind.WELCOME, 1, b""), [])])
                if mut == "register: no descriptor":
                    return exchange(path, [(shm.frame(Kind.REGISTER, 1, shm.REGISTER.pack(BUFFER)), [])])
                if mut == "register: pipe":
                    r, w = os.pipe()
                    try:
                        return exchange(path, [register(r)])
                    finally:
                        os.close(r)
                        os.close(w)
                fd = _memfd(size, sealed=False)
                try:
                    return exchange(path, [register(fd)])
                finally:
                    os.close(fd)

            return Case(self.name, mut, send, frozenset({expect}), False)

        if mut.startswith("get"):
            req = pb.BulkGetRequest(namespace=fresh if mut == "get: unknown namespace" else t.ns, hashes=t.stored[:2])
            offsets = {"get: target past end": (0, size - n // 2), "get: overlapping targets": (0, n // 2)}
            for off in offsets.get(mut, (0, n)):
                buf = 7 if mut == "get: unregistered buffer" else BUFFER
                req.targets.add(buffer=buf, offset=off, size=n - 1 if mut == "get: target too small" else n)
            expect = {"get: valid": OK, "get: unknown namespace": NOT_FOUND}.get(mut, INVALID)
            body = req.SerializeToString()
            may_change = expect == OK  # a Get that serves pages counts hits
        else:
            req2 = pb.BulkPutRequest()
            if mut != "put: no open":
                req2.open.CopyFrom(pb.PutOpen(namespace=t.ns, layout=layout_to_pb(t.layout)))
            if mut != "put: no pages":
                off = size - n // 2 if mut == "put: slice past end" else 0
                buf = 7 if mut == "put: unregistered buffer" else BUFFER
                req2.pages.add(hash=h, offset=off, payload_bytes=n, buffer=buf)
            expect = OK if mut == "put: valid" else INVALID
            body = req2.SerializeToString()
            may_change = expect == OK
        kind = Kind.GET if mut.startswith("get") else Kind.PUT

        def send_request(tg: FuzzTarget) -> str:
            tg.sent += 1
            fd = _memfd(size)
            try:
                with mmap.mmap(fd, size) as view:
                    view[:n] = content(h, n)
                return exchange(path, [register(fd), (shm.frame(kind, 2, body), [])])
            finally:
                os.close(fd)

        return Case(self.name, mut, send_request, frozenset({expect}), may_change)
