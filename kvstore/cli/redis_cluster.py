"""A Redis Cluster on loopback (RedisClusterGroup): masters sharing the 16384 slots, each with replicas, every one a
RedisProcess (redis_server.py) stopped by PID; what `redis+cluster://` index URLs (kvstore/index/connect.py) name.

Invariant: ready only once every server sees every other, every slot is served and every replica is in sync;
every server carries the same administrator password and ACL users; every wait is bounded in time.
"""

from __future__ import annotations

import time
from typing import Any

from kvstore.cli.redis_server import RedisProcess, probe

CLUSTER_SLOTS = 16384


class RedisClusterGroup:
    """A Redis Cluster on loopback: `masters` redis-servers in cluster mode sharing the 16384 slots evenly,
    each with `replicas` replicas, every one a RedisProcess child stopped by close(). Every server carries
    the same administrator password and ACL users: Redis Cluster does not propagate ACLs, and any replica
    may become a master.

    The cluster is formed by hand (CLUSTER MEET, ADDSLOTSRANGE, REPLICATE), as `redis-cli --cluster create`
    would, and is ready once every server sees every other, every slot is served and every replica is in
    sync. `url_for(user)` is a redis+cluster:// URL naming every server (kvstore/index/connect.py);
    `processes()` lists the children for a supervisor (`kvstore up` restarts one that exits, once the
    cluster has had time to fail it over: it then rejoins as a replica, from its kept nodes.conf)."""

    def __init__(
        self,
        password: str,
        users: dict[str, tuple[str, str]] | None = None,
        *,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 2000,
        host: str = "127.0.0.1",
    ) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError("a Redis Cluster needs at least one master (and zero or more replicas per master)")
        self.password = password
        self.users = dict(users or {})
        self.node_timeout_ms = node_timeout_ms
        self.host = host
        self.masters = [
            RedisProcess(host, password=password, users=self.users, cluster_node_timeout_ms=node_timeout_ms)
            for _ in range(masters)
        ]
        self.replicas = [
            [
                RedisProcess(host, password=password, users=self.users, cluster_node_timeout_ms=node_timeout_ms)
                for _ in range(replicas)
            ]
            for _ in range(masters)
        ]

    def processes(self) -> list[RedisProcess]:
        return [*self.masters, *(r for group in self.replicas for r in group)]

    def start(self, timeout: float = 60.0) -> RedisClusterGroup:
        try:
            for p in self.processes():
                p.start()
            self._form(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _admin(self, p: RedisProcess, **kw: Any) -> Any:
        return probe(p.host, p.port, self.password, decode_responses=True, **kw)

    def _form(self, timeout: float) -> None:
        """Meet, share the slots out, attach the replicas, then wait until the cluster says it is whole."""
        deadline = time.monotonic() + timeout
        first = self.masters[0]
        per = CLUSTER_SLOTS // len(self.masters)
        for i, m in enumerate(self.masters):
            with self._admin(m) as c:
                # Distinct config epochs up front: no collisions for the cluster to resolve on its first start.
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                hi = CLUSTER_SLOTS - 1 if i == len(self.masters) - 1 else (i + 1) * per - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, hi)
        with self._admin(first) as c:
            for p in self.processes()[1:]:
                c.execute_command("CLUSTER", "MEET", p.host, p.port, p.cluster_port)
        self._wait(deadline, lambda: all(self._known(p) == len(self.processes()) for p in self.processes()),
                   "every server to know every other")  # fmt: skip
        for m, group in zip(self.masters, self.replicas, strict=True):
            with self._admin(m) as c:
                master_id = c.execute_command("CLUSTER", "MYID")
            for r in group:
                with self._admin(r) as c:
                    c.execute_command("CLUSTER", "REPLICATE", master_id)
        self.wait_ready(max(1.0, deadline - time.monotonic()))

    def _known(self, p: RedisProcess) -> int:
        import redis

        try:
            with self._admin(p) as c:
                return len([line for line in c.execute_command("CLUSTER", "NODES").splitlines() if line.strip()])
        except (redis.RedisError, OSError):
            return 0

    def _state(self, p: RedisProcess) -> dict[str, Any]:
        """CLUSTER INFO and the replication role of one live server, or {} when it cannot say."""
        import redis

        if p.proc is None or p.proc.poll() is not None:
            return {}
        try:
            with self._admin(p) as c:
                info = dict(
                    line.split(":", 1) for line in c.execute_command("CLUSTER", "INFO").splitlines() if ":" in line
                )
                info.update(c.info("replication"))
                return info
        except (redis.RedisError, OSError):
            return {}

    def _wait(self, deadline: float, cond: Any, what: str) -> None:
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.1)
        raise TimeoutError(f"Redis Cluster: timed out waiting for {what}")

    def wait_ready(self, timeout: float) -> None:
        """Until every live server says cluster_state:ok with all slots served, there are as many masters
        as the cluster was made with, and every live replica's link to its master is up."""

        def whole() -> bool:
            states = [self._state(p) for p in self.processes() if p.proc is not None and p.proc.poll() is None]
            if not states or any(not s for s in states):
                return False
            ok = all(s.get("cluster_state") == "ok" and s.get("cluster_slots_ok") == str(CLUSTER_SLOTS) for s in states)
            masters = sum(s.get("role") == "master" for s in states)
            synced = all(s.get("master_link_status") == "up" for s in states if s.get("role") == "slave")
            return ok and masters == len(self.masters) and synced

        self._wait(time.monotonic() + timeout, whole, "every slot served and every replica in sync")

    def masters_now(self) -> list[RedisProcess]:
        """The live servers that are masters now (after a failover: a promoted replica among them)."""
        return [p for p in self.processes() if self._state(p).get("role") == "master"]

    def master_for_slot(self, slot: int) -> RedisProcess | None:
        """The live server that serves `slot` now: a master whose own view (CLUSTER SLOTS) names itself for it
        and, where two masters both do (a failed-over master that has not heard of it yet), the one most live
        servers' views name. NOTE: not any one server's view: under load a server may still name a master the
        cluster has failed over, and a test that stops that one stops nothing lookups use."""
        import redis

        claims: list[RedisProcess] = []
        votes: dict[int, int] = {}
        for p in self.processes():
            if p.proc is None or p.proc.poll() is not None:
                continue
            try:
                with self._admin(p) as c:
                    master = c.execute_command("ROLE")[0] == "master"
                    for lo, hi, (_, port, *_), *_ in c.execute_command("CLUSTER", "SLOTS"):
                        if lo <= slot <= hi:
                            votes[int(port)] = votes.get(int(port), 0) + 1
                            if master and int(port) == p.port:
                                claims.append(p)
            except (redis.RedisError, OSError, ValueError, IndexError):
                continue
        return max(claims, key=lambda p: votes.get(p.port, 0), default=None)

    def url_for(self, user: str) -> str:
        from urllib.parse import quote

        pw = self.password if user == "default" else self.users[user][0]
        hosts = ",".join(f"{p.host}:{p.port}" for p in self.processes())
        return f"redis+cluster://{quote(user)}:{quote(pw)}@{hosts}/"

    @property
    def url(self) -> str:
        """The administrator's URL."""
        return self.url_for("default")

    def close(self) -> None:
        for p in reversed(self.processes()):
            p.close()
