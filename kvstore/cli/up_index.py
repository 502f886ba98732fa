"""The index of one `kvstore up` (up.py): the operator's Redis, or a private redis-server, Sentinel group or
Redis Cluster (redis_procs.py), its ACL users and the URLs each party gets, and the restart of a private
server that exited.

Invariants: a private index always runs with protected mode and ACL users (kvstore/index/acl.py): each node
its own user, allowed to write only its own records, clients a read-only one, each tenant a read-only one that
sees only its entries; the administrator's URL and each tenant's are written to files of mode 0600 in the
run's directory, never printed (the printed URL is redacted). A restarted server comes back on the same port
with the same users, so every URL handed out stays valid; a Redis Cluster's server only once the cluster has
had time to fail it over.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from kvstore.cli.redis_procs import RedisClusterGroup, RedisProcess, SentinelGroup

console = Console()


@dataclass
class UpIndex:
    """A `kvstore up`'s index: `url` is what clients use (read-only on a private Redis), `node_urls` each
    node's own user's URL; `proc` the private Redis (None: the operator's); `restarts` how many of its
    servers `revive` restarted. `close` stops a private one."""

    proc: RedisProcess | SentinelGroup | RedisClusterGroup | None = None
    url: str = ""
    node_urls: dict[str, str] = field(default_factory=dict)  # node id -> its own Redis user's URL
    restarts: int = 0
    _dead_since: dict[int, float] = field(default_factory=dict)  # a cluster server's death, first seen

    def start(
        self,
        root: Path,
        external: str | None,
        node_ids: list[str],
        *,
        tenants: tuple[str, ...] = (),
        sentinel: object = None,
        cluster: object = None,
    ) -> None:
        """The operator's (`external`), else a private redis-server, or with `sentinel` (a
        values.SentinelPlan) a private Sentinel group, or with `cluster` (a values.ClusterPlan) a private
        Redis Cluster (kvstore/cli/redis_procs.py SentinelGroup, RedisClusterGroup)."""
        from kvstore.cli.redis_procs import RedisClusterGroup, RedisProcess, SentinelGroup
        from kvstore.cli.values import ClusterPlan, SentinelPlan
        from kvstore.index.acl import (
            CLIENT_RULES,
            CLIENT_USER,
            node_rules,
            node_user,
            tenant_client_rules,
            tenant_client_user,
        )
        from kvstore.security import redact_url

        if external:  # the operator's Redis, with the operator's users
            self.url = external
            self.node_urls = dict.fromkeys(node_ids, external)
        else:
            users = {CLIENT_USER: (secrets.token_hex(20), CLIENT_RULES)}
            users |= {node_user(n): (secrets.token_hex(20), node_rules(n)) for n in node_ids}
            users |= {tenant_client_user(t): (secrets.token_hex(20), tenant_client_rules(t)) for t in tenants}
            proc: RedisProcess | SentinelGroup | RedisClusterGroup
            if isinstance(cluster, ClusterPlan):
                proc = RedisClusterGroup(
                    secrets.token_hex(20),
                    users,
                    masters=cluster.masters,
                    replicas=cluster.replicas,
                    node_timeout_ms=cluster.node_timeout_ms,
                ).start(timeout=120)
                console.print(
                    f"redis: Redis Cluster of {cluster.masters} master(s), {cluster.replicas} replica(s) each "
                    "(every server carries the ACL users)"
                )
            elif isinstance(sentinel, SentinelPlan):
                proc = SentinelGroup(
                    secrets.token_hex(20),
                    users,
                    name=sentinel.master_name,
                    replicas=sentinel.replicas - 1,
                    sentinels=sentinel.replicas,
                    down_after_ms=sentinel.down_after_ms,
                    failover_timeout_ms=sentinel.failover_timeout_ms,
                ).start(timeout=120)
                console.print(
                    f"redis: Sentinel group {sentinel.master_name!r}: a master, {sentinel.replicas - 1} replica(s), "
                    f"{sentinel.replicas} sentinel(s)"
                )
            else:
                proc = RedisProcess(password=secrets.token_hex(20), users=users).start()
            self.proc = proc  # NOTE: held before the files below: `close` stops it whatever follows
            for t in tenants:  # each tenant's read-only index user sees only its entries (KVSTORE_TENANT=<t>)
                url = root / f"redis-tenant-{t}.url"
                url.touch(mode=0o600)
                url.write_text(proc.url_for(tenant_client_user(t)) + "\n")
            self.url = proc.url_for(CLIENT_USER)
            self.node_urls = {n: proc.url_for(node_user(n)) for n in node_ids}
            admin = root / "redis-admin.url"
            admin.touch(mode=0o600)
            admin.write_text(proc.url + "\n")
        console.print(
            f"redis index: {redact_url(self.url)} (read-only; full URL in KVSTORE_REDIS_URL of "
            "--ready-file)" + ("" if external else f", administrator's in {root / 'redis-admin.url'}")
        )

    def describe(self) -> dict[str, object]:
        """The private Redis's PIDs, for operators and fault tests (none for the operator's)."""
        from kvstore.cli.redis_procs import RedisClusterGroup, SentinelGroup

        redis = self.proc
        if isinstance(redis, RedisClusterGroup):  # the private Redis Cluster
            return {"redis_pids": [p.proc.pid for p in redis.processes() if p.proc is not None]}
        if isinstance(redis, SentinelGroup):  # the private Sentinel group
            return {
                "redis_pids": [p.proc.pid for p in (redis.master, *redis.replicas) if p.proc is not None],
                "sentinel_pids": [p.proc.pid for p in redis.sentinels if p.proc is not None],
            }
        if redis is not None:  # the private redis-server
            return {"redis_pid": redis.proc.pid}  # type: ignore[union-attr]
        return {}

    def revive(self) -> str | None:
        """Restart a private redis-server (or sentinel) that exited (killed, OOM): reaped here, started
        again on the same port with the same users, so every URL stays valid. One Redis comes back empty:
        the nodes find their records gone at their next heartbeat and republish every page (within a third
        of the index TTL). In a Sentinel group the sentinels have meanwhile failed over to a replica (the
        nodes republish there), and turn the restarted Redis into a replica. A Redis Cluster's server is
        restarted only once the cluster has had time to fail it over (twice its node timeout): it then
        rejoins, from its kept cluster state, as a replica, rather than as an empty master whose replica
        would copy its emptiness. Returns why the stack must stop when a process cannot be restarted,
        else None."""
        from kvstore.cli.redis_procs import RedisClusterGroup, RedisProcess, SentinelGroup

        redis = self.proc
        procs = (
            redis.processes()
            if isinstance(redis, (SentinelGroup, RedisClusterGroup))
            else [redis]
            if redis is not None
            else []
        )
        for p in procs:
            if p.proc is None or p.proc.poll() is None:
                continue
            if isinstance(redis, RedisClusterGroup):
                died = self._dead_since.setdefault(id(p), time.monotonic())
                if time.monotonic() - died < 2 * redis.node_timeout_ms / 1000:
                    continue
                self._dead_since.pop(id(p))
            what = "redis-server" if isinstance(p, RedisProcess) else "redis sentinel"
            code = p.proc.returncode  # poll() reaped it: nothing left defunct
            console.print(f"[yellow]{what} exited with {code}[/]: restarting it on port {p.port}")
            try:
                p.start()
            except (RuntimeError, TimeoutError, OSError) as exc:
                return f"{what} exited with {code} and could not be restarted: {exc}"
            self.restarts += 1
            console.print(f"{what} restarted (pid {p.proc.pid}); the nodes republish their pages")  # type: ignore[union-attr]
        return None

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()
