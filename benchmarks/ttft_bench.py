"""TTFT benchmark: time to first token through disaggregated prefill/decode, by cached-prefix share.

Method: a local stack (redis-server, one cache node with DRAM large enough to keep every page in DRAM,
local Ray with one prefill and one decode worker) serves a Llama-shaped random-weight model (default:
hidden 512, 8 layers, 8 heads / 2 KV heads, 64 KiB pages of 16 tokens, fp32 on CPU). For each prompt
length and cached share f, a fresh random prompt is used; a warm-up request for its first f of the
tokens puts those pages in the cache, then the measured request (max_new_tokens=1) runs the full
prompt. TTFT = router arrival to first token (prefill's lookup + page fetch + compute of the uncached
part; the put of new pages happens after the first token). Reported: median over repetitions, the
per-phase split, and the ratio to the 0%-cached TTFT of the same length (the recompute baseline
measured in the same run). Target (DESIGN.md §13, CPU): a full-prefix hit at 2048 tokens in <= 0.2x the
recompute TTFT.

Writes benchmarks/out/ttft_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from machine import machine_line

from workers.runtime import LocalStack, StackConfig
from workers.tiny import TinyLlamaSpec, make_tiny_llama

BLOCK = 16


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="512,2048,4096", help="prompt lengths in tokens")
    ap.add_argument("--cached", default="0,0.5,1", help="cached shares of the prompt")
    ap.add_argument("--reps", type=int, default=3, help="measured requests per cell (median)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, 128/256 tokens, 1 rep")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    lengths = [128, 256] if args.quick else [int(x) for x in args.lengths.split(",")]
    shares = [float(x) for x in args.cached.split(",")]
    reps = 1 if args.quick else args.reps
    hidden, layers = (64, 2) if args.quick else (args.hidden, args.layers)
    spec = TinyLlamaSpec(hidden=hidden, layers=layers, heads=8, kv_heads=2, vocab=1024, seed=7,
                         max_position_embeddings=max(lengths) + 64)  # fmt: skip
    rng = random.Random(0)
    rows = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstore-ttft-") as tmp:
        mdir = make_tiny_llama(Path(tmp) / "bench-llama", spec)
        total_blocks = sum(((n // BLOCK) + 1) * (reps + 1) * len(shares) for n in lengths)
        cfg = StackConfig(model_dir=str(mdir), block_size=BLOCK, num_blocks=max(lengths) // BLOCK + 16,
                          run_dir=str(Path(tmp) / "run"), nvme_bytes=0)  # fmt: skip
        page = LocalStack.page_bytes(cfg)
        cfg.dram_bytes = (total_blocks + 64) * (page + 8192)  # everything stays in DRAM
        with LocalStack(cfg) as stack:
            stack.generate("warmup", [rng.randrange(3, 1024) for _ in range(BLOCK + 1)], 1)
            for n in lengths:
                base = None
                for f in shares:
                    ttft, phases, cached = [], [], []
                    for r in range(reps):
                        prompt = [rng.randrange(3, 1024) for _ in range(n)]
                        k = int(n * f)
                        if k >= BLOCK:  # put the first k tokens' full blocks in the cache
                            stack.generate(f"warm-{n}-{f}-{r}", prompt[: k if k < n else n], 1)
                        res = stack.generate(f"ttft-{n}-{f}-{r}", prompt, 1)
                        ttft.append(res.ttft_s)
                        phases.append(res.prefill)
                        cached.append(res.cached_blocks * BLOCK)
                    med = statistics.median(ttft)
                    if f == 0:
                        base = med
                    row = {
                        "prompt_tokens": n, "cached_share": f, "cached_tokens": statistics.median(cached),
                        "ttft_ms": med * 1e3, "ttft_runs_ms": [x * 1e3 for x in ttft],
                        "lookup_ms": statistics.median(p.lookup_s for p in phases) * 1e3,
                        "fetch_ms": statistics.median(p.fetch_s for p in phases) * 1e3,
                        "compute_ms": statistics.median(p.compute_s for p in phases) * 1e3,
                        "ratio_to_recompute": med / base if base else None,
                    }  # fmt: skip
                    rows.append(row)
                    print(f"{n:5d} tokens, {f:4.0%} cached: TTFT {row['ttft_ms']:8.1f} ms "
                          f"(lookup {row['lookup_ms']:.1f}, fetch {row['fetch_ms']:.1f}, compute {row['compute_ms']:.1f})"
                          + (f"  = {row['ratio_to_recompute']:.3f}x recompute" if row["ratio_to_recompute"] else ""),
                          flush=True)  # fmt: skip
    wall = time.perf_counter() - t_start
    lines = [
        machine_line(),
        f"- Model: random-weight Llama, hidden {hidden}, {layers} layers, 8 heads / 2 KV heads, fp32 on CPU; "
        f"block {BLOCK} tokens, page {page // 1024} KiB; {reps} rep(s) per cell, median; wall {wall:.0f} s",
        "", "| prompt tokens | cached | cached tokens | TTFT ms | lookup ms | fetch ms | compute ms | vs recompute |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]  # fmt: skip
    for r in rows:
        ratio = f"{r['ratio_to_recompute']:.3f}x" if r["ratio_to_recompute"] else "1 (baseline)"
        lines.append(f"| {r['prompt_tokens']} | {r['cached_share']:.0%} | {r['cached_tokens']:.0f} | {r['ttft_ms']:.1f} | "
                     f"{r['lookup_ms']:.1f} | {r['fetch_ms']:.1f} | {r['compute_ms']:.1f} | {ratio} |")  # fmt: skip
    md = "\n".join(lines)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ttft_bench.md").write_text(md + "\n")
    (args.out / "ttft_bench.json").write_text(json.dumps({"rows": rows, "wall_s": wall}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
