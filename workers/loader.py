"""Load a Llama-family model from a Hugging Face checkpoint directory.

A checkpoint directory holds `config.json`, the weights as `*.safetensors` (one file, or shards listed
in `model.safetensors.index.json` under `weight_map`), and optionally `tokenizer.json`. Only the
safetensors format is read (no pickled `*.bin`): it is a plain header plus raw tensor bytes, so loading
executes nothing from the checkpoint.

Every error is a CheckpointError (a ValueError) naming the file or tensor at fault, raised before the
model is built: missing and unexpected tensors are listed, shapes are checked against the config before
any tensor is read. A model type, activation or RoPE kind that `workers.model` does not compute raises
UnsupportedModelError.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from workers.model import CacheConfig, LayerWeights, ModelConfig, ModelWeights, PagedLlama
from workers.tokenizer import TextTokenizer, load_tokenizer

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "Checkpoint",
    "CheckpointError",
    "default_dtype",
    "load_checkpoint",
    "load_model",
    "load_weights",
    "parameter_shapes",
    "read_config",
    "read_config_dict",
    "tensor_files",
]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LIST_AT_MOST = 8  # names shown in an error message; the count says how many more

# Tensors some checkpoints carry that are not weights (older transformers saved RoPE buffers).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# HF name within a layer -> LayerWeights field.
_LAYER_FIELDS = {
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "post_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.bias": "o_bias",
    "mlp.gate_proj.bias": "gate_bias",
    "mlp.up_proj.bias": "up_bias",
    "mlp.down_proj.bias": "down_bias",
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as it is: the message names the file or tensor."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint: the model, and its tokenizer when the directory has `tokenizer.json`."""

    model: PagedLlama
    tokenizer: TextTokenizer | None
    directory: Path


# ---------------------------------------------------------------------------------------- config


def read_config_dict(directory: str | Path) -> dict[str, Any]:
    """The raw `config.json` of a checkpoint directory."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {d} does not exist or is not a directory")
    path = d / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{d} is not a Hugging Face checkpoint: it has no {CONFIG_FILE}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def read_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (UnsupportedModelError for a model we do not compute)."""
    return _parse_config(read_config_dict(directory), Path(directory))


def _parse_config(raw: Mapping[str, Any], directory: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf(raw)
    except ValueError as e:
        raise CheckpointError(f"{directory / CONFIG_FILE}: {e}") from e


def default_dtype(raw_config: Mapping[str, Any], device: torch.device) -> torch.dtype:
    """float32 on CPU (exact and fast enough there); on an accelerator the checkpoint's own half dtype.

    A checkpoint that declares float32 or nothing runs in bfloat16 on an accelerator.
    """
    if device.type == "cpu":
        return torch.float32
    declared = raw_config.get("dtype") or raw_config.get("torch_dtype")
    by_name = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    return by_name.get(str(declared), torch.bfloat16)


# ---------------------------------------------------------------------------------------- tensors


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must hold: HF name -> shape (linear weights [out, in])."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_out = config.num_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_out, hidden),
            p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_out),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
                p + "self_attn.o_proj.bias": (hidden,),
            }
        if config.mlp_bias:
            shapes |= {
                p + "mlp.gate_proj.bias": (inter,),
                p + "mlp.up_proj.bias": (inter,),
                p + "mlp.down_proj.bias": (hidden,),
            }
    return shapes


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_LIST_AT_MOST])
    more = len(names) - _LIST_AT_MOST
    return shown + (f" (and {more} more)" if more > 0 else "")


def tensor_files(directory: str | Path) -> dict[str, Path]:
    """tensor name -> the safetensors file that holds it (from the shard index, else from every file)."""
    d = Path(directory)
    index = d / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map: {e}") from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
        out: dict[str, Path] = {}
        for name, file in weight_map.items():
            path = d / str(file)
            if not path.is_file():
                raise CheckpointError(f"{index} maps tensor {name!r} to {file}, which does not exist in {d}")
            out[name] = path
        return out
    files = sorted(d.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in d.glob("*.bin"))
        hint = f" (found {pickled}: only safetensors is supported)" if pickled else ""
        raise CheckpointError(f"{d} holds no *.safetensors weights{hint}")
    out = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open objects are not iterable)
                if name in out:
                    raise CheckpointError(f"tensor {name!r} is in both {out[name].name} and {path.name}")
                out[name] = path
    return out


def load_weights(
    directory: str | Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> ModelWeights:
    """Read, check and convert every tensor the config needs; `lm_head` is the embedding when tied.

    Raises CheckpointError listing missing tensors, unexpected tensors, or the first tensor whose shape
    differs from the config's, before converting anything.
    """
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {dtype}")
    d = Path(directory)
    sources = tensor_files(d)
    expected = parameter_shapes(config)
    ignored = {n for n in sources if _IGNORED.fullmatch(n)}
    if config.tie_word_embeddings:
        ignored.add("lm_head.weight")  # some tied checkpoints store a copy; the embedding is the truth
    missing = sorted(set(expected) - set(sources))
    unexpected = sorted(set(sources) - set(expected) - ignored)
    if missing:
        raise CheckpointError(f"checkpoint {d} lacks {len(missing)} tensor(s) the config needs: {_names(missing)}")
    if unexpected:
        raise CheckpointError(
            f"checkpoint {d} holds {len(unexpected)} tensor(s) this config does not use: {_names(unexpected)} "
            "(does config.json match the weights?)"
        )
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(sources[name], []).append(name)
    # NOTE: all shapes are checked (from the headers, no tensor data read) before any tensor is converted.
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            held = set(f.keys())
            for name in names:
                if name not in held:
                    raise CheckpointError(f"{INDEX_FILE} maps tensor {name!r} to {path.name}, which does not hold it")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(
                        f"tensor {name!r} in {path.name} has shape {list(shape)}; "
                        f"the config expects {list(expected[name])}"
                    )
    tensors: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                t = f.get_tensor(name)
                if not t.is_floating_point():
                    raise CheckpointError(f"tensor {name!r} in {path.name} has dtype {t.dtype}; expected a float dtype")
                tensors[name] = t.to(device=device, dtype=dtype).contiguous()
    return _assemble(config, tensors)


def _assemble(config: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> ModelWeights:
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        fields = {field: tensors[p + suffix] for suffix, field in _LAYER_FIELDS.items() if p + suffix in tensors}
        layers.append(LayerWeights(**fields))
    embed = tensors["model.embed_tokens.weight"]
    lm_head = embed if config.tie_word_embeddings else tensors["lm_head.weight"]
    return ModelWeights(embed_tokens=embed, layers=layers, norm=tensors["model.norm.weight"], lm_head=lm_head)


# ---------------------------------------------------------------------------------------- entry points


def load_model(
    directory: str | Path,
    *,
    cache: CacheConfig | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> PagedLlama:
    """A PagedLlama with the checkpoint's weights and an empty paged cache of `cache` size.

    dtype: the weights' and KV cache's dtype; None picks `default_dtype` (float32 on CPU).
    """
    dev = torch.device(device)
    raw = read_config_dict(directory)
    config = _parse_config(raw, Path(directory))
    weights = load_weights(directory, config, dtype=dtype or default_dtype(raw, dev), device=dev)
    return PagedLlama(config, weights, cache)


def load_checkpoint(
    directory: str | Path,
    *,
    cache: CacheConfig | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> Checkpoint:
    """The model and, when `tokenizer.json` is present, its tokenizer (whose ids must fit the vocabulary)."""
    model = load_model(directory, cache=cache, dtype=dtype, device=device)
    tokenizer = load_tokenizer(directory, bos_token_id=model.config.bos_token_id)
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(
            f"{Path(directory) / 'tokenizer.json'} has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{model.config.vocab_size}"
        )
    return Checkpoint(model=model, tokenizer=tokenizer, directory=Path(directory))
