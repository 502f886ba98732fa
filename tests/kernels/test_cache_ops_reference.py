"""reshape_and_cache, gather_pages, scatter_pages (CPU reference path) against plain Python loops."""

from __future__ import annotations

import pytest
import torch

import kernels
from tests.kernels._cases import DTYPES, make_caches

BLOCK_SIZES = (8, 16, 32)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_reshape_and_cache_matches_slot_loop(block_size: int, slot_dtype: torch.dtype, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 2, 64, 40
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens: never written
    key_cache, value_cache = make_caches(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=1)[0]
    expect_k, expect_v = key_cache.clone(), value_cache.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // block_size, slot % block_size] = key[token]
            expect_v[slot // block_size, slot % block_size] = value[token]

    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots.to(slot_dtype))
    assert torch.equal(key_cache, expect_k) and torch.equal(value_cache, expect_v)


def test_reshape_and_cache_all_padding_changes_nothing() -> None:
    key_cache, value_cache = make_caches(1, 2, 8, 1, 64, torch.float16, seed=2)[0]
    before = (key_cache.clone(), value_cache.clone())
    key = torch.ones(3, 1, 64, dtype=torch.float16)
    kernels.reshape_and_cache(key, key, key_cache, value_cache, torch.full((3,), -1, dtype=torch.int64))
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.uint8], ids=lambda d: str(d).removeprefix("torch."))
def test_gather_matches_loop_and_scatter_round_trips(block_size: int, dtype: torch.dtype) -> None:
    num_layers, num_blocks, num_kv_heads, head_dim = 3, 9, 2, 64
    if dtype == torch.uint8:
        gen = torch.Generator().manual_seed(3)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        caches = [
            (
                torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8),
                torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8),
            )
            for _ in range(num_layers)
        ]
    else:
        caches = make_caches(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=3)
    ids = [7, 0, 4, 4, 8]  # repeats are fine for a gather

    pages = kernels.gather_pages(caches, ids)
    assert pages.shape == (len(ids), num_layers, 2, block_size, num_kv_heads, head_dim)
    assert pages.dtype == dtype and pages.is_contiguous()
    for i, block in enumerate(ids):
        for layer, (k, v) in enumerate(caches):
            assert torch.equal(pages[i, layer, 0], k[block]) and torch.equal(pages[i, layer, 1], v[block])

    # Scatter the distinct pages into fresh caches at other blocks, then gather them back: exact.
    distinct = pages[[0, 1, 2, 4]]
    targets = torch.tensor([1, 2, 3, 5], dtype=torch.int32)
    fresh = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    kernels.scatter_pages(distinct, fresh, targets)
    assert torch.equal(kernels.gather_pages(fresh, targets), distinct)
    untouched = [0, 4, 6, 7, 8]
    assert all(torch.count_nonzero(t[untouched]) == 0 for pair in fresh for t in pair)


def test_gather_into_out_and_empty_ids() -> None:
    caches = make_caches(2, 4, 16, 2, 64, torch.bfloat16, seed=4)
    out = torch.empty(2, 2, 2, 16, 2, 64, dtype=torch.bfloat16)
    result = kernels.gather_pages(caches, torch.tensor([3, 1]), out=out)
    assert result is out and torch.equal(out[0, 1, 1], caches[1][1][3])
    assert kernels.gather_pages(caches, []).shape == (0, 2, 2, 16, 2, 64)
    kernels.scatter_pages(torch.empty(0, 2, 2, 16, 2, 64, dtype=torch.bfloat16), caches, [])
