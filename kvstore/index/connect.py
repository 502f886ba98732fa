"""The one place an index URL becomes a Redis client: blocking for the reader (clients, kvctl), asyncio for
the publisher (nodes). Parsing is pure; only `sync_client` / `async_client` build connection objects
(they connect lazily, on the first command, except a blocking Redis Cluster client, which asks the
cluster for its slots when built: IndexReader builds it on first use).

URL forms:

    redis://[USER:PASSWORD@]HOST:PORT/DB[?ssl_ca_certs=CA]      one Redis (rediss:// speaks TLS)
    redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER[/DB][?QUERY]
                                                                Redis Sentinel (rediss+sentinel:// for TLS)
    redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][/][?ssl_ca_certs=CA]
                                                                Redis Cluster (rediss+cluster:// for TLS)

With Redis Cluster, HOST:PORT are servers of the cluster to ask for its slots (any subset will do: the
client asks each in turn until one answers, every time it refreshes its map, so a Service name or the
pods' own names stay valid as pods come and go); there is no database but 0 (a path of `/0` is
accepted). The client then talks to the masters by the addresses the cluster announces. The index's
keys are laid out for a cluster (kvstore/index/keys.py): a lookup reads the chain's stripes from every
master that holds one, all requests written before any reply is read (kvstore/index/reader.py).

With Sentinel, HOST:PORT are the sentinels (any subset of them will do: the client asks each in turn),
MASTER is the name they monitor, USER:PASSWORD are the Redis (data) user's, as for one Redis.
QUERY may hold `sentinel_username` and `sentinel_password` (the sentinels' own user, when they require
one), and `ssl_ca_certs` (TLS to the master and the sentinels alike). Every command goes
to the master the sentinels name now: after a failover the next connection goes to the new master (a
command on a connection to a demoted master fails and is retried by its caller, who reconnects).

Credentials never leave this module in clear: messages use kvstore.security.redact_url.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.asyncio.sentinel as aiosentinel
from redis import cluster, sentinel

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS
DEFAULT_SENTINEL_PORT = 26379
DEFAULT_REDIS_PORT = 6379
_QUERY_KEYS = {"sentinel_username", "sentinel_password", "ssl_ca_certs"}
_CLUSTER_QUERY_KEYS = {"ssl_ca_certs"}


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """A parsed redis+sentinel:// URL (see the module docstring)."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: bool = False
    ssl_ca_certs: str | None = None


@dataclass(frozen=True, slots=True)
class ClusterTarget:
    """A parsed redis+cluster:// URL (see the module docstring)."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ssl_ca_certs: str | None = None


def is_sentinel(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def is_cluster(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def _userinfo(netloc: str) -> tuple[str, str | None, str | None]:
    """(hosts, user, password) of a URL's netloc."""
    if "@" not in netloc:
        return netloc, None, None
    userinfo, hosts = netloc.rsplit("@", 1)
    user, colon, pw = userinfo.partition(":")
    return hosts, (unquote(user) or None), (unquote(pw) if colon else None)


def parse_cluster_url(url: str) -> ClusterTarget:
    """The parts of a redis+cluster:// URL; ValueError naming what is wrong (never echoing a password)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(f"index URL: not a Redis Cluster URL (redis+cluster:// or rediss+cluster://): {scheme}://...")
    rest, _, query = rest.partition("?")  # NOTE: first: the query may hold a path (ssl_ca_certs=/ca)
    netloc, _, path = rest.partition("/")
    hosts, username, password = _userinfo(netloc)
    nodes = tuple(_host_port(h, DEFAULT_REDIS_PORT, "server") for h in hosts.split(",") if h)
    if not nodes:
        raise ValueError("index URL: a Redis Cluster URL names at least one server (host:port[,host:port...])")
    if path.strip("/") not in ("", "0"):
        raise ValueError(f"index URL: a Redis Cluster has only database 0, the path names {path.strip('/')!r}")
    params = dict(parse_qsl(query, keep_blank_values=True))
    unknown = set(params) - _CLUSTER_QUERY_KEYS
    if unknown:
        raise ValueError(
            f"index URL: unknown Redis Cluster URL parameters {sorted(unknown)} (known: {sorted(_CLUSTER_QUERY_KEYS)})"
        )
    return ClusterTarget(nodes, username, password, CLUSTER_SCHEMES[scheme.lower()], params.get("ssl_ca_certs") or None)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The parts of a redis+sentinel:// URL; ValueError naming what is wrong (never echoing a password)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError(f"index URL: not a Sentinel URL (redis+sentinel:// or rediss+sentinel://): {scheme}://...")
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    netloc, username, password = _userinfo(netloc)
    sentinels = tuple(_host_port(h, DEFAULT_SENTINEL_PORT, "sentinel") for h in netloc.split(",") if h)
    if not sentinels:
        raise ValueError("index URL: a Sentinel URL names at least one sentinel (host:port[,host:port...])")
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise ValueError("index URL: a Sentinel URL's path is /MASTER or /MASTER/DB (the name the sentinels monitor)")
    master = unquote(parts[0])
    try:
        db = int(parts[1]) if len(parts) == 2 else 0
    except ValueError:
        raise ValueError(f"index URL: the database after /{master}/ must be a number, got {parts[1]!r}") from None
    params = dict(parse_qsl(query, keep_blank_values=True))
    unknown = set(params) - _QUERY_KEYS
    if unknown:
        raise ValueError(f"index URL: unknown Sentinel URL parameters {sorted(unknown)} (known: {sorted(_QUERY_KEYS)})")
    return SentinelTarget(
        sentinels=sentinels,
        master=master,
        db=db,
        username=username,
        password=password,
        sentinel_username=params.get("sentinel_username") or None,
        sentinel_password=params.get("sentinel_password") or None,
        tls=SENTINEL_SCHEMES[scheme.lower()],
        ssl_ca_certs=params.get("ssl_ca_certs") or None,
    )


def _host_port(text: str, default_port: int, what: str) -> tuple[str, int]:
    if text.startswith("["):  # [v6]:port
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    try:
        number = int(port) if port else default_port
    except ValueError:
        raise ValueError(f"index URL: {what} {text!r} is not host:port") from None
    if not host or not 0 < number < 65536:
        raise ValueError(f"index URL: {what} {text!r} is not host:port")
    return host, number


def _kwargs(target: SentinelTarget, timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the master connection's keyword arguments, the sentinels')."""
    tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": target.ssl_ca_certs} if target.tls else {}
    common = {"socket_timeout": timeout, "socket_connect_timeout": timeout, **tls}
    master = {"username": target.username, "password": target.password, "db": target.db, **common}
    sentinels = {"username": target.sentinel_username, "password": target.sentinel_password, **common}
    return master, sentinels


def _cluster_kwargs(target: ClusterTarget, timeout: float) -> dict[str, Any]:
    """Keyword arguments of a Redis Cluster client (blocking or asyncio) of `target`."""
    tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": target.ssl_ca_certs} if target.tls else {}
    # NOTE: require_full_coverage=False: a cluster with a master failing over still serves the rest (a
    # lookup of a block on it is a miss); dynamic_startup_nodes=False: the URL's servers stay the ones
    # asked for the slots, so a Service name survives pods that come back on new addresses.
    return {"username": target.username, "password": target.password, "socket_timeout": timeout,
            "socket_connect_timeout": timeout, "require_full_coverage": False, "dynamic_startup_nodes": False,
            **tls}  # fmt: skip


def sync_cluster(url: str, timeout: float) -> cluster.RedisCluster:
    """A blocking Redis Cluster client of `url` (a redis+cluster:// URL). It connects when built (it asks
    the servers for the slot map): raises redis errors, or RedisClusterException, when none answers."""
    target = parse_cluster_url(url)
    nodes = [cluster.ClusterNode(h, p) for h, p in target.nodes]
    return cluster.RedisCluster(startup_nodes=nodes, **_cluster_kwargs(target, timeout))


def sync_client(url: str, timeout: float) -> redis.Redis | cluster.RedisCluster:
    """A blocking client of the index at `url` (any form; a Redis Cluster one connects when built, see
    sync_cluster)."""
    if is_cluster(url):
        return sync_cluster(url, timeout)
    if not is_sentinel(url):
        return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    target = parse_sentinel_url(url)
    master, sentinels = _kwargs(target, timeout)
    group = sentinel.Sentinel(list(target.sentinels), sentinel_kwargs=sentinels, **master)
    return group.master_for(target.master)


def close_sync(client: redis.Redis | cluster.RedisCluster) -> None:
    """Close a client of `sync_client`, its sentinels' connections included."""
    client.close()
    if isinstance(client, cluster.RedisCluster):
        return
    group = getattr(client.connection_pool, "sentinel_manager", None)
    for s in getattr(group, "sentinels", ()):
        s.close()


class MasterWatch:
    """Which master(s) hold the index now: the publisher republishes when that changed. One Redis: always
    None. Sentinel: the master's address as the sentinels name it. Redis Cluster: the run ids of the
    masters (a failover, a master restarted empty, or a master added changes them; a slot moving between
    masters does not, since its keys move with it)."""

    def __init__(self, group: aiosentinel.Sentinel | None, master: str, rc: aiocluster.RedisCluster | None = None):
        self._group = group
        self._master = master
        self._cluster = rc
        self._last: frozenset[str] | None = None

    async def where(self) -> object:
        """The masters as of now (a value to compare with a later one). Raises redis errors (Sentinel's
        MasterNotFoundError is a ConnectionError) like any index command. A cluster whose masters do not
        all answer (a failover under way) reports its last complete answer: the change is seen once the
        cluster has settled, and republished once."""
        if self._cluster is not None:
            return await self._cluster_masters(self._cluster)
        if self._group is None:
            return None
        host, port = await self._group.discover_master(self._master)
        return str(host), int(port)

    async def _cluster_masters(self, rc: aiocluster.RedisCluster) -> frozenset[str] | None:
        await rc.initialize()
        await rc.nodes_manager.initialize()  # the slot map as the cluster has it now, not as last cached
        primaries = rc.get_primaries()
        answers = await asyncio.gather(
            *(rc.execute_command("INFO", "server", target_nodes=p) for p in primaries), return_exceptions=True
        )
        ids = [a.get("run_id") if isinstance(a, dict) else None for a in answers]
        if all(ids):
            self._last = frozenset(str(i) for i in ids)
        return self._last

    async def aclose(self) -> None:
        """Close the connections to the sentinels (the master's client is closed by its owner)."""
        for s in self._group.sentinels if self._group is not None else ():
            await s.aclose()


def async_client(url: str, timeout: float) -> tuple[aioredis.Redis | aiocluster.RedisCluster, MasterWatch]:
    """An asyncio client of the index at `url` (any form) and the watch of its master(s)."""
    if is_cluster(url):
        target = parse_cluster_url(url)
        nodes = [aiocluster.ClusterNode(h, p) for h, p in target.nodes]
        rc = aiocluster.RedisCluster(startup_nodes=nodes, **_cluster_kwargs(target, timeout))
        return rc, MasterWatch(None, "", rc)
    if not is_sentinel(url):
        client = aioredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        return client, MasterWatch(None, "")
    target = parse_sentinel_url(url)
    master, sentinels = _kwargs(target, timeout)
    group = aiosentinel.Sentinel(list(target.sentinels), sentinel_kwargs=sentinels, **master)
    return group.master_for(target.master), MasterWatch(group, target.master)
