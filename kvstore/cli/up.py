"""`kvstore up`: one machine's cluster on embedded defaults: a private redis-server and N cache nodes."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvstore.cli.common import friendly_errors

console = Console()


@friendly_errors
def up(
    nodes: Annotated[int, typer.Option(help="cache nodes to start", min=1, max=64)] = 1,
    dram_bytes: Annotated[str, typer.Option(help="DRAM per node")] = "256MiB",
    nvme_bytes: Annotated[str, typer.Option(help="NVMe per node (0: none)")] = "1GiB",
    nvme_root: Annotated[Path | None, typer.Option(help="NVMe directories go here (default: a temp dir)")] = None,
    max_page_bytes: Annotated[str, typer.Option(help="largest page a node accepts")] = "2MiB",
    redis_url: Annotated[str | None, typer.Option(help="use this Redis instead of starting one")] = None,
    index_ttl: Annotated[float, typer.Option(help="index heartbeat TTL, seconds")] = 10.0,
    metrics: Annotated[bool, typer.Option(help="serve Prometheus /metrics per node on a free port")] = True,
    ready_file: Annotated[Path | None, typer.Option(help="write {redis_url, nodes} JSON here once up")] = None,
) -> None:
    """Start Redis and N nodes on loopback; stop them all on Ctrl-C or SIGTERM."""
    from kvstore.launch import NodeProcess, RedisProcess

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    tmp = tempfile.TemporaryDirectory(prefix="kvstore-up-")
    root = nvme_root or Path(tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    redis = None if redis_url else RedisProcess()
    procs: list[NodeProcess] = []
    try:
        if redis is not None:
            redis.start()
            redis_url = redis.url
        assert redis_url is not None
        console.print(f"redis index: {redis_url}")
        for i in range(nodes):
            node = NodeProcess(dram_bytes=dram_bytes, nvme_path=root / f"node-{i}", nvme_bytes=nvme_bytes,
                               max_page_bytes=max_page_bytes, node_id=f"node-{i}", redis_url=redis_url,
                               extra_args=["--index-ttl", str(index_ttl), *(["--metrics-port", "0"] if metrics else [])],
                               log_path=root / f"node-{i}.log")  # fmt: skip
            procs.append(node.start())
            scrape = f"  metrics http://{node.host}:{node.metrics_port}/metrics" if node.metrics_port else ""
            console.print(f"node-{i}: {node.addr}{scrape}  (log {node.log_path})")
        if ready_file is not None:
            tmp_ready = ready_file.with_suffix(".tmp")
            tmp_ready.write_text(json.dumps({"redis_url": redis_url, "pid": os.getpid(),
                                             "nodes": {f"node-{i}": p.addr for i, p in enumerate(procs)},
                                             "metrics": {f"node-{i}": p.metrics_port for i, p in enumerate(procs)}}))  # fmt: skip
            os.replace(tmp_ready, ready_file)
        console.print(f"[green]up[/]: kvctl nodes --redis-url {redis_url}   (Ctrl-C stops everything)")
        while not stop.wait(1.0):
            for i, p in enumerate(procs):
                if p.proc is not None and p.proc.poll() is not None:
                    console.print(f"[red]node-{i} exited[/] with {p.proc.returncode}; see {p.log_path}")
                    stop.set()
    finally:
        for p in procs:
            p.close()
        if redis is not None:
            redis.close()
        tmp.cleanup()
        console.print("stopped")
