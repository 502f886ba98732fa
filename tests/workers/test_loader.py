"""Checkpoint loading: config parsing, tensor checks with errors naming the tensor, tokenizer pickup.

Checkpoints here come from the transformers-free writer (fast, no oracle needed); the oracle tests
cover loading what `save_pretrained` writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from devkit.hf import CheckpointWriter, TinyLlamaSpec, make_tiny_llama
from workers.loader import CheckpointError, load_checkpoint, load_model, read_config
from workers.model import CacheConfig, ModelConfig, RopeType, UnsupportedModelError

pytestmark = pytest.mark.fast  # pure: no process, node or network (tests/conftest.py)

SPEC = TinyLlamaSpec(hidden=32, layers=2, heads=4, kv_heads=2, vocab=300, seed=5)


def _write(d: Path, spec: TinyLlamaSpec = SPEC, **kw: object) -> Path:
    return make_tiny_llama(d, spec, writer=CheckpointWriter.SAFETENSORS, **kw)  # type: ignore[arg-type]


def _edit_config(d: Path, **changes: object) -> None:
    raw = json.loads((d / "config.json").read_text())
    raw.update(changes)
    (d / "config.json").write_text(json.dumps(raw))


def _edit_tensors(d: Path, edit: dict[str, torch.Tensor | None]) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    for name, t in edit.items():
        if t is None:
            del tensors[name]
        else:
            tensors[name] = t
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------- config


def test_config_from_transformers_5_and_legacy_forms() -> None:
    new = SPEC.hf_config()
    cfg = ModelConfig.from_hf(new)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (2, 4, 2, 8, 300)
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"} | {
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "eos_token_id": [2, 7],
    }  # fmt: skip
    cfg = ModelConfig.from_hf(legacy)
    assert cfg.rope.theta == 500000.0 and cfg.rope.rope_type is RopeType.LLAMA3 and cfg.rope.factor == 32.0
    assert cfg.eos_token_ids == (2, 7)
    del legacy["head_dim"], legacy["num_key_value_heads"]
    cfg = ModelConfig.from_hf(legacy)
    assert (cfg.head_dim, cfg.num_kv_heads) == (8, 4)  # hidden / heads; MHA by default


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope type 'yarn'"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
    ],
)
def test_unsupported_models_raise_not_implemented(tmp_path: Path, change: dict[str, object], match: str) -> None:
    d = _write(tmp_path)
    _edit_config(d, **change)
    with pytest.raises(UnsupportedModelError, match=match):
        load_model(d)
    assert issubclass(UnsupportedModelError, NotImplementedError)


def test_inconsistent_config_is_a_checkpoint_error(tmp_path: Path) -> None:
    d = _write(tmp_path)
    _edit_config(d, num_key_value_heads=3)
    with pytest.raises(CheckpointError, match="multiple of num_key_value_heads 3"):
        read_config(d)
    _edit_config(d, num_key_value_heads=2)
    raw = json.loads((d / "config.json").read_text())
    del raw["vocab_size"]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="missing required field 'vocab_size'"):
        read_config(d)


# ---------------------------------------------------------------------------------------- directory


def test_wrong_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"not a Hugging Face checkpoint: it has no config\.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read JSON"):
        load_model(tmp_path)


def test_no_safetensors(tmp_path: Path) -> None:
    d = _write(tmp_path)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights \(found \['pytorch_model.bin'\]"):
        load_model(d)


# ---------------------------------------------------------------------------------------- tensors


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    d = _write(tmp_path)
    _edit_tensors(d, {"model.layers.1.mlp.up_proj.weight": None})
    with pytest.raises(
        CheckpointError, match=r"lacks 1 tensor\(s\) the config needs: model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        load_model(d)


def test_untied_checkpoint_without_lm_head_is_missing_it(tmp_path: Path) -> None:
    d = _write(tmp_path)
    _edit_tensors(d, {"lm_head.weight": None})
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        load_model(d)


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    d = _write(tmp_path)
    _edit_tensors(d, {"model.layers.2.mlp.up_proj.weight": torch.zeros(64, 32)})
    with pytest.raises(CheckpointError, match=r"does not use: model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(d)


def test_shape_mismatch_is_named(tmp_path: Path) -> None:
    d = _write(tmp_path)
    _edit_tensors(d, {"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 32)})
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' in model\.safetensors has shape \[32, 32\]; the config expects \[16, 32\]",
    ):
        load_model(d)


def test_int_tensor_is_rejected(tmp_path: Path) -> None:
    d = _write(tmp_path)
    _edit_tensors(d, {"model.norm.weight": torch.ones(32, dtype=torch.int32)})
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' .* dtype torch\.int32"):
        load_model(d)


def test_sharded_index_errors(tmp_path: Path) -> None:
    d = _write(tmp_path, shard_bytes=20_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    load_model(d)  # sane as written
    # The index points a tensor at a shard that does not hold it.
    name = next(n for n, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][name] = shards[1]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"maps tensor '{name}' to {shards[1]}, which does not hold it"):
        load_model(d)
    # ... or at a file that is not there.
    (d / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=f"to {shards[1]}, which does not exist"):
        load_model(d)


def test_tolerated_extras(tmp_path: Path) -> None:
    """Old RoPE buffers are skipped; a tied checkpoint may carry an lm_head copy, which is not used."""
    spec = TinyLlamaSpec(hidden=32, layers=2, heads=4, kv_heads=2, vocab=300, tie=True, seed=6)
    d = _write(tmp_path, spec)
    _edit_tensors(
        d, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4), "lm_head.weight": torch.zeros(300, 32)}
    )
    model = load_model(d)
    assert model.weights.lm_head is model.weights.embed_tokens
    assert model.prefill("s", [5, 6, 7]).abs().max() > 0  # the zero copy was not used


def test_dtype_conversion(tmp_path: Path) -> None:
    d = _write(tmp_path)
    model = load_model(d, dtype=torch.bfloat16, cache=CacheConfig(block_size=4, num_blocks=4))
    assert model.weights.layers[0].q_proj.dtype == torch.bfloat16
    assert model.cache.key_caches[0].shape == (4, 4, 2, 8) and model.cache.key_caches[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(d, dtype=torch.float64)


# ---------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_is_picked_up(tmp_path: Path) -> None:
    d = _write(tmp_path, with_tokenizer=True)
    ckpt = load_checkpoint(d, cache=CacheConfig(block_size=4, num_blocks=32))
    tok = ckpt.tokenizer
    assert tok is not None and tok.vocab_size <= SPEC.vocab
    text = "the cache keeps pages, says hello to Zürich!"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == 1 and all(0 <= i < SPEC.vocab for i in ids)
    assert tok.decode(ids) == text
    gen = ckpt.model.greedy_generate(ids, 4)
    assert isinstance(tok.decode(gen.tokens), str)


def test_no_tokenizer_means_token_ids(tmp_path: Path) -> None:
    assert load_checkpoint(_write(tmp_path)).tokenizer is None


def test_tokenizer_larger_than_vocab_is_rejected(tmp_path: Path) -> None:
    d = _write(tmp_path, with_tokenizer=True)
    _edit_config(d, vocab_size=100)
    _edit_tensors(d, {"model.embed_tokens.weight": torch.zeros(100, 32), "lm_head.weight": torch.zeros(100, 32)})
    with pytest.raises(CheckpointError, match="ids but the model's vocab_size is 100"):
        load_checkpoint(d)


def test_broken_tokenizer_file(tmp_path: Path) -> None:
    d = _write(tmp_path)
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a valid tokenizers file"):
        load_checkpoint(d)
