"""`kvstore up`: one machine's cluster: a private redis-server and N cache nodes, or, with `--values`,
the roles the Helm chart starts, from the chart's own values file, as local processes.

Redis always runs with protected mode and ACL users (kvstore/index/acl.py): each node gets its own user,
allowed to write only its own records, and clients (workers, kvctl, the ready file's `redis_url`) a
read-only one; the administrator's URL is kept in `redis-admin.url` (0600) in the run's directory.
URLs reach the nodes through their environment, as in the chart, never a command line.

`--values FILE` (repeatable, merged in order over helm/kvstore/values.yaml as Helm merges them):
Redis (as above), `local.nodes` cache nodes with the chart's node.toml and budgets times `local.scale`, read-write
and read-only token files when auth.enabled, and with `local.workers` a local Ray head offering the
chart's prefill/decode slots plus `kvstore pd-serve`, the same driver the chart runs beside its Ray head.
With node.localSocket each node serves its same-host socket (in a short directory under /tmp; where this
`kvstore serve` has --local-socket), named node-i as KVSTORE_NODE_NAME, and clients get node-0's as
KVSTORE_LOCAL_NODE / KVSTORE_LOCAL_SOCKET. With engines.enabled, where vLLM's CPU build is installed
(kvstore/cli/engines.py), `lmcache server` with kvstore's L2 adapter aimed at node-0 and vLLM's OpenAI
server with LMCacheMPConnector, each in its own process group; elsewhere the run is refused, naming
local.engines.python.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvstore.cli.common import friendly_errors
from kvstore.cli.waits import POLL_S, tail, wait_http, wait_port

console = Console()


@friendly_errors
# one parameter per CLI option (typer)
def up(  # noqa: PLR0913, PLR0917
    nodes: Annotated[int, typer.Option(help="cache nodes to start (without --values)", min=1, max=64)] = 1,
    dram_bytes: Annotated[str, typer.Option(help="DRAM per node")] = "256MiB",
    nvme_bytes: Annotated[str, typer.Option(help="NVMe per node (0: none)")] = "1GiB",
    nvme_root: Annotated[Path | None, typer.Option(help="NVMe directories go here (default: a temp dir)")] = None,
    max_page_bytes: Annotated[str, typer.Option(help="largest page a node accepts")] = "2MiB",
    redis_url: Annotated[str | None, typer.Option(help="use this Redis instead of starting one")] = None,
    redis_cluster: Annotated[
        int,
        typer.Option(
            help="start a local Redis Cluster of this many masters instead of one redis-server (0: off)", min=0, max=16
        ),
    ] = 0,
    redis_cluster_replicas: Annotated[
        int, typer.Option(help="replicas per master of --redis-cluster", min=0, max=4)
    ] = 1,
    index_ttl: Annotated[float, typer.Option(help="index heartbeat TTL, seconds")] = 10.0,
    metrics: Annotated[bool, typer.Option(help="serve Prometheus /metrics per node on a free port")] = True,
    values: Annotated[
        list[Path] | None,
        typer.Option("--values", "-f", help="the Helm chart's values file: start the roles it describes"),
    ] = None,
    chart: Annotated[Path | None, typer.Option(help="chart directory for --values (default: helm/kvstore)")] = None,
    ready_file: Annotated[Path | None, typer.Option(help="write {redis_url, nodes, ...} JSON here once up")] = None,
) -> None:
    """Start Redis and N nodes on loopback (or the chart's roles with --values); stop all on Ctrl-C/SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    tmp = tempfile.TemporaryDirectory(prefix="kvstore-up-")
    root = nvme_root or Path(tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    stack = Stack(root)
    try:
        if values:
            from kvstore.cli.values import chart_from_env, load_values, plan

            v = load_values(list(values), chart or chart_from_env())
            stack.start_from_plan(plan(v, root), v)
        else:
            if redis_cluster and redis_url:
                raise typer.BadParameter("give --redis-url or --redis-cluster, not both", param_hint="--redis-cluster")
            cluster = None
            if redis_cluster:
                from kvstore.cli.values import ClusterPlan

                cluster = ClusterPlan(redis_cluster, redis_cluster_replicas, 2000)
            stack.start_simple(nodes, dram_bytes, nvme_bytes, max_page_bytes, redis_url, index_ttl, metrics, cluster)
        if ready_file is not None:
            _write_ready(ready_file, stack)
        console.print(
            "[green]up[/]: kvctl nodes --redis-url URL, kvctl top --redis-url URL   (Ctrl-C stops everything)"
        )
        while not stop.wait(1.0):
            restarts = stack.redis_restarts
            dead = stack.revive_redis() or stack.dead()
            if dead:
                console.print(f"[red]{dead}[/]")
                stop.set()
            elif ready_file is not None and stack.redis_restarts != restarts:
                _write_ready(ready_file, stack)  # the new redis_pid
    finally:
        stack.close()
        tmp.cleanup()
        console.print("stopped")


@dataclass
class Stack:
    """The processes of one `kvstore up`; close() stops them all (workers, nodes, Redis), each by PID."""

    root: Path
    redis: object | None = None
    redis_url: str = ""  # what clients use: read-only on the private Redis
    node_urls: dict[str, str] = field(default_factory=dict)  # node id -> its own Redis user's URL
    nodes: list = field(default_factory=list)
    ray_head: subprocess.Popen[bytes] | None = None
    ray_address: str = ""
    driver: subprocess.Popen[bytes] | None = None
    driver_ready: dict = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # what every client of this stack needs (tokens)
    ray_tmp: tempfile.TemporaryDirectory[str] | None = None
    socket_dir: tempfile.TemporaryDirectory[str] | None = None  # the nodes' same-host sockets
    lmcache: subprocess.Popen[bytes] | None = None
    vllm: subprocess.Popen[bytes] | None = None
    engine_urls: dict[str, str] = field(default_factory=dict)
    redis_restarts: int = 0
    _dead_since: dict[int, float] = field(default_factory=dict)  # a cluster server's death, first seen

    def start_simple(
        self,
        n: int,
        dram: str,
        nvme: str,
        page: str,
        redis_url: str | None,
        ttl: float,
        metrics: bool,
        cluster: object = None,
    ) -> None:
        self._start_redis(redis_url, [f"node-{i}" for i in range(n)], cluster=cluster)
        for i in range(n):
            self._start_node(
                i, dram, nvme, page, ["--index-ttl", str(ttl), *(["--metrics-port", "0"] if metrics else [])]
            )

    def start_from_plan(self, plan: object, values: dict) -> None:
        from kvstore.cli.values import LocalPlan

        assert isinstance(plan, LocalPlan)
        for note in plan.notes:
            console.print(f"[yellow]note[/]: {note}")
        self._start_redis(
            plan.redis_external_url,
            [f"node-{i}" for i in range(plan.nodes)],
            plan.tenants,
            plan.redis_sentinel,
            plan.redis_cluster,
        )
        extra: list[str] = []
        if plan.auth_tokens:
            # Local nodes serve plaintext (no certificates here): an explicit opt-in, see SECURITY.md. The
            # index cannot be used to redirect tokens: only each node's own Redis user writes its record.
            self.env["KVSTORE_ALLOW_PLAINTEXT_TOKEN"] = "1"
            rw, ro = self.root / "rw.tokens", self.root / "ro.tokens"
            for f in (rw, ro):
                f.write_text(secrets.token_urlsafe(32) + "\n")
                f.chmod(0o600)
            for name in plan.tenants:  # as the chart: each tenant's token bound by its rw.tokens line, and alone
                token, own = secrets.token_urlsafe(32), self.root / f"tenant-{name}.token"
                own.touch(mode=0o600)
                own.write_text(token + "\n")
                rw.write_text(rw.read_text() + f"{token} {name}\n")
                console.print(f"tenant {name}: token in {own}")
            # The nodes' own token, for the copies they make of each other's pages (DESIGN.md §7.3), as the chart.
            peer = self.root / "peer.tokens"
            peer.touch(mode=0o600)
            peer.write_text(secrets.token_urlsafe(32) + "\n")
            extra += [
                "--auth-tokens-file",
                str(rw),
                "--auth-read-tokens-file",
                str(ro),
                "--auth-peer-tokens-file",
                str(peer),
            ]
            if plan.tenants_toml:
                tf = self.root / "tenants.toml"
                tf.touch(mode=0o600)
                tf.write_text(plan.tenants_toml)
                extra += ["--tenants-file", str(tf)]
            self.env["KVSTORE_TOKEN_FILE"] = str(rw)
            console.print(f"tokens: read-write {rw}, read-only {ro}")
        if plan.node is not None:
            conf = self.root / "node.toml"
            conf.write_text(_toml_table("node", plan.node.config))
            sockets = self._socket_paths(plan)
            for i in range(plan.nodes):
                own = ["--local-socket", sockets[i]] if sockets else []
                self._start_node(
                    i,
                    plan.node.dram_bytes,
                    plan.node.nvme_bytes,
                    plan.node.max_page_bytes,
                    [
                        "--config",
                        str(conf),
                        "--hbm-bytes",
                        str(plan.node.hbm_bytes),
                        "--metrics-port",
                        "0",
                        *own,
                        *extra,
                    ],
                )
            if sockets:  # clients of this stack sit on node-0's "host"
                self.env |= {"KVSTORE_LOCAL_NODE": "node-0", "KVSTORE_LOCAL_SOCKET": sockets[0]}
        if plan.workers is not None:
            self._start_workers(plan.workers)
        if plan.engines is not None:
            self._start_engines(plan.engines)

    def _socket_paths(self, plan: object) -> list[str]:
        """Each node's same-host socket, or [] where node.localSocket is off or this `kvstore serve` cannot
        serve one yet (said out loud). Sockets live under /tmp: a Unix socket path must fit 107 bytes."""
        from kvstore.cli.serve import serve
        from kvstore.cli.values import LocalPlan

        assert isinstance(plan, LocalPlan)
        if not plan.local_socket:
            return []
        if "local_socket" not in inspect.signature(serve).parameters:
            console.print(
                "[yellow]note[/]: node.localSocket: this `kvstore serve` has no --local-socket yet; "
                "clients on this machine use the other planes"
            )
            return []
        self.socket_dir = tempfile.TemporaryDirectory(prefix="kvs-", dir="/tmp")
        return [str(Path(self.socket_dir.name) / f"node-{i}.sock") for i in range(plan.nodes)]

    def _start_redis(
        self,
        external: str | None,
        node_ids: list[str],
        tenants: tuple[str, ...] = (),
        sentinel: object = None,
        cluster: object = None,
    ) -> None:
        """The index: the operator's (`external`), else a private redis-server, or with `sentinel` (a
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
            self.redis_url = external
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
            for t in tenants:  # each tenant's read-only index user sees only its entries (KVSTORE_TENANT=<t>)
                url = self.root / f"redis-tenant-{t}.url"
                url.touch(mode=0o600)
                url.write_text(proc.url_for(tenant_client_user(t)) + "\n")
            self.redis = proc
            self.redis_url = proc.url_for(CLIENT_USER)
            self.node_urls = {n: proc.url_for(node_user(n)) for n in node_ids}
            admin = self.root / "redis-admin.url"
            admin.touch(mode=0o600)
            admin.write_text(proc.url + "\n")
        console.print(
            f"redis index: {redact_url(self.redis_url)} (read-only; full URL in KVSTORE_REDIS_URL of "
            "--ready-file)" + ("" if external else f", administrator's in {self.root / 'redis-admin.url'}")
        )

    def _start_node(self, i: int, dram: int | str, nvme: int | str, page: int | str, extra: list[str]) -> None:
        from kvstore.cli.launch import NodeProcess

        # The Redis URL (with its password) reaches the node through its environment, as in the chart.
        # KVSTORE_NODE_NAME: the "host" this node advertises; a client whose KVSTORE_LOCAL_NODE matches is local.
        node = NodeProcess(
            dram_bytes=dram,
            nvme_path=self.root / f"node-{i}",
            nvme_bytes=nvme,
            max_page_bytes=page,
            node_id=f"node-{i}",
            extra_args=extra,
            log_path=self.root / f"node-{i}.log",
            env={"KVSTORE_REDIS_URL": self.node_urls[f"node-{i}"], "KVSTORE_NODE_NAME": f"node-{i}"},
        )
        self.nodes.append(node.start())
        scrape = f"  metrics http://{node.host}:{node.metrics_port}/metrics" if node.metrics_port else ""
        console.print(f"node-{i}: {node.addr}{scrape}  (log {node.log_path})")

    def _start_workers(self, w: object) -> None:
        """A local Ray head with the chart's slots, then `kvstore pd-serve` against it (as in the chart)."""
        from kvstore.cli.ray_head import start_ray_head
        from kvstore.cli.values import WorkersPlan

        assert isinstance(w, WorkersPlan)
        token = self.root / "ray_auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        env = {
            **os.environ,
            **self.env,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            "KVSTORE_REDIS_URL": self.redis_url,
            "KVSTORE_LOCAL_NODE": "node-0",
        }
        # NOTE: Ray's unix socket paths must stay under 107 bytes: its temp dir is short, not under root.
        self.ray_tmp = tempfile.TemporaryDirectory(prefix="kvray-", dir="/tmp")
        resources = json.dumps({"kvstore_prefill": w.prefill_slots, "kvstore_decode": w.decode_slots})
        self.ray_head, port = start_ray_head(
            env, resources, self.ray_tmp.name, self.root / "ray-head.log", say=console.print
        )
        self.ray_address = f"127.0.0.1:{port}"
        ready = self.root / "pd-serve.json"
        cmd = [
            sys.executable,
            "-m",
            "kvstore.cli.main",
            "pd-serve",
            f"--ray-address={self.ray_address}",
            f"--model={w.model_path}",
            f"--dtype={w.dtype}",
            f"--block-size={w.block_size}",
            f"--num-blocks={w.num_blocks}",
            f"--max-inflight={w.max_inflight}",
            f"--min-prefill={w.prefill_slots}",
            f"--min-decode={w.decode_slots}",
            "--worker-wait=120",
            f"--ready-file={ready}",
            f"--kv-encoding={w.kv_encoding}",
        ]
        log = open(self.root / "pd-serve.log", "ab")  # noqa: SIM115
        self.driver = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + 300.0
        while not ready.exists():
            if self.driver.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvstore pd-serve did not come up:\n{tail(self.root / 'pd-serve.log')}")
            time.sleep(POLL_S)
        self.driver_ready = json.loads(ready.read_text())
        console.print(
            f"ray: {self.ray_address} (token {token}); {w.prefill_slots} prefill + {w.decode_slots} decode "
            f"workers; router {self.driver_ready['router']!r} in Ray namespace "
            f"{self.driver_ready['ray_namespace']!r}  (log {self.root / 'pd-serve.log'})"
        )

    def _start_engines(self, e: object) -> None:
        """`lmcache server` (kvstore's L2 adapter aimed at node-0), then vLLM's OpenAI server with
        LMCacheMPConnector, as the chart's engine pod runs them; each waited for, bounded in time."""
        from kvstore.cli.engines import CPU_ENGINE_ENV, EnginesPlan
        from kvstore.cli.waits import free_port

        assert isinstance(e, EnginesPlan)
        env = {**os.environ, **self.env, **CPU_ENGINE_ENV}
        token_file = self.env.get("KVSTORE_TOKEN_FILE")
        if token_file and e.tenant:  # as the chart: the engine presents its tenant's token only
            token_file = env["KVSTORE_TOKEN_FILE"] = str(self.root / f"tenant-{e.tenant}.token")
        lm_port, port = free_port(), e.vllm_port or free_port()
        log = open(self.root / "lmcache.log", "ab")  # noqa: SIM115 - closed right after the child has it
        argv = e.lmcache_argv(lm_port, self.nodes[0].addr, token_file, f"kvstore-up-{os.getpid()}")
        self.lmcache = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        wait_port("127.0.0.1", lm_port, 120.0, self.lmcache, self.root / "lmcache.log", what="lmcache server")
        log = open(self.root / "vllm.log", "ab")  # noqa: SIM115
        self.vllm = subprocess.Popen(
            e.vllm_argv(port, lm_port), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        wait_http(f"http://127.0.0.1:{port}/health", 900.0, self.vllm, self.root / "vllm.log", "vllm")
        self.engine_urls = {"openai": f"http://127.0.0.1:{port}/v1", "lmcache": f"127.0.0.1:{lm_port}"}
        console.print(
            f"engine: vLLM {self.engine_urls['openai']} (log {self.root / 'vllm.log'}), LMCache "
            f"{self.engine_urls['lmcache']} -> kvstore node-0 (log {self.root / 'lmcache.log'})"
        )

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {
            "redis_url": self.redis_url,
            "pid": os.getpid(),
            "nodes": {f"node-{i}": p.addr for i, p in enumerate(self.nodes)},
            "metrics": {f"node-{i}": p.metrics_port for i, p in enumerate(self.nodes)},
            "env": self.env,
        }
        from kvstore.cli.redis_procs import RedisClusterGroup, SentinelGroup

        if isinstance(self.redis, RedisClusterGroup):  # the private Redis Cluster (for operators and fault tests)
            out["redis_pids"] = [p.proc.pid for p in self.redis.processes() if p.proc is not None]
        elif isinstance(self.redis, SentinelGroup):  # the private Sentinel group (for operators and fault tests)
            out["redis_pids"] = [p.proc.pid for p in (self.redis.master, *self.redis.replicas) if p.proc is not None]
            out["sentinel_pids"] = [p.proc.pid for p in self.redis.sentinels if p.proc is not None]
        elif self.redis is not None:  # the private redis-server (for operators and fault tests)
            out["redis_pid"] = self.redis.proc.pid  # type: ignore[attr-defined]
        if self.engine_urls:
            out["engines"] = dict(self.engine_urls)
        if self.driver is not None:
            out["ray"] = {
                "address": self.ray_address,
                "auth_token_path": str(self.root / "ray_auth_token"),
                **self.driver_ready,
            }
        return out

    def revive_redis(self) -> str | None:
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

        redis = self.redis
        procs = (
            redis.processes()
            if isinstance(redis, (SentinelGroup, RedisClusterGroup))
            else [redis]
            if redis is not None
            else []
        )
        for p in procs:
            if p.proc is None or p.proc.poll() is None:  # type: ignore[attr-defined]
                continue
            if isinstance(redis, RedisClusterGroup):
                died = self._dead_since.setdefault(id(p), time.monotonic())
                if time.monotonic() - died < 2 * redis.node_timeout_ms / 1000:
                    continue
                self._dead_since.pop(id(p))
            what = "redis-server" if isinstance(p, RedisProcess) else "redis sentinel"
            code = p.proc.returncode  # type: ignore[attr-defined]  # poll() reaped it: nothing left defunct
            console.print(f"[yellow]{what} exited with {code}[/]: restarting it on port {p.port}")  # type: ignore[attr-defined]
            try:
                p.start()  # type: ignore[attr-defined]
            except (RuntimeError, TimeoutError, OSError) as exc:
                return f"{what} exited with {code} and could not be restarted: {exc}"
            self.redis_restarts += 1
            console.print(f"{what} restarted (pid {p.proc.pid}); the nodes republish their pages")  # type: ignore[attr-defined]
        return None

    def dead(self) -> str | None:
        for i, p in enumerate(self.nodes):
            if p.proc is not None and p.proc.poll() is not None:
                return f"node-{i} exited with {p.proc.returncode}; see {p.log_path}"
        for name, proc in (
            ("ray head", self.ray_head),
            ("pd-serve", self.driver),
            ("lmcache server", self.lmcache),
            ("vllm", self.vllm),
        ):
            if proc is not None and proc.poll() is not None:
                return f"{name} exited with {proc.returncode}; see {self.root}"
        return None

    def close(self) -> None:
        # Engines and workers first (they write to nodes), then nodes (their shutdown spill needs no Redis),
        # then Redis. An engine's process group goes whole: vLLM's workers outlive a killed parent.
        for proc in (self.vllm, self.lmcache):
            if proc is not None:
                terminate(proc, 30.0)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in (self.driver, self.ray_head):
            if proc is not None:
                terminate(proc, 60.0)
        if self.ray_head is not None:
            # `ray start --block` stops its raylet and GCS on SIGTERM; anything left in the session it was
            # started in (its own process group, id = its pid) goes too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.ray_head.pid, signal.SIGKILL)
        if self.ray_tmp is not None:
            self.ray_tmp.cleanup()
        for p in self.nodes:
            p.close()
        if self.socket_dir is not None:
            self.socket_dir.cleanup()
        if self.redis is not None:
            self.redis.close()  # type: ignore[attr-defined]


def _write_ready(ready_file: Path, stack: Stack) -> None:
    tmp_ready = ready_file.with_suffix(".tmp")
    tmp_ready.touch(mode=0o600)  # it holds the Redis URL, password included
    tmp_ready.write_text(json.dumps(stack.describe()))
    os.replace(tmp_ready, ready_file)


def terminate(proc: subprocess.Popen[bytes], grace: float) -> int:
    """SIGTERM, up to `grace` seconds for a clean exit, then SIGKILL; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    if proc.poll() is None:
        proc.kill()
    return proc.wait(10)


def _toml_table(name: str, table: dict) -> str:
    """A flat TOML table (strings, numbers, booleans): JSON's literals are TOML's for these."""
    lines = [f"[{name}]"]
    for k, v in table.items():
        lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines) + "\n"
