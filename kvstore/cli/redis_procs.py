"""Private Redis processes on loopback for tests, the demo and `kvstore up`: a redis-server
(RedisProcess), a Sentinel group (SentinelGroup: a master, replicas and sentinels) and a Redis Cluster
(RedisClusterGroup: masters, each with replicas), each child started on a free port, ready only once the
server on that port is provably ours, stopped by PID.

Every wait is bounded in time; `stop()` sends SIGTERM, waits, then SIGKILLs.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.cli.waits import START_POLL_S, free_port, retry_if_port_taken, wait_port


def _probe(host: str, port: int, password: str | None, **kw: Any) -> Any:
    """A redis-py client for one look at a child (its PID, a sentinel's view): the default user, and no
    retries (redis-py's own retry would turn a port that accepts but never answers into a 15 s wait)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(host, port, username="default" if password else None, password=password, socket_timeout=1,
                       retry=Retry(NoBackoff(), 0), **kw)  # fmt: skip


class _Child:
    """A server child process (`proc`) with a private directory (`_tmp`) on `host:port`: started and waited
    for (bounded), stopped with SIGTERM, a bounded wait, then SIGKILL."""

    proc: subprocess.Popen[bytes] | None
    host: str
    port: int
    _tmp: tempfile.TemporaryDirectory[str]

    def _log(self, what: str) -> Path:
        return Path(self._tmp.name) / f"{what.replace(' ', '-')}.log"

    def _start_retrying(self, what: str, first: bool, once: Callable[[], None], refresh: Callable[[], None]) -> None:
        """once() (a _launch of `what`) until it starts. On a first start, a port taken between free_port()
        and the child's bind (Redis logs "in use") is retried on a fresh one, after refresh() (what names
        the port: a config file); a restart keeps its port (clients hold the URL)."""

        def fresh_port() -> None:
            self.port = free_port(self.host)
            refresh()

        log = self._log(what)
        retry_if_port_taken(once, taken=lambda e: first and "in use" in log.read_text(errors="replace"),
                            before_retry=fresh_port)  # fmt: skip

    def _launch(self, argv: list[str], what: str, answers: Callable[[], bool], timeout: float) -> None:
        """Start `argv` (output to <dir>/<what>.log) and wait until its port `answers` (True)."""
        log_path = self._log(what)
        log = open(log_path, "ab")  # noqa: SIM115 - the child's now
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            wait_port(self.host, self.port, timeout, self.proc, log_path, what=what, answers=answers, poll=START_POLL_S)
        except TimeoutError:
            self.stop()
            raise

    def _redis_is_ours(self, password: str | None) -> bool:
        """The server on our port is our child: it takes `password` (the default user's, when set) and its
        `INFO server` names our PID. A process that took the port after free_port() fails this, and ours
        then exits (port in use): _launch sees that, and the caller's retry moves to a fresh port."""
        import redis

        if self.proc is None:
            return False
        try:
            with _probe(self.host, self.port, password) as c:
                return c.info("server").get("process_id") == self.proc.pid
        except (redis.RedisError, OSError):
            return False

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


class RedisProcess(_Child):
    """A private redis-server on loopback: no persistence, a free port, stopped by stop()/close().
    Protected mode is always on. With `password` the default (administrator) user needs it; `users`
    adds ACL users, `{name: (password, rules)}` (kvstore/index/acl.py). Both live in a 0600 config
    file, never on a command line.

    `restart()` keeps the port (so clients and nodes reconnect to the same URL) and, like a real
    Redis restart without persistence, comes back empty.

    `cluster_node_timeout_ms`: run in cluster mode (a member of a RedisClusterGroup), with its cluster
    bus on a port of its own; its cluster state (nodes.conf) survives restart(), its data does not.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        binary: str = "redis-server",
        password: str | None = None,
        users: dict[str, tuple[str, str]] | None = None,
        replica_of: RedisProcess | None = None,
        cluster_node_timeout_ms: int | None = None,
    ) -> None:
        """`replica_of`: start as a replica of that Redis (authenticating as its administrator)."""
        path = shutil.which(binary)
        if path is None:
            raise RuntimeError(f"{binary} not found: install Debian's redis-server (./dev setup does)")
        self.binary = path
        self.host = host
        self.port = free_port(host)
        self.password = password  # the default user's, given in a config file (never on the command line)
        self.users = dict(users or {})
        if self.users and not password:
            raise ValueError("ACL users need an administrator password too (the default user would be open)")
        self.replica_of = replica_of
        self.cluster_node_timeout_ms = cluster_node_timeout_ms
        self.cluster_port = free_port(host) if cluster_node_timeout_ms is not None else 0
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self._conf_written = False

    @property
    def url(self) -> str:
        """The administrator's URL (the default user)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def url_for(self, user: str) -> str:
        """The URL of one of the ACL users."""
        return f"redis://{user}:{self.users[user][0]}@{self.host}:{self.port}/0"

    def start(self, timeout: float = 15.0) -> RedisProcess:
        """Start it (bounded; a port taken on a first start is retried, see _Child._start_retrying)."""
        self._start_retrying("redis-server", not self._conf_written, lambda: self._start_once(timeout), self._new_bus)
        return self

    def _new_bus(self) -> None:
        """A first start retried on a fresh port: the cluster bus (if any) moves too (either may be the taken one)."""
        if self.cluster_port:
            self.cluster_port = free_port(self.host)

    def _start_once(self, timeout: float) -> None:
        conf = Path(self._tmp.name) / "redis.conf"
        if not self._conf_written:  # kept across restarts: Sentinel rewrites it (who replicates whom)
            conf.touch(mode=0o600)
            conf.write_text(self._auth_conf())
            self._conf_written = True
        args = [
            self.binary,
            str(conf),
            "--bind",
            self.host,
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._tmp.name,
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
        ]
        if self.cluster_node_timeout_ms is not None:
            # NOTE: cluster-require-full-coverage no: while one master's slots have no owner (a failover in
            # progress) the others keep answering; the index reads what it can and counts the rest as a
            # miss. cluster-replica-validity-factor 0: any replica may take over, however long its link was
            # down (the index is rebuilt by the nodes' republish, so a stale replica loses nothing that matters).
            # No diskless-sync delay: a replica (re)joining syncs at once rather than 5 s later.
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port",
                     str(self.cluster_port), "--cluster-node-timeout", str(self.cluster_node_timeout_ms),
                     "--cluster-require-full-coverage", "no", "--cluster-replica-validity-factor", "0",
                     "--repl-diskless-sync-delay", "0"]  # fmt: skip
        self._launch(args, "redis-server", lambda: self._redis_is_ours(self.password), timeout)

    def _auth_conf(self) -> str:
        from kvstore.index.acl import acl_line, admin_line

        lines = []
        if self.password:
            lines = [admin_line(self.password)] + [acl_line(u, pw, rules) for u, (pw, rules) in self.users.items()]
        if self.replica_of is not None:
            m = self.replica_of
            lines.append(f"replicaof {m.host} {m.port}")
            if m.password:
                lines += ["masteruser default", f"masterauth {m.password}"]
        if self.password:  # a replica promoted by Sentinel later: its own replicas authenticate the same way
            lines += ["masteruser default", f"masterauth {self.password}"]
        return "\n".join(dict.fromkeys(lines)) + "\n"

    def restart(self) -> RedisProcess:
        self.stop()
        return self.start()

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


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
                with _probe(s.host, s.port, self.sentinel_password) as c:
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
            with _probe(s.host, s.port, self.sentinel_password, decode_responses=True) as c:
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


class SentinelProcess(_Child):
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
        """Start it (bounded; a port taken on a first start is retried, see _Child._start_retrying). A
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
        return _probe(p.host, p.port, self.password, decode_responses=True, **kw)

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
        """The live server that serves `slot` now: a master whose own view (CLUSTER SLOTS) names itself for it.
        NOTE: not any server's view: under load a server may still name a master the cluster has failed over
        (a failover while the cluster formed), and a test that stops that one stops nothing lookups use."""
        import redis

        for p in self.processes():
            if p.proc is None or p.proc.poll() is not None:
                continue
            try:
                with self._admin(p) as c:
                    if c.execute_command("ROLE")[0] != "master":
                        continue
                    for lo, hi, (_, port, *_), *_ in c.execute_command("CLUSTER", "SLOTS"):
                        if lo <= slot <= hi and int(port) == p.port:
                            return p
            except (redis.RedisError, OSError, ValueError, IndexError):
                continue
        return None

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
