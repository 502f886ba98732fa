"""A Sentinel group on loopback (SentinelGroup): a master, replicas and Redis Sentinels, each a `Child`
(redis_server.py) stopped by PID; what `redis+sentinel://` index URLs (kvstore/index/connect.py) name.

Invariant: every Redis of the group has the same administrator password and ACL users (any may become the
master); passwords live in 0600 config files, never on a command line; every wait is bounded in time.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstore.cli.redis_server import Child, RedisProcess, probe
from kvstore.cli.waits import free_port


class SentinelGroup:
    """A Redis index with no single point of failure, on loopback: a master, `replicas` replicas and
    `sentinels` Redis Sentinels (`redis-server --sentinel`) monitoring it as `name`, each process a
    RedisProcess-like child stopped by close(). Every Redis has the same administrator password and ACL
    users (so any of them can become the master); the sentinels have their own administrator and the
    read-only `kvsentinel` user (kvstore/index/acl.py) that index URLs carry.

    `url_for(user)` is a redis+sentinel:// URL (kvstore/index/connect.py); `processes()` lists every
    child for a supervisor (`kvstore up` restarts one that exits: a restarted Redis is turned into a
    replica by the sentinels, a restarted sentinel rejoins)."""

    def __init__(
        self,
        password: str,
        users: dict[str, tuple[str, str]] | None = None,
        *,
        name: str = "kvstore",
        replicas: int = 2,
        sentinels: int = 3,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 2000,
        host: str = "127.0.0.1",
    ) -> None:
        import secrets

        from kvstore.index.acl import SENTINEL_CLIENT_USER

        if sentinels < 1 or replicas < 1:
            raise ValueError("a Sentinel group needs at least one replica and one sentinel")
        self.name = name
        self.password = password
        self.users = dict(users or {})
        self.sentinel_password = secrets.token_hex(20)  # the sentinels' administrator
        self.client_password = secrets.token_hex(20)  # kvsentinel, in every index URL
        self.sentinel_user = SENTINEL_CLIENT_USER
        self.quorum = sentinels // 2 + 1
        self.master = RedisProcess(host, password=password, users=self.users)
        self.replicas = [
            RedisProcess(host, password=password, users=self.users, replica_of=self.master) for _ in range(replicas)
        ]
        self.sentinels = [
            SentinelProcess(self, host, down_after_ms=down_after_ms, failover_timeout_ms=failover_timeout_ms)
            for _ in range(sentinels)
        ]

    def processes(self) -> list[RedisProcess | SentinelProcess]:
        return [self.master, *self.replicas, *self.sentinels]

    def start(self, timeout: float = 30.0) -> SentinelGroup:
        try:
            for p in self.processes():
                p.start()
            self.wait_ready(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def url_for(self, user: str) -> str:
        from urllib.parse import quote

        from kvstore.index.connect import DEFAULT_SENTINEL_PORT

        hosts = ",".join(f"{s.host}:{s.port}" for s in self.sentinels) or f"127.0.0.1:{DEFAULT_SENTINEL_PORT}"
        pw = self.password if user == "default" else self.users[user][0]
        return (
            f"redis+sentinel://{quote(user)}:{quote(pw)}@{hosts}/{self.name}/0"
            f"?sentinel_username={self.sentinel_user}&sentinel_password={self.client_password}"
        )

    @property
    def url(self) -> str:
        """The administrator's URL."""
        return self.url_for("default")

    def master_now(self) -> RedisProcess | None:
        """The Redis the sentinels name as the master now (None while none does)."""
        import redis

        for s in self.sentinels:
            try:
                with probe(s.host, s.port, self.sentinel_password) as c:
                    _, port = c.sentinel_get_master_addr_by_name(self.name) or (None, None)
            except (redis.RedisError, OSError, TypeError):
                continue
            for r in (self.master, *self.replicas):
                if r.port == int(port or 0) and r.proc is not None and r.proc.poll() is None:
                    return r
        return None

    def wait_ready(self, timeout: float) -> RedisProcess:
        """The master, once every sentinel knows it, its replicas (in sync) and the other sentinels: only
        then can the group fail over (a sentinel learns replicas from the master's INFO)."""
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.master_now()
            if m is not None and all(self._knows_all(s, redis) for s in self.sentinels):
                return m
            time.sleep(0.1)
        raise TimeoutError(
            f"the sentinels of {self.name!r} do not all know its master and replicas after {timeout}s: "
            + "; ".join(self._knowledge(s, redis) for s in self.sentinels)
        )

    def wait_master(self, timeout: float, other_than: RedisProcess | None = None) -> RedisProcess:
        """The live master the sentinels name (after a failover: `other_than` the old one)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.master_now()
            if m is not None and m is not other_than:
                return m
            time.sleep(0.1)
        raise TimeoutError(f"the sentinels of {self.name!r} name no live master after {timeout}s")

    def _view(self, s: SentinelProcess, redis: Any) -> tuple[int, int] | str:
        """(other sentinels, replicas in sync) as sentinel `s` sees them, or why it cannot say."""
        if s.proc is None or s.proc.poll() is not None:
            return "not running"
        try:
            with probe(s.host, s.port, self.sentinel_password, decode_responses=True) as c:
                state = c.sentinel_master(self.name)
                replicas = c.sentinel_slaves(self.name)
        except (redis.RedisError, OSError) as e:
            return f"{type(e).__name__}: {e}"
        in_sync = [r for r in replicas if r.get("master-link-status") == "ok" and not r.get("is_disconnected")]
        return int(state.get("num-other-sentinels", 0)), len(in_sync)

    def _knows_all(self, s: SentinelProcess, redis: Any) -> bool:
        return self._view(s, redis) == (len(self.sentinels) - 1, len(self.replicas))

    def _knowledge(self, s: SentinelProcess, redis: Any) -> str:
        v = self._view(s, redis)
        seen = (
            v
            if isinstance(v, str)
            else f"{v[0]}/{len(self.sentinels) - 1} other sentinels, {v[1]}/{len(self.replicas)} replicas in sync"
        )
        return f"sentinel :{s.port} {seen}"

    def close(self) -> None:
        for p in reversed(self.processes()):
            p.close()


class SentinelProcess(Child):
    """One Redis Sentinel of a SentinelGroup, on a free port; its config file (0600, rewritten by the
    sentinel itself) holds the passwords, never its command line."""

    def __init__(self, group: SentinelGroup, host: str, *, down_after_ms: int, failover_timeout_ms: int) -> None:
        path = shutil.which("redis-server")
        if path is None:
            raise RuntimeError("redis-server not found: install Debian's redis-server (./dev setup does)")
        self.binary = path
        self.group = group
        self.host = host
        self.port = free_port(host)
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-sentinel-")
        self.conf = Path(self._tmp.name) / "sentinel.conf"
        self.proc: subprocess.Popen[bytes] | None = None

    def _conf(self) -> str:
        from kvstore.index.acl import SENTINEL_CLIENT_RULES, acl_line, admin_line

        g, m = self.group, self.group.master
        return "\n".join([
            f"bind {self.host}",
            f"port {self.port}",
            f"dir {self._tmp.name}",
            f"sentinel monitor {g.name} {m.host} {m.port} {g.quorum}",
            f"sentinel down-after-milliseconds {g.name} {self.down_after_ms}",
            f"sentinel failover-timeout {g.name} {self.failover_timeout_ms}",
            f"sentinel auth-pass {g.name} {g.password}",
            admin_line(g.sentinel_password),
            acl_line(g.sentinel_user, g.client_password, SENTINEL_CLIENT_RULES),
            "sentinel sentinel-user default",
            f"sentinel sentinel-pass {g.sentinel_password}",
        ]) + "\n"  # fmt: skip

    def start(self, timeout: float = 15.0) -> SentinelProcess:
        """Start it (bounded; a port taken on a first start is retried, see Child._start_retrying). A
        restart keeps its port and the config the sentinel rewrote (what it learned)."""
        first = not self.conf.exists()
        if first:
            self.conf.touch(mode=0o600)
            self.conf.write_text(self._conf())
        argv = [self.binary, str(self.conf), "--sentinel"]

        def once() -> None:
            self._launch(argv, "redis sentinel", lambda: self._redis_is_ours(self.group.sentinel_password),
                         timeout)  # fmt: skip

        self._start_retrying("redis sentinel", first, once, lambda: self.conf.write_text(self._conf()))
        return self
