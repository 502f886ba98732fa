"""Public kernel entry points: validate, then dispatch to CUDA (CuPy) or to the torch reference.

Dispatch is by device: CUDA tensors run the kernels in kernels/*.cu on the current torch stream;
CPU tensors run `kernels.reference`. All tensor arguments of one call must be on one device.

Errors: TypeError for a wrong Python type or tensor dtype, ValueError for a wrong shape, device,
layout (non-contiguous, misaligned) or out-of-range index; each message names the argument. Index
ranges that live in device memory (block table entries, slots of a CUDA slot_mapping) are checked on
CPU inputs only: checking them on a GPU would cost a synchronization per call. The CUDA kernels
skip out-of-range slots and block ids rather than touch memory outside the caches.

Layouts (all contiguous; DESIGN.md section 4):
    query         [num_seqs, num_heads, head_dim]             fp16 / bf16 / fp32
    key_cache,
    value_cache   [num_blocks, block_size, num_kv_heads, head_dim]   one layer
    block_tables  [num_seqs, max_blocks_per_seq] int32, seq_lens [num_seqs] int32
    key, value    [num_tokens, num_kv_heads, head_dim], slot_mapping [num_tokens] int32/int64
    pages         [num_pages, num_layers, 2, block_size, num_kv_heads, head_dim]
    fp8 q         like pages, float8_e4m3fn (uint8 accepted on input)
    fp8 scales    [num_pages, num_layers, 2, num_kv_heads] fp32: one per (page, layer, K/V, kv head)
fp8 q and scales may be "paged": each page's part contiguous, pages at any stride (views into packed
encoded pages, where one buffer per page holds its scales and its values; see quantize_fp8).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence

import torch

from kernels import planning, reference
from kernels.reference import FP8_E4M3_MAX, FP8_MIN_ABSMAX, KVCaches

__all__ = [
    "FP8_E4M3_MAX",
    "FP8_MIN_ABSMAX",
    "FP8_REL_ERROR",
    "FP8_SUBNORMAL_ABS_ERROR",
    "KVCaches",
    "NonFiniteKV",
    "dequantize_fp8",
    "gather_pages",
    "paged_attention_decode",
    "quantize_fp8",
    "reshape_and_cache",
    "scatter_pages",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)
CUDA_ALIGN = 16  # bytes: the kernels move data in 16-byte vectors

# Round-trip bound of quantize_fp8 -> dequantize_fp8 (before rounding to the output dtype), for a value
# x in a slab with scale s = absmax / 448: |x' - x| <= FP8_REL_ERROR * |x| + FP8_SUBNORMAL_ABS_ERROR * s.
# e4m3 keeps 3 mantissa bits, so rounding to nearest is within half a step, 2^-4 relative, for normal
# values (|x / s| >= 2^-6); below that the subnormal step is 2^-9, so the error is within 2^-10 * s.
FP8_REL_ERROR = 2.0**-4
FP8_SUBNORMAL_ABS_ERROR = 2.0**-10


class NonFiniteKV(ValueError):
    """fp8 pages refused: a (page, layer, K/V, kv head) slab holds NaN or inf (quantizing), or its stored
    scale is not a finite, non-negative number (dequantizing). `page`, `layer`, `kv` (0: K, 1: V) and
    `head` locate the first such slab.

    NOTE: refused, not clamped. One inf makes the slab's absmax, hence its scale, inf, and every value of
    the slab then decodes as NaN or 0; clamping instead would store KV the engine never computed under the
    prompt's hash, served as a hit to every later request with that prefix. Non-finite KV is the engine's
    own fault (its raw pages are what it computed); the cache refuses to spread it."""

    def __init__(self, what: str, page: int, layer: int, kv: int, head: int, *, why: str) -> None:
        self.what, self.page, self.layer, self.kv, self.head, self.why = what, page, layer, kv, head, why
        super().__init__(f"{what}[{page}] layer {layer} {'KV'[kv]} kv head {head}: {why}")

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # NOTE: pickled whole (a Ray actor raising it hands it to the driver so): an exception pickles as its
        # class and `args`, which here is only the message, so rebuilding it would fail on the missing fields.
        return functools.partial(NonFiniteKV, why=self.why), (self.what, self.page, self.layer, self.kv, self.head)


def check_fp8_scales(what: str, scales: torch.Tensor, why: str) -> None:
    """NonFiniteKV naming the first (page, layer, K/V, head) whose scale is not finite or is negative.
    scales: [num_pages, num_layers, 2, num_kv_heads]. On CUDA this costs one synchronization."""
    bad = ~torch.isfinite(scales) | (scales < 0)
    if not bool(bad.any()):
        return
    page, layer, kv, head = (int(i) for i in bad.nonzero()[0])
    raise NonFiniteKV(what, page, layer, kv, head, why=f"{why} (scale {float(scales[page, layer, kv, head])})")


# ---------------------------------------------------------------------------------------- checking


def _tensor(name: str, value: object, ndim: int, dtypes: Sequence[torch.dtype] | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(value.dtype).removeprefix('torch.')}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    if not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(value.shape)}, strides {value.stride()})")
    return value


def _same_dtype(name: str, value: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if value.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {value.dtype} but {like_name} has {like.dtype}")


def _same_shape(name: str, value: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if value.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(value.shape)} but {like_name} has {tuple(like.shape)}")


def _paged(name: str, value: object, ndim: int, dtypes: Sequence[torch.dtype]) -> torch.Tensor:
    """A tensor whose dim 0 counts pages: each page's part contiguous, pages at any stride that does not
    overlap (a contiguous tensor is one such)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(value.dtype).removeprefix('torch.')}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    inner = math.prod(value.shape[1:])
    if value.shape[0] and inner and (not value[0].is_contiguous() or (value.shape[0] > 1 and value.stride(0) < inner)):
        raise ValueError(
            f"{name} must hold each page contiguously, pages at a stride >= the page (shape {tuple(value.shape)}, "
            f"strides {value.stride()})"
        )
    return value


def _device_of(named: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    """The one device of all tensors; only CPU and CUDA are supported."""
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")
    if first.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{first_name} is on {first.device}: only cpu and cuda tensors are supported")
    return first.device


def _aligned(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    for name, t in named:
        if t.data_ptr() % CUDA_ALIGN:
            raise ValueError(f"{name} must start on a {CUDA_ALIGN}-byte boundary for the CUDA kernels")


def _int_arg(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


# ---------------------------------------------------------------------------------------- attention


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    partition_size: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Decode attention: one query token per sequence against its paged K/V. Returns [num_seqs, num_heads, head_dim].

    Head h of a sequence attends with kv head h // (num_heads / num_kv_heads) (GQA; num_heads must be a
    multiple of num_kv_heads) over tokens 0 .. seq_lens[s] - 1, token t living at offset t % block_size
    of cache block block_tables[s, t // block_size]. Softmax and accumulation are fp32; the output has
    the query's dtype. A sequence of length 0 gives zeros. Entries of block_tables past a sequence's
    last block are ignored (any value, e.g. -1).

    partition_size: tokens per split-K partition. None lets the backend choose (CUDA: split only when
        the batch is too small to fill the GPU; reference: no split).
    max_seq_len: an upper bound of seq_lens that the CUDA path uses to size its grid; None reads it
        from seq_lens (one device synchronization). Every sequence must be at most this long.
    CUDA supports head_dim in planning.SUPPORTED_HEAD_DIMS; the reference supports any.
    """
    query = _tensor("query", query, 3, FLOAT_DTYPES)
    key_cache = _tensor("key_cache", key_cache, 4, FLOAT_DTYPES)
    value_cache = _tensor("value_cache", value_cache, 4, FLOAT_DTYPES)
    block_tables = _tensor("block_tables", block_tables, 2, (torch.int32,))
    seq_lens = _tensor("seq_lens", seq_lens, 1, (torch.int32,))
    _same_dtype("key_cache", key_cache, query, "query")
    _same_dtype("value_cache", value_cache, query, "query")
    _same_shape("value_cache", value_cache, key_cache, "key_cache")
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"key_cache head_dim {cache_head_dim} does not match query head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"query num_heads {num_heads} must be a multiple of key_cache num_kv_heads {num_kv_heads}")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences in query")
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for {num_seqs} sequences in query")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if partition_size is not None:
        partition_size = _int_arg("partition_size", partition_size, 1)
    if max_seq_len is not None:
        max_seq_len = _int_arg("max_seq_len", max_seq_len, 0)
    device = _device_of(
        [
            ("query", query),
            ("key_cache", key_cache),
            ("value_cache", value_cache),
            ("block_tables", block_tables),
            ("seq_lens", seq_lens),
        ]
    )
    capacity = block_tables.shape[1] * block_size

    if device.type == "cpu":
        _check_seq_lens_and_tables(seq_lens, block_tables, block_size, num_blocks, max_seq_len)
        return reference.paged_attention_decode(
            query, key_cache, value_cache, block_tables, seq_lens, scale=float(scale), partition_size=partition_size
        )

    if head_dim not in planning.SUPPORTED_HEAD_DIMS:
        raise ValueError(f"query head_dim {head_dim} is not supported on CUDA; one of {planning.SUPPORTED_HEAD_DIMS}")
    _aligned([("query", query), ("key_cache", key_cache), ("value_cache", value_cache)])
    if max_seq_len is None and num_seqs:
        low, high = (int(v) for v in torch.aminmax(seq_lens))
        if low < 0 or high > capacity:
            raise ValueError(
                f"seq_lens must lie in [0, {capacity}] (block_tables width x block_size), got [{low}, {high}]"
            )
        max_seq_len = high
    from kernels import cuda

    return cuda.paged_attention_decode(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        scale=float(scale),
        max_seq_len=max_seq_len or 0,
        partition_size=partition_size,
    )


def _check_seq_lens_and_tables(
    seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, num_blocks: int, max_seq_len: int | None
) -> None:
    """CPU-side range checks: lengths within the table, and every block a sequence uses a real block."""
    capacity = block_tables.shape[1] * block_size
    for seq, length in enumerate(seq_lens.tolist()):
        if not 0 <= length <= capacity:
            raise ValueError(
                f"seq_lens[{seq}] = {length} must lie in [0, {capacity}] (block_tables width x block_size)"
            )
        if max_seq_len is not None and length > max_seq_len:
            raise ValueError(f"seq_lens[{seq}] = {length} exceeds max_seq_len {max_seq_len}")
        used = block_tables[seq, : math.ceil(length / block_size)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise ValueError(f"block_tables[{seq}] uses block ids outside [0, {num_blocks}): {used.tolist()}")


# ---------------------------------------------------------------------------------------- cache writes


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K and V into the paged caches, in place.

    Token i goes to block slot_mapping[i] // block_size, offset slot_mapping[i] % block_size; a negative
    slot (padding) is skipped. Slots must be distinct (for duplicates, which token lands is unspecified)
    and below num_blocks * block_size. All four tensors share one dtype (any: the copy is bytewise).
    """
    key = _tensor("key", key, 3)
    value = _tensor("value", value, 3)
    key_cache = _tensor("key_cache", key_cache, 4)
    value_cache = _tensor("value_cache", value_cache, 4)
    slot_mapping = _tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    _same_shape("value", value, key, "key")
    _same_shape("value_cache", value_cache, key_cache, "key_cache")
    for name, t in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        _same_dtype(name, t, key, "key")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key has shape {tuple(key.shape)}; expected [num_tokens, {num_kv_heads}, {head_dim}] to match key_cache"
        )
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens in key")
    device = _device_of(
        [
            ("key", key),
            ("value", value),
            ("key_cache", key_cache),
            ("value_cache", value_cache),
            ("slot_mapping", slot_mapping),
        ]
    )
    if device.type == "cpu":
        if slot_mapping.numel() and int(slot_mapping.max()) >= num_blocks * block_size:
            raise ValueError(
                f"slot_mapping holds slot {int(slot_mapping.max())}; slots must be < num_blocks x block_size "
                f"= {num_blocks * block_size}"
            )
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    from kernels import cuda

    cuda.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


# ---------------------------------------------------------------------------------------- pages


def _check_caches(kv_caches: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """kv_caches: a non-empty list over layers of (key_cache, value_cache), all alike."""
    if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, Sequence) or not kv_caches:
        raise TypeError("kv_caches must be a non-empty list of (key_cache, value_cache) pairs, one per layer")
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer, pair in enumerate(kv_caches):
        if isinstance(pair, torch.Tensor) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise TypeError(f"kv_caches[{layer}] must be a (key_cache, value_cache) pair")
        k = _tensor(f"kv_caches[{layer}][0]", pair[0], 4)
        v = _tensor(f"kv_caches[{layer}][1]", pair[1], 4)
        pairs.append((k, v))
    first = pairs[0][0]
    for layer, (k, v) in enumerate(pairs):
        for kv, t in enumerate((k, v)):
            name = f"kv_caches[{layer}][{kv}]"
            _same_dtype(name, t, first, "kv_caches[0][0]")
            _same_shape(name, t, first, "kv_caches[0][0]")
    _device_of([(f"kv_caches[{layer}][{kv}]", t) for layer, pair in enumerate(pairs) for kv, t in enumerate(pair)])
    return pairs


def _block_ids(block_ids: object, num_blocks: int, device: torch.device) -> torch.Tensor:
    """block_ids (a 1-D int tensor or a sequence of ints) as int64 on `device`.

    Ids given on the host (a sequence or a CPU tensor) must lie in [0, num_blocks). A CUDA tensor is
    not checked (that would cost a synchronization per call); the kernels skip an id outside the range,
    leaving that page (gather) or nothing (scatter) written.
    """
    if isinstance(block_ids, torch.Tensor):
        ids = _tensor("block_ids", block_ids, 1, INDEX_DTYPES)
    elif isinstance(block_ids, Sequence) and all(
        isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in block_ids
    ):
        ids = torch.tensor(list(block_ids), dtype=torch.int64)
    else:
        raise TypeError("block_ids must be a 1-D int32/int64 tensor or a sequence of ints")
    if ids.device.type == "cpu" and ids.numel():
        low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= num_blocks:
            raise ValueError(f"block_ids must lie in [0, {num_blocks}), got values in [{low}, {high}]")
    elif ids.device != device:
        raise ValueError(f"block_ids is on {ids.device} but the caches are on {device}")
    return ids.to(device=device, dtype=torch.int64)


def _page_shape(num_pages: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, ...]:
    _, block_size, num_kv_heads, head_dim = pairs[0][0].shape
    return (num_pages, len(pairs), 2, block_size, num_kv_heads, head_dim)


def gather_pages(
    kv_caches: KVCaches, block_ids: torch.Tensor | Sequence[int], *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy blocks out of the per-layer caches into contiguous pages, all layers in one launch.

    Returns pages [len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim] on the caches'
    device (into `out` when given: that shape, the caches' dtype and device, contiguous).
    block_ids must lie in [0, num_blocks); repeats are allowed.
    """
    pairs = _check_caches(kv_caches)
    first = pairs[0][0]
    ids = _block_ids(block_ids, first.shape[0], first.device)
    shape = _page_shape(ids.shape[0], pairs)
    if out is None:
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
    else:
        out = _tensor("out", out, 6)
        _same_dtype("out", out, first, "kv_caches[0][0]")
        if tuple(out.shape) != shape:
            raise ValueError(f"out has shape {tuple(out.shape)}; expected {shape}")
        _device_of([("kv_caches[0][0]", first), ("out", out)])
    if first.device.type == "cpu":
        return reference.gather_pages(pairs, ids, out)
    _aligned([("out", out)] + [(f"kv_caches[{i}]", k) for i, (k, _) in enumerate(pairs)])
    from kernels import cuda

    return cuda.gather_pages(pairs, ids, out)


def scatter_pages(pages: torch.Tensor, kv_caches: KVCaches, block_ids: torch.Tensor | Sequence[int]) -> None:
    """Copy contiguous pages into the per-layer caches (the inverse of gather_pages), in place.

    pages: [len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim] in the caches' dtype and
    on their device. block_ids must lie in [0, num_blocks) and be distinct (for repeats, which page
    lands is unspecified).
    """
    pairs = _check_caches(kv_caches)
    first = pairs[0][0]
    pages = _tensor("pages", pages, 6)
    _same_dtype("pages", pages, first, "kv_caches[0][0]")
    _device_of([("kv_caches[0][0]", first), ("pages", pages)])
    ids = _block_ids(block_ids, first.shape[0], first.device)
    shape = _page_shape(ids.shape[0], pairs)
    if tuple(pages.shape) != shape:
        raise ValueError(f"pages has shape {tuple(pages.shape)}; expected {shape} for {ids.shape[0]} block_ids")
    if first.device.type == "cpu":
        reference.scatter_pages(pages, pairs, ids)
        return
    _aligned([("pages", pages)] + [(f"kv_caches[{i}]", k) for i, (k, _) in enumerate(pairs)])
    from kernels import cuda

    cuda.scatter_pages(pages, pairs, ids)


# ---------------------------------------------------------------------------------------- fp8


def quantize_fp8(
    pages: torch.Tensor, *, out: torch.Tensor | None = None, out_scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize pages to e4m3 with one scale per (page, layer, K/V, kv head).

    pages: [num_pages, num_layers, 2, block_size, num_kv_heads, head_dim], fp16 / bf16 / fp32.
    Returns (q, scales): q float8_e4m3fn of the same shape (`q.view(torch.uint8)` gives the bytes);
    scales fp32 [num_pages, num_layers, 2, num_kv_heads] with scale = absmax / 448 over the slab's
    block_size x head_dim values (0 for an all-zero slab, or one below FP8_MIN_ABSMAX). Round-trip error:
    see FP8_REL_ERROR. NaN or inf in pages is refused: NonFiniteKV naming the first such (page, layer,
    K/V, kv head); on CPU out and out_scales are then unchanged, on CUDA they hold meaningless values (the
    kernel writes as it goes; the check reads only the scales, one synchronization).

    out, out_scales (both or neither): where to write q (float8_e4m3fn or uint8) and the scales, on the
    pages' device; each page's part contiguous, pages at any stride, e.g. views into packed encoded
    pages. On CUDA, out and its page stride must be 16-byte aligned (scales: 4-byte).
    """
    pages = _tensor("pages", pages, 6, FLOAT_DTYPES)
    if pages.shape[2] != 2:
        raise ValueError(
            f"pages must be [num_pages, num_layers, 2, block_size, num_kv_heads, head_dim], got {tuple(pages.shape)}"
        )
    if (out is None) != (out_scales is None):
        raise ValueError("give both out and out_scales, or neither")
    scales_shape = (*pages.shape[:3], pages.shape[4])
    if out is None or out_scales is None:
        out = torch.empty(pages.shape, dtype=torch.float8_e4m3fn, device=pages.device)
        out_scales = torch.empty(scales_shape, dtype=torch.float32, device=pages.device)
    else:
        out = _paged("out", out, 6, FP8_DTYPES)
        out_scales = _paged("out_scales", out_scales, 4, (torch.float32,))
        if out.shape != pages.shape:
            raise ValueError(f"out has shape {tuple(out.shape)} but pages has {tuple(pages.shape)}")
        if tuple(out_scales.shape) != scales_shape:
            raise ValueError(f"out_scales has shape {tuple(out_scales.shape)}; expected {scales_shape} for pages")
    device = _device_of([("pages", pages), ("out", out), ("out_scales", out_scales)])
    q = out.view(torch.float8_e4m3fn)
    if device.type == "cpu":
        q_new, scales_new = reference.quantize_fp8(pages)
        check_fp8_scales("pages", scales_new, NON_FINITE)
        q.copy_(q_new)
        out_scales.copy_(scales_new)
        return q, out_scales
    vec = 16 // pages.element_size()
    if pages.shape[-1] % vec:
        raise ValueError(f"pages head_dim {pages.shape[-1]} must be a multiple of {vec} on CUDA")
    _aligned([("pages", pages), ("out", q)])
    _page_stride_aligned("out", q, CUDA_ALIGN)
    _page_stride_aligned("out_scales", out_scales, out_scales.element_size())
    from kernels import cuda

    cuda.quantize_fp8(pages, q, out_scales)
    check_fp8_scales("pages", out_scales, NON_FINITE)
    return q, out_scales


NON_FINITE = "holds NaN or inf; fp8 quantization refuses non-finite KV"


def _page_stride_aligned(name: str, t: torch.Tensor, align: int) -> None:
    if t.shape[0] > 1 and (t.stride(0) * t.element_size()) % align:
        raise ValueError(f"{name}'s page stride ({t.stride(0) * t.element_size()} B) must be a multiple of {align} B")


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Inverse of quantize_fp8: pages = float(q) * scale, rounded once to `dtype` (fp16 / bf16 / fp32).

    q: [num_pages, num_layers, 2, block_size, num_kv_heads, head_dim], float8_e4m3fn or its uint8 bytes;
    scales: fp32 [num_pages, num_layers, 2, num_kv_heads] on the same device. Each page's part of q and
    of scales contiguous, pages at any stride (views into packed encoded pages work). Returns a new
    contiguous tensor. On CUDA, q and its page stride must be 8-byte aligned. A scale that is not finite
    or is negative (no quantize_fp8 writes one: another writer's page, or damage) is refused with
    NonFiniteKV naming its (page, layer, K/V, kv head), one synchronization on CUDA; the e4m3 values are
    not checked (the NaN bytes 0x7f / 0xff decode as NaN).
    """
    q = _paged("q", q, 6, FP8_DTYPES)
    scales = _paged("scales", scales, 4, (torch.float32,))
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    num_pages, num_layers, two, _, num_kv_heads, head_dim = q.shape
    if two != 2:
        raise ValueError(
            f"q must be [num_pages, num_layers, 2, block_size, num_kv_heads, head_dim], got {tuple(q.shape)}"
        )
    if tuple(scales.shape) != (num_pages, num_layers, 2, num_kv_heads):
        raise ValueError(
            f"scales has shape {tuple(scales.shape)}; expected {(num_pages, num_layers, 2, num_kv_heads)} for q"
        )
    device = _device_of([("q", q), ("scales", scales)])
    check_fp8_scales("q", scales, "has a scale that is not a finite, non-negative number; fp8 pages need one")
    if device.type == "cpu":
        return reference.dequantize_fp8(q, scales, dtype)
    from kernels import cuda

    if head_dim % cuda.FP8_GROUP:
        raise ValueError(f"q head_dim {head_dim} must be a multiple of {cuda.FP8_GROUP} on CUDA")
    if q.data_ptr() % cuda.FP8_GROUP:
        raise ValueError(f"q must start on a {cuda.FP8_GROUP}-byte boundary for the CUDA kernels")
    _page_stride_aligned("q", q, cuda.FP8_GROUP)
    _page_stride_aligned("scales", scales, scales.element_size())
    return cuda.dequantize_fp8(q.view(torch.float8_e4m3fn), scales, dtype)
