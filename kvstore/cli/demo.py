"""`kvstore demo`: the local demo on embedded defaults (the README's first command).

Starts a real node with small DRAM and NVMe budgets, puts the KV pages of several prompts that share
prefixes (a shared system prompt, multi-turn follow-ups), looks them up, pushes enough data to force
demotion to NVMe, reads everything back (checksums verified end to end), restarts the node on the same
NVMe directory to show warm recovery, and prints `kvctl stats`.
"""

from __future__ import annotations

import random
import tempfile
import time
from typing import Annotated

import typer
from rich.console import Console

from kvstore.cli.common import friendly_errors

console = Console()


@friendly_errors
def demo(
    seed: Annotated[int, typer.Option(help="random seed for prompts and page bytes")] = 0,
    prompts: Annotated[int, typer.Option(help="number of prompts")] = 12,
) -> None:
    """Run the single-node demo: put, lookup, demote to NVMe, read back, restart, stats."""
    from kvstore.cli.launch import NodeProcess
    from kvstore.cli.stats import render_stats
    from kvstore.client import KVStoreClient
    from kvstore.hashing import prefix_hashes
    from kvstore.layout import DType, PageLayout
    from kvstore.pageformat import slot_bytes_for

    rng = random.Random(seed)
    # A small model's page: 4 layers x 2 x 16 tokens x 4 kv heads x 64 dims x fp16 = 64 KiB.
    layout = PageLayout(DType.FLOAT16, num_layers=4, num_kv_heads=4, head_dim=64, block_size=16)
    ns = "demo-llama-tiny/rev0/fp16/tp1"
    system = [rng.randrange(32000) for _ in range(4 * layout.block_size)]  # shared system prompt: 4 blocks
    convs = []
    for _ in range(prompts):
        turn1 = system + [rng.randrange(32000) for _ in range(rng.randrange(2, 6) * layout.block_size)]
        convs.append(turn1)
        convs.append(turn1 + [rng.randrange(32000) for _ in range(rng.randrange(1, 4) * layout.block_size)])

    def page_for(h: bytes) -> bytes:  # deterministic bytes per block so reads can be checked
        return random.Random(h).randbytes(layout.page_bytes)

    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as nvme:
        # DRAM holds 24 pages, NVMe 400: the workload (~250 distinct blocks) must spill to NVMe.
        slot = slot_bytes_for(layout.page_bytes)
        node = NodeProcess(
            dram_bytes=24 * slot,
            nvme_path=nvme,
            nvme_bytes=400 * slot,
            max_page_bytes=layout.page_bytes,
            node_id="demo",
        )
        console.rule("[bold]kvstore demo")
        console.print(f"layout: {layout.describe()}; namespace {ns!r}")
        node.start()
        try:
            console.print(f"node up on {node.addr} (DRAM 24 pages, NVMe 400 pages in {nvme})")
            with KVStoreClient(node.addr) as kv:
                total_new = total_hit = 0
                t0 = time.perf_counter()
                for i, tokens in enumerate(convs):
                    hashes = prefix_hashes(tokens, layout.block_size, ns)
                    hit = kv.lookup(ns, hashes)
                    got = kv.get(ns, hashes[:hit])
                    assert all(bytes(p) == page_for(h) for p, h in zip(got, hashes, strict=False))
                    r = kv.put(ns, layout, hashes[hit:], [page_for(h) for h in hashes[hit:]])
                    total_new += r.stored
                    total_hit += hit
                    if i < 6 or i == len(convs) - 1:
                        console.print(
                            f"request {i:2d}: {len(hashes):2d} blocks, cached prefix {hit:2d}, stored {r.stored}"
                        )
                dt = time.perf_counter() - t0
                console.print(f"{len(convs)} requests in {dt:.2f}s: {total_hit} blocks reused, {total_new} stored")
                console.rule("read everything back (forces promotions from NVMe)")
                served: dict[str, int] = {}
                for tokens in convs:
                    hashes = prefix_hashes(tokens, layout.block_size, ns)
                    for page in kv.get_pages(ns, hashes):
                        assert bytes(page.data) == page_for(page.hash), "page content mismatch"
                        served[page.tier.label] = served.get(page.tier.label, 0) + 1
                console.print(f"pages served per tier: {served} (all verified)")
                render_stats(kv.stats(), console)
            console.rule("restart on the same NVMe directory")
            node.stop()
            node.start()
            with KVStoreClient(node.addr) as kv:
                hashes = prefix_hashes(convs[-1], layout.block_size, ns)
                hit = kv.lookup(ns, hashes)
                pages = kv.get_pages(ns, hashes[:hit])
                ok = all(bytes(p.data) == page_for(p.hash) for p in pages)
                console.print(
                    f"after restart: last conversation matches {hit}/{len(hashes)} blocks, content verified: {ok}"
                )
                render_stats(kv.stats(), console)
        finally:
            node.close()
    console.rule("[bold green]demo finished")
