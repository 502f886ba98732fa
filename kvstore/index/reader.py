"""The client side of the index: longest-prefix lookups (one round trip) and the node listing."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from kvstore.errors import Unavailable
from kvstore.index.connect import close_sync, sync_client
from kvstore.index.keys import ALIVE_PREFIX, LOOKUP_SCRIPT, NODES_KEY, alive_key, block_key, node_key
from kvstore.index.lookup import ClusterLookup, summarize
from kvstore.scoping import DEFAULT_TENANT, check_tenant, scope
from kvstore.security import redact_url
from kvstore.stats import PlaneInfo, planes_from_json

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger(__name__)


class IndexUnavailable(Unavailable):
    """The Redis index cannot be reached (down, restarting, or timing out). Nodes keep serving their own
    pages meanwhile; a caller may go to a node it knows directly or retry."""


def _index_call(fn: F) -> F:
    """Redis connection failures leave as IndexUnavailable (a kvstore error), naming the index URL."""

    @functools.wraps(fn)
    def wrapper(self: IndexReader, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise IndexUnavailable(f"index at {redact_url(self.url)} unreachable: {exc}") from exc

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
    """Blocking reads of the index: longest-prefix lookup (one round trip) and node listing."""

    def __init__(
        self, url: str, *, socket_timeout: float = 5.0, client: redis.Redis | None = None, tenant: str | None = None
    ) -> None:
        """`tenant`: whose entries lookups read (kvstore/scoping.py); by default KVSTORE_TENANT, else the
        default tenant. It must be the tenant the nodes bind this client's token to, or lookups find
        nothing; Redis ACL users (index/acl.py) keep a tenant's client from reading any other's."""
        self.url = url
        self.tenant = check_tenant(tenant or os.environ.get("KVSTORE_TENANT") or DEFAULT_TENANT, "KVSTORE_TENANT")
        self._redis = client or sync_client(url, socket_timeout)  # one Redis or Sentinel (index/connect.py)
        self._lookup = self._redis.register_script(LOOKUP_SCRIPT)
        self._noperm_logged = False

    def close(self) -> None:
        close_sync(self._redis)

    def __enter__(self) -> IndexReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @_index_call
    def lookup(self, namespace: str, hashes: Sequence[bytes]) -> ClusterLookup:
        """Longest prefix of the chain held by any live node: exactly one Redis round trip."""
        if not hashes:
            return ClusterLookup(0, [], {})
        try:
            scoped = scope(namespace, self.tenant)
            raw = self._lookup(keys=[block_key(scoped, h) for h in hashes], args=[ALIVE_PREFIX])
        except redis.exceptions.NoPermissionError as exc:
            if "script" not in str(exc).lower() and not self._noperm_logged:
                # Redis refused this user the tenant's entries: its URL is another tenant's index user, or
                # KVSTORE_TENANT names a tenant it may not read. Nothing it may see is a miss (the same
                # answer as an empty index), said once so the misconfiguration is visible.
                self._noperm_logged = True
                log.warning(
                    "index at %s: this Redis user may not read tenant %r's entries (%s); every lookup is a "
                    "miss: use that tenant's index user (kvclient-%s) or set KVSTORE_TENANT to this user's tenant",
                    redact_url(self.url),
                    self.tenant,
                    exc,
                    self.tenant,
                )
            # (With "script": a read-only client may not load the script; nodes load it when they
            # publish, so none has published since this Redis started: no node holds anything yet.)
            return ClusterLookup(0, [], {})
        return summarize(raw)

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
