"""Who may read the KV-event feed, and what a subscriber may cost the node (kvstore/node/kv_events.py).

The outside probe: `--help` and the README bound the feed to tcp://0.0.0.0:5557 while gRPC listened on
127.0.0.1; any subscriber learnt every tenant's names, namespaces and hashes; 20 subscribers that never
read plus one re-join a second took node RSS +160 MiB (kept after they left) and another tenant's lookup
p99 from 8.6 to 249 ms. Now: a bare port binds the gRPC host, an address other hosts reach is refused
without CURVE keys or an explicit opt-in, a CURVE key bound to a tenant receives that tenant's topics only,
what a never-reading subscriber holds in the node is bounded in bytes, and snapshots are paced by their
cost and read the page table a slice per loop turn. Latency figures: benchmarks/kv_events_abuse_bench.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from devkit.kv_events_sub import decode_plain
from kvstore.client import KVStoreClient
from kvstore.config import NodeConfig
from kvstore.hashing import prefix_hashes
from kvstore.names import TierKind
from kvstore.node import kv_events
from kvstore.node.kv_events import KvEventPublisher, granted
from kvstore.security import ClientSecurity
from tests.integration.conftest import LAYOUT, NS, page, start_node
from tests.security.conftest import private_file, rss_bytes, wait_for

MiB = 1 << 20
TOK_ACME = "acme-token-" + "a" * 24
TOK_OPS = "ops-token-" + "o" * 24  # no tenant on its line: the default tenant


def keys(tmp_path: Path, name: str) -> tuple[bytes, bytes]:
    _, secret_file = zmq.auth.create_certificates(tmp_path, name)
    Path(secret_file).chmod(0o600)
    return zmq.auth.load_certificate(secret_file)


class CurveSub:
    """A SUB socket with CURVE keys (what a vLLM-style pyzmq subscriber sets: three socket options)."""

    def __init__(self, endpoint: str, server_key: bytes, key_pair: tuple[bytes, bytes], topic: bytes) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.curve_serverkey = server_key
        self.sock.curve_publickey, self.sock.curve_secretkey = key_pair
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.topics: set[str] = set()

    def read(self, seconds: float) -> set[str]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                topic, _seq, payload = self.sock.recv_multipart()
                decode_plain(payload)
                self.topics.add(topic.decode())
        return self.topics

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def test_a_bare_port_binds_the_grpc_host_and_an_open_network_feed_is_refused(tmp_path: Path) -> None:
    assert NodeConfig(kv_events_endpoint="5557").kv_events_endpoint == "tcp://127.0.0.1:5557"
    assert NodeConfig(host="::1", kv_events_endpoint="tcp://:5557").kv_events_endpoint == "tcp://[::1]:5557"
    for endpoint, host in (("tcp://0.0.0.0:5557", "127.0.0.1"), ("5557", "0.0.0.0"), ("tcp://*:5557", "::1")):
        with pytest.raises(ValueError, match=r"kv_events_endpoint: .* to anyone who reaches it"):
            NodeConfig(host=host, kv_events_endpoint=endpoint)
        assert NodeConfig(host=host, kv_events_endpoint=endpoint, kv_events_allow_open=True).kv_events_endpoint
    secret = private_file(tmp_path / "node.key_secret", "x")
    subs = private_file(tmp_path / "subscribers", "", 0o644)
    assert NodeConfig(kv_events_endpoint="tcp://0.0.0.0:5557", kv_events_curve_secret_file=str(secret),
                      kv_events_subscribers_file=str(subs)).kv_events_endpoint  # fmt: skip
    with pytest.raises(ValueError, match="kv_events_curve_secret_file and kv_events_subscribers_file go together"):
        NodeConfig(kv_events_endpoint="5557", kv_events_curve_secret_file=str(secret))
    # What the node tells its users: no example binds every interface.
    shown = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--help"], capture_output=True, text=True, check=True,
                           timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout  # fmt: skip
    assert "--kv-events-endpoint" in shown and "0.0.0.0" not in shown
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "--kv-events-endpoint tcp://0.0.0.0" not in readme


def test_subscriptions_are_cut_to_the_subscribers_tenant() -> None:
    assert granted(b"kv@", "acme", "kv", "n0") == b"kv@n0/acme@"
    assert granted(b"", "acme", "kv", "n0") == b"kv@n0/acme@"
    assert granted(b"kv@n0/acme@it/x", "acme", "kv", "n0") == b"kv@n0/acme@it/x"
    assert granted(b"kv@n0@", "acme", "kv", "n0") is None  # the default tenant's topics
    assert granted(b"kv@n0/acmex@", "acme", "kv", "n0") is None
    assert granted(b"kv@n0/other@", "acme", "kv", "n0") is None
    assert granted(b"kv@", "default", "kv", "n0") == b"kv@"  # the operator's key: everything
    assert granted(b"", None, "kv", "n0") == b""  # no CURVE: an open feed, as configured


def test_curve_keys_admit_listed_subscribers_each_to_its_tenants_topics(tmp_path: Path) -> None:
    node_keys = keys(tmp_path, "node")
    acme, ops, stranger = keys(tmp_path, "acme"), keys(tmp_path, "ops"), keys(tmp_path, "stranger")
    subscribers = tmp_path / "subscribers"
    subscribers.write_text(f"# key tenant\n{acme[0].decode()} acme\n{ops[0].decode()}\n")
    tokens = private_file(tmp_path / "rw.tokens", f"{TOK_ACME} acme\n{TOK_OPS}\n")
    node = start_node(tmp_path, name="n0", extra_args=[
        "--auth-tokens-file", str(tokens), "--kv-events-endpoint", "0",
        "--kv-events-curve-secret-file", str(tmp_path / "node.key_secret"),
        "--kv-events-subscribers-file", str(subscribers)])  # fmt: skip
    subs: list[CurveSub] = []
    try:
        with KVStoreClient(node.addr, timeout=30, security=ClientSecurity(token=TOK_OPS)) as ops_kv:
            status = ops_kv.stats().kv_events
            assert status is not None and status.curve and status.endpoint.startswith("tcp://127.0.0.1:")
            endpoint = status.endpoint
        for tok in (TOK_ACME, TOK_OPS):
            hs = prefix_hashes(list(range(32)), 16, NS)
            with KVStoreClient(node.addr, timeout=30, security=ClientSecurity(token=tok)) as kv:
                kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
        acme_all = CurveSub(endpoint, node_keys[0], acme, b"kv@")
        acme_default = CurveSub(endpoint, node_keys[0], acme, b"kv@n0@")  # the default tenant's topics
        ops_all = CurveSub(endpoint, node_keys[0], ops, b"")
        unlisted = CurveSub(endpoint, node_keys[0], stranger, b"")
        subs = [acme_all, acme_default, ops_all, unlisted]
        for s in subs:
            s.read(0.1)
        wait_for(lambda: {f"kv@n0/acme@{NS}", f"kv@n0@{NS}"} <= ops_all.read(0.2), 30, "the operator's snapshot")
        assert acme_all.read(1.0) == {f"kv@n0/acme@{NS}"}, "a tenant's key hears its own topics only"
        assert acme_default.read(0.5) == set() and unlisted.read(0.5) == set()
        with KVStoreClient(node.addr, timeout=30, security=ClientSecurity(token=TOK_OPS)) as ops_kv:
            status = ops_kv.stats().kv_events
        assert status.refused >= 2  # acme's subscription to the default topics; the unlisted key
    finally:
        for s in subs:
            s.close()
        node.close()


def test_a_bad_subscribers_file_or_a_readable_secret_refuses_the_start(tmp_path: Path) -> None:
    keys(tmp_path, "node")
    secret = tmp_path / "node.key_secret"
    bad = tmp_path / "subscribers"
    args = ["--kv-events-endpoint", "0", "--kv-events-curve-secret-file", str(secret),
            "--kv-events-subscribers-file", str(bad)]  # fmt: skip
    bad.write_text("not-a-key acme\n")
    with pytest.raises(RuntimeError) as refused:
        start_node(tmp_path, extra_args=args)
    assert "subscribers:1: a line is a CURVE public key" in " ".join(str(refused.value).split())
    bad.write_text("")
    secret.chmod(0o644)
    with pytest.raises(RuntimeError) as refused:
        start_node(tmp_path, extra_args=args)
    assert "node.key_secret: accessible to every user" in " ".join(str(refused.value).split())


def test_subscribers_that_never_read_and_a_join_every_moment_hold_bounded_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """20 subscribers that connect and never read, and a subscriber re-joining every 0.2 s for 12 s, against
    a publisher holding 60,000 pages (each its own BlockStored: ~8 MB a snapshot). Before: every snapshot
    stayed queued for the stuck subscribers (100,000 messages of up to 1,024 events each), so memory grew
    by a snapshot each time the sender could encode one (+109 MiB in 8 s here, growing). Now a stuck subscriber holds at most SEND_HWM messages of
    at most MAX_EVENTS_PER_BATCH events (~36 MiB, shared by subscribers of the same topics), and snapshots
    are paced by their cost. The bound asserted, 96 MiB, is that plus room for the process's own noise."""
    monkeypatch.setattr(kv_events, "SNAPSHOT_MIN_SECONDS", 0.05)  # joins as fast as the old limit allowed
    held = [(NS, i.to_bytes(32, "big"), TierKind.DRAM) for i in range(60_000)]
    pid = os.getpid()

    async def run() -> tuple[int, int]:
        pub = KvEventPublisher("tcp://127.0.0.1:0", "mem", lambda: list(held), lambda ns, h: (None, 16))
        pub.start(asyncio.get_running_loop())
        ctx = zmq.Context()
        stuck = []
        try:
            for _ in range(20):
                s = ctx.socket(zmq.SUB)
                s.setsockopt(zmq.RCVHWM, 1)
                s.setsockopt(zmq.RCVBUF, 4096)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(pub.endpoint)
                s.setsockopt(zmq.SUBSCRIBE, b"")
                stuck.append(s)
            await asyncio.sleep(1.0)
            before = rss_bytes(pid)
            peak = before
            deadline = time.monotonic() + 12.0
            while time.monotonic() < deadline:  # a join every 0.2 s
                j = ctx.socket(zmq.SUB)
                j.setsockopt(zmq.LINGER, 0)
                j.connect(pub.endpoint)
                j.setsockopt(zmq.SUBSCRIBE, b"kv@")
                await asyncio.sleep(0.2)
                j.close()
                peak = max(peak, rss_bytes(pid))
            return peak - before, pub.snapshot_status().snapshots
        finally:
            for s in stuck:
                s.close()
            ctx.term()
            await asyncio.to_thread(pub.close)

    grew, snapshots = asyncio.run(run())
    assert snapshots >= 2  # the joins were answered
    assert grew < 96 * MiB, f"never-reading subscribers held +{grew / MiB:.0f} MiB ({snapshots} snapshots)"


def test_a_snapshot_reads_the_page_table_a_slice_per_loop_turn() -> None:
    """A join must not stop the node's loop for a whole walk of its pages: while a snapshot of 50,000 pages
    is read, a task on the same loop keeps running between slices."""
    held = [(NS, i.to_bytes(32, "big"), TierKind.DRAM) for i in range(50_000)]

    async def run() -> tuple[int, Any]:
        pub = KvEventPublisher("tcp://127.0.0.1:0", "slices", lambda: iter(held), lambda ns, h: (None, 16))
        ticks = 0
        stop = False

        async def ticker() -> None:
            nonlocal ticks
            while not stop:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.get_running_loop().create_task(ticker())
        await asyncio.sleep(0)
        pub.start(asyncio.get_running_loop())
        try:
            for _ in range(400):
                if pub.snapshot_status().snapshots >= 1:
                    break
                await asyncio.sleep(0.01)
            return ticks, pub.snapshot_status()
        finally:
            stop = True
            await task
            await asyncio.to_thread(pub.close)

    ticks, status = asyncio.run(run())
    assert status.snapshots == 1
    assert ticks >= 50_000 // kv_events.SNAPSHOT_SLICE, f"the loop turned {ticks} times during the walk"
