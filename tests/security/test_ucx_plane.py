"""The UCX plane against real ucxx attackers (SECURITY.md, round 3, findings 2 and 3), each a process of its own that
reaches a real node by its advertised worker address or its listener, as anyone on the fabric can:
- nothing is accepted before HELLO: 200k unmatched tagged messages (random tags, the old protocol's
  HELLO and connection tags), and stream and active messages, cost the node no memory and no log flood,
  and the node keeps serving;
- every request runs as the endpoint that proved its token: forged PUTs under a live session's earlier
  tags (a replay), under tags of a guessed secret, or under the old protocol's connection-id tags land
  nothing anywhere, and the session keeps working;
- why the design needs secret tags at all: UCX matches a receive posted on an endpoint against
  messages from any endpoint of its worker (shown here, so a future ucxx that binds them is noticed).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devkit.ucx_stranger import settle, stranger
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.client.planes.ucx import UcxConnection
from kvstore.pageformat import payload_checksum
from kvstore.security import ClientSecurity
from kvstore.wire.streams import layout_to_pb
from kvstore.wire.ucx import Kind, Lane, SessionTags, frame, load_ucxx, parse_address, ucxx_installed
from kvstore.wire.ucx_progress import wait_blocking
from tests.integration.conftest import LAYOUT, NS, key, page, start_node
from tests.security.conftest import private_file, rss_bytes

pytestmark = pytest.mark.skipif(not ucxx_installed(), reason="ucxx is not installed (pip install 'kvstore[ucx]')")

TOK_A = "ucx-alice-" + "a" * 24
TOK_B = "ucx-bob---" + "b" * 24
FLOOD = 200_000  # the review's reproduction: 200k x 64 B took the node from 89 to 310 MiB
# NOTE: what keeping a message costs the node: its payload and UCX's descriptor of it (the code that kept
# them grew by 220 MiB for 200k x 64 B: ~1.1 KiB a message). A test's bound is a quarter of what keeping
# them all would cost, several times what the node's allocator and UCX's pools move by on their own
# (0.9-8 MiB measured for the same floods), so noise cannot break it and keeping them cannot pass it.
DESCRIPTOR_BYTES = 1024
WAVE = 2_000  # sends an attacker keeps posted at once
STREAM_SIZE = 8000  # bytes of each stream and active message (as large as the flood's eager ones)
OLD_HELLO_TAG = 0xFFFFFFFF_FF000000  # protocol v1's public HELLO tag


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    rw = private_file(tmp_path / "rw.tokens", f"{TOK_A} tenant-a\n{TOK_B} tenant-b\n")
    n = start_node(tmp_path, name="ucxsec", extra_args=["--ucx", "--auth-tokens-file", str(rw)],
                   env={"UCX_NET_DEVICES": "lo"})  # fmt: skip
    try:
        yield n
    finally:
        n.close()


def ucx_address(node: NodeProcess, token: str = TOK_A) -> str:
    with KVStoreClient(node.addr, transport="grpc", security=ClientSecurity(token=token)) as c:
        return next(p.address for p in c.stats().planes if p.name == "ucx")


def context(ucx: Any, stream_and_am: bool = False) -> Any:
    extra = (ucx.Feature.STREAM, ucx.Feature.AM) if stream_and_am else ()
    return ucx.UCXContext({}, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP, *extra))


def _attack(address: str, how: str, path: str, q: mp.Queue, tags: list[int], count: int, size: int) -> None:  # type: ignore[type-arg]
    """Child process: an endpoint that never sends a HELLO (`path`: "worker" address or "listener"), and
    sends what `how` says (`count` messages of `size` bytes for a flood); reports how many messages it got
    out, then stays until told to go."""
    ucx, worker, ep = stranger(address, path, ("STREAM", "AM") if how == "stream+am" else ())
    from ucxx._lib.arr import Array

    payload = Array(bytearray(b"x" * size))
    rng = random.Random(7)
    sent = 0
    if how == "flood":  # random tags, the old HELLO tag and old-style connection tags among them
        while sent < count:
            wave = []
            for i in range(WAVE):
                t = OLD_HELLO_TAG if i == 0 else rng.getrandbits(64) if i % 2 else rng.getrandbits(32) << 32 | 1 << 24
                wave.append(ep.tag_send(payload, ucx.UCXXTag(t)))
            settle(worker, wave, 5.0)
            sent += sum(r.completed for r in wave)
    elif how == "stream+am":
        for _ in range(5):
            wave = [ep.stream_send(payload) for _ in range(1000)] + [ep.am_send(payload) for _ in range(1000)]
            settle(worker, wave, 5.0)
            sent += sum(r.completed for r in wave)
    elif how == "forge":  # a well-formed PUT (control, then its page) under each tag pair given
        keep = []
        for ctrl, base in zip(tags[::2], tags[1::2], strict=True):
            p = page(key(ctrl % 1000, "forged"))
            req = pb.BulkPutRequest(open=pb.PutOpen(namespace=NS, layout=layout_to_pb(LAYOUT)))
            req.pages.add(hash=key(ctrl % 1000, "forged"), payload_bytes=len(p), checksum=payload_checksum(p))
            for seq in (1, 2, 3):
                msg, data = Array(bytearray(frame(Kind.PUT, seq, req.SerializeToString()))), Array(bytearray(p))
                keep += [msg, data]
                wave = [ep.tag_send(msg, ucx.UCXXTag(ctrl)), ep.tag_send(data, ucx.UCXXTag(base))]
                settle(worker, wave, 0.5)
                sent += 1
    q.put(sent)
    q.get(timeout=120)  # stay connected until the test has measured


class Attacker:
    """An attack process; `close` stops it (by PID, bounded)."""

    def __init__(
        self,
        node: NodeProcess,
        how: str,
        path: str,
        tags: tuple[int, ...] = (),
        count: int = FLOOD,
        size: int = 64,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.q = ctx.Queue()
        args = (ucx_address(node), how, path, self.q, list(tags), count, size)
        self.proc = ctx.Process(target=_attack, args=args)
        self.proc.start()

    def sent(self, timeout: float = 300) -> int:
        return int(self.q.get(timeout=timeout))

    def close(self) -> None:
        self.q.put("go")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def footprint(node: NodeProcess) -> list[tuple[int, int]]:
    with KVStoreClient(node.addr, transport="grpc", security=ClientSecurity(token=TOK_A)) as c:
        return [(t.pages, t.used_bytes) for t in c.stats().tiers]


def round_trip(node: NodeProcess, tag: str, token: str = TOK_A) -> None:
    hs = [key(i, tag) for i in range(4)]
    with KVStoreClient(node.addr, transport="ucx", timeout=30, security=ClientSecurity(token=token)) as kv:
        kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
        assert [bytes(p) for p in kv.get(NS, hs)] == [page(h) for h in hs]


def kept_bytes(count: int, size: int) -> int:
    """What the node would grow by if it kept `count` messages of `size` bytes."""
    return count * (size + DESCRIPTOR_BYTES)


def settled_rss(pid: int, seconds: float = 3.0) -> int:
    """The node's RSS once it stopped moving for a moment (the node drains what arrived meanwhile)."""
    last, deadline = rss_bytes(pid), time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = rss_bytes(pid)
        if abs(now - last) < (1 << 20):
            return now
        last = now
    return last


@pytest.mark.parametrize(
    ("path", "count", "size"), [("worker", FLOOD, 64), ("listener", FLOOD, 64), ("worker", 20_000, 8000)]
)
def test_unmatched_messages_before_hello_cost_the_node_nothing(
    node: NodeProcess, path: str, count: int, size: int
) -> None:
    """The review's flood from either way in, and one of the largest messages UCX sends eagerly."""
    round_trip(node, "warm")  # the node's UCX state as a served client leaves it
    assert node.proc is not None
    before = settled_rss(node.proc.pid)
    attacker = Attacker(node, "flood", path, count=count, size=size)
    try:
        assert attacker.sent() >= count  # every message left the attacker: the node received them all
        grown = settled_rss(node.proc.pid) - before
        round_trip(node, f"after-{path}")  # still serving, while the attacker stays connected
    finally:
        attacker.close()
    kept = kept_bytes(count, size)
    assert grown < kept // 4, (
        f"the node grew by {grown >> 20} MiB from {count} unmatched messages (keeping them: ~{kept >> 20} MiB)"
    )
    assert "dropped" in node.log_tail()  # counted, in one line, not one per message


def test_stream_and_active_messages_are_neither_buffered_nor_logged(node: NodeProcess) -> None:
    round_trip(node, "warm")
    assert node.proc is not None
    before, log_before = settled_rss(node.proc.pid), Path(node.log_path).stat().st_size
    attacker = Attacker(node, "stream+am", "worker", size=STREAM_SIZE)
    try:
        assert attacker.sent() == 10_000
        grown = settled_rss(node.proc.pid) - before
        round_trip(node, "after-stream")
    finally:
        attacker.close()
    kept = kept_bytes(10_000, STREAM_SIZE)  # NOTE: messages large enough that keeping them shows in RSS
    assert grown < kept // 4, f"the node grew by {grown >> 20} MiB (keeping the messages: ~{kept >> 20} MiB)"
    # UCX would log a warning and a backtrace per message a feature without a handler gets (~3 KB each)
    assert Path(node.log_path).stat().st_size - log_before < 64 << 10


def _session(node: NodeProcess, token: str) -> tuple[UcxConnection, Any]:
    ucx = load_ucxx()
    ctx = context(ucx)
    return UcxConnection(ucx, ctx, parse_address(ucx_address(node, token)), token, time.monotonic() + 30), ctx


def put_raw(conn: UcxConnection, hashes: list[bytes]) -> pb.PutResponse:
    req = pb.BulkPutRequest(open=pb.PutOpen(namespace=NS, layout=layout_to_pb(LAYOUT)))
    for h in hashes:
        req.pages.add(hash=h, payload_bytes=LAYOUT.page_bytes, checksum=payload_checksum(page(h)))
    return conn.put(req, [page(h) for h in hashes], time.monotonic() + 30)


@pytest.mark.parametrize("path", ["worker", "listener"])
def test_requests_run_only_as_the_session_that_proved_its_token(node: NodeProcess, path: str) -> None:
    victim, _ctx = _session(node, TOK_A)
    try:
        assert put_raw(victim, [key(0, "victim")]).stored == 1  # request 1 of alice's session
        spent = victim.tags  # what an eavesdropper of request 1 could have learned, and more
        guessed = SessionTags(os.urandom(32))
        tags = [spent.tag(Lane.CONTROL, 1), spent.tag(Lane.PUT_PAGES, 1)]  # a replay of request 1
        for seq in range(1, 20):  # a wrong secret's tags for the requests to come
            tags += [guessed.tag(Lane.CONTROL, seq), guessed.tag(Lane.PUT_PAGES, seq)]
        for cid in (1, 0x1234, victim.seq):  # protocol v1's tags: (cid << 32 | CTRL_TO_NODE << 24 | seq << 16)
            tags += [cid << 32 | 1 << 24 | 2 << 16, cid << 32 | 2 << 24 | 2 << 16]
        before = footprint(node)
        attacker = Attacker(node, "forge", path, tuple(tags))
        try:
            assert attacker.sent() == 3 * len(tags) // 2
            time.sleep(1.0)  # whatever the node would do with them, it has done
            assert footprint(node) == before  # nothing landed, in any tenant
            assert put_raw(victim, [key(1, "victim")]).stored == 1  # the session is still in step (request 2)
        finally:
            attacker.close()
        with KVStoreClient(node.addr, transport="grpc", security=ClientSecurity(token=TOK_A)) as kv:
            assert kv.lookup(NS, [key(i, "forged") for i in range(1000)]) == 0
    finally:
        victim.close()


def test_ucx_receives_on_an_endpoint_match_messages_from_any_endpoint() -> None:
    """The UCX fact the protocol is built around (kvstore/wire/ucx.py): tag matching is per worker."""
    ucx = load_ucxx()
    from ucxx._lib.arr import Array

    ctx = context(ucx)
    server = ucx.UCXWorker(ctx)
    server.init_blocking_progress_mode()
    addr = ucx.UCXAddress.create_from_buffer(bytes(server.address.tobytes()))
    peers = [ucx.UCXWorker(ctx) for _ in range(2)]
    eps = [ucx.UCXEndpoint.create_from_worker_address(w, addr, True) for w in peers]
    back = ucx.UCXEndpoint.create_from_worker_address(
        server, ucx.UCXAddress.create_from_buffer(bytes(peers[0].address.tobytes())), True
    )
    buf = bytearray(8)
    keep = [Array(buf), Array(bytearray(b"peer one"))]  # referenced while UCX reads and writes them
    recv = back.tag_recv(keep[0], ucx.UCXXTag(42))  # posted "on" peer 0's endpoint
    send = eps[1].tag_send(keep[1], ucx.UCXXTag(42))  # sent by peer 1
    deadline = time.monotonic() + 10
    while not (recv.completed and send.completed) and time.monotonic() < deadline:
        for w in (server, *peers):
            w.progress()
    assert recv.completed and bytes(buf) == b"peer one"
    for ep in (*eps, back):
        ep.close_blocking(period=10**8, max_attempts=1)
    wait_blocking(server, [], time.monotonic() + 1)
