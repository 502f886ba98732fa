"""Replication by heat on a real cluster (DESIGN.md §7.3): redis-server (one, a Redis Cluster, a Sentinel group)
and three or four real nodes on loopback, copying pages node to node.

- a page read often gets a copy on another node, the index lists both holders and reads spread over them; a page
  read once keeps its one copy;
- a Put's replicas=k (on every plane) keeps k copies; a holder killed with SIGKILL costs no read, and the lost copy
  is made again on another node (on one Redis, a Redis Cluster and a Sentinel group);
- a node stopped with SIGSTOP costs one call at most its timeout, is marked suspect by the index within seconds,
  and reads go to the other holder;
- SIGTERM hands a node's hot pages to the others before it exits;
- a node that joins takes its share of new chains; puts spread by room, not by node id.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.cli.redis_procs import RedisClusterGroup, RedisProcess, SentinelGroup
from kvstore.client import KVStoreClient
from kvstore.client.cluster import ClusterClient
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.index import acl
from tests.integration.conftest import LAYOUT, NS, SLOT, key, page
from tests.security.conftest import wait_for

TTL = 1.5  # index heartbeat TTL: a killed node stops being named within seconds
FAST = {"KVSTORE_REPLICATION_INTERVAL_SECONDS": "0.2"}  # replication rounds 5x a second (default: 1 s)


def start(tmp_path: Path, url: str, name: str, *, dram_pages: int = 64, env: dict[str, str] | None = None,
          extra: list[str] | None = None, ttl: float = TTL) -> NodeProcess:  # fmt: skip
    return NodeProcess(dram_bytes=dram_pages * SLOT, nvme_path=tmp_path / name, nvme_bytes=64 * SLOT, node_id=name,
                       max_page_bytes=LAYOUT.page_bytes, redis_url=url, env={**FAST, **(env or {})},
                       extra_args=["--index-ttl", str(ttl), *(extra or [])],
                       log_path=tmp_path / f"{name}.log").start()  # fmt: skip


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    r = RedisProcess().start()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def cluster(tmp_path: Path, redis_server: RedisProcess) -> Iterator[tuple[str, dict[str, NodeProcess]]]:
    nodes: dict[str, NodeProcess] = {}
    try:
        for i in range(3):
            nodes[f"n{i}"] = start(tmp_path, redis_server.url, f"n{i}")
        yield redis_server.url, nodes
    finally:
        for n in nodes.values():
            n.close()


def holders(cc: ClusterClient, chain: list[bytes]) -> list[set[str]]:
    found = cc.lookup(NS, chain)
    return [set(b) for b in found.holders] + [set()] * (len(chain) - found.matched)


def replication(node: NodeProcess) -> Any:
    with KVStoreClient(node.addr, timeout=10) as kv:
        return kv.stats().replication


def test_a_hot_page_gets_a_copy_and_reads_spread_a_cold_one_keeps_one(
    cluster: tuple[str, dict[str, NodeProcess]],
) -> None:
    url, nodes = cluster
    hot = [key(i, "hot") for i in range(8)]
    cold = [key(i, "cold") for i in range(8)]
    with KVStoreClient(nodes["n0"].addr) as kv:
        kv.put(NS, LAYOUT, hot + cold, [page(h) for h in hot + cold])
    with ClusterClient(url, local_copies=False, seed=1) as cc:
        wait_for(lambda: cc.lookup(NS, hot + cold).matched == 16, 10, "the index to list the pages")
        assert [bytes(p) for p in cc.get(NS, cold)] == [page(h) for h in cold]  # read once: stays cold
        for _ in range(40):  # read often: hot (a few reads a second is enough: DESIGN.md §7.3)
            assert len(cc.get(NS, hot)) == 8
        wait_for(lambda: all(len(b) >= 2 for b in holders(cc, hot)), 15, "a second holder of every hot page")
        second = (holders(cc, hot)[0] - {"n0"}).pop()
        with KVStoreClient(nodes[second].addr) as kv:  # the copy is the page, byte for byte, verified on arrival
            assert [bytes(p) for p in kv.get(NS, hot)] == [page(h) for h in hot]
        assert replication(nodes[second]).copies_in >= 8 and replication(nodes["n0"]).copies_out >= 8
        assert all(b == {"n0"} for b in holders(cc, cold))
        served = {n: replication(p).served_pages for n, p in nodes.items()}
        for _ in range(30):
            assert len(cc.get(NS, hot)) == 8
        more = {n: replication(p).served_pages - served[n] for n, p in nodes.items()}
        assert more["n0"] > 0 and more[second] > 0  # both holders serve reads


@pytest.mark.parametrize("plane", ["grpc", "tcp", "shm"])
def test_put_replicas_on_every_plane_keeps_that_many_copies(
    cluster: tuple[str, dict[str, NodeProcess]], plane: str
) -> None:
    url, nodes = cluster
    chain = [key(i, f"rep-{plane}") for i in range(4)]
    with KVStoreClient(nodes["n1"].addr, transport=plane) as kv:
        kv.put(NS, LAYOUT, chain, [page(h) for h in chain], replicas=3)
    with ClusterClient(url, local_copies=False) as cc:
        wait_for(lambda: all(len(b) == 3 for b in holders(cc, chain)), 15, "three holders of every page")


def test_bad_replicas_is_refused_naming_the_field(cluster: tuple[str, dict[str, NodeProcess]]) -> None:
    _, nodes = cluster
    chain = [key(0, "bad-replicas")]
    with KVStoreClient(nodes["n0"].addr) as kv:
        with pytest.raises(Exception, match="replicas"):
            kv.put(NS, LAYOUT, chain, [page(chain[0])], replicas=17)
        assert kv.lookup(NS, chain) == 0  # nothing stored


def kill9_and_repair(url: str, nodes: dict[str, NodeProcess], tag: str) -> None:
    """replicas=2 on a cluster of three: SIGKILL a holder under a stream of reads; no read loses a page, and
    the page has two live holders again within a bounded time."""
    chain = [key(i, tag) for i in range(6)]
    with ClusterClient(url, local_copies=False) as cc:
        wait_for(lambda: len([n for n in cc.nodes() if n.alive]) == len(nodes), 20, "every node to register")
        first, _ = cc.put(NS, LAYOUT, chain, [page(h) for h in chain], replicas=2)
        wait_for(lambda: all(len(b) == 2 for b in holders(cc, chain)), 20, "two holders of every page")
        victim = first
        nodes[victim].kill()
        for _ in range(20):  # reads in flight move to the other holder: no page is lost
            assert [bytes(p) for p in cc.get(NS, chain)] == [page(h) for h in chain]
        wait_for(lambda: all(len(b - {victim}) == 2 for b in holders(cc, chain)), 30,
                 "the lost copies to be made again on the third node")  # fmt: skip
        assert [bytes(p) for p in cc.get(NS, chain)] == [page(h) for h in chain]


def test_a_holder_killed_costs_no_read_and_its_copies_are_made_again(
    cluster: tuple[str, dict[str, NodeProcess]],
) -> None:
    url, nodes = cluster
    kill9_and_repair(url, nodes, "kill9")


def test_on_a_redis_cluster_a_killed_holder_is_repaired(tmp_path: Path) -> None:
    users = {
        acl.CLIENT_USER: ("client-" + "c" * 20, acl.CLIENT_RULES),
        **{acl.node_user(n): (f"node-{n}-" + "n" * 16, acl.node_rules(n)) for n in ("n0", "n1", "n2")},
    }
    group = RedisClusterGroup("admin-" + "a" * 20, users, masters=3, replicas=0, node_timeout_ms=1000).start()
    nodes: dict[str, NodeProcess] = {}
    try:
        for n in ("n0", "n1", "n2"):
            nodes[n] = start(tmp_path, group.url_for(acl.node_user(n)), n)
        kill9_and_repair(group.url_for(acl.CLIENT_USER), nodes, "rc-kill9")
    finally:
        for p in nodes.values():
            p.close()
        group.close()


def test_behind_sentinel_a_killed_holder_is_repaired(tmp_path: Path) -> None:
    group = SentinelGroup("admin-" + "s" * 20, replicas=1, sentinels=1).start()
    nodes: dict[str, NodeProcess] = {}
    try:
        for n in ("n0", "n1", "n2"):
            nodes[n] = start(tmp_path, group.url, n)
        kill9_and_repair(group.url, nodes, "sentinel-kill9")
    finally:
        for p in nodes.values():
            p.close()
        group.close()


def test_a_stopped_node_costs_one_call_then_is_skipped(tmp_path: Path, redis_server: RedisProcess) -> None:
    """The index TTL is long here (30 s): what skips the stopped node is its missing beat, within seconds."""
    url = redis_server.url
    nodes = {n: start(tmp_path, url, n, ttl=30.0) for n in ("n0", "n1")}
    try:
        stopped_node_is_skipped(url, nodes)
    finally:
        for p in nodes.values():
            p.close()


def stopped_node_is_skipped(url: str, nodes: dict[str, NodeProcess]) -> None:
    chain = [key(i, "stop") for i in range(6)]
    with KVStoreClient(nodes["n0"].addr) as kv:
        kv.put(NS, LAYOUT, chain, [page(h) for h in chain], replicas=2)
    timeout = 3.0
    with ClusterClient(url, local_copies=False, timeout=timeout) as cc:
        wait_for(lambda: all(len(b) == 2 for b in holders(cc, chain)), 20, "two holders of every page")
        proc = nodes["n0"].proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            for _ in range(10):
                started = time.monotonic()
                assert [bytes(p) for p in cc.get(NS, chain)] == [page(h) for h in chain]
                # NOTE: a bound, not a speed: one deadline per call across planes (never the 4x of a call that
                # starts its wait over on every plane), plus the same-host plane's fixed drain wait.
                assert time.monotonic() - started < 2 * timeout + 3
            wait_for(lambda: "n0" in cc.index.suspects(), 10, "the index to mark the stopped node suspect")
            with ClusterClient(url, local_copies=False, timeout=timeout) as fresh:  # a client that never failed
                for _ in range(5):
                    started = time.monotonic()
                    assert len(fresh.get(NS, chain)) == 6
                    assert time.monotonic() - started < timeout  # it skipped the suspect node: no wait at all
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        wait_for(lambda: "n0" not in cc.index.suspects(), 10, "the node to beat again")


def test_sigterm_hands_hot_pages_to_the_others(cluster: tuple[str, dict[str, NodeProcess]]) -> None:
    url, nodes = cluster
    hot = [key(i, "handoff") for i in range(6)]
    with KVStoreClient(nodes["n2"].addr) as kv:
        # read a few times: warm, not hot (no copies by heat), so only the hand-off moves them
        kv.put(NS, LAYOUT, hot, [page(h) for h in hot])
        for _ in range(4):
            assert len(kv.get(NS, hot)) == 6
    with ClusterClient(url, local_copies=False) as cc:
        assert nodes["n2"].stop() == 0  # SIGTERM: the hand-off runs before the drain
        wait_for(lambda: all(len(b) >= 1 for b in holders(cc, hot)), 10, "the pages on another node")
        assert all("n2" not in b for b in holders(cc, hot))
        assert [bytes(p) for p in cc.get(NS, hot)] == [page(h) for h in hot]


def test_a_node_that_joins_takes_its_share_of_new_chains(tmp_path: Path, redis_server: RedisProcess) -> None:
    nodes = {n: start(tmp_path, redis_server.url, n, env={"KVSTORE_REPLICATION": "0"}) for n in ("j0", "j1")}
    try:
        with ClusterClient(redis_server.url, seed=3) as cc:
            for c in range(12):
                chain = [key(i, f"before{c}") for i in range(4)]
                cc.put(NS, LAYOUT, chain, [page(h) for h in chain])
            nodes["j2"] = start(tmp_path, redis_server.url, "j2", env={"KVSTORE_REPLICATION": "0"})
            # NOTE: a client reads the node records at most LOADS_REFRESH_S apart: it learns of j2 within that
            wait_for(lambda: "j2" in cc.loads(), 10, "the client to see j2 registered")
            placed = [cc.put(NS, LAYOUT, ch, [page(h) for h in ch])[0]
                      for ch in ([key(i, f"after{c}") for i in range(4)] for c in range(12))]  # fmt: skip
            assert placed.count("j2") >= 4  # the empty node wins the draws it is in (never "the highest id")
            assert placed.count("j0") + placed.count("j1") >= 1
    finally:
        for p in nodes.values():
            p.close()


def test_replicate_refuses_bad_requests_naming_the_field(
    tmp_path: Path, cluster: tuple[str, dict[str, NodeProcess]]
) -> None:
    _, nodes = cluster
    h = key(0, "replicate-errors")
    with KVStoreClient(nodes["n0"].addr) as kv:
        for call, field in (
            (lambda: kv.replicate(NS, [h], ""), "source"),
            (lambda: kv.replicate(NS, [h], "n1", replicas=17), "replicas"),
            (lambda: kv.replicate(NS, [b"short"], "n1"), "hashes"),
            (lambda: kv.replicate(NS, [h] * 5000, "n1"), "hashes"),
            (lambda: kv.replicate("bad\x00namespace", [h], "n1"), "namespace"),
        ):
            with pytest.raises(InvalidArgument, match=field):
                call()
        assert kv.replicate(NS, [h], "no-such-node", layout=LAYOUT).failed == 1  # a miss, not an error
        assert kv.replicate(NS, [h], "n0").already_present == 1  # itself: nothing to copy
        assert kv.lookup(NS, [h]) == 0
    lonely = NodeProcess(dram_bytes=8 * SLOT, max_page_bytes=LAYOUT.page_bytes, node_id="lonely").start()
    try:
        with KVStoreClient(lonely.addr) as kv, pytest.raises(KVStoreError, match="takes no copies"):
            kv.replicate(NS, [h], "n0")  # a node without an index makes and takes no copies
    finally:
        lonely.close()
