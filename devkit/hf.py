"""transformers as the outside oracle for the workers' model (tests only; transformers is a dev dependency).

`make_tiny_llama(..., writer=CheckpointWriter.TRANSFORMERS)` builds `LlamaForCausalLM` and calls
`save_pretrained` (the format's authority); `CheckpointWriter.SAFETENSORS` delegates to
`workers.tiny.make_tiny_llama`, which writes the same files with safetensors alone. `load_hf_oracle` and
`hf_reference_logits` give transformers' own logits to compare against.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from workers import tiny
from workers.tiny import TinyLlamaSpec, randomize

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

__all__ = [
    "LLAMA3_SCALING",
    "ORACLE_CASES",
    "CheckpointWriter",
    "OracleCase",
    "TinyLlamaSpec",
    "hf_reference_logits",
    "load_hf_oracle",
    "make_tiny_llama",
    "top2_margin",
]


class CheckpointWriter(enum.Enum):
    TRANSFORMERS = "transformers"  # LlamaForCausalLM(...).save_pretrained: needs transformers
    SAFETENSORS = "safetensors"  # config.json + safetensors files written directly (workers.tiny)


def make_tiny_llama(
    directory: str | Path,
    spec: TinyLlamaSpec | None = None,
    *,
    shard_bytes: int | None = None,
    with_tokenizer: bool = False,
    writer: CheckpointWriter = CheckpointWriter.TRANSFORMERS,
) -> Path:
    """`workers.tiny.make_tiny_llama`, with the choice of writer; both write the same weights."""
    if writer is CheckpointWriter.SAFETENSORS:
        return tiny.make_tiny_llama(directory, spec, shard_bytes=shard_bytes, with_tokenizer=with_tokenizer)
    spec = spec or TinyLlamaSpec()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    model = _build_hf_llama(spec)
    model.save_pretrained(d, max_shard_size=shard_bytes if shard_bytes is not None else "50GB")
    if with_tokenizer:
        tiny.make_tiny_tokenizer(spec.vocab).save(str(d / tiny.TOKENIZER_FILE))
    return d


def _build_hf_llama(spec: TinyLlamaSpec) -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    raw = spec.hf_config()
    for key in ("architectures", "model_type"):
        raw.pop(key)
    # transformers initializes from the global generator: seed it inside a fork so that the caller's
    # random state is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(LlamaConfig(**raw)).eval()
    with torch.no_grad():
        params = dict(model.named_parameters())
        randomize(params, spec.init_std, torch.Generator().manual_seed(spec.seed + 1))
    return model


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small on purpose: with a 64-token pretraining context, head_dim 32's wavelengths (6.3 .. 5600
    # positions) fall in all three bands: kept (< 16), smoothed (16 .. 64), divided by factor (> 64).
    "original_max_position_embeddings": 64,
}


@dataclass(frozen=True, slots=True)
class OracleCase:
    """A checkpoint shape of the transformers oracle tests (tests/workers/test_model_oracle.py), also the
    shapes benchmarks/fp8_quality.py measures on."""

    name: str
    spec: TinyLlamaSpec
    block_size: int
    prompt_len: int
    shard_bytes: int | None = None


ORACLE_CASES = [
    OracleCase("gqa-untied-b4", TinyLlamaSpec(hidden=64, layers=2, heads=4, kv_heads=2, vocab=512, seed=1), 4, 13),
    OracleCase(
        "mha-tied-theta5e5-b8",
        TinyLlamaSpec(hidden=128, layers=3, heads=4, kv_heads=4, vocab=1000, tie=True, rope_theta=500000.0, seed=2),
        8,
        21,
    ),
    OracleCase(
        "gqa4-attnbias-sharded-b16",
        TinyLlamaSpec(hidden=128, layers=2, heads=8, kv_heads=2, vocab=256, attention_bias=True, seed=3),
        16,
        37,
        shard_bytes=48_000,
    ),
    OracleCase(
        "mqa-llama3-headdim32-mlpbias-b8",
        TinyLlamaSpec(
            hidden=64,
            layers=2,
            heads=4,
            kv_heads=1,
            head_dim=32,
            vocab=300,
            mlp_bias=True,
            rope_scaling=LLAMA3_SCALING,
            seed=4,
        ),
        8,
        30,
    ),
]


def load_hf_oracle(directory: str | Path) -> LlamaForCausalLM:
    """transformers' own LlamaForCausalLM from the checkpoint, fp32, eval mode, eager attention."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_reference_logits(model: LlamaForCausalLM, prompt: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
    """fp32 [len(generated), vocab]: the oracle's logits for each generated position, teacher-forced.

    One causal forward over prompt + generated[:-1] (no KV cache): row i is the distribution that
    generated[i] should be the argmax of under greedy decoding. If every row's argmax equals
    generated[i], the oracle's own greedy run produces exactly `generated`.
    """
    ids = list(prompt) + list(generated[:-1])
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False).logits[0].float()
    start = len(prompt) - 1
    return out[start : start + len(generated)]


def top2_margin(logits: torch.Tensor) -> float:
    """Smallest gap between the best and second-best logit over rows: how clear-cut greedy choices are."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min()) if top.numel() else math.inf
