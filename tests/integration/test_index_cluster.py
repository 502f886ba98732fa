"""The index on a Redis Cluster: real redis-server processes in cluster mode on loopback (3 masters, a
replica each, every server with the index's ACL users) and 3 real cache nodes publishing through
redis+cluster:// URLs (kvstore/index/connect.py).

- Nodes register, publish and a cluster client finds and fetches a chain split across them; the
  entries spread over every master; each server refuses a client's writes (ACLs are per server).
- A node killed with SIGKILL stops being named once its heartbeat TTL has passed.
- A master killed under a stream of lookups, and a slot moved between masters under it: every lookup
  answers (a shorter prefix, a miss, while the cluster changes), none raises; afterwards the nodes have
  republished (new epochs) and lookups find the whole chain again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from kvstore.cli.launch import NodeProcess
from kvstore.cli.redis_procs import RedisClusterGroup, RedisProcess
from kvstore.client import KVStoreClient
from kvstore.client.cluster import ClusterClient
from kvstore.index import IndexReader, acl, alive_key, stripe_key
from kvstore.index.connect import sync_cluster
from kvstore.index.keys import PREFIX, stripe_of
from tests.integration.conftest import LAYOUT, NS, SLOT, key, page

TTL = 3.0  # heartbeats every second: a dead node is gone, and a master change seen, within seconds
NODES = ("n0", "n1", "n2")
ADMIN = "admin-" + "a" * 20


def users() -> dict[str, tuple[str, str]]:
    return {
        acl.CLIENT_USER: ("client-" + "c" * 20, acl.CLIENT_RULES),
        **{acl.node_user(n): (f"node-{n}-" + "n" * 16, acl.node_rules(n)) for n in NODES},
    }


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def start_nodes(tmp_path: Path, group: RedisClusterGroup) -> list[NodeProcess]:
    nodes: list[NodeProcess] = []
    try:
        for n in NODES:
            node = NodeProcess(dram_bytes=32 * SLOT, nvme_path=tmp_path / n, nvme_bytes=64 * SLOT, node_id=n,
                               max_page_bytes=LAYOUT.page_bytes, redis_url=group.url_for(acl.node_user(n)),
                               extra_args=["--index-ttl", str(TTL)], log_path=tmp_path / f"{n}.log")  # fmt: skip
            nodes.append(node.start())
    except BaseException:
        for p in nodes:
            p.close()
        raise
    return nodes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisClusterGroup, list[NodeProcess]]]:
    group = RedisClusterGroup(ADMIN, users(), masters=3, replicas=1, node_timeout_ms=1000).start()
    try:
        nodes = start_nodes(tmp_path_factory.mktemp("nodes"), group)
        try:
            yield group, nodes
        finally:
            for n in nodes:
                n.close()
    finally:
        group.close()


@pytest.fixture
def fresh_cluster(tmp_path: Path) -> Iterator[tuple[RedisClusterGroup, list[NodeProcess]]]:
    """A cluster of its own, for a test that kills one of its masters."""
    group = RedisClusterGroup(ADMIN, users(), masters=3, replicas=1, node_timeout_ms=1000).start()
    try:
        nodes = start_nodes(tmp_path, group)
        try:
            yield group, nodes
        finally:
            for n in nodes:
                n.close()
    finally:
        group.close()


def put_direct(addr: str, hashes: list[bytes]) -> None:
    with KVStoreClient(addr, timeout=30) as kv:
        kv.put(NS, LAYOUT, hashes, [page(h) for h in hashes])


def admin(p: RedisProcess) -> redis.Redis:
    return redis.Redis(p.host, p.port, username="default", password=ADMIN, socket_timeout=5, decode_responses=True)


class Lookups:
    """Lookups (and a get) in a thread, as fast as they come, until stopped: every answer and every error
    kept. Bounded: at most `limit` rounds, and stop() waits at most 30 s."""

    def __init__(self, url: str, chain: list[bytes], limit: int = 20_000) -> None:
        self.chain, self.limit = chain, limit
        self.matched: list[int] = []
        self.fetched: list[int] = []
        self.errors: list[BaseException] = []
        self.reader = IndexReader(url, socket_timeout=2)
        self.cc = ClusterClient(url, timeout=5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for i in range(self.limit):
            if self._stop.is_set():
                return
            try:
                self.matched.append(self.reader.lookup(NS, self.chain).matched)
                if i % 10 == 0:
                    self.fetched.append(len(self.cc.get_pages(NS, self.chain)))
            except BaseException as exc:  # every error is the finding
                self.errors.append(exc)
            time.sleep(0.01)

    def __enter__(self) -> Lookups:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.reader.close()
        self.cc.close()


def test_nodes_register_publish_and_a_client_finds_a_chain_across_them(
    cluster: tuple[RedisClusterGroup, list[NodeProcess]],
) -> None:
    group, nodes = cluster
    client_url = group.url_for(acl.CLIENT_USER)
    assert client_url.startswith("redis+cluster://kvclient:")
    chain = [key(i, "split") for i in range(96)]
    put_direct(nodes[0].addr, chain[:32])
    put_direct(nodes[1].addr, chain[32:64])
    put_direct(nodes[2].addr, chain[64:])
    put_direct(nodes[2].addr, chain[:8])  # a second holder of the first pages
    with ClusterClient(client_url, timeout=30) as cc:
        wait_for(lambda: {n.node_id for n in cc.nodes() if n.alive} == set(NODES), 30, "3 live nodes")
        wait_for(lambda: cc.lookup(NS, chain).matched == 96, 30, "the whole chain in the index")
        found = cc.lookup(NS, chain)
        assert set(found.holders[0]) == {"n0", "n2"} and set(found.holders[8]) == {"n0"}
        assert found.plan() == [("n0", 0, 32), ("n1", 32, 64), ("n2", 64, 96)]
        assert [bytes(p.data) for p in cc.get_pages(NS, chain)] == [page(h) for h in chain]
        tail = [key(i, "split-tail") for i in range(4)]  # a put placed through the index: to the chain's holder
        node, res = cc.put(NS, LAYOUT, tail, [page(h) for h in tail], parent_chain=chain)
        assert node == "n0" and res.stored == 4
        wait_for(lambda: cc.lookup(NS, chain + tail).matched == 100, 30, "the put's pages in the index")
    # The namespace's entries spread over every master (32 stripes, each a slot of its own).
    masters = group.masters_now()
    assert len(masters) == 3
    for m in masters:
        with admin(m) as a:
            assert a.dbsize() > 0 and a.keys(f"{PREFIX}b:*")
    # Every server, replicas included, carries the ACL users: the client's user reads but never writes.
    for p in group.processes():
        with admin(p) as a:
            assert a.acl_getuser(acl.CLIENT_USER) is not None and a.acl_getuser(acl.node_user("n0")) is not None
    rc = sync_cluster(client_url, 5)
    try:
        assert rc.get(alive_key("n0")) is not None
        for write in (lambda: rc.set(alive_key("evil"), "1"), lambda: rc.hset(stripe_key(NS, 0), "x", "y"),
                      lambda: rc.eval("return 1", 0)):  # fmt: skip
            with pytest.raises(redis.exceptions.NoPermissionError):
                write()
    finally:
        rc.close()


def test_a_killed_node_stops_being_named_within_its_ttl(cluster: tuple[RedisClusterGroup, list[NodeProcess]]) -> None:
    group, nodes = cluster
    shared = [key(i, "shared") for i in range(8)]
    only2 = [key(i, "only2") for i in range(4)]
    put_direct(nodes[1].addr, shared)
    put_direct(nodes[2].addr, shared + only2)
    with ClusterClient(group.url_for(acl.CLIENT_USER), timeout=10) as cc:
        wait_for(lambda: cc.lookup(NS, shared + only2).matched == 12, 30, "the chains in the index")
        assert set(cc.lookup(NS, shared).holders[0]) == {"n1", "n2"}
        nodes[2].kill()  # SIGKILL: no deregistration
        assert [bytes(p.data) for p in cc.get_pages(NS, shared)] == [page(h) for h in shared]  # from n1
        t0 = time.monotonic()
        wait_for(lambda: "n2" not in cc.lookup(NS, shared).holders[0], TTL + 5, "n2 to stop being named")
        assert time.monotonic() - t0 < TTL + 5
        assert cc.lookup(NS, only2).matched == 0  # only the dead node had it: a miss
        assert {n.node_id: n.alive for n in cc.nodes()} == {"n0": True, "n1": True, "n2": False}


def _migrate(group: RedisClusterGroup, slot: int, half_moved: Callable[[], None]) -> tuple[RedisProcess, RedisProcess]:
    """Move `slot` to another master by hand, as `redis-cli --cluster reshard` does: IMPORTING on the
    target, MIGRATING on the source, every key MIGRATEd (then `half_moved()`: lookups meet ASK), then
    the slot's owner set everywhere."""
    src = group.master_for_slot(slot)
    assert src is not None
    dst = next(m for m in group.masters_now() if m is not src)
    with admin(src) as s, admin(dst) as d:
        src_id, dst_id = s.execute_command("CLUSTER", "MYID"), d.execute_command("CLUSTER", "MYID")
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        for _ in range(1000):  # bounded: a slot holds a handful of stripes here
            keys = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10)
            if not keys:
                break
            s.execute_command("MIGRATE", dst.host, dst.port, "", 0, 5000, "AUTH2", "default", ADMIN, "KEYS", *keys)
        half_moved()
        for m in group.masters_now():
            with admin(m) as a:
                a.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    return src, dst


def test_a_slot_moved_under_lookups_is_a_miss_never_an_error(
    cluster: tuple[RedisClusterGroup, list[NodeProcess]],
) -> None:
    group, nodes = cluster
    chain = [key(i, "moving") for i in range(48)]
    put_direct(nodes[0].addr, chain)
    url = group.url_for(acl.CLIENT_USER)
    slot = key_slot(stripe_key(NS, stripe_of(chain[0])).encode())
    with ClusterClient(url, timeout=10) as cc:
        wait_for(lambda: cc.lookup(NS, chain).matched == 48, 30, "the chain in the index")
        with Lookups(url, chain) as run:
            time.sleep(0.3)

            def half_moved() -> None:  # the slot's keys moved, its owner not yet changed: a few lookups then
                seen = len(run.matched)
                wait_for(lambda: len(run.matched) >= seen + 3, 20, "lookups while the slot is half moved")

            src, dst = _migrate(group, slot, half_moved)
            wait_for(lambda: run.matched[-5:] == [48] * 5, 30, "whole lookups after the move")
        assert run.errors == [], run.errors[:3]
        assert group.master_for_slot(slot) is dst and dst is not src
        assert min(run.matched) < 48 <= max(run.matched)  # lookups met the move (a miss), then found it all
        assert run.reader.misses_on_change > 0
        # The node writes to the stripe's new master (redis-py follows MOVED for the publisher).
        put_direct(nodes[0].addr, [key(99, "moving")])
        wait_for(lambda: cc.lookup(NS, [*chain, key(99, "moving")]).matched == 49, 30, "a write after the move")


def test_a_master_killed_under_lookups_is_a_miss_never_an_error(
    fresh_cluster: tuple[RedisClusterGroup, list[NodeProcess]],
) -> None:
    group, nodes = fresh_cluster
    chain = [key(i, "failover") for i in range(64)]
    put_direct(nodes[0].addr, chain[:32])
    put_direct(nodes[1].addr, chain[32:])
    url = group.url_for(acl.CLIENT_USER)
    slot = key_slot(stripe_key(NS, stripe_of(chain[0])).encode())
    with ClusterClient(url, timeout=10) as cc:
        wait_for(lambda: cc.lookup(NS, chain).matched == 64, 30, "the chain in the index")
        epochs = {n.node_id: n.epoch for n in cc.nodes()}
        victim = group.master_for_slot(slot)  # the master of the chain's first stripe
        assert victim is not None
        with Lookups(url, chain) as run:
            time.sleep(0.3)
            victim.kill()  # SIGKILL
            promoted = wait_for(lambda: (m := group.master_for_slot(slot)) is not victim and m, 30, "a failover")
            # The nodes see the masters change at their next heartbeat and republish under new epochs.
            wait_for(lambda: all((n.epoch or 0) > (epochs[n.node_id] or 0) for n in cc.nodes()), 30,
                     "the nodes to republish")  # fmt: skip
            wait_for(lambda: run.matched[-5:] == [64] * 5, 30, "whole lookups after the failover")
        assert run.errors == [], run.errors[:3]
        assert min(run.matched) < 64  # lookups met the failover: a miss, not an error
        assert run.fetched and max(run.fetched) == 64
        assert promoted in [r for group_ in group.replicas for r in group_]
        assert [bytes(p.data) for p in cc.get_pages(NS, chain)] == [page(h) for h in chain]


@pytest.mark.parametrize("where", ["one Redis", "Redis Cluster"])
def test_garbage_collection_drops_only_holders_that_can_never_count_again(
    where: str, cluster: tuple[RedisClusterGroup, list[NodeProcess]]
) -> None:
    """gc_step's rule (kvstore/index/publisher.py), on one Redis and on the cluster: a holder superseded by
    its node's later epoch goes; a node that is not alive but still has its record keeps its holders (it
    may be restarting); once its record is gone too, its holders go."""
    import asyncio

    from kvstore.index.keys import entry_of, holders_of, node_key
    from kvstore.index.publisher import IndexPublisher
    from kvstore.names import TierKind

    one = RedisProcess(password=ADMIN).start() if where == "one Redis" else None
    url = one.url if one is not None else cluster[0].url
    pages = [key(i, f"gc-{where}") for i in range(6)]

    async def scenario() -> None:
        held = {"g0": list(pages), "g1": list(pages)}
        pubs = {n: IndexPublisher(url, n, "127.0.0.1:1", lambda n=n: [(NS, h, TierKind.DRAM) for h in held[n]],
                                  lambda: {}, ttl_seconds=30.0) for n in held}  # fmt: skip
        for p in pubs.values():
            await p.start()
            assert await p.wait_registered(30)
        admin = pubs["g0"]._redis

        async def holders(h: bytes) -> dict[str, int]:
            return {n: e for n, e, _ in holders_of(await admin.hget(*entry_of(NS, h)) or b"")}

        async def sweep() -> None:  # a full round over every stripe of every master
            for _ in range(400):
                await pubs["g0"].gc_step(count=1000)
                if pubs["g0"].gc_round_done:
                    return
            raise AssertionError("the sweep did not come round")

        first = pubs["g0"].status().epoch
        held["g0"] = pages[:2]  # g0 republishes under a new epoch, holding only two of the pages now
        pubs["g0"].resync()
        await asyncio.to_thread(wait_for, lambda: pubs["g0"].status().epoch > first, 10, "g0's new epoch")
        await pubs["g1"].close(deregister=True)  # not alive; its record stays (it may come back)
        assert (await holders(pages[4]))["g0"] == first
        await sweep()
        assert set(await holders(pages[0])) == {"g0", "g1"} and set(await holders(pages[4])) == {"g1"}
        await admin.delete(node_key("g1"))  # its record expired: gone for good
        await sweep()
        assert await holders(pages[0]) == {"g0": pubs["g0"].status().epoch}
        assert await admin.hget(*entry_of(NS, pages[4])) is None  # no holder left: the field is gone
        await pubs["g0"].close(deregister=True)

    try:
        asyncio.run(scenario())
    finally:
        if one is not None:
            one.close()


def test_a_hung_master_costs_one_slow_lookup_per_second_not_one_each(
    fresh_cluster: tuple[RedisClusterGroup, list[NodeProcess]],
) -> None:
    """A master stopped (SIGSTOP: it accepts nothing and answers nothing) under lookups: the reader waits
    out its timeout once, then skips it for a second (a miss at once), until the cluster fails it over."""
    import os
    import signal

    group, nodes = fresh_cluster
    chain = [key(i, "hung") for i in range(64)]
    put_direct(nodes[0].addr, chain)
    url = group.url_for(acl.CLIENT_USER)
    with IndexReader(url, socket_timeout=1.5) as index:
        wait_for(lambda: index.lookup(NS, chain).matched == 64, 30, "the chain in the index")
        # The master of the chain's first stripe as it is now (after the lookups above), by its own account.
        victim = group.master_for_slot(key_slot(stripe_key(NS, stripe_of(chain[0])).encode()))
        assert victim is not None and victim.proc is not None
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            took: list[float] = []
            matched: list[int] = []
            start = time.monotonic()
            # Bounded: at least 3 s and 20 lookups (a loaded machine may spend the first seconds in timeouts),
            # at most 15 s or 1,000 lookups.
            while (time.monotonic() - start < 3.0 or len(took) < 20) and time.monotonic() - start < 15.0:
                if len(took) >= 1000:
                    break
                t0 = time.monotonic()
                matched.append(index.lookup(NS, chain).matched)  # never raises
                took.append(time.monotonic() - t0)
            elapsed = time.monotonic() - start
            slow = [t for t in took if t >= 1.0]
            assert min(matched) < 64  # a miss from the stopped master's first block (until a failover)
            # Not one timeout per lookup: at most about one slow lookup per second (MAP_REFRESH_S), however
            # many lookups ran meanwhile.
            assert len(took) >= 20 and 1 <= len(slow) <= elapsed / 1.0 + 2, (len(took), elapsed, slow)
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        wait_for(lambda: index.lookup(NS, chain).matched == 64, 60, "whole lookups after the master came back")
