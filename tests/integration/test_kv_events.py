"""KV events for routers (kvstore/node/kv_events.py) on a real node and real ZMQ sockets on loopback.

An indexer that follows the feed must end up believing what the node holds: every page in the tier it
is in (stores, demotions, promotions, deletes), per namespace topic, with contiguous sequence numbers.
A subscriber that never reads must not slow the node, and a full queue drops, counts and resyncs.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from devkit.kv_events_sub import decode_plain, replay_state
from kvstore.client import KVStoreClient
from kvstore.config import NodeConfig
from kvstore.hashing import prefix_hashes
from kvstore.names import TierKind
from kvstore.node.kv_events import MEDIUM, Batcher, KvEventPublisher, topic_of
from kvstore.scoping import scope
from tests.integration.conftest import LAYOUT, NS, page, start_node


class Sub:
    """A SUB socket in a thread, collecting decoded messages (plain msgpack, as a Go indexer reads them)."""

    def __init__(self, endpoint: str, rcvhwm: int = 1000) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, "kv@")
        self.messages: list[dict[str, Any]] = []
        self.raw = False  # check that events arrive as arrays
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            topic, seq, payload = self.sock.recv_multipart()
            form = list if self.raw else dict  # the array form [tag, fields...], or vLLM 0.32's maps
            assert all(isinstance(e, form) for e in msgspec.msgpack.decode(payload)[1])
            ts, events = decode_plain(payload)
            self.messages.append(
                {"topic": topic.decode(), "seq": int.from_bytes(seq, "big"), "ts": ts, "events": events}
            )

    def wait(self, pred: Any, timeout: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return True
            time.sleep(0.02)
        return pred()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        self.ctx.term()


def truth(kv: KVStoreClient, hashes: list[bytes]) -> dict[bytes, set[str]]:
    """What the node holds, page by page, asked through Lookup (no promotion)."""
    out = {}
    for h in hashes:
        res = kv.lookup_detail(NS, [h])
        if res.matched:
            out[h] = {MEDIUM[res.tiers[0]]}
    return out


@pytest.mark.parametrize("encoding", ["map", "array"])  # vLLM 0.32's events; the older form llm-d's adapter reads
def test_feed_follows_stores_moves_and_deletes(tmp_path: Path, encoding: str) -> None:
    node = start_node(tmp_path, dram_pages=8, nvme_pages=64, extra_args=[
        "--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-encoding", encoding, "--metrics-port", "0",
        "--policy", "lru"])  # fmt: skip
    sub = None
    try:
        with KVStoreClient(node.addr, timeout=30, transport="grpc") as kv:
            ev = kv.stats().kv_events
            assert ev is not None and ev.endpoint.startswith("tcp://127.0.0.1:")
            sub = Sub(ev.endpoint)
            sub.raw = encoding == "array"
            # A new subscriber gets a snapshot: a node holding nothing says so on its node topic.
            assert sub.wait(lambda: any(e["type"] == "AllBlocksCleared" for m in sub.messages for e in m["events"]))
            hashes = prefix_hashes(list(range(16 * 12)), 16, NS)
            kv.put(NS, LAYOUT, hashes, [page(h) for h in hashes])  # 12 pages into 8 DRAM slots: 4 demoted
            kv.get(NS, hashes[:2])  # NVMe hits are promoted
            kv.delete(NS, hashes[-2:])
            want = truth(kv, hashes)
            topic = topic_of("kv", "n0", NS)
            assert sub.wait(lambda: replay_state(sub.messages).get(topic) == want), (
                f"indexer state {replay_state(sub.messages).get(topic)} != node {want}"
            )
            assert {m for media in want.values() for m in media} == {"CPU", "STORAGE"}  # both tiers exercised
            seqs = [m["seq"] for m in sub.messages]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence numbers are contiguous"
            stored = [e for m in sub.messages if m["topic"] == topic for e in m["events"] if e["type"] == "BlockStored"]
            assert all(e["block_size"] == 16 and e["token_ids"] == [] for e in stored)
            first = next(e for e in stored if hashes[0] in e["block_hashes"])
            assert first["parent_block_hash"] is None and first["block_hashes"][:2] == hashes[:2]  # one chain event
            ev = kv.stats().kv_events
            assert ev.sent_batches >= len(sub.messages) and ev.dropped_events == 0 and ev.subscribers >= 1
            shown = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "stats", "--addr", node.addr],
                                   check=True, capture_output=True, text=True, timeout=60).stdout  # fmt: skip
            assert f"kv events {ev.endpoint}" in " ".join(shown.split())
            text = urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10).read().decode()
            assert "kvstore_kv_events_sent_batches_total" in text and "kvstore_kv_events_dropped_events_total" in text
        n_before = len(sub.messages)
        assert node.stop() == 0
        # The stop clears the namespace for every subscriber (its DRAM pages are gone with it).
        assert sub.wait(lambda: any(e["type"] == "AllBlocksCleared" and m["topic"] == topic
                                    for m in sub.messages[n_before:] for e in m["events"]))  # fmt: skip
    finally:
        if sub is not None:
            sub.close()
        node.close()


def test_a_subscriber_that_never_reads_does_not_slow_the_node(tmp_path: Path) -> None:
    node = start_node(tmp_path, dram_pages=64, nvme_pages=0, extra_args=["--kv-events-endpoint", "tcp://127.0.0.1:0"])
    stuck_ctx = zmq.Context()
    stuck = stuck_ctx.socket(zmq.SUB)  # connects, subscribes, never reads
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.setsockopt(zmq.LINGER, 0)
    fast = None
    try:
        with KVStoreClient(node.addr, timeout=30, transport="grpc") as kv:
            endpoint = kv.stats().kv_events.endpoint
            stuck.connect(endpoint)
            stuck.setsockopt_string(zmq.SUBSCRIBE, "")
            fast = Sub(endpoint)
            rounds = 300
            for i in range(rounds):  # every put churns the 64-page DRAM tier: one store and one eviction each
                hs = prefix_hashes([i] * 16, 16, NS)
                assert kv.put(NS, LAYOUT, hs, [page(h) for h in hs]).stored == 1
            ev = kv.stats().kv_events
            assert ev.dropped_events == 0 and ev.send_errors == 0
            topic = topic_of("kv", "n0", NS)
            held = {h for i in range(rounds) for h in prefix_hashes([i] * 16, 16, NS) if kv.lookup(NS, [h])}
            assert len(held) == 64
            assert fast.wait(lambda: set(replay_state(fast.messages).get(topic, {})) == held)
            seqs = [m["seq"] for m in fast.messages]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # the stuck one cost the fast one nothing
    finally:
        if fast is not None:
            fast.close()
        stuck.close()
        stuck_ctx.term()
        node.close()


def test_full_queue_drops_counts_and_resyncs() -> None:
    """The queue is bounded: changes beyond it are dropped and counted, and a snapshot (clear + holdings)
    follows, so a subscriber still converges on the holdings."""
    held: list[tuple[str, bytes, TierKind]] = []  # the "node" holds nothing until the burst below
    pages = [(NS, bytes([i]) * 32, TierKind.DRAM) for i in range(50)]

    async def run() -> tuple[Any, list[dict[str, Any]]]:
        pub = KvEventPublisher("tcp://127.0.0.1:0", "unit", lambda: list(held), lambda ns, h: (None, 16), max_queue=10)
        pub.start(asyncio.get_running_loop())
        sub = Sub(pub.endpoint)
        try:
            for _ in range(150):  # the start's snapshot and the join's (at most one a second) have gone out
                if pub.snapshot_status().snapshots >= 1 and sub.messages:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(1.2)
            for page in pages:  # 50 pages stored in one loop turn: the sender thread cannot keep up
                held.append(page)
                pub.note(*page)
            status = pub.snapshot_status()
            assert status.queued <= 10 and status.dropped_events >= 40
            topic = topic_of("kv", "unit", NS)
            want = {h: {"CPU"} for _, h, _ in pages}
            for _ in range(250):
                if replay_state(sub.messages).get(topic) == want:
                    break
                await asyncio.sleep(0.02)
            return pub.snapshot_status(), sub.messages
        finally:
            sub.close()
            await asyncio.to_thread(pub.close)

    status, messages = asyncio.run(run())
    assert replay_state(messages).get(topic_of("kv", "unit", NS)) == {h: {"CPU"} for _, h, _ in pages}
    assert status.snapshots >= 2 and status.dropped_events >= 40  # the one after the drops carried them


def test_batcher_groups_chains_and_removals() -> None:
    b = Batcher("kv", "n", "bytes")
    h = [bytes([i]) * 32 for i in range(5)]
    changes = [(NS, h[0], TierKind.DRAM, None, None, 16), (NS, h[1], TierKind.DRAM, None, h[0], 16),
               (NS, h[2], TierKind.DRAM, None, h[1], 16), (NS, h[3], TierKind.DRAM, None, None, 16),
               (NS, h[0], TierKind.NVME, TierKind.DRAM, None, 16), (NS, h[1], TierKind.NVME, TierKind.DRAM, h[0], 16),
               (NS, h[4], None, TierKind.DRAM, None, 0)]  # fmt: skip
    events = b.batches(changes)[topic_of("kv", "n", NS)]
    kinds = [(type(e).__name__, len(e.block_hashes), e.medium) for e in events]
    assert kinds == [("BlockStored", 3, "CPU"), ("BlockStored", 1, "CPU"), ("BlockRemoved", 1, "CPU"),
                     ("BlockStored", 1, "STORAGE"), ("BlockRemoved", 1, "CPU"), ("BlockStored", 1, "STORAGE"),
                     ("BlockRemoved", 1, "CPU")]  # fmt: skip
    assert Batcher("kv", "n", "u64").wire_hash(b"\x00" * 24 + (7).to_bytes(8, "big")) == 7
    # A tenant's namespace is its own topic: kv@node/tenant@namespace.
    assert topic_of("kv", "n", scope(NS, "acme")) == f"kv@n/acme@{NS}"


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_events_endpoint", "localhost:5557"), ("kv_events_hash_format", "hex"), ("kv_events_max_queue", 0),
     ("kv_events_topic", "a@b"), ("kv_events_encoding", "json")],
)  # fmt: skip
def test_bad_config_names_the_field(field: str, value: object) -> None:
    kw: dict[str, object] = {"kv_events_endpoint": "tcp://127.0.0.1:5557", field: value}
    with pytest.raises(ValueError, match=field):
        NodeConfig(**kw)  # type: ignore[arg-type]


def test_busy_endpoint_refuses_to_start(tmp_path: Path) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUB)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(RuntimeError, match="kv_events_endpoint"):
            start_node(tmp_path, extra_args=["--kv-events-endpoint", f"tcp://127.0.0.1:{port}"])
    finally:
        s.close(0)
        ctx.term()
