"""The one place an index URL becomes a Redis client: blocking for the reader (clients, kvctl), asyncio for
the publisher (nodes). Parsing is pure; only `sync_client` / `async_client` build connection objects
(they connect lazily, on the first command).

URL forms:

    redis://[USER:PASSWORD@]HOST:PORT/DB[?ssl_ca_certs=CA]      one Redis (rediss:// speaks TLS)
    redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER[/DB][?QUERY]
                                                                Redis Sentinel (rediss+sentinel:// for TLS)

With Sentinel, HOST:PORT are the sentinels (any subset of them will do: the client asks each in turn),
MASTER is the name they monitor, USER:PASSWORD are the Redis (data) user's, as for one Redis.
QUERY may hold `sentinel_username` and `sentinel_password` (the sentinels' own user, when they require
one), and `ssl_ca_certs` (TLS to the master and the sentinels alike). Every command goes
to the master the sentinels name now: after a failover the next connection goes to the new master (a
command on a connection to a demoted master fails and is retried by its caller, who reconnects).

Credentials never leave this module in clear: messages use kvstore.security.redact_url.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
from redis import sentinel

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
DEFAULT_SENTINEL_PORT = 26379
_QUERY_KEYS = {"sentinel_username", "sentinel_password", "ssl_ca_certs"}


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


def is_sentinel(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The parts of a redis+sentinel:// URL; ValueError naming what is wrong (never echoing a password)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError(f"index URL: not a Sentinel URL (redis+sentinel:// or rediss+sentinel://): {scheme}://...")
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    username = password = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, colon, pw = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(pw) if colon else None)
    sentinels = tuple(_host_port(h) for h in netloc.split(",") if h)
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


def _host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [v6]:port
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    try:
        number = int(port) if port else DEFAULT_SENTINEL_PORT
    except ValueError:
        raise ValueError(f"index URL: sentinel {text!r} is not host:port") from None
    if not host or not 0 < number < 65536:
        raise ValueError(f"index URL: sentinel {text!r} is not host:port")
    return host, number


def _kwargs(target: SentinelTarget, timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the master connection's keyword arguments, the sentinels')."""
    tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": target.ssl_ca_certs} if target.tls else {}
    common = {"socket_timeout": timeout, "socket_connect_timeout": timeout, **tls}
    master = {"username": target.username, "password": target.password, "db": target.db, **common}
    sentinels = {"username": target.sentinel_username, "password": target.sentinel_password, **common}
    return master, sentinels


def sync_client(url: str, timeout: float) -> redis.Redis:
    """A blocking client of the index at `url` (either form)."""
    if not is_sentinel(url):
        return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    target = parse_sentinel_url(url)
    master, sentinels = _kwargs(target, timeout)
    group = sentinel.Sentinel(list(target.sentinels), sentinel_kwargs=sentinels, **master)
    return group.master_for(target.master)


def close_sync(client: redis.Redis) -> None:
    """Close a client of `sync_client`, its sentinels' connections included."""
    client.close()
    group = getattr(client.connection_pool, "sentinel_manager", None)
    for s in getattr(group, "sentinels", ()):
        s.close()


class MasterWatch:
    """Where the index's master is now (None for one Redis): the publisher republishes when it moved."""

    def __init__(self, group: aiosentinel.Sentinel | None, master: str) -> None:
        self._group = group
        self._master = master

    async def where(self) -> tuple[str, int] | None:
        """The master's address as the sentinels name it now; None for one Redis. Raises redis errors
        (MasterNotFoundError is a ConnectionError) like any index command."""
        if self._group is None:
            return None
        host, port = await self._group.discover_master(self._master)
        return str(host), int(port)

    async def aclose(self) -> None:
        """Close the connections to the sentinels (the master's client is closed by its owner)."""
        for s in self._group.sentinels if self._group is not None else ():
            await s.aclose()


def async_client(url: str, timeout: float) -> tuple[aioredis.Redis, MasterWatch]:
    """An asyncio client of the index at `url` (either form) and the watch of its master."""
    if not is_sentinel(url):
        client = aioredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        return client, MasterWatch(None, "")
    target = parse_sentinel_url(url)
    master, sentinels = _kwargs(target, timeout)
    group = aiosentinel.Sentinel(list(target.sentinels), sentinel_kwargs=sentinels, **master)
    return group.master_for(target.master), MasterWatch(group, target.master)
