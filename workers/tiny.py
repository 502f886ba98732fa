"""Tiny random Llama checkpoints for the demo (and tests).

`make_tiny_llama(dir, TinyLlamaSpec(...))` writes a Hugging Face checkpoint directory (config.json,
safetensors weights, sharded on request, optionally a `tokenizer.json`) that both `workers.loader` and
`transformers.LlamaForCausalLM.from_pretrained` read, with safetensors alone (the `workers` extra is
enough). `devkit.hf` writes the same checkpoints through transformers' own `save_pretrained`, the
format's authority, and holds the transformers oracle the tests compare against.

Weights are random but not degenerate: linear and embedding weights are N(0, init_std) and, unlike
transformers' own init, RMSNorm weights are U(0.5, 1.5) and biases N(0, init_std), so a loader that
dropped a norm or a bias would be caught. `init_std` is large enough (0.1) that greedy choices are
clear-cut: the top two logits differ by far more than fp32 rounding, so greedy tokens are a stable
thing to compare.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from workers.loader import CONFIG_FILE, INDEX_FILE, parameter_shapes
from workers.model import ModelConfig
from workers.tokenizer import TOKENIZER_FILE

if TYPE_CHECKING:
    import tokenizers

__all__ = ["TOKENIZER_SENTENCES", "TinyLlamaSpec", "make_tiny_llama", "make_tiny_tokenizer", "randomize"]

BOS_ID, EOS_ID = 1, 2
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the Llama convention, matching the config
BYTE_ALPHABET = 256  # a byte-level BPE starts from every byte, so it can encode any text

TOKENIZER_SENTENCES = (
    "a prefix shared by many prompts is prefilled once per cluster",
    "the cache keeps pages of keys and values in hbm, dram and nvme",
    "a page holds the keys and values of one block for all layers",
    "the router sends a request to the worker with the longest cached prefix",
    "hello world, this is a tiny llama that knows nothing at all",
    "tokens are hashed block by block into a chain of keys",
)


@dataclass(frozen=True, slots=True)
class TinyLlamaSpec:
    """Shape and seed of a tiny random Llama. `rope_scaling` is an HF rope dict, e.g. llama3's."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    intermediate: int | None = None  # None: 2 * hidden
    head_dim: int | None = None  # None: hidden // heads
    tie: bool = False
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = field(default=None, hash=False)
    attention_bias: bool = False
    mlp_bias: bool = False
    init_std: float = 0.1
    seed: int = 0
    max_position_embeddings: int = 2048

    def hf_config(self) -> dict[str, Any]:
        """The `config.json` contents (transformers 5 form: RoPE under `rope_parameters`)."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope |= dict(self.rope_scaling)
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate or 2 * self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim or self.hidden // self.heads,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "initializer_range": self.init_std,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "dtype": "float32",
        }


def make_tiny_llama(
    directory: str | Path,
    spec: TinyLlamaSpec | None = None,
    *,
    shard_bytes: int | None = None,
    with_tokenizer: bool = False,
) -> Path:
    """Write a random Llama checkpoint into `directory` (created if needed); returns it as a Path.

    shard_bytes: split the weights into safetensors shards of about this many bytes, with
        `model.safetensors.index.json` (None: one `model.safetensors`).
    with_tokenizer: also write a byte-level BPE `tokenizer.json` trained on TOKENIZER_SENTENCES
        (needs vocab > 259: 256 bytes + 3 special tokens).
    Deterministic in `spec`: the same arguments write the same weights.
    """
    spec = spec or TinyLlamaSpec()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _write_safetensors(d, spec, shard_bytes)
    if with_tokenizer:
        make_tiny_tokenizer(spec.vocab).save(str(d / TOKENIZER_FILE))
    return d


def make_tiny_tokenizer(vocab_size: int, sentences: Sequence[str] = TOKENIZER_SENTENCES) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer with at most `vocab_size` ids; `<unk>`, `<s>`, `</s>` are ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    floor = BYTE_ALPHABET + len(SPECIAL_TOKENS)
    if vocab_size <= floor:
        raise ValueError(f"a byte-level tokenizer needs vocab_size > {floor}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(sentences), trainer)
    return tok


# ---------------------------------------------------------------------------------------- writers


def randomize(tensors: Mapping[str, torch.Tensor], std: float, generator: torch.Generator) -> None:
    """In place: norm weights U(0.5, 1.5), biases N(0, std); the rest is left as it is."""
    for name in sorted(tensors):  # sorted: the draw order, hence the weights, do not depend on dict order
        t = tensors[name]
        if name.endswith("norm.weight"):
            t.copy_(torch.rand(t.shape, generator=generator) + 0.5)
        elif name.endswith(".bias"):
            t.copy_(torch.randn(t.shape, generator=generator) * std)


def _write_safetensors(d: Path, spec: TinyLlamaSpec, shard_bytes: int | None) -> None:
    from safetensors.torch import save_file

    raw = spec.hf_config()
    shapes = parameter_shapes(ModelConfig.from_hf(raw))
    gen = torch.Generator().manual_seed(spec.seed)
    tensors = {name: torch.randn(shape, generator=gen) * spec.init_std for name, shape in sorted(shapes.items())}
    randomize(tensors, spec.init_std, torch.Generator().manual_seed(spec.seed + 1))
    (d / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    metadata = {"format": "pt"}
    if shard_bytes is None:
        save_file(tensors, str(d / "model.safetensors"), metadata=metadata)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(d / file), metadata=metadata)
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
