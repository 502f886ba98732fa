"""What an encoded page costs in model quality: one prompt, its cached prefix through a page codec, against
the uncompressed path (benchmarks/fp8_quality.py, tests/integration/test_workers_fp8.py).

The path being measured is the serving path: a request whose prompt prefix comes from the cache gets the
prefix's pages (all full blocks but the one holding the last prompt token) as the codec returns them,
computes the rest of the prompt, then decodes greedily; the KV it computes itself stays unquantized.
The uncompressed path is the same with raw pages, which round-trip exactly (so it equals computing the
whole prompt).

Figures per prompt (N generated tokens):
- greedy agreement: the fraction of the N steps whose argmax, teacher-forced on the uncompressed path's
  tokens, is the uncompressed path's token (top-1 agreement), and the first step at which a free-running
  greedy decode over the encoded pages leaves the uncompressed tokens (N when it never does);
- |logit delta|: max and mean over the N steps and the vocabulary of |logits_encoded - logits_raw|,
  teacher-forced, with the uncompressed logits' own max |logit| and median top-2 margin for scale (a
  greedy call flips only where the delta reaches the margin).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.model import PagedLlama
from workers.page_codec import PageCodec


@dataclass(frozen=True, slots=True)
class Quality:
    prompt_tokens: int
    encoded_tokens: int  # prompt tokens whose KV came through the codec
    steps: int
    top1_agreement: float  # teacher-forced
    first_divergence: int  # free-running; == steps when the greedy tokens never differ
    max_abs_logit_delta: float
    mean_abs_logit_delta: float
    max_abs_logit: float  # of the uncompressed path, for scale
    median_top2_margin: float  # of the uncompressed path: how close its greedy calls are
    raw_tokens: tuple[int, ...]
    encoded_tokens_generated: tuple[int, ...]


@torch.no_grad()
def prefix_pages(model: PagedLlama, prompt: Sequence[int]) -> torch.Tensor:
    """Pages of the prompt's full blocks but the last token's, computed from scratch (as a prefill that
    stored them would have): `[k, *page_shape]`, k = (len(prompt) - 1) // block_size."""
    k = (len(prompt) - 1) // model.block_size
    if k == 0:
        return torch.empty((0, *model.page_layout().page_shape), dtype=model.dtype, device=model.device)
    seq = "__kv_quality/prefix"
    try:
        model.prefill(seq, list(prompt[: k * model.block_size]))
        return model.export_pages(seq, list(range(k)))
    finally:
        model.free(seq)


def through(codec: PageCodec, pages: torch.Tensor) -> torch.Tensor:
    """The pages as a fetch returns them after a Put through `codec`."""
    return codec.decode_tensor(codec.encode(pages).to(pages.device))


@torch.no_grad()
def teacher_forced_logits(model: PagedLlama, prompt: Sequence[int], pages: torch.Tensor,
                          tokens: Sequence[int]) -> torch.Tensor:  # fmt: skip
    """fp32 [len(tokens), vocab]: logits at each generated position, fed `tokens` (not its own choices)."""
    seq = "__kv_quality/forced"
    n = pages.shape[0] * model.block_size
    rows = []
    try:
        if pages.shape[0]:
            model.import_pages(seq, pages)
        logits = model.prefill(seq, list(prompt[n:]), start_pos=n)
        for i, t in enumerate(tokens):
            rows.append(logits.float().reshape(-1))
            if i < len(tokens) - 1:
                logits = model.decode([seq], [t])[0]
    finally:
        model.free(seq)
    return torch.stack(rows)


@torch.no_grad()
def measure(model: PagedLlama, codec: PageCodec, prompt: Sequence[int], steps: int) -> Quality:
    """The figures of the module docstring for one prompt."""
    pages = prefix_pages(model, prompt)
    raw = model.greedy_generate(list(prompt), steps, prefix_pages=pages, return_logits=True)
    assert raw.logits is not None
    raw_logits = raw.logits.float().reshape(len(raw.tokens), -1)
    encoded = through(codec, pages)
    forced = teacher_forced_logits(model, prompt, encoded, raw.tokens)
    free = model.greedy_generate(list(prompt), steps, prefix_pages=encoded).tokens
    diverge = next((i for i, (a, b) in enumerate(zip(raw.tokens, free, strict=True)) if a != b), len(raw.tokens))
    delta = (forced - raw_logits).abs()
    top2 = torch.topk(raw_logits, 2, dim=-1).values
    agree = (forced.argmax(-1) == torch.tensor(raw.tokens, device=forced.device)).float().mean()
    return Quality(
        prompt_tokens=len(prompt), encoded_tokens=pages.shape[0] * model.block_size, steps=len(raw.tokens),
        top1_agreement=float(agree), first_divergence=diverge, max_abs_logit_delta=float(delta.max()),
        mean_abs_logit_delta=float(delta.mean()), max_abs_logit=float(raw_logits.abs().max()),
        median_top2_margin=float(top2[:, 0].sub(top2[:, 1]).median()),
        raw_tokens=tuple(raw.tokens), encoded_tokens_generated=tuple(free),
    )  # fmt: skip
