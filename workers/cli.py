"""`kvstore generate` and `kvstore pd-demo`, contributed to the `kvstore` CLI by this package
(entry-point group "kvstore.cli"), so kvstore itself never imports workers."""

from __future__ import annotations

import enum
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvstore.cli.common import friendly_errors

console = Console()

# A small model for the demo: big enough that prefill compute is visible on a CPU, small enough to
# start in seconds. Page = 4 layers x 2 x 16 tokens x 2 kv heads x 64 dims x fp32 = 64 KiB.
DEMO_SPEC = {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 2, "vocab": 1024, "seed": 1}

SYSTEM_PROMPTS = [
    "you are a careful assistant for a storage team. answer with short precise sentences. "
    "the cache keeps pages of keys and values in hbm, dram and nvme, and a prefix shared by many prompts "
    "is prefilled once per cluster. always say which tier a page came from and why it was there. ",
    "you are a travel planner. you know trains, ferries and mountain huts. ask for dates before booking, "
    "prefer night trains over flights, and never plan more than three changes in one day. list the "
    "stops in order and the time of each change, then the price range in euros. ",
    "you review python code for a team that values small pure functions, typed public interfaces and "
    "tests that assert behaviour. point out the one change that matters most first, then the rest in "
    "order of risk, and show a corrected snippet for each point you make. ",
]
USER_TURNS = [
    ["where did the last page come from?", "why was it not in dram?", "what would prefetch change?"],
    ["plan a trip from lyon to bergen in june.", "make it cheaper.", "add one night in a mountain hut."],
    ["review this: def f(x): return x and x[0]", "what about types?", "write the test you would add."],
    ["how does the router pick a worker?", "and when two workers hold the prefix?", "what if redis is down?"],
]


KV_ENCODING_HELP = "how the workers store KV pages: raw, or fp8 (e4m3 with per-head scales: half the bytes)"


class KVEncodingFlag(enum.StrEnum):
    """Values of `--kv-encoding` (kvstore generate, pd-demo, pd-serve) and of the chart's
    `workers.kvEncoding`: how a deployment's workers store pages (workers/page_codec.py)."""

    RAW = "raw"  # the model's KV bytes as they are (default)
    FP8 = "fp8"  # fp8-e4m3 with per-(layer, K/V, head) scales: half the bytes, within the fp8 bound


def _model_dir(model: Path | None, workdir: Path) -> Path:
    if model is not None:
        return model
    from workers.tiny import TinyLlamaSpec, make_tiny_llama

    d = workdir / "demo-llama"
    console.print(f"writing a small random-weight Llama checkpoint (HF format) to {d}")
    return make_tiny_llama(d, TinyLlamaSpec(**DEMO_SPEC), with_tokenizer=True)


@friendly_errors
# one parameter per CLI option (typer)
def generate(  # noqa: PLR0917
    model: Annotated[Path, typer.Option(help="Hugging Face checkpoint directory (config.json + safetensors)")],
    prompt: Annotated[str | None, typer.Option(help="text prompt (needs tokenizer.json in the model dir)")] = None,
    prompt_ids: Annotated[str | None, typer.Option(help="comma-separated token ids")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="tokens to generate")] = 16,
    block_size: Annotated[int, typer.Option(min=1, help="tokens per KV block / cache page")] = 16,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON: tokens and per-phase timings")] = False,
    kv_encoding: Annotated[KVEncodingFlag, typer.Option(help=KV_ENCODING_HELP)] = KVEncodingFlag.RAW,
) -> None:
    """Run one request through disaggregated prefill/decode on a local cluster (Redis, a cache node, Ray)."""
    from workers.runtime import LocalStack, StackConfig
    from workers.tokenizer import load_tokenizer

    if (prompt is None) == (prompt_ids is None):
        raise ValueError("give exactly one of --prompt and --prompt-ids")
    tok = load_tokenizer(model)
    if prompt_ids is not None:
        ids = [int(x) for x in prompt_ids.replace(" ", "").split(",") if x]
    else:
        if tok is None:
            raise ValueError(f"{model} has no tokenizer.json: use --prompt-ids")
        ids = tok.encode(prompt or "")
    with LocalStack(StackConfig(model_dir=str(model), block_size=block_size, kv_encoding=kv_encoding.value)) as stack:
        r = stack.generate("cli-0", ids, max_new_tokens)
    timings = {
        "lookup_s": r.prefill.lookup_s,
        "fetch_s": r.prefill.fetch_s,
        "prefill_s": r.prefill.compute_s,
        "put_s": r.prefill.put_s,
        "ttft_s": r.ttft_s,
        "decode_fetch_s": r.decode.fetch_s,
        "decode_s": r.total_s - r.ttft_s,
        "total_s": r.total_s,
    }
    if json_out:
        typer.echo(
            json.dumps(
                {
                    "prompt_ids": ids,
                    "tokens": r.tokens,
                    "logprobs": r.logprobs,
                    "cached_blocks": r.cached_blocks,
                    "timings": timings,
                    "text": tok.decode(r.tokens) if tok else None,
                }
            )
        )
        return
    console.print(f"prompt: {len(ids)} tokens, cached prefix {r.cached_blocks} blocks; tokens: {r.tokens}")
    if tok is not None:
        console.print(f"text: {tok.decode(r.tokens)!r}")
    console.print(" ".join(f"{k}={v * 1000:.1f}ms" for k, v in timings.items()))


@friendly_errors
def pd_demo(
    model: Annotated[Path | None, typer.Option(help="checkpoint dir (default: a small model made locally)")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 8,
    seed: Annotated[int, typer.Option()] = 0,
    kv_encoding: Annotated[KVEncodingFlag, typer.Option(help=KV_ENCODING_HELP)] = KVEncodingFlag.RAW,
) -> None:
    """The main job: Redis, a cache node and a local Ray cluster with a prefill and a decode worker serve a
    multi-turn chat workload whose conversations share system prompts; prints TTFT per request with the
    cached prefix, then the node's tier stats (hits from DRAM and from NVMe)."""
    from kvstore.cli.stats import render_stats
    from kvstore.client import KVStoreClient
    from kvstore.pageformat import slot_bytes_for
    from kvstore.security import redact_url
    from workers.runtime import LocalStack, StackConfig
    from workers.tokenizer import load_tokenizer

    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="kvstore-pd-demo-") as tmp:
        mdir = _model_dir(model, Path(tmp))
        tok = load_tokenizer(mdir)
        if tok is None:
            raise ValueError(f"{mdir} has no tokenizer.json")
        # DRAM for 24 pages and NVMe for 512: earlier conversations' pages are demoted to NVMe while
        # later ones run, so later turns hit both tiers.
        cfg = StackConfig(
            model_dir=str(mdir), block_size=16, num_blocks=2048, torch_threads=1, kv_encoding=kv_encoding.value
        )
        slot = slot_bytes_for(LocalStack.page_bytes(cfg))
        cfg.dram_bytes, cfg.nvme_bytes = 24 * slot, 512 * slot
        console.rule("[bold]kvstore: disaggregated prefill/decode through the cache")
        t0 = time.perf_counter()
        with LocalStack(cfg) as stack:
            redis = redact_url(stack.redis.url)  # type: ignore[union-attr]
            console.print(
                f"up in {time.perf_counter() - t0:.1f}s: redis {redis}, node {stack.node.addr}, "  # type: ignore[union-attr]
                f"Ray with 1 prefill + 1 decode worker; namespace {stack.namespace}"
            )
            table = Table(title="requests (greedy; random weights, so the text is noise)")
            for col in ("req", "conv", "sys", "prompt", "cached", "cached from", "TTFT ms", "compute", "fetch"):
                table.add_column(col, justify="right")
            history = {c: "" for c in range(len(USER_TURNS))}
            order = [(c, t) for t in range(3) for c in rng.sample(range(len(USER_TURNS)), len(USER_TURNS))]
            for n, (c, t) in enumerate(order):
                sys_id = c % len(SYSTEM_PROMPTS)
                history[c] += f"user: {USER_TURNS[c][t]} assistant: "
                ids = tok.encode(SYSTEM_PROMPTS[sys_id] + history[c])
                r = stack.generate(f"req-{n}", ids, max_new_tokens)
                history[c] += tok.decode(r.tokens) + " "
                src = " ".join(f"{k}:{v}" for k, v in sorted(r.cached_tiers.items())) or "-"
                table.add_row(
                    str(n),
                    f"{c}.{t}",
                    str(sys_id),
                    str(len(ids)),
                    str(r.cached_blocks * cfg.block_size),
                    src,
                    f"{r.ttft_s * 1000:.0f}",
                    f"{r.prefill.compute_s * 1000:.0f}",
                    f"{r.prefill.fetch_s * 1000:.0f}",
                )
            console.print(table)
            console.rule("kvctl stats (the cache node)")
            with KVStoreClient(stack.node.addr) as kv:  # type: ignore[union-attr]
                render_stats(kv.stats(), console)
        console.rule("[bold green]demo finished")
