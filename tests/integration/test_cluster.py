"""A real cluster: redis-server on a free loopback port and 2-3 real nodes publishing to it."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from kvstore.addresses import host_id
from kvstore.cli.launch import NodeProcess
from kvstore.cli.redis_procs import RedisProcess
from kvstore.client import KVStoreClient
from kvstore.client.cluster import ClusterClient
from kvstore.index import IndexReader, alive_key, entry_of, holder
from kvstore.names import TierKind
from tests.integration.conftest import LAYOUT, NS, SLOT, key, page

TTL = 1.5  # index heartbeat TTL for these tests: nodes heartbeat every 0.5 s


def wait_for(cond: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    r = RedisProcess().start()
    try:
        yield r
    finally:
        r.close()


def start(tmp_path: Path, url: str, name: str, dram_pages: int = 16, nvme_pages: int = 64,
          ttl: float = TTL) -> NodeProcess:  # fmt: skip
    return NodeProcess(dram_bytes=dram_pages * SLOT, nvme_path=tmp_path / name, nvme_bytes=nvme_pages * SLOT,
                       max_page_bytes=LAYOUT.page_bytes, node_id=name, redis_url=url,
                       extra_args=["--index-ttl", str(ttl)], log_path=tmp_path / f"{name}.log").start()  # fmt: skip


@pytest.fixture
def cluster(tmp_path: Path, redis_server: RedisProcess) -> Iterator[tuple[RedisProcess, list[NodeProcess]]]:
    nodes = [start(tmp_path, redis_server.url, f"n{i}") for i in range(3)]
    try:
        with ClusterClient(redis_server.url) as cc:
            wait_for(lambda: sum(n.alive for n in cc.nodes()) == 3, what="3 live nodes")
        yield redis_server, nodes
    finally:
        for n in nodes:
            n.close()


def index_settled(addrs: list[str]) -> bool:
    """Every node has written all its queued updates."""
    for addr in addrs:
        with KVStoreClient(addr, timeout=10) as kv:
            idx = kv.stats().index
            if idx is None or not idx.connected or idx.queued or idx.resync_pending:
                return False
    return True


def put_direct(addr: str, hashes: list[bytes]) -> None:
    with KVStoreClient(addr) as kv:
        kv.put(NS, LAYOUT, hashes, [page(h) for h in hashes])


def test_prefix_split_across_nodes(cluster: tuple[RedisProcess, list[NodeProcess]]) -> None:
    r, nodes = cluster
    chain = [key(i, "split") for i in range(8)]
    put_direct(nodes[0].addr, chain[:3])
    put_direct(nodes[1].addr, chain[3:8])
    with ClusterClient(r.url) as cc:
        wait_for(lambda: cc.lookup(NS, chain).matched == 8, what="index to show the whole chain")
        found = cc.lookup(NS, chain)
        assert found.plan() == [("n0", 0, 3), ("n1", 3, 8)]
        assert (found.nodes["n0"].leading, found.nodes["n1"].blocks, found.nodes["n1"].leading) == (3, 5, 0)
        pages = cc.get_pages(NS, [*chain, key(99, "absent")])
        assert [bytes(p.data) for p in pages] == [page(h) for h in chain]


def test_lookup_matches_brute_force(cluster: tuple[RedisProcess, list[NodeProcess]]) -> None:
    r, nodes = cluster
    rng = random.Random(7)
    chains = [[key(i, f"c{c}") for i in range(rng.randrange(2, 10))] for c in range(12)]
    for chain in chains:  # scatter every chain's blocks over the nodes, some blocks on two nodes
        for h in chain:
            for n in rng.sample(nodes, rng.choice([1, 1, 2])):
                put_direct(n.addr, [h])
        if rng.random() < 0.5:  # and punch a hole in some chains
            victim = rng.randrange(len(chain))
            for n in nodes:
                with KVStoreClient(n.addr) as kv:
                    kv.delete(NS, [chain[victim]])
    wait_for(lambda: index_settled([n.addr for n in nodes]), what="index to settle")
    clients = {n.addr: KVStoreClient(n.addr) for n in nodes}
    try:
        with ClusterClient(r.url) as cc:
            for chain in chains:
                expected: list[set[str]] = []
                for h in chain:  # brute force: ask every node about every block
                    holders = {f"n{i}" for i, n in enumerate(nodes) if clients[n.addr].lookup(NS, [h]) == 1}
                    if not holders:
                        break
                    expected.append(holders)
                found = cc.lookup(NS, chain)
                assert found.matched == len(expected)
                assert [set(b) for b in found.holders] == expected
    finally:
        for c in clients.values():
            c.close()


def test_tiers_are_tracked_through_demotion(tmp_path: Path, redis_server: RedisProcess) -> None:
    node = start(tmp_path, redis_server.url, "small", dram_pages=2, nvme_pages=16)
    try:
        chain = [key(i, "tier") for i in range(6)]
        put_direct(node.addr, chain)
        with ClusterClient(redis_server.url) as cc:
            wait_for(lambda: index_settled([node.addr]), what="index to settle")
            tiers = [b["small"] for b in cc.lookup(NS, chain).holders]
            with KVStoreClient(node.addr) as kv:
                assert tiers == kv.lookup_detail(NS, chain).tiers
            assert tiers.count(TierKind.NVME) == 4
    finally:
        node.close()


def test_redis_killed_and_restarted_mid_workload(tmp_path: Path, redis_server: RedisProcess) -> None:
    nodes = [start(tmp_path, redis_server.url, f"r{i}") for i in range(2)]
    try:
        before = [key(i, "before") for i in range(4)]
        put_direct(nodes[0].addr, before)
        wait_for(lambda: index_settled([n.addr for n in nodes]), what="index to settle")
        redis_server.kill()
        during = [key(i, "during") for i in range(4)]
        with KVStoreClient(nodes[0].addr) as kv:
            for _ in range(20):  # the node keeps serving its own pages without Redis: no failed get
                assert [bytes(p) for p in kv.get(NS, before)] == [page(h) for h in before]
            kv.put(NS, LAYOUT, during, [page(h) for h in during])
            assert kv.lookup(NS, during) == 4
            wait_for(lambda: not kv.stats().index.connected, what="node to notice Redis is gone")  # type: ignore[union-attr]
        redis_server.start()  # same port, empty: like a Redis restart without persistence
        with ClusterClient(redis_server.url) as cc:
            wait_for(lambda: cc.lookup(NS, before).matched == 4 and cc.lookup(NS, during).matched == 4,
                     what="index to converge after Redis returned")  # fmt: skip
            assert [bytes(p) for p in cc.get(NS, during)] == [page(h) for h in during]
            wait_for(lambda: {n.node_id for n in cc.nodes() if n.alive} == {"r0", "r1"},
                     what="both nodes to re-register")  # fmt: skip
    finally:
        for n in nodes:
            n.close()


def test_node_killed_entries_expire_and_clients_recover(cluster: tuple[RedisProcess, list[NodeProcess]]) -> None:
    r, nodes = cluster
    shared = [key(i, "shared") for i in range(4)]  # on n0 and n1
    only0 = [key(i, "only0") for i in range(3)]  # on n0 alone
    put_direct(nodes[0].addr, shared + only0)
    put_direct(nodes[1].addr, shared)
    with ClusterClient(r.url) as cc:
        wait_for(lambda: index_settled([n.addr for n in nodes]), what="index to settle")
        assert set(cc.lookup(NS, shared).holders[0]) == {"n0", "n1"}
        nodes[0].kill()  # SIGKILL: no deregistration
        # Before its entries expire, gets fall back from the dead node to the other holder.
        assert [bytes(p) for p in cc.get(NS, shared)] == [page(h) for h in shared]
        assert cc.get(NS, only0) == []  # only the dead node had it: a miss, not an error
        wait_for(lambda: "n0" not in cc.lookup(NS, shared).holders[0], timeout=3 * TTL + 5,
                 what="dead node's entries to stop matching")  # fmt: skip
        assert cc.lookup(NS, only0).matched == 0
        assert {n.node_id: n.alive for n in cc.nodes()} == {"n0": False, "n1": True, "n2": True}


def test_stale_entry_costs_one_miss_not_an_error(cluster: tuple[RedisProcess, list[NodeProcess]]) -> None:
    r, nodes = cluster
    chain = [key(i, "stale") for i in range(3)]
    put_direct(nodes[1].addr, chain[:2])
    with ClusterClient(r.url) as cc:
        wait_for(lambda: cc.lookup(NS, chain).matched == 2, what="index")
        rd = redis.Redis.from_url(r.url)
        epoch = int(rd.get(alive_key("n1")))
        rd.hset(*entry_of(NS, chain[2]), holder("n1", epoch, int(TierKind.DRAM)))  # a lie: n1 lacks it
        rd.close()
        assert cc.lookup(NS, chain).matched == 3
        pages = cc.get_pages(NS, chain)
        assert [bytes(p.data) for p in pages] == [page(h) for h in chain[:2]]


def test_put_placement_prefers_the_chain_holder(cluster: tuple[RedisProcess, list[NodeProcess]]) -> None:
    r, nodes = cluster
    chain = [key(i, "aff") for i in range(6)]
    put_direct(nodes[2].addr, chain[:3])
    with ClusterClient(r.url) as cc:
        wait_for(lambda: cc.lookup(NS, chain[:3]).matched == 3, what="index")
        node, res = cc.put(NS, LAYOUT, chain[3:], [page(h) for h in chain[3:]], parent_chain=chain[:3])
        assert node == "n2" and res.stored == 3
        wait_for(lambda: {n.node_id: n.info.get("slots_used_dram") for n in cc.nodes()}["n2"] == "6",
                 what="n2's load to reach the index (heartbeat)")  # fmt: skip
        fresh = [key(i, "fresh") for i in range(2)]
        node2, _ = cc.put(NS, LAYOUT, fresh, [page(h) for h in fresh])  # no affinity: least loaded
        assert node2 in {"n0", "n1"}
    with ClusterClient(r.url, local_node="n1") as cc:
        node3, _ = cc.put(NS, LAYOUT, [key(0, "loc")], [page(key(0, "loc"))])
        assert node3 == "n1"


def test_kvctl_nodes_and_lookup(cluster: tuple[RedisProcess, list[NodeProcess]], tmp_path: Path) -> None:
    from kvstore.hashing import prefix_hashes

    r, nodes = cluster
    tokens = list(range(5 * LAYOUT.block_size))
    hashes = prefix_hashes(tokens, LAYOUT.block_size, NS)
    put_direct(nodes[0].addr, hashes[:2])
    put_direct(nodes[1].addr, hashes[2:4])
    wait_for(lambda: index_settled([n.addr for n in nodes]), what="index")

    def kvctl_nodes() -> dict[str, dict[str, object]]:
        out = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "nodes", "--redis-url", r.url, "--json"],
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        return {n["node_id"]: n for n in json.loads(out.stdout)}

    # Per-node counters are refreshed with each heartbeat (every TTL/3), so they trail the puts a little.
    listed: dict[str, dict[str, object]] = {}
    wait_for(lambda: listed.update(kvctl_nodes()) or listed["n0"]["pages_dram"] == "2", what="n0 heartbeat")
    assert set(listed) == {"n0", "n1", "n2"} and all(n["alive"] for n in listed.values())
    assert listed["n0"]["pages_dram"] == "2" and listed["n0"]["queued"] == "0"
    with IndexReader(r.url) as index:  # each record advertises the node's data planes and host, as Stats does
        for info in index.nodes():
            with KVStoreClient(info.addr) as kv:
                stats = kv.stats()
            assert info.planes == stats.planes and info.host_id == stats.host_id == host_id()
    tokens_file = tmp_path / "tokens.txt"
    tokens_file.write_text(" ".join(map(str, tokens)))
    out = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "lookup", "--redis-url", r.url, "--namespace", NS,
                          "--tokens-file", str(tokens_file), "--block-size", str(LAYOUT.block_size), "--json"],
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    res = json.loads(out.stdout)
    assert res["blocks"] == 5 and res["matched"] == 4
    assert res["nodes"]["n0"]["leading"] == 2 and res["nodes"]["n1"]["blocks"] == 2
    assert res["plan"] == [["n0", 0, 2], ["n1", 2, 4]]


def test_kvstore_up_serves_a_prefix_split_across_two_nodes(tmp_path: Path) -> None:
    ready = tmp_path / "up.json"
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli.main", "up", "--nodes", "2", "--ready-file",
                             str(ready), "--nvme-root", str(tmp_path / "nvme"), "--dram-bytes", "8MiB",
                             "--nvme-bytes", "16MiB", "--max-page-bytes", "64KiB", "--index-ttl", str(TTL)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_for(ready.exists, timeout=60, what="kvstore up to be ready")
        info = json.loads(ready.read_text())
        chain = [key(i, "up") for i in range(6)]
        put_direct(info["nodes"]["node-0"], chain[:3])
        put_direct(info["nodes"]["node-1"], chain[3:])
        with ClusterClient(info["redis_url"]) as cc:
            wait_for(lambda: cc.lookup(NS, chain).matched == 6, what="index")
            pages = cc.get_pages(NS, chain)
            assert [bytes(p.data) for p in pages] == [page(h) for h in chain]
            assert [n for n, _, _ in cc.lookup(NS, chain).plan()] == ["node-0", "node-1"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0
    for addr in [*info["nodes"].values(), info["redis_url"].split("//")[1].split("/")[0]]:
        host, port = addr.rsplit(":", 1)
        with pytest.raises(OSError):  # `up` stopped every process it started
            socket.create_connection((host, int(port)), timeout=2).close()


def test_brief_redis_stall_flushes_the_queue_without_a_resync(tmp_path: Path, redis_server: RedisProcess) -> None:
    """Redis unreachable for a moment but not restarted: queued updates are written, no full resync."""
    # TTL 4 s: Redis calls time out after 1 s and heartbeats come every 1.33 s, so a 2 s stall makes
    # calls fail but cannot let the alive key expire.
    node = start(tmp_path, redis_server.url, "p0", ttl=4.0)
    try:
        with ClusterClient(redis_server.url) as cc, KVStoreClient(node.addr) as kv:
            wait_for(lambda: index_settled([node.addr]), what="index to settle")
            resyncs = kv.stats().index.resyncs  # type: ignore[union-attr]
            rd = redis.Redis.from_url(redis_server.url)
            rd.execute_command("CLIENT", "PAUSE", "2000", "ALL")  # every client's commands stall 2 s
            rd.close()
            stalled = [key(i, "stall") for i in range(3)]
            kv.put(NS, LAYOUT, stalled, [page(h) for h in stalled])  # the node serves on meanwhile
            assert kv.lookup(NS, stalled) == 3
            wait_for(lambda: cc.lookup(NS, stalled).matched == 3, timeout=20, what="queued updates to land")
            wait_for(lambda: index_settled([node.addr]), what="index to settle")
            status = kv.stats().index
            assert status.errors > 0 and status.resyncs == resyncs  # type: ignore[union-attr]
    finally:
        node.close()


def test_a_ready_node_is_already_findable_through_the_index(tmp_path: Path, redis_server: RedisProcess) -> None:
    """Ready (ready file, health SERVING) means registered: a restarted node's recovered NVMe pages and
    new address are in the index the moment start() returns, not one publish later."""
    node = start(tmp_path, redis_server.url, "r0", ttl=30.0)  # a long TTL: the old incarnation stays alive
    try:
        chain = [key(i, "ready") for i in range(3)]
        with ClusterClient(redis_server.url) as cc:
            assert {n.node_id for n in cc.nodes() if n.alive} == {"r0"}
            put_direct(node.addr, chain)
            node.stop()  # graceful: DRAM pages are spilled to NVMe
            node.start()
            assert {n.node_id: n.addr for n in cc.nodes() if n.alive} == {"r0": node.addr}
            found = cc.lookup(NS, chain)
            assert found.matched == 3 and found.nodes["r0"].tiers == {TierKind.NVME: 3}
            assert [p.hash for p in cc.get_pages(NS, chain)] == chain
    finally:
        node.close()


def test_a_node_without_its_index_still_starts_and_serves(tmp_path: Path) -> None:
    """Redis down at startup: the node waits only --index-register-wait, then serves its own pages."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # nothing listens once the socket closes
    node = NodeProcess(dram_bytes=8 * SLOT, node_id="lonely", redis_url=dead_url, max_page_bytes=LAYOUT.page_bytes,
                       extra_args=["--index-ttl", "2", "--index-register-wait", "0.5"]).start()  # fmt: skip
    try:
        chain = [key(i, "lonely") for i in range(2)]
        put_direct(node.addr, chain)
        with KVStoreClient(node.addr) as kv:
            assert kv.lookup(NS, chain) == 2
            assert [p.hash for p in kv.get_pages(NS, chain)] == chain
            idx = kv.stats().index
            assert idx is not None and not idx.connected and idx.resync_pending
    finally:
        node.close()


def test_client_follows_a_node_that_restarted_on_a_new_port(tmp_path: Path, redis_server: RedisProcess) -> None:
    node = start(tmp_path, redis_server.url, "m0")
    try:
        with ClusterClient(redis_server.url) as cc:
            wait_for(lambda: any(n.alive for n in cc.nodes()), what="node to register")
            first = [key(i, "move1") for i in range(2)]
            cc.put(NS, LAYOUT, first, [page(h) for h in first])  # caches the node's address
            old = node.addr
            node.stop()
            node.start()  # same NVMe, new port
            assert node.addr != old
            wait_for(lambda: {n.node_id: n.addr for n in cc.nodes() if n.alive}.get("m0") == node.addr,
                     what="the new address in the index")  # fmt: skip
            second = [key(i, "move2") for i in range(2)]
            assert cc.put(NS, LAYOUT, second, [page(h) for h in second])[1].stored == 2
            assert cc.call_node("m0", lambda c: c.lookup(NS, first)) == 2  # recovered from NVMe/spill
            wait_for(lambda: cc.lookup(NS, second).matched == 2, what="index")
            assert [bytes(p) for p in cc.get(NS, second)] == [page(h) for h in second]
    finally:
        node.close()


def test_publisher_close_is_not_hung_by_a_wake_racing_the_cancel() -> None:
    """Regression: on Python 3.11 asyncio.wait_for swallows a cancellation that lands as its event fires,
    so a flush loop built on it ran forever and a node's SIGTERM shutdown hung until SIGKILL (losing
    its DRAM spill). Here the wake and the cancel land together, many times."""
    import asyncio

    from kvstore.index.publisher import IndexPublisher

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # nothing listens: the loops back off

    async def one_round() -> None:
        pub = IndexPublisher(dead, "race", "127.0.0.1:1", lambda: [], lambda: {}, ttl_seconds=1.0)
        await pub.start()
        pub._need_resync = False  # park the flush loop in its wait, as on a registered idle node
        await asyncio.sleep(0.01)
        pub._wake.set()  # what note() does under load
        async with asyncio.timeout(10):
            await pub.close(deregister=False)

    async def main() -> None:
        for _ in range(20):
            await one_round()

    asyncio.run(main())
