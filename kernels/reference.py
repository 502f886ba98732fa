"""Torch reference implementations of the kernels: the oracle in tests and the CPU execution path.

Written for clarity over speed, in fp32 like the CUDA kernels (softmax and accumulation in fp32,
one rounding to the output dtype at the end). They run on any torch device. They assume inputs that
`kernels.ops` has validated (shapes, dtypes, devices, index ranges); call them directly only with
such inputs.

Shapes (names as in DESIGN.md section 4 and kernels/README.md):
    query        [num_seqs, num_heads, head_dim]
    key/value    [num_tokens, num_kv_heads, head_dim]                 (new tokens)
    caches       [num_blocks, block_size, num_kv_heads, head_dim]     (one layer's K or V)
    block_tables [num_seqs, max_blocks_per_seq] int32, seq_lens [num_seqs] int32
    pages        [num_pages, num_layers, 2, block_size, num_kv_heads, head_dim]
    fp8 scales   [num_pages, num_layers, 2, num_kv_heads] fp32
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
# Smallest absmax whose 448 / absmax is finite in fp32 (kFp8MinAbsmax in fp8.cu): a slab below it (bf16 or
# fp32 values under 1.5e-36) is stored as zeros (scale 0), where 448 / absmax would turn its zeros into NaN.
FP8_MIN_ABSMAX = 2.0**-119

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    partition_size: int | None = None,
) -> torch.Tensor:
    """softmax(q K^T * scale) V per sequence over its first seq_lens[s] cached tokens.

    A sequence of length 0 gives zeros. With `partition_size`, each sequence is cut into partitions of
    that many tokens, each partition is attended separately (its max, sum and normalized output), and
    the partitions are merged as the CUDA split-K reduce kernel does; the result equals the unsplit
    one up to fp32 rounding.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros((num_seqs, num_heads, head_dim), dtype=torch.float32, device=query.device)
    lengths = seq_lens.tolist()
    for seq in range(num_seqs):
        length = int(lengths[seq])
        if length == 0:
            continue
        num_blocks = math.ceil(length / block_size)
        blocks = block_tables[seq, :num_blocks].long()
        # [num_blocks, block_size, kv, d] -> [tokens, kv, d]: the logical token order of the sequence.
        keys = key_cache[blocks].reshape(num_blocks * block_size, num_kv_heads, head_dim)[:length].float()
        values = value_cache[blocks].reshape(num_blocks * block_size, num_kv_heads, head_dim)[:length].float()
        q = query[seq].float().reshape(num_kv_heads, group, head_dim)  # heads h*group..(h+1)*group-1 share kv h
        if partition_size is None or partition_size >= length:
            logits = torch.einsum("kgd,tkd->kgt", q, keys) * scale
            probs = torch.softmax(logits, dim=-1)
            result = torch.einsum("kgt,tkd->kgd", probs, values)
        else:
            result = _split_attention(q, keys, values, scale, partition_size)
        out[seq] = result.reshape(num_heads, head_dim)
    return out.to(query.dtype)


def _split_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, partition_size: int
) -> torch.Tensor:
    """Split-K attention of one sequence: q [kv, group, d], keys/values [tokens, kv, d] -> [kv, group, d]."""
    maxima, sums, outputs = [], [], []
    for start in range(0, keys.shape[0], partition_size):
        k = keys[start : start + partition_size]
        v = values[start : start + partition_size]
        logits = torch.einsum("kgd,tkd->kgt", q, k) * scale
        m = logits.amax(dim=-1)
        p = torch.exp(logits - m.unsqueeze(-1))
        s = p.sum(dim=-1)
        maxima.append(m)
        sums.append(s)
        outputs.append(torch.einsum("kgt,tkd->kgd", p, v) / s.unsqueeze(-1))
    m_all = torch.stack(maxima)  # [parts, kv, group]
    weights = torch.stack(sums) * torch.exp(m_all - m_all.amax(dim=0))
    merged = (weights.unsqueeze(-1) * torch.stack(outputs)).sum(dim=0)
    return merged / weights.sum(dim=0).unsqueeze(-1)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key_cache[slot // block_size, slot % block_size] = key[token] for every slot >= 0 (same for V)."""
    block_size = key_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    kept = slots[keep]
    blocks = torch.div(kept, block_size, rounding_mode="floor")
    offsets = kept - blocks * block_size
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]


def gather_pages(kv_caches: KVCaches, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """pages[i, layer, 0] = K_layer[block_ids[i]], pages[i, layer, 1] = V_layer[block_ids[i]]."""
    ids = block_ids.long()
    pages = torch.stack([torch.stack((k[ids], v[ids]), dim=1) for k, v in kv_caches], dim=1)
    if out is None:
        return pages
    out.copy_(pages)
    return out


def scatter_pages(pages: torch.Tensor, kv_caches: KVCaches, block_ids: torch.Tensor) -> None:
    """The inverse of gather_pages: K_layer[block_ids[i]] = pages[i, layer, 0], V likewise."""
    ids = block_ids.long()
    for layer, (k, v) in enumerate(kv_caches):
        k[ids] = pages[:, layer, 0]
        v[ids] = pages[:, layer, 1]


def quantize_fp8(
    pages: torch.Tensor, q: torch.Tensor | None = None, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 pages with one scale per (page, layer, K/V, kv head): scale = absmax / 448.

    Returns (q float8_e4m3fn, same shape as pages; scales fp32 [num_pages, num_layers, 2, num_kv_heads]),
    written into `q` and `scales` when given (views at any page stride work). A slab holding NaN or inf
    gets a non-finite scale (amax propagates NaN), which `kernels.ops.quantize_fp8` refuses.
    """
    num_pages, num_layers, two, block_size, num_kv_heads, head_dim = pages.shape
    planes = pages.reshape(-1, block_size, num_kv_heads, head_dim).float()
    amax = planes.abs().amax(dim=(1, 3))  # [planes, kv]
    # NOTE: tensor / tensor of equal shapes, never a Python scalar divisor: torch may turn division by
    # a scalar into multiplication by its reciprocal, which can round differently from the IEEE
    # division the CUDA kernel does. Equal shapes keep the two bit-identical.
    fp8_max = torch.full_like(amax, FP8_E4M3_MAX)
    zeros = torch.zeros_like(amax)
    inv = torch.where(amax >= FP8_MIN_ABSMAX, fp8_max / amax, zeros)  # NaN fails the test: 0
    scaled = (planes * inv[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q_new = scaled.to(torch.float8_e4m3fn).reshape(pages.shape)
    scales_new = torch.where(amax < FP8_MIN_ABSMAX, zeros, amax / fp8_max)  # NaN passes: a NaN scale
    scales_new = scales_new.reshape(num_pages, num_layers, two, num_kv_heads)
    if q is None or scales is None:
        return q_new, scales_new
    q.copy_(q_new)
    scales.copy_(scales_new)
    return q, scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pages = float(q) * scale of its (page, layer, K/V, kv head), rounded once to `dtype`."""
    if q.dtype == torch.uint8:
        q = q.view(torch.float8_e4m3fn)
    block_size, num_kv_heads, head_dim = q.shape[3:]
    planes = q.reshape(-1, block_size, num_kv_heads, head_dim).float()
    values = planes * scales.reshape(-1, num_kv_heads)[:, None, :, None]
    return values.to(dtype).reshape(q.shape)
