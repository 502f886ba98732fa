"""The client side of the index: longest-prefix lookups (one round trip) and the node listing."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from kvstore.errors import IndexFailure, IndexUnavailable, PermissionDenied
from kvstore.index.connect import close_sync, is_cluster, sync_client
from kvstore.index.keys import NODES_KEY, alive_key, beat_key, entry_field, node_key, stripe_key, stripe_of
from kvstore.index.lookup import ClusterLookup, from_entries, holders_in
from kvstore.names import TierKind
from kvstore.scoping import DEFAULT_TENANT, check_tenant, scope
from kvstore.security import redact_url
from kvstore.stats import PlaneInfo, planes_from_json

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger(__name__)

# What a Redis Cluster answers while it changes under a lookup (a master failing over, a slot moving):
# the commands of that master are a miss for this lookup, and the slot map is refreshed.
_MOVING = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ClusterError,
           redis.exceptions.AskError, redis.exceptions.TryAgainError, redis.exceptions.ReadOnlyError,
           RedisClusterException, OSError)  # fmt: skip
_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
LIVE_REFRESH_S = 0.5  # how old the reader's view of who is alive may get (a lookup past it asks again)
UNREACHABLE_S = 30.0  # a Redis Cluster silent this long (no view of who is alive either) is down, not failing over
MAP_REFRESH_S = 1.0  # at most one slot-map refresh per this long, however many lookups found it stale


def _index_call(fn: F) -> F:
    """The edge between Redis and kvstore: nothing of redis-py's leaves a reader call. Connection failures
    (and a Redis Cluster that cannot say where a key is) leave as IndexUnavailable, a Redis user refused
    a read as PermissionDenied, every other Redis error as IndexFailure: each a KVStoreError naming the
    index URL."""

    @functools.wraps(fn)
    def wrapper(self: IndexReader, *args: Any, **kwargs: Any) -> Any:
        where = f"index at {redact_url(self.url)}"
        try:
            return fn(self, *args, **kwargs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ClusterError,
                RedisClusterException) as exc:  # fmt: skip
            raise IndexUnavailable(f"{where} unreachable: {exc}") from exc
        except redis.exceptions.NoPermissionError as exc:
            raise PermissionDenied(f"{where}: this Redis user may not read it: {exc}") from exc
        except redis.RedisError as exc:
            raise IndexFailure(f"{where} answered with an error: {type(exc).__name__}: {exc}") from exc

    return wrapper  # type: ignore[return-value]


@dataclass(slots=True)
class NodeInfo:
    node_id: str
    alive: bool
    addr: str
    epoch: int | None
    info: dict[str, str]

    @property
    def planes(self) -> list[PlaneInfo]:
        """The bulk data planes the node advertised in its record."""
        return planes_from_json(self.info.get("planes", "[]"))

    @property
    def host_id(self) -> str:
        return self.info.get("host_id", "")


class IndexReader:
    """Blocking reads of the index: longest-prefix lookup (one round trip) and node listing.

    A lookup reads the chain's entries from its namespace's stripes (one HMGET per stripe the chain
    touches, all sent before any reply is read: to one Redis, or to every master of a Redis Cluster
    holding one) and keeps the holders that are live at their current epoch, as of a view of the alive
    keys at most LIVE_REFRESH_S old (refreshed, one round trip, by the first lookup past that age). So a
    dead node stops matching within its heartbeat TTL plus LIVE_REFRESH_S.

    On a Redis Cluster, a master that does not answer, or answers that its slot moved, is a miss for the
    blocks it holds (the prefix ends before the first of them) and the slot map is refreshed; a master
    that did not answer is not asked again for MAP_REFRESH_S (one lookup per period waits out a dead or
    hung server's timeout). A lookup raises IndexUnavailable only when nothing of the cluster answered
    for UNREACHABLE_S. Thread-safe: each call takes its own connections; the alive view and the slot map
    are shared under a lock.
    """

    def __init__(
        self,
        url: str,
        *,
        socket_timeout: float = 5.0,
        client: redis.Redis | RedisCluster | None = None,
        tenant: str | None = None,
        live_refresh_s: float = LIVE_REFRESH_S,
    ) -> None:
        """`tenant`: whose entries lookups read (kvstore/scoping.py); by default KVSTORE_TENANT, else the
        default tenant. It must be the tenant the nodes bind this client's token to, or lookups find
        nothing; Redis ACL users (index/acl.py) keep a tenant's client from reading any other's."""
        self.url = url
        self.tenant = check_tenant(tenant or os.environ.get("KVSTORE_TENANT") or DEFAULT_TENANT, "KVSTORE_TENANT")
        self.socket_timeout = socket_timeout
        self.live_refresh_s = live_refresh_s
        self._client = client  # built on first use (a Redis Cluster client connects when built)
        self._cluster = is_cluster(url) if client is None else isinstance(client, RedisCluster)
        self._lock = threading.Lock()
        self._live: dict[str, int] = {}
        self._live_at = -1.0  # when the view was read (monotonic); < 0: never
        self._live_tried = -1e18
        self._map_stale = False
        self._map_at = -1e18
        self._down: dict[str, float] = {}  # master -> until when it is not asked (it did not answer)
        self._noperm_logged = False
        self._beaters: set[str] = set()  # nodes known to beat (index/keys.py BEAT_S): seen beating, or by record
        self._no_beat: frozenset[str] = frozenset()  # live nodes whose beat key was gone at the last view
        self.misses_on_change = 0  # lookups cut short by a Redis Cluster changing under them (counted)

    def close(self) -> None:
        if self._client is not None:
            close_sync(self._client)

    def __enter__(self) -> IndexReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _redis(self) -> redis.Redis | RedisCluster:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = sync_client(self.url, self.socket_timeout)  # one Redis, Sentinel or Cluster
        return self._client

    # -- lookups

    @_index_call
    def lookup(self, namespace: str, hashes: Sequence[bytes]) -> ClusterLookup:
        """Longest prefix of the chain held by any live node: one round trip (two when the view of who is
        alive is due for a refresh)."""
        if not hashes:
            return ClusterLookup(0, [], {})
        try:
            live = self._live_view()
        except redis.exceptions.NoPermissionError as exc:  # a Redis user that may not read node records
            self._no_permission(exc)
            return ClusterLookup(0, [], {})
        if not live:
            return ClusterLookup(0, [], {})  # nobody is alive: nothing to read
        scoped = scope(namespace, self.tenant)
        stripes: dict[int, list[int]] = {}  # stripe -> positions in the chain, in order
        for i, h in enumerate(hashes):
            stripes.setdefault(stripe_of(h), []).append(i)
        reads = [(stripe_key(scoped, s), [entry_field(hashes[i]) for i in pos]) for s, pos in stripes.items()]
        answers = self._read_stripes(reads)
        # A master failing over is a miss; a cluster of which nothing answered for UNREACHABLE_S (not even
        # who is alive) is down, and says so.
        silent = time.monotonic() - self._live_at > UNREACHABLE_S
        if self._cluster and silent and all(isinstance(a, _UNREACHABLE) for a in answers):
            raise redis.exceptions.ConnectionError(f"no server of the Redis Cluster answered: {answers[0]}")
        values: list[bytes | None] = [None] * len(hashes)
        cut = len(hashes)  # NOTE: a stripe not read is not a wrong answer but a shorter one: the prefix ends there
        for pos, answer in zip(stripes.values(), answers, strict=True):
            if isinstance(answer, redis.exceptions.NoPermissionError):
                self._no_permission(answer)
                return ClusterLookup(0, [], {})
            if isinstance(answer, BaseException):
                cut = min(cut, pos[0])
                continue
            for i, v in zip(pos, answer, strict=True):
                values[i] = v
        return from_entries(values[:cut], live)

    def _no_permission(self, exc: BaseException) -> None:
        if self._noperm_logged:
            return
        # Redis refused this user the tenant's entries (or the node records): its URL is another tenant's
        # index user, or KVSTORE_TENANT names a tenant it may not read. Nothing it may see is a miss (the
        # same answer as an empty index), said once so the misconfiguration is visible.
        self._noperm_logged = True
        log.warning(
            "index at %s: this Redis user may not read tenant %r's entries (%s); every lookup is a miss: use "
            "that tenant's index user (kvclient-%s) or set KVSTORE_TENANT to this user's tenant",
            redact_url(self.url),
            self.tenant,
            exc,
            self.tenant,
        )

    def _round_trip(self, commands: list[tuple[str, ...]]) -> list[Any]:
        """Each command (its key at [1]) in one round trip; per command its reply or the exception it met.
        One Redis (or Sentinel's master): one pipeline, whose connection errors raise (the index is
        unreachable). A Redis Cluster: see _fan_out."""
        if not self._cluster:
            pipe = self._redis.pipeline(transaction=False)
            for cmd in commands:
                pipe.execute_command(*cmd)
            return pipe.execute(raise_on_error=False)
        return self._fan_out(commands)

    def _read_stripes(self, reads: list[tuple[str, list[str]]]) -> list[Any]:
        """HMGET key fields... for each read, in one round trip."""
        return self._round_trip([("HMGET", key, *fields) for key, fields in reads])

    # -- Redis Cluster: one round trip to every master a call needs

    def _fan_out(self, commands: list[tuple[str, ...]]) -> list[Any]:
        """Send each command (its key at [1]) to the master serving the key's slot, every command written
        before any reply is read; per command its reply or the exception it met. Redirections are not
        followed: a miss is a lookup's answer to a cluster that is changing. A command that met a change
        is sent once more, to where a fresh slot map says, only when the map is due for a refresh (at most
        once per MAP_REFRESH_S: a client that slept through a failover does not miss on its first call)."""
        rc = self._redis
        assert isinstance(rc, RedisCluster)
        self._refresh_map_if_due(rc)
        out = self._send_all(rc, commands)
        failed = [i for i, o in enumerate(out) if isinstance(o, _MOVING)]
        if failed:
            self._map_stale = True
            if self._refresh_map_if_due(rc):
                for i, o in zip(failed, self._send_all(rc, [commands[i] for i in failed]), strict=True):
                    out[i] = o
        if any(isinstance(o, _MOVING) for o in out):
            self._map_stale = True
            self.misses_on_change += 1
        return out

    def _send_all(self, rc: RedisCluster, commands: list[tuple[str, ...]]) -> list[Any]:
        """One round trip: every command written to its slot's master (as the cached map says) before
        any reply is read; per command its reply or the exception it met."""
        out: list[Any] = [None] * len(commands)
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, cmd in enumerate(commands):
            try:
                node = rc.nodes_manager.get_node_from_slot(key_slot(cmd[1].encode()))
            except RedisClusterException as exc:  # a slot nobody serves now
                out[i] = exc
                continue
            by_node.setdefault(node.name, (node, []))[1].append(i)
        now = time.monotonic()
        for name, (_, idx) in list(by_node.items()):
            # NOTE: a master that did not answer is not asked again for MAP_REFRESH_S: one lookup per
            # period waits out its timeout (a dead or hung server), the others miss at once.
            if self._down.get(name, 0.0) > now:
                for i in idx:
                    out[i] = redis.exceptions.ConnectionError(f"{name} did not answer lately")
                del by_node[name]
        sent: list[list[Any]] = []  # [pool, connection, its commands, replies still pending, master]
        try:
            for node, idx in by_node.values():
                pool = conn = None
                try:
                    pool = rc.get_redis_connection(node).connection_pool
                    conn = pool.get_connection()
                    conn.send_packed_command(conn.pack_commands([commands[i] for i in idx]), check_health=False)
                except _MOVING as exc:
                    self._mark_down(node.name, exc)
                    for i in idx:
                        out[i] = exc
                    if conn is not None:
                        conn.disconnect()
                        pool.release(conn)  # type: ignore[union-attr]
                    continue
                sent.append([pool, conn, idx, True, node.name])
            for entry in sent:
                conn, idx = entry[1], entry[2]
                for n, i in enumerate(idx):
                    try:
                        out[i] = conn.read_response()
                    except redis.exceptions.ResponseError as exc:  # an error reply: the connection is in step
                        out[i] = exc
                    except _MOVING as exc:  # the connection is not: dropped below
                        self._mark_down(entry[4], exc)
                        for j in idx[n:]:
                            out[j] = exc
                        break
                else:
                    entry[3] = False
        finally:
            for pool, conn, _, pending, _ in sent:
                if pending:
                    conn.disconnect()  # never handed out again with replies still on the way
                pool.release(conn)
        return out

    def _mark_down(self, name: str, exc: BaseException) -> None:
        if isinstance(exc, _UNREACHABLE):
            self._down[name] = time.monotonic() + MAP_REFRESH_S

    def _refresh_map_if_due(self, rc: RedisCluster) -> bool:
        """Ask the cluster for its slot map when a call met a change and the last ask is MAP_REFRESH_S
        old; True when the map was refreshed now."""
        now = time.monotonic()
        if not self._map_stale or now - self._map_at < MAP_REFRESH_S:
            return False
        with self._lock:
            if not self._map_stale:
                return False
            self._map_stale, self._map_at = False, now
        try:
            rc.nodes_manager.initialize()
            self._down = {n: t for n, t in self._down.items() if rc.nodes_manager.get_node(node_name=n) is not None}
        except _MOVING as exc:  # no server answered: the commands themselves will say so
            self._map_stale = True
            log.info("index at %s: Redis Cluster slot map refresh failed: %s", redact_url(self.url), exc)
            return False
        return True

    # -- who is alive

    def _live_view(self) -> dict[str, int]:
        """node id -> current epoch of every live node, as of at most live_refresh_s ago. When a refresh
        fails on a Redis Cluster (failing the node records' master over) the last view stands, and the next
        try is live_refresh_s later: an entry of a node that died meanwhile costs a miss at its node, never
        a wrong page. Raises when no view was ever read."""
        now = time.monotonic()
        if now - self._live_tried < self.live_refresh_s:
            return self._live
        self._live_tried = now
        try:
            live = self._read_live()
        except (redis.RedisError, RedisClusterException, OSError) as exc:
            # NOTE: only a Redis Cluster keeps the last view: its masters fail over one at a time. One Redis
            # (or Sentinel's master) that does not answer is down, and lookups say so.
            if self._live_at < 0 or not self._cluster:
                raise
            log.info("index at %s: who is alive could not be read (%s); using the view of %.1f s ago",
                     redact_url(self.url), exc, now - self._live_at)  # fmt: skip
            return self._live
        with self._lock:
            self._live, self._live_at = live, now
        return live

    def _read_live(self) -> dict[str, int]:
        """Every registered id and the epochs of the live ones, and which of them are suspect (their beat
        key is gone): one round trip (the ids seen last time are asked for with the set; ids new since then
        cost one more)."""
        known = sorted(self._live)
        cmds: list[tuple[str, ...]] = [("SMEMBERS", NODES_KEY)]
        if known:
            cmds.append(("MGET", *(alive_key(n) for n in known)))
            cmds.append(("MGET", *(beat_key(n) for n in known)))
        res = self._round_trip(cmds)
        for r in res:
            if isinstance(r, BaseException):
                raise r
        ids = {x.decode() for x in res[0]}
        epochs = dict(zip(known, res[1], strict=True)) if known else {}
        beats = dict(zip(known, res[2], strict=True)) if known else {}
        new = sorted(n for n in ids if n not in epochs)
        if new:
            more = self._round_trip([("MGET", *(alive_key(n) for n in new)), ("MGET", *(beat_key(n) for n in new))])
            for r in more:
                if isinstance(r, BaseException):
                    raise r
            epochs |= dict(zip(new, more[0], strict=True))
            beats |= dict(zip(new, more[1], strict=True))
        live = {n: int(e) for n, e in epochs.items() if n in ids and e is not None and e.isdigit()}
        self._beaters |= {n for n, b in beats.items() if b is not None}
        self._no_beat = frozenset(n for n in live if beats.get(n) is None)
        return live

    def suspects(self) -> frozenset[str]:
        """Live nodes that stopped beating (hung, stopped, cut off from Redis): read from only when no other
        holder is. As of the same view as `lookup` (at most live_refresh_s old)."""
        with contextlib.suppress(redis.RedisError, RedisClusterException, OSError):
            self._live_view()  # unreadable: the last view stands
        # NOTE: only a node known to beat (seen beating, or its record says so) is suspect without a beat: a node
        # that predates beats never has one.
        return self._no_beat & self._beaters

    @_index_call
    def holders(self, namespace: str, hashes: Sequence[bytes]) -> list[dict[str, TierKind]]:
        """Who holds each page (live nodes at their current epochs), not only a prefix: for nodes, which know
        the stored (tenant-scoped) namespace of their pages and read every tenant's entries. One round trip;
        a stripe that could not be read (a Redis Cluster changing) says nobody holds its pages."""
        if not hashes:
            return []
        live = self._live_view()
        stripes: dict[int, list[int]] = {}
        for i, h in enumerate(hashes):
            stripes.setdefault(stripe_of(h), []).append(i)
        reads = [(stripe_key(namespace, s), [entry_field(hashes[i]) for i in pos]) for s, pos in stripes.items()]
        out: list[dict[str, TierKind]] = [{} for _ in hashes]
        for pos, answer in zip(stripes.values(), self._read_stripes(reads), strict=True):
            if isinstance(answer, BaseException):
                continue
            for i, v in zip(pos, answer, strict=True):
                if v:
                    out[i] = holders_in(v, live)
        return out

    # -- nodes

    @_index_call
    def nodes(self) -> list[NodeInfo]:
        ids = sorted(x.decode() for x in self._redis.smembers(NODES_KEY))
        if not ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for node in ids:
            pipe.get(alive_key(node))
            pipe.hgetall(node_key(node))
        res = pipe.execute()
        out = []
        for k, node in enumerate(ids):
            epoch_raw, info_raw = res[2 * k], res[2 * k + 1]
            info = {a.decode(): b.decode() for a, b in info_raw.items()}
            if info.get("beats") == "1":
                self._beaters.add(node)
            out.append(
                NodeInfo(
                    node,
                    epoch_raw is not None,
                    info.get("addr", ""),
                    int(epoch_raw) if epoch_raw is not None else None,
                    info,
                )
            )
        return out

    def node_addrs(self) -> dict[str, str]:
        """Addresses of live nodes."""
        return {n.node_id: n.addr for n in self.nodes() if n.alive and n.addr}
