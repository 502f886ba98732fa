"""What fp8-e4m3 pages buy: bytes per token, hit rate at equal budgets, TTFT on a full hit (DESIGN.md §4.1, §13).

Three parts, raw pages as the reference in the same run:

bytes     per model shape (block 16): the page payload (what a hit moves) and the node slot it takes
          (4 KiB header + payload rounded to 4 KiB: what a tier budget pays), per token, raw vs fp8.
hits      the workload suite (devkit/workloads.py: chat, rag, agent, batch, tenants; --suite full|smoke),
          replayed through the simulated tiered cache (devkit/sim.py: the node's default policy,
          `adaptive`, with admission) with DRAM and NVMe budgets in BYTES: --dram-share and --nvme-share
          of each workload's working set (blocks referenced at least twice) stored as raw pages of
          --hits-model. Each tier holds budget // slot pages, raw or fp8: equal bytes, about twice the
          fp8 pages. Reported: prefix hit rate (the prefill saved) and the share served by each tier.
ttft      a local P/D stack (redis-server, one cache node, Ray with one prefill and one decode worker)
          per encoding, one after the other in this run, on a random-weight Llama (hidden 512, 8 layers,
          8 heads / 2 KV heads, head_dim 64, --dtype, block 16, CPU). Per prompt length: a warm request
          stores the prompt's pages, then the measured request (max_new_tokens 1) finds every usable
          block cached (a full hit): TTFT = router arrival to first token; fetch = the prefill's page
          fetch and decode (dequantize) time; moved = the node's bytes out during the measured
          requests over the tokens they fetched. Median of --reps. The 0%-cached TTFT of the raw
          stack is the recompute reference.

Writes benchmarks/out/fp8_economics.{json,md}.

Run:  .venv/bin/python benchmarks/fp8_economics.py [--parts bytes,hits,ttft] [--suite full]
          [--dram-share 0.02 --nvme-share 0.1] [--lengths 512,2048] [--reps 3] [--dtype bfloat16] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from machine import machine_line, save_results

from devkit.sim import TierSpec, replay_policy
from devkit.workloads import suite
from kvstore.layout import DType, PageEncoding, PageLayout
from kvstore.pageformat import slot_bytes_for

BLOCK = 16
SHAPES = {  # name -> (dtype, layers, kv heads, head dim): KV shapes per tensor-parallel rank
    "Llama-3.1-8B bf16": (DType.BFLOAT16, 32, 8, 128),
    "Llama-3.1-70B bf16 TP8": (DType.BFLOAT16, 80, 1, 128),
    "SmolLM2-135M bf16": (DType.BFLOAT16, 30, 3, 64),
    "ttft model fp32": (DType.FLOAT32, 8, 2, 64),
}
ENCODINGS = (PageEncoding.RAW, PageEncoding.FP8_E4M3)


def layouts(shape: str) -> dict[PageEncoding, PageLayout]:
    dtype, layers, heads, dim = SHAPES[shape]
    raw = PageLayout(dtype, layers, heads, dim, BLOCK)
    return {e: raw.with_encoding(e) for e in ENCODINGS}


def bytes_part() -> tuple[list[dict[str, object]], list[str]]:
    rows = []
    for shape in SHAPES:
        ls = layouts(shape)
        r, f = ls[PageEncoding.RAW], ls[PageEncoding.FP8_E4M3]
        rows.append({
            "shape": shape, "raw_page": r.page_bytes, "fp8_page": f.page_bytes,
            "raw_slot": slot_bytes_for(r.page_bytes), "fp8_slot": slot_bytes_for(f.page_bytes),
        })  # fmt: skip
    lines = ["| model shape (block 16) | raw moved B/token | fp8 moved B/token | moved ratio | raw stored B/token "
             "| fp8 stored B/token | stored ratio |", "|---|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
    for x in rows:
        rm, fm, rs, fs = (x[k] / BLOCK for k in ("raw_page", "fp8_page", "raw_slot", "fp8_slot"))  # type: ignore[operator]
        lines.append(
            f"| {x['shape']} | {rm:,.0f} | {fm:,.0f} | {fm / rm:.3f} | {rs:,.0f} | {fs:,.0f} | {fs / rs:.3f} |"
        )
    return rows, lines


def hits_part(size: str, shape: str, dram_share: float, nvme_share: float) -> tuple[list[dict[str, object]], list[str]]:
    ls = layouts(shape)
    slots = {e: slot_bytes_for(ls[e].page_bytes) for e in ENCODINGS}
    rows = []
    for name, requests in suite(size).items():
        refs = Counter(b for r in requests for b in r)
        working = sum(1 for c in refs.values() if c >= 2)
        budgets = (dram_share * working * slots[PageEncoding.RAW], nvme_share * working * slots[PageEncoding.RAW])
        for enc in ENCODINGS:
            dram, nvme = (max(1, int(b // slots[enc])) for b in budgets)
            res, _ = replay_policy(requests, (TierSpec("dram", dram), TierSpec("nvme", nvme)), "adaptive")
            tiers = res.tier_rates()
            rows.append({
                "workload": name, "encoding": enc.label, "working_set_blocks": working, "dram_bytes": budgets[0],
                "nvme_bytes": budgets[1], "dram_pages": dram, "nvme_pages": nvme, "prefix_hit": res.prefix_hit_rate,
                "dram_prefix_hit": tiers["dram"][1], "nvme_prefix_hit": tiers["nvme"][1], "blocks": res.blocks,
            })  # fmt: skip
            print(f"{name:8s} {enc.label:9s} dram {dram:6d} + nvme {nvme:6d} pages: prefix hit {res.prefix_hit_rate:.3f} "
                  f"(dram {tiers['dram'][1]:.3f}, nvme {tiers['nvme'][1]:.3f})", flush=True)  # fmt: skip
    lines = ["| workload | working set (blocks) | DRAM / NVMe budget | encoding | pages DRAM + NVMe | prefix hit rate "
             "| from DRAM | from NVMe | fp8 / raw |", "|---|--:|--:|---|--:|--:|--:|--:|--:|"]  # fmt: skip
    for raw, fp8 in zip(rows[::2], rows[1::2], strict=True):
        for x in (raw, fp8):
            gain = f"{fp8['prefix_hit'] / raw['prefix_hit']:.2f}x" if x is fp8 and raw["prefix_hit"] else ""  # type: ignore[operator]
            lines.append(
                f"| {x['workload']} | {x['working_set_blocks']:,} | {x['dram_bytes'] / 2**30:.2f} / "  # type: ignore[operator]
                f"{x['nvme_bytes'] / 2**30:.2f} GiB | {x['encoding']} | {x['dram_pages']:,} + {x['nvme_pages']:,} "
                f"| {x['prefix_hit']:.3f} | {x['dram_prefix_hit']:.3f} | {x['nvme_prefix_hit']:.3f} | {gain} |"
            )
    return rows, lines


def ttft_part(lengths: list[int], reps: int, dtype: str, quick: bool) -> tuple[list[dict[str, object]], list[str]]:
    from kvstore.client import KVStoreClient
    from workers.runtime import LocalStack, StackConfig
    from workers.tiny import TinyLlamaSpec, make_tiny_llama

    hidden, layers = (64, 2) if quick else (512, 8)
    spec = TinyLlamaSpec(hidden=hidden, layers=layers, heads=8, kv_heads=2, vocab=1024, seed=7,
                         max_position_embeddings=max(lengths) + 64)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvstore-fp8e-") as tmp:
        mdir = make_tiny_llama(Path(tmp) / "bench-llama", spec)
        for enc in ("raw", "fp8"):
            rng = random.Random(0)  # the same prompts for both encodings
            cfg = StackConfig(model_dir=str(mdir), block_size=BLOCK, num_blocks=max(lengths) // BLOCK + 16,
                              run_dir=str(Path(tmp) / f"run-{enc}"), nvme_bytes=0, dtype=dtype, kv_encoding=enc)  # fmt: skip
            page = LocalStack.page_bytes(cfg)
            total_blocks = sum((n // BLOCK + 1) * (reps + 1) * 2 for n in lengths)
            cfg.dram_bytes = (total_blocks + 64) * slot_bytes_for(page)  # everything stays in DRAM
            with LocalStack(cfg) as stack:
                warm = [rng.randrange(3, 1024) for _ in range(2 * BLOCK + 1)]
                for i in range(2):  # the second one fetches: both workers have run the decode path once
                    stack.generate(f"warmup-{i}", warm, 1)
                for n in lengths:
                    recompute = []
                    if enc == "raw":
                        for r in range(reps):
                            res = stack.generate(f"cold-{n}-{r}", [rng.randrange(3, 1024) for _ in range(n)], 1)
                            recompute.append(res.ttft_s)
                    prompts = [[rng.randrange(3, 1024) for _ in range(n)] for _ in range(reps)]
                    for r, p in enumerate(prompts):
                        stack.generate(f"warm-{n}-{r}", p, 1)
                    with KVStoreClient(stack.node.addr) as kv:  # type: ignore[union-attr]
                        before = sum(t.counters.bytes_out for t in kv.stats().tiers)
                    runs = [stack.generate(f"hit-{n}-{r}", p, 1) for r, p in enumerate(prompts)]
                    with KVStoreClient(stack.node.addr) as kv:  # type: ignore[union-attr]
                        moved = sum(t.counters.bytes_out for t in kv.stats().tiers) - before
                    # A measured request's pages are read twice: by its prefill and by its decode worker.
                    fetched_tokens = sum((x.cached_blocks + x.decode_fetched_blocks) * BLOCK for x in runs)
                    row = {
                        "encoding": enc, "prompt_tokens": n, "page_bytes": page,
                        "cached_tokens": statistics.median(x.cached_blocks * BLOCK for x in runs),
                        "ttft_ms": statistics.median(x.ttft_s for x in runs) * 1e3,
                        "ttft_runs_ms": [x.ttft_s * 1e3 for x in runs],
                        "fetch_ms": statistics.median(x.prefill.fetch_s for x in runs) * 1e3,
                        "compute_ms": statistics.median(x.prefill.compute_s for x in runs) * 1e3,
                        "moved_bytes_per_token": moved / max(fetched_tokens, 1),
                        "recompute_ttft_ms": statistics.median(recompute) * 1e3 if recompute else None,
                    }  # fmt: skip
                    rows.append(row)
                    print(f"{enc:4s} {n:5d} tokens, full hit: TTFT {row['ttft_ms']:7.1f} ms (fetch {row['fetch_ms']:.1f}, "
                          f"compute {row['compute_ms']:.1f}); moved {row['moved_bytes_per_token']:.0f} B/token", flush=True)  # fmt: skip
    raw_by_len = {r["prompt_tokens"]: r for r in rows if r["encoding"] == "raw"}
    lines = ["| prompt tokens | encoding | page B | cached tokens | TTFT ms (full hit) | fetch ms | compute ms "
             "| moved B/token | TTFT vs raw | raw recompute TTFT ms |", "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
    for r in sorted(rows, key=lambda x: (x["prompt_tokens"], x["encoding"] != "raw")):  # type: ignore[arg-type,return-value]
        base = raw_by_len[r["prompt_tokens"]]
        rec = f"{base['recompute_ttft_ms']:.1f}" if r is base and base["recompute_ttft_ms"] else ""
        lines.append(
            f"| {r['prompt_tokens']} | {r['encoding']} | {r['page_bytes']:,} | {r['cached_tokens']:.0f} | {r['ttft_ms']:.1f} "
            f"| {r['fetch_ms']:.1f} | {r['compute_ms']:.1f} | {r['moved_bytes_per_token']:,.0f} "
            f"| {r['ttft_ms'] / base['ttft_ms']:.2f}x | {rec} |"  # type: ignore[operator]
        )
    return rows, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="bytes,hits,ttft")
    ap.add_argument("--suite", default="full", choices=["full", "smoke"])
    ap.add_argument("--hits-model", default="Llama-3.1-8B bf16", choices=list(SHAPES))
    ap.add_argument("--dram-share", type=float, default=0.02, help="DRAM budget: share of the working set as raw pages")
    ap.add_argument("--nvme-share", type=float, default=0.10, help="NVMe budget: share of the working set as raw pages")
    ap.add_argument("--lengths", default="512,2048", help="TTFT prompt lengths")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", help="the TTFT model's dtype (engines hold bf16 KV)")
    ap.add_argument("--quick", action="store_true", help="smoke run: smoke suite, a tiny TTFT model, 1 rep")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    lengths = [64, 128] if args.quick else [int(x) for x in args.lengths.split(",")]
    reps = 1 if args.quick else args.reps
    size = "smoke" if args.quick else args.suite
    t0 = time.perf_counter()
    md = [machine_line()]
    payload: dict[str, object] = {}
    if "bytes" in parts:
        payload["bytes"], lines = bytes_part()
        md += ["", "Bytes per token (payload = what a hit moves; slot = what a tier budget pays):", "", *lines]
    if "hits" in parts:
        payload["hits"], lines = hits_part(size, args.hits_model, args.dram_share, args.nvme_share)
        md += ["", f"Hit rate at equal budgets: suite `{size}`, pages of {args.hits_model}, DRAM {args.dram_share:.0%} "
               f"+ NVMe {args.nvme_share:.0%} of each working set as raw pages, policy `adaptive`:", "", *lines]  # fmt: skip
    if "ttft" in parts:
        payload["ttft"], lines = ttft_part(lengths, reps, args.dtype, args.quick)
        md += ["", f"TTFT on a full hit through P/D ({args.dtype} random-weight Llama, block {BLOCK}, CPU; "
               f"median of {reps}):", "", *lines]  # fmt: skip
    wall = time.perf_counter() - t0
    md.insert(1, f"- wall {wall:.0f} s")
    save_results(args.out, "fp8_economics", "\n".join(md), args, wall_s=wall, **payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
