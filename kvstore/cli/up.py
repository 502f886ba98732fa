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

This module is the command and the stack (`Stack`: its nodes, and what it starts in which order and stops in
the reverse); the index, and the restart of a private Redis server that exited, are up_index.py; the token
files, the workers and the engines up_roles.py.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvstore.cli.common import friendly_errors
from kvstore.cli.up_index import UpIndex
from kvstore.cli.up_roles import Engines, Workers, terminate, write_tokens

# `terminate` as it was before up_roles.py (tests import it here).
__all__ = ["Stack", "terminate", "up"]

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
            stack.start_simple(
                nodes,
                dram=dram_bytes,
                nvme=nvme_bytes,
                page=max_page_bytes,
                redis_url=redis_url,
                ttl=index_ttl,
                metrics=metrics,
                cluster=cluster,
            )
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
    """The processes of one `kvstore up`; close() stops them all (engines, workers, nodes, Redis), each by PID.
    Its parts: the index (`up_index.UpIndex`), the nodes (here), the workers and engines (`up_roles`)."""

    root: Path
    index: UpIndex = field(default_factory=UpIndex)
    nodes: list = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # what every client of this stack needs (tokens)
    socket_dir: tempfile.TemporaryDirectory[str] | None = None  # the nodes' same-host sockets
    workers: Workers | None = None
    engines: Engines | None = None

    @property
    def redis_restarts(self) -> int:
        return self.index.restarts

    def start_simple(
        self,
        n: int,
        *,
        dram: str,
        nvme: str,
        page: str,
        redis_url: str | None,
        ttl: float,
        metrics: bool,
        cluster: object = None,
    ) -> None:
        self.index.start(self.root, redis_url, [f"node-{i}" for i in range(n)], cluster=cluster)
        for i in range(n):
            self._start_node(
                i, dram, nvme, page, ["--index-ttl", str(ttl), *(["--metrics-port", "0"] if metrics else [])]
            )

    def start_from_plan(self, plan: object, values: dict) -> None:
        from kvstore.cli.values import LocalPlan

        assert isinstance(plan, LocalPlan)
        for note in plan.notes:
            console.print(f"[yellow]note[/]: {note}")
        self.index.start(
            self.root,
            plan.redis_external_url,
            [f"node-{i}" for i in range(plan.nodes)],
            tenants=plan.tenants,
            sentinel=plan.redis_sentinel,
            cluster=plan.redis_cluster,
        )
        extra: list[str] = []
        if plan.auth_tokens:
            env, extra = write_tokens(self.root, plan.tenants, plan.tenants_toml)
            self.env |= env
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
            self.workers = Workers(self.root)
            self.workers.start(plan.workers, self.env, self.index.url)
        if plan.engines is not None:
            self.engines = Engines(self.root)
            self.engines.start(plan.engines, self.env, self.nodes[0].addr)

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
            env={"KVSTORE_REDIS_URL": self.index.node_urls[f"node-{i}"], "KVSTORE_NODE_NAME": f"node-{i}"},
        )
        self.nodes.append(node.start())
        scrape = f"  metrics http://{node.host}:{node.metrics_port}/metrics" if node.metrics_port else ""
        console.print(f"node-{i}: {node.addr}{scrape}  (log {node.log_path})")

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {
            "redis_url": self.index.url,
            "pid": os.getpid(),
            "nodes": {f"node-{i}": p.addr for i, p in enumerate(self.nodes)},
            "metrics": {f"node-{i}": p.metrics_port for i, p in enumerate(self.nodes)},
            "env": self.env,
        }
        out |= self.index.describe()
        if self.engines is not None:
            out |= self.engines.describe()
        if self.workers is not None:
            out |= self.workers.describe()
        return out

    def revive_redis(self) -> str | None:
        """Restart a private Redis server that exited (`UpIndex.revive`); why the stack must stop, else None."""
        return self.index.revive()

    def dead(self) -> str | None:
        for i, p in enumerate(self.nodes):
            if p.proc is not None and p.proc.poll() is not None:
                return f"node-{i} exited with {p.proc.returncode}; see {p.log_path}"
        for part in (self.workers, self.engines):
            why = None if part is None else part.dead()
            if why is not None:
                return why
        return None

    def close(self) -> None:
        # Engines and workers first (they write to nodes), then nodes (their shutdown spill needs no Redis),
        # then Redis.
        for part in (self.engines, self.workers):
            if part is not None:
                part.close()
        for p in self.nodes:
            p.close()
        if self.socket_dir is not None:
            self.socket_dir.cleanup()
        self.index.close()


def _write_ready(ready_file: Path, stack: Stack) -> None:
    tmp_ready = ready_file.with_suffix(".tmp")
    tmp_ready.touch(mode=0o600)  # it holds the Redis URL, password included
    tmp_ready.write_text(json.dumps(stack.describe()))
    os.replace(tmp_ready, ready_file)


def _toml_table(name: str, table: dict) -> str:
    """A flat TOML table (strings, numbers, booleans): JSON's literals are TOML's for these."""
    lines = [f"[{name}]"]
    for k, v in table.items():
        lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines) + "\n"
