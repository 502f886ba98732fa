"""`kvctl nodes` and `kvctl lookup`: the cluster as the Redis index sees it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvstore.cli.common import friendly_errors

RedisOpt = Annotated[str, typer.Option("--redis-url", help="Redis index URL, e.g. redis://127.0.0.1:6379/0")]


@friendly_errors
def nodes(redis_url: RedisOpt, json_out: Annotated[bool, typer.Option("--json", help="print JSON")] = False) -> None:
    """Nodes, liveness, pages per tier, index lag and queued updates."""
    from kvstore.index import IndexReader

    with IndexReader(redis_url) as index:
        infos = index.nodes()
    if json_out:
        typer.echo(
            json.dumps(
                [{"node_id": n.node_id, "alive": n.alive, "addr": n.addr, "epoch": n.epoch, **n.info} for n in infos],
                indent=2,
            )
        )
        return
    from kvstore.security import redact_url

    table = Table(title=f"kvstore nodes in {redact_url(redis_url)}")
    for col in ("node", "alive", "addr", "epoch", "HBM", "DRAM", "NVMe", "queued", "lag ms", "resyncs"):
        table.add_column(col, justify="right" if col not in ("node", "addr") else "left")
    for n in infos:
        i = n.info
        table.add_row(
            n.node_id,
            "[green]yes[/]" if n.alive else "[red]no[/]",
            n.addr,
            str(n.epoch or "-"),
            i.get("pages_hbm", "-"),
            i.get("pages_dram", "-"),
            i.get("pages_nvme", "-"),
            i.get("queued", "-"),
            i.get("lag_ms", "-"),
            i.get("resyncs", "-"),
        )
    Console().print(table)


@friendly_errors
def lookup(
    redis_url: RedisOpt,
    namespace: Annotated[str, typer.Option(help="namespace the pages were put under")],
    tokens_file: Annotated[Path, typer.Option(help="token ids: JSON list, or whitespace/comma separated")],
    block_size: Annotated[int, typer.Option(help="tokens per block (the hash contract's B)", min=1)],
    json_out: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """The longest cached prefix of a token sequence, and how much of it each live node holds."""
    from kvstore.hashing import prefix_hashes
    from kvstore.index import IndexReader

    text = tokens_file.read_text().strip()
    tokens = json.loads(text) if text.startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    hashes = prefix_hashes(tokens, block_size, namespace)
    with IndexReader(redis_url) as index:
        found = index.lookup(namespace, hashes)
    per_node = {
        n.node_id: {"blocks": n.blocks, "leading": n.leading, "tiers": {t.label: c for t, c in n.tiers.items()}}
        for n in found.nodes.values()
    }
    if json_out:
        typer.echo(
            json.dumps(
                {"blocks": len(hashes), "matched": found.matched, "nodes": per_node, "plan": found.plan()}, indent=2
            )
        )
        return
    console = Console()
    console.print(f"{len(tokens)} tokens -> {len(hashes)} full blocks; longest cached prefix: {found.matched} blocks")
    table = Table()
    for col in ("node", "blocks held", "leading run", "tiers"):
        table.add_column(col)
    for node, d in sorted(per_node.items()):
        table.add_row(node, str(d["blocks"]), str(d["leading"]), ", ".join(f"{k}:{v}" for k, v in d["tiers"].items()))
    console.print(table)
    console.print("fetch plan: " + (", ".join(f"{n}[{a}:{b}]" for n, a, b in found.plan()) or "-"))
