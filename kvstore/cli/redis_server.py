"""One private redis-server on loopback (RedisProcess), and what every Redis child shares (`Child`): started on
a free port, ready only once the server on that port is provably ours, stopped by PID.

Invariant: every wait is bounded in time; `stop()` sends SIGTERM, waits, then SIGKILLs; a port taken between
picking it and the child's bind is retried on a fresh one on a first start only (a restart keeps its port).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.cli.waits import START_POLL_S, free_port, retry_if_port_taken, wait_port


def probe(host: str, port: int, password: str | None, **kw: Any) -> Any:
    """A redis-py client for one look at a child (its PID, a sentinel's view): the default user, and no
    retries (redis-py's own retry would turn a port that accepts but never answers into a 15 s wait)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(host, port, username="default" if password else None, password=password, socket_timeout=1,
                       retry=Retry(NoBackoff(), 0), **kw)  # fmt: skip


class Child:
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
            with probe(self.host, self.port, password) as c:
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


class RedisProcess(Child):
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
        *,
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
        """Start it (bounded; a port taken on a first start is retried, see Child._start_retrying)."""
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
