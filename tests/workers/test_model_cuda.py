"""The paged Llama on CUDA (CUDA kernels for cache writes, decode attention, page moves) against transformers on CPU.

Skipped where torch sees no CUDA device or CuPy is absent. head_dim 64: a size the CUDA decode kernel
is built for. Tolerances: fp32 logits atol 1e-3 (CUDA GEMMs and the split-K decode kernel sum in other
orders than CPU; still 10x under the fixtures' greedy margins); bf16 as in test_model_oracle.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from devkit.hf import TinyLlamaSpec, hf_reference_logits, load_hf_oracle, make_tiny_llama
from workers.loader import load_model
from workers.model import CacheConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
    pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs CuPy: pip install 'kvstore[gpu]'"),
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None, reason="transformers (dev extra) is the oracle"
    ),
]

SPEC = TinyLlamaSpec(hidden=128, layers=2, heads=2, kv_heads=1, vocab=512, seed=11)  # head_dim 64, GQA 2:1
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.4}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("cuda"), SPEC)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_model_matches_transformers_with_imported_pages(ckpt: Path, dtype: torch.dtype) -> None:
    oracle = load_hf_oracle(ckpt)
    prompt = list(range(5, 42))  # 37 tokens: 2 full blocks of 16 and a partial one
    cache = CacheConfig(block_size=16, num_blocks=32)
    producer = load_model(ckpt, cache=cache, dtype=dtype, device="cuda")
    producer.prefill("p", prompt)
    pages = producer.export_pages("p").cpu()  # as they would travel to the cache service
    consumer = load_model(ckpt, cache=cache, dtype=dtype, device="cuda")
    gen = consumer.greedy_generate(prompt, 32, prefix_pages=pages, return_logits=True)
    assert gen.num_imported_tokens == 32 and gen.logits is not None
    ref = hf_reference_logits(oracle, prompt, gen.tokens)
    if dtype == torch.float32:
        assert ref.argmax(-1).tolist() == gen.tokens
    torch.testing.assert_close(gen.logits.cpu(), ref, atol=TOLERANCE[dtype], rtol=0)
