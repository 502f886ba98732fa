"""Paged-attention and page-movement kernels: CUDA sources launched through CuPy, torch references.

Entry points (kernels.ops; each dispatches on the tensors' device, CUDA or CPU):
    paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale) -> out
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    gather_pages(kv_caches, block_ids) -> pages      scatter_pages(pages, kv_caches, block_ids)
    quantize_fp8(pages) -> (q, scales)                dequantize_fp8(q, scales, dtype) -> pages

CuPy is needed only for CUDA tensors (the `gpu` extra) and is imported on first use. See
kernels/README.md for layouts, grid mappings and tolerances.
"""

from kernels.ops import (
    FP8_E4M3_MAX,
    FP8_REL_ERROR,
    FP8_SUBNORMAL_ABS_ERROR,
    KVCaches,
    dequantize_fp8,
    gather_pages,
    paged_attention_decode,
    quantize_fp8,
    reshape_and_cache,
    scatter_pages,
)

__all__ = [
    "FP8_E4M3_MAX",
    "FP8_REL_ERROR",
    "FP8_SUBNORMAL_ABS_ERROR",
    "KVCaches",
    "dequantize_fp8",
    "gather_pages",
    "paged_attention_decode",
    "quantize_fp8",
    "reshape_and_cache",
    "scatter_pages",
]
