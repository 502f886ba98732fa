"""Bad calls into the model fail clearly and leave the cache as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from devkit.hf import CheckpointWriter, TinyLlamaSpec, make_tiny_llama
from workers.loader import load_model
from workers.model import CacheConfig, PagedLlama
from workers.paged_cache import CacheFullError, UnknownSequenceError

pytestmark = pytest.mark.fast  # pure: no process, node or network (tests/conftest.py)

SPEC = TinyLlamaSpec(hidden=32, layers=2, heads=4, kv_heads=2, vocab=300, seed=8)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("ckpt"), SPEC, writer=CheckpointWriter.SAFETENSORS)


def _model(ckpt: Path, num_blocks: int = 3, block_size: int = 4) -> PagedLlama:
    return load_model(ckpt, cache=CacheConfig(block_size=block_size, num_blocks=num_blocks))


def test_prompt_too_long_for_the_cache(ckpt: Path) -> None:
    model = _model(ckpt)  # 3 blocks of 4 tokens
    with pytest.raises(CacheFullError, match="13 new tokens need 4 more KV blocks of 4 tokens; 3 of 3 are free"):
        model.prefill("s", list(range(13)))
    assert model.num_free_blocks == 3 and model.num_tokens("s") == 0
    with pytest.raises(CacheFullError, match="a prompt of 10 tokens plus 5 new tokens needs 4 KV blocks"):
        model.greedy_generate(list(range(10)), 5)
    assert model.num_free_blocks == 3
    assert len(model.greedy_generate(list(range(10)), 3).tokens) == 3  # 12 tokens fit exactly


def test_decode_past_the_cache_changes_nothing(ckpt: Path) -> None:
    model = _model(ckpt, num_blocks=2)
    model.prefill("a", list(range(4)))
    model.prefill("b", list(range(4)))
    with pytest.raises(CacheFullError):
        model.decode(["a", "b"], [1, 2])
    assert (model.num_tokens("a"), model.num_tokens("b"), model.num_free_blocks) == (4, 4, 0)
    model.free("b")
    assert model.decode(["a"], [1]).shape == (1, SPEC.vocab)


def test_bad_tokens_and_positions(ckpt: Path) -> None:
    model = _model(ckpt)
    with pytest.raises(ValueError, match=r"token id 300, outside \[0, 300\)"):
        model.prefill("s", [1, 300])
    with pytest.raises(ValueError, match="token id -1"):
        model.prefill("s", torch.tensor([-1]))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        model.prefill("s", torch.tensor([1.0]))
    with pytest.raises(TypeError, match="must hold ints"):
        model.prefill("s", [1, "2"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one token"):
        model.prefill("s", [])
    with pytest.raises(ValueError, match="start_pos 4, but it holds 0 tokens"):
        model.prefill("s", [1, 2], start_pos=4)
    model.prefill("s", [1, 2])
    with pytest.raises(ValueError, match="start_pos 0, but it holds 2 tokens"):
        model.prefill("s", [3], start_pos=0)
    assert model.num_tokens("s") == 2


def test_bad_decode_calls(ckpt: Path) -> None:
    model = _model(ckpt)
    model.prefill("s", [1, 2])
    with pytest.raises(UnknownSequenceError, match="'nope' is not in this cache"):
        model.decode(["s", "nope"], [1, 1])
    with pytest.raises(ValueError, match="2 sequences but 1 last_tokens"):
        model.decode(["s", "s"], [1])
    with pytest.raises(ValueError, match="twice"):
        model.decode(["s", "s"], [1, 1])
    assert model.num_tokens("s") == 2
    assert model.decode([], []).shape == (0, SPEC.vocab)
    with pytest.raises(UnknownSequenceError):
        model.free("nope")


def test_bad_generate_calls(ckpt: Path) -> None:
    model = _model(ckpt, num_blocks=8)
    with pytest.raises(ValueError, match="must not be empty"):
        model.greedy_generate([], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.greedy_generate([1], -1)
    model.prefill("p", list(range(3, 11)))
    pages = model.export_pages("p")  # 2 pages
    with pytest.raises(ValueError, match="k <= 1"):
        model.greedy_generate(list(range(3, 9)), 2, prefix_pages=pages)  # 6 tokens: 1 full block
    assert model.greedy_generate([1, 2], 0).tokens == []


def test_pages_covering_the_whole_prompt_leave_the_last_block_computed(ckpt: Path) -> None:
    """With every prompt block available, the last one is still computed: its last token gives the first logits."""
    model = _model(ckpt, num_blocks=8)
    prompt = list(range(3, 11))  # exactly 2 blocks
    model.prefill("p", prompt)
    pages = model.export_pages("p")
    model.free("p")
    gen = model.greedy_generate(prompt, 4, prefix_pages=pages)
    assert (gen.num_imported_tokens, gen.num_prefilled_tokens) == (4, 4)
    assert gen.tokens == model.greedy_generate(prompt, 4).tokens
    assert model.num_free_blocks == 8
