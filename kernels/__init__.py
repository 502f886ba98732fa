"""Paged-attention and page-movement kernels: CUDA sources launched through CuPy, torch references.

Entry points (kernels.ops; each dispatches on the tensors' device, CUDA or CPU):
    paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, *, scale) -> out
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    gather_pages(kv_caches, block_ids) -> pages      scatter_pages(pages, kv_caches, block_ids)
    quantize_fp8(pages) -> (q, scales)                dequantize_fp8(q, scales, dtype) -> pages

CuPy is needed only for CUDA tensors (the `gpu` extra) and is imported on first use. See
kernels/README.md for layouts, grid mappings and tolerances.
"""

# The package exposes exactly kernels.ops' public names (listed once, in its __all__).
from kernels.ops import *  # noqa: F403
from kernels.ops import __all__  # noqa: F401
