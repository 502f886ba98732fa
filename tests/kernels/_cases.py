"""Input builders and naive oracles shared by the CPU kernel tests and the GPU comparison tests."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(slots=True)
class AttentionCase:
    """One decode batch: caches with blocks scattered at random, unused table entries set to -1."""

    query: torch.Tensor  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    scale: float

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The positional tensors of paged_attention_decode; `scale` is passed by keyword."""
        return self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens

    def to(self, device: str | torch.device) -> AttentionCase:
        return AttentionCase(
            self.query.to(device),
            self.key_cache.to(device),
            self.value_cache.to(device),
            self.block_tables.to(device),
            self.seq_lens.to(device),
            self.scale,
        )


def make_attention_case(
    seq_lens: Sequence[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 3,
    query_gain: float = 1.0,
) -> AttentionCase:
    """Random caches and queries; `query_gain` > 1 sharpens the softmax (large, spread-out logits)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    width = max(blocks_per_seq, default=0) + 1  # one extra column: entries past the end are never read
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for seq, count in enumerate(blocks_per_seq):
        table[seq, :count] = torch.tensor(order[used : used + count], dtype=torch.int32)
        used += count
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return AttentionCase(
        query=(torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen) * query_gain).to(dtype),
        key_cache=torch.randn(shape, generator=gen).to(dtype),
        value_cache=torch.randn(shape, generator=gen).to(dtype),
        block_tables=table,
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32),
        scale=1.0 / math.sqrt(head_dim),
    )


def dense_attention(case: AttentionCase) -> torch.Tensor:
    """Naive fp64 oracle: padded dense K/V per sequence built token by token from the block table,
    then softmax(q K^T * scale) V with padding masked out. Returns fp64 [num_seqs, num_heads, head_dim]."""
    query, key_cache, value_cache = (t.double() for t in (case.query, case.key_cache, case.value_cache))
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    lengths = case.seq_lens.tolist()
    longest = max(lengths, default=0)
    keys = torch.zeros(num_seqs, longest, num_kv_heads, head_dim, dtype=torch.float64)
    values = torch.zeros_like(keys)
    for seq, length in enumerate(lengths):
        for t in range(length):
            block = int(case.block_tables[seq, t // block_size])
            keys[seq, t] = key_cache[block, t % block_size]
            values[seq, t] = value_cache[block, t % block_size]
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float64)
    mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]  # [seqs, tokens]
    for head in range(num_heads):
        kv = head // group
        logits = torch.einsum("sd,std->st", query[:, head], keys[:, :, kv]) * case.scale
        logits = logits.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # an empty row gives zeros
        out[:, head] = torch.einsum("st,std->sd", probs, values[:, :, kv])
    return out


def output_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Reference (fp32 math, one rounding) vs the fp64 oracle: about one output ulp, with 2x slack."""
    return {
        torch.float32: {"rtol": 1e-5, "atol": 1e-6},
        torch.float16: {"rtol": 2.0**-10, "atol": 1e-5},
        torch.bfloat16: {"rtol": 2.0**-7, "atol": 1e-4},
    }[dtype]


def make_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(num_layers)
    ]


def make_fp8_pages(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Pages whose (page, layer, K/V, head) slabs span 10^-3 .. 10^3 in magnitude; one slab all zero."""
    gen = torch.Generator().manual_seed(seed)
    num_pages, num_layers, two, _, num_kv_heads, _ = shape
    magnitude = 10.0 ** (torch.rand(num_pages, num_layers, two, 1, num_kv_heads, 1, generator=gen) * 6 - 3)
    pages = torch.randn(shape, generator=gen) * magnitude
    pages[0, 0, 0, :, 0, :] = 0.0
    return pages.to(dtype)
