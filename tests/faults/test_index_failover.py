"""No single point of failure in the index (DESIGN.md §7; SECURITY.md, round 3, finding 8): Redis Sentinel, with real redis-server and
real `redis-server --sentinel` processes on loopback, and the master killed (SIGKILL) under the nodes.

- Nodes publish and clients look up through redis+sentinel:// URLs with the same ACL users as one Redis
  (kvstore/index/connect.py; the sentinels' own read-only user, kvstore/index/acl.py).
- The worst case of a failover: entries the old master acknowledged but never replicated. The replicas
  are stopped while a node publishes, then the master is killed before they resume, so the new master
  may lack those entries (and, Redis 7 not replicating SCRIPT LOAD, lacks the node's entry scripts). The
  node sees the master move at its next heartbeat and republishes everything: no entry is missing for
  longer than that one republish, and the cluster client finds every page again.
- The sentinels' user that clients hold cannot reconfigure them (no SENTINEL SET / FAILOVER / REMOVE).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvstore.cli.launch import NodeProcess
from kvstore.cli.redis_procs import SentinelGroup
from kvstore.client import KVStoreClient
from kvstore.client.cluster import ClusterClient
from kvstore.index import IndexReader, acl
from kvstore.index.connect import parse_sentinel_url
from tests.integration.conftest import LAYOUT, NS, SLOT, key, page

TTL = 12.0  # the nodes' index TTL: heartbeats every TTL/3; long enough that the alive key outlives a failover


def _users() -> dict[str, tuple[str, str]]:
    return {
        acl.CLIENT_USER: ("client-" + "c" * 20, acl.CLIENT_RULES),
        acl.node_user("n0"): ("node-" + "n" * 20, acl.node_rules("n0")),
    }


@pytest.fixture
def group() -> Iterator[SentinelGroup]:
    g = SentinelGroup("admin-" + "a" * 20, _users(), replicas=2, sentinels=3).start(timeout=60)
    yield g
    g.close()


def _lookup(index: IndexReader, chain: list[bytes]) -> int:
    try:
        return index.lookup(NS, chain).matched
    except redis.RedisError:  # during the failover: no master named yet
        return -1
    except Exception as exc:  # IndexUnavailable (the wrapped connection errors)
        if "unreachable" in str(exc):
            return -1
        raise


def _wait(cond: object, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_a_killed_master_loses_no_index_entry_for_longer_than_one_republish(
    tmp_path: Path, group: SentinelGroup
) -> None:
    node = NodeProcess(dram_bytes=16 * SLOT, nvme_path=tmp_path / "nvme", nvme_bytes=64 * SLOT,
                       max_page_bytes=LAYOUT.page_bytes, node_id="n0", redis_url=group.url_for(acl.node_user("n0")),
                       extra_args=["--index-ttl", str(TTL)]).start()  # fmt: skip
    try:
        client_url = group.url_for(acl.CLIENT_USER)
        assert parse_sentinel_url(client_url).master == "kvstore"
        before = [key(i, "before") for i in range(4)]
        unreplicated = [key(i, "unreplicated") for i in range(4)]
        with KVStoreClient(node.addr, timeout=30) as kv, IndexReader(client_url, socket_timeout=2) as index:
            kv.put(NS, LAYOUT, before, [page(h) for h in before])
            _wait(lambda: _lookup(index, before) == 4, 30, "the first pages in the index")
            master = group.master_now()
            assert master is not None and master.proc is not None
            epoch = kv.stats().index.epoch  # type: ignore[union-attr]
            # The replicas stop; the node publishes more pages to the master alone; the master dies.
            stopped = [r for r in (group.master, *group.replicas) if r is not master and r.proc is not None]
            for r in stopped:
                os.kill(r.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            try:
                kv.put(NS, LAYOUT, unreplicated, [page(h) for h in unreplicated])
                _wait(lambda: _lookup(index, unreplicated) == 4, 10, "the new pages on the old master")
            finally:
                master.kill()
                for r in stopped:
                    os.kill(r.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
            group.wait_master(60, other_than=master)

            # The new master may lack the unreplicated entries, and lacks the node's entry scripts (Redis
            # does not replicate SCRIPT LOAD): the node sees the master move at its next heartbeat and
            # republishes everything under a new epoch, which brings back every entry.
            def republished() -> bool:
                stats = kv.stats().index
                return stats is not None and stats.epoch > epoch and stats.connected and not stats.resync_pending

            took = _wait(lambda: republished() and _lookup(index, before) == 4 and _lookup(index, unreplicated) == 4,
                         TTL + 30, "a republish and every entry again after the failover")  # fmt: skip
            assert took < TTL + 30
        # A cluster client over the Sentinel URL finds and fetches every page, new writes land too.
        with ClusterClient(client_url, timeout=30) as cc:
            assert cc.lookup(NS, unreplicated).matched == 4
            assert [bytes(p.data) for p in cc.get_pages(NS, before)] == [page(h) for h in before]
            after = [key(i, "after") for i in range(3)]
            cc.put(NS, LAYOUT, after, [page(h) for h in after])
            _wait(lambda: cc.lookup(NS, after).matched == 3, 30, "pages put after the failover in the index")
    finally:
        node.close()


def test_the_sentinels_client_user_only_asks_where_the_master_is(group: SentinelGroup) -> None:
    s = group.sentinels[0]
    with redis.Redis(s.host, s.port, username=group.sentinel_user, password=group.client_password,
                     socket_timeout=5, decode_responses=True) as c:  # fmt: skip
        assert c.sentinel_get_master_addr_by_name(group.name)
        for cmd in (("SENTINEL", "SET", group.name, "quorum", "1"), ("SENTINEL", "FAILOVER", group.name),
                    ("SENTINEL", "REMOVE", group.name), ("SENTINEL", "MONITOR", "evil", "127.0.0.1", "1", "1"),
                    ("SENTINEL", "CONFIG", "SET", "resolve-hostnames", "yes")):  # fmt: skip
            with pytest.raises(redis.exceptions.NoPermissionError):
                c.execute_command(*cmd)
    with pytest.raises(redis.exceptions.AuthenticationError):  # and the sentinels need a password at all
        redis.Redis(s.host, s.port, username=group.sentinel_user, password="wrong", socket_timeout=5).ping()


def test_bad_sentinel_urls_name_what_is_wrong() -> None:
    for url, words in (
        ("redis+sentinel:///kvstore", "at least one sentinel"),
        ("redis+sentinel://h:1", "path is /MASTER"),
        ("redis+sentinel://h:1/m/x", "must be a number"),
        ("redis+sentinel://h:x/m", "is not host:port"),
        ("redis+sentinel://h:1/m?sentinel_pasword=p", "unknown Sentinel URL parameters"),
    ):
        with pytest.raises(ValueError, match=words):
            parse_sentinel_url(url)
    t = parse_sentinel_url("rediss+sentinel://u:p%40ss@a:1,[::1]:2,b/m/3?sentinel_password=s&ssl_ca_certs=/ca")
    assert t.sentinels == (("a", 1), ("::1", 2), ("b", 26379)) and (t.master, t.db, t.tls) == ("m", 3, True)
    assert (t.username, t.password, t.sentinel_password, t.ssl_ca_certs) == ("u", "p@ss", "s", "/ca")
