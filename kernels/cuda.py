"""CuPy launchers for the CUDA kernels in kernels/*.cu. Thin on purpose: geometry and checks live in
`kernels.planning` and `kernels.ops`.

- CuPy is optional (the `gpu` extra) and imported only when a CUDA tensor arrives, so importing this
  module, and every CPU path, works without it.
- Each kernel instantiation is compiled by NVRTC at first use (`cupy.RawModule` with
  `name_expressions`, so only the requested template instance is built) and cached: in this process
  per (source, instantiation, device), and on disk by CuPy across processes.
- Tensors cross to CuPy through DLPack, zero-copy; kernels run on the current torch CUDA stream, so
  they order with the caller's torch work without any synchronization.
- Scalars go to the kernels as numpy.int32 / numpy.int64 / numpy.float32, matching the C parameter
  types exactly (a mismatch would shift every later argument).

These functions trust their inputs (validated by kernels.ops) and are not a public entry point.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from kernels import planning

KERNEL_DIR = Path(__file__).resolve().parent
COMMON_HEADER = "common.cuh"
LOG2E = 1.4426950408889634  # the decode kernel works in the log2 domain: exp(x) = exp2(x * log2(e))

DECODE_THREADS = 128  # kDecodeThreads in paged_attention.cu
REDUCE_THREADS = 128  # kReduceThreads
COPY_THREADS = 256  # kCopyThreads in cache_ops.cu
QUANT_THREADS = 128  # kQuantThreads in fp8.cu
DEQUANT_THREADS = 256  # kDequantThreads
FP8_GROUP = 8  # kFp8Group
MAX_GRID_X = 2**31 - 1
DEQUANT_MAX_BLOCKS = 65536  # grid-stride beyond this: enough blocks to fill any GPU

# torch dtype -> C++ element type in the kernel templates.
C_TYPES: dict[torch.dtype, str] = {
    torch.float32: "float",
    torch.float16: "__half",
    torch.bfloat16: "__nv_bfloat16",
}
# copy unit bytes -> C++ type of cache_ops.cu
UNIT_TYPES: dict[int, str] = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
SLOT_TYPES: dict[torch.dtype, str] = {torch.int32: "int", torch.int64: "long long"}
# Types CuPy's DLPack import cannot represent, viewed as an integer type of the same width (kernels
# only see the address).
_DLPACK_VIEWS: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


# ------------------------------------------------------------------------------------- kernel names


def decode_kernel_name(dtype: torch.dtype, head_dim: int, heads_per_block: int) -> str:
    return f"kvstore::paged_attention_decode_kernel<{C_TYPES[dtype]}, {head_dim}, {heads_per_block}>"


def reduce_kernel_name(dtype: torch.dtype) -> str:
    return f"kvstore::paged_attention_reduce_kernel<{C_TYPES[dtype]}>"


def reshape_kernel_name(unit_bytes: int, slot_dtype: torch.dtype) -> str:
    return f"kvstore::reshape_and_cache_kernel<{UNIT_TYPES[unit_bytes]}, {SLOT_TYPES[slot_dtype]}>"


def gather_kernel_name(unit_bytes: int) -> str:
    return f"kvstore::gather_pages_kernel<{UNIT_TYPES[unit_bytes]}>"


def scatter_kernel_name(unit_bytes: int) -> str:
    return f"kvstore::scatter_pages_kernel<{UNIT_TYPES[unit_bytes]}>"


def quantize_kernel_name(dtype: torch.dtype) -> str:
    return f"kvstore::quantize_fp8_kernel<{C_TYPES[dtype]}>"


def dequantize_kernel_name(dtype: torch.dtype) -> str:
    return f"kvstore::dequantize_fp8_kernel<{C_TYPES[dtype]}>"


def all_kernel_names() -> dict[str, list[str]]:
    """Every instantiation the launchers can request, per source file (checked against the .cu files)."""
    decode = [
        decode_kernel_name(dt, d, h)
        for dt in C_TYPES
        for d in planning.SUPPORTED_HEAD_DIMS
        for h in planning.HEADS_PER_BLOCK_CHOICES
    ]
    return {
        "paged_attention.cu": decode + [reduce_kernel_name(dt) for dt in C_TYPES],
        "cache_ops.cu": [reshape_kernel_name(u, s) for u in UNIT_TYPES for s in SLOT_TYPES]
        + [gather_kernel_name(u) for u in UNIT_TYPES]
        + [scatter_kernel_name(u) for u in UNIT_TYPES],
        "fp8.cu": [quantize_kernel_name(dt) for dt in C_TYPES] + [dequantize_kernel_name(dt) for dt in C_TYPES],
    }


# --------------------------------------------------------------------------------------- compiling


def load_source(filename: str) -> str:
    """The .cu source with common.cuh pasted in place of its #include line.

    NOTE: CuPy's disk cache is keyed on the source text; pasting the header in (rather than passing an
    include path) makes a change to common.cuh a cache miss instead of a stale kernel.
    """
    text = (KERNEL_DIR / filename).read_text()
    header = (KERNEL_DIR / COMMON_HEADER).read_text().replace("#pragma once", "")
    pasted, count = re.subn(rf'^#include "{re.escape(COMMON_HEADER)}"$', lambda _: header, text, flags=re.M)
    if count != 1:
        raise RuntimeError(f"{filename} must include {COMMON_HEADER} exactly once (found {count})")
    return pasted


def cuda_include_dirs() -> list[str]:
    """Directories holding the CUDA headers the kernels include (cuda_bf16.h, cuda_fp8.h).

    CuPy bundles only cuda_fp16.h; the others come from a CUDA toolkit (CUDA_PATH / CUDA_HOME /
    /usr/local/cuda) or from the nvidia-cuda-runtime / nvidia-cuda-nvrtc wheels.
    """
    candidates: list[Path] = []
    for var in ("KVSTORE_CUDA_INCLUDE", "CUDA_PATH", "CUDA_HOME"):
        value = os.environ.get(var)
        if value:
            candidates += [Path(value), Path(value) / "include"]
    candidates.append(Path("/usr/local/cuda/include"))
    site = Path(sysconfig.get_paths()["purelib"]) / "nvidia"
    candidates += [site / "cuda_runtime" / "include", site / "cuda_nvrtc" / "include", site / "cu13" / "include"]
    found: list[str] = []
    for path in candidates:
        if (path / "cuda_fp8.h").is_file() and str(path) not in found:
            found.append(str(path))
    return found


def _cupy() -> ModuleType:
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the host
        raise RuntimeError(
            "CUDA tensors need CuPy for the kvstore kernels: install the 'gpu' extra "
            "(pip install 'kvstore[gpu]'), or pass CPU tensors to use the torch reference"
        ) from exc
    return cupy


@functools.cache
def _kernel(filename: str, name: str, device_index: int) -> Any:
    """The compiled RawKernel for one instantiation on one device.

    NOTE: functools.cache is the process-wide compile cache; it is thread-safe (two threads may compile the
    same kernel once each, harmlessly) and bounded by the finite list in all_kernel_names().
    """
    cp = _cupy()
    includes = cuda_include_dirs()
    if not includes:
        raise RuntimeError(
            "cannot find the CUDA headers (cuda_fp8.h, cuda_bf16.h) that the kvstore kernels include: "
            "install a CUDA toolkit or set KVSTORE_CUDA_INCLUDE / CUDA_PATH to its include directory"
        )
    options = ("-std=c++17", *(f"-I{d}" for d in includes))
    with cp.cuda.Device(device_index):
        module = cp.RawModule(code=load_source(filename), options=options, name_expressions=(name,))
        return module.get_function(name)


# ---------------------------------------------------------------------------------------- launching


def _as_cupy(cp: ModuleType, tensor: torch.Tensor) -> Any:
    """Zero-copy CuPy view of a CUDA tensor (DLPack); dtypes CuPy lacks are viewed as same-width ints."""
    view = _DLPACK_VIEWS.get(tensor.dtype)
    return cp.from_dlpack(tensor.detach() if view is None else tensor.detach().view(view))


class _Launcher:
    """Runs kernels on one device and the current torch stream of that device."""

    def __init__(self, device: torch.device) -> None:
        self.cp = _cupy()
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.stream = self.cp.cuda.ExternalStream(torch.cuda.current_stream(self.index).cuda_stream, self.index)

    def __call__(
        self,
        filename: str,
        name: str,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: Sequence[Any],
        *,
        shared_mem: int = 0,
    ) -> None:
        kernel = _kernel(filename, name, self.index)
        cp = self.cp
        with cp.cuda.Device(self.index), self.stream:
            converted = tuple(_as_cupy(cp, a) if isinstance(a, torch.Tensor) else a for a in args)
            kernel(grid, block, converted, shared_mem=shared_mem)


def _i32(value: int) -> np.int32:
    if not -(2**31) <= value < 2**31:
        raise ValueError(f"{value} does not fit the kernel's 32-bit parameter")
    return np.int32(value)


# a launcher takes the kernel's tensors and sizes as they are (STYLE.md 7)
def paged_attention_decode(  # noqa: PLR0913
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    max_seq_len: int,
    partition_size: int | None,
    heads_per_block: int | None = None,
) -> torch.Tensor:
    """Launch the decode kernel (and the split-K reduce when the plan splits). See kernels.ops."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if num_seqs > planning.MAX_GRID_YZ:
        raise ValueError(f"at most {planning.MAX_GRID_YZ} sequences per launch, got {num_seqs}")
    tile = heads_per_block or planning.heads_per_block(num_heads, num_kv_heads)
    if tile not in planning.HEADS_PER_BLOCK_CHOICES or (num_heads // num_kv_heads) % tile:
        raise ValueError(
            f"heads_per_block must be one of {planning.HEADS_PER_BLOCK_CHOICES} and divide the GQA group "
            f"{num_heads // num_kv_heads}, got {tile}"
        )
    launch = _Launcher(query.device)
    num_sms = torch.cuda.get_device_properties(launch.index).multi_processor_count
    plan = planning.plan_decode(max_seq_len, num_seqs, num_heads // tile, num_sms, partition_size)
    if plan.split:
        partial_out = torch.empty(
            (num_seqs, num_heads, plan.num_partitions, head_dim), dtype=torch.float32, device=query.device
        )
        partial_max = torch.empty((num_seqs, num_heads, plan.num_partitions), dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        # Unused by a single-pass launch, but the kernel takes valid pointers.
        partial_out = partial_max = partial_sum = torch.empty(1, dtype=torch.float32, device=query.device)
    launch(
        "paged_attention.cu",
        decode_kernel_name(query.dtype, head_dim, tile),
        (num_heads // tile, num_seqs, plan.num_partitions),
        (DECODE_THREADS, 1, 1),
        (
            out,
            partial_out,
            partial_max,
            partial_sum,
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            _i32(num_heads),
            _i32(num_heads // num_kv_heads),
            _i32(key_cache.shape[1]),
            _i32(plan.partition_size),
            np.float32(scale * LOG2E),
            _i32(query.stride(0)),
            _i32(query.stride(1)),
            _i32(key_cache.stride(0)),
            _i32(key_cache.stride(1)),
            _i32(key_cache.stride(2)),
            _i32(value_cache.stride(0)),
            _i32(value_cache.stride(1)),
            _i32(value_cache.stride(2)),
            _i32(block_tables.stride(0)),
            _i32(out.stride(0)),
            _i32(out.stride(1)),
        ),
    )
    if plan.split:
        launch(
            "paged_attention.cu",
            reduce_kernel_name(query.dtype),
            (num_heads, num_seqs, 1),
            (REDUCE_THREADS, 1, 1),
            (
                out,
                partial_out,
                partial_max,
                partial_sum,
                seq_lens,
                _i32(num_heads),
                _i32(head_dim),
                _i32(plan.num_partitions),
                _i32(plan.partition_size),
                _i32(out.stride(0)),
                _i32(out.stride(1)),
            ),
            shared_mem=4 * plan.num_partitions,
        )
    return out


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Launch reshape_and_cache_kernel: one block per token. See kernels.ops."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    item = key.element_size()
    row = key.shape[1] * key.shape[2] * item
    tensors = (key, value, key_cache, value_cache)
    strides = (key.stride(0), value.stride(0), key_cache.stride(0), key_cache.stride(1))
    strides += (value_cache.stride(0), value_cache.stride(1))
    # Every quantity is a multiple of the element size (torch aligns storage to it), so unit >= item.
    unit = planning.copy_unit_bytes(row, *(s * item for s in strides), *(t.data_ptr() for t in tensors))

    def units(stride: int) -> np.int32:
        return _i32(stride * item // unit)

    num_blocks, block_size = key_cache.shape[:2]
    _Launcher(key.device)(
        "cache_ops.cu",
        reshape_kernel_name(unit, slot_mapping.dtype),
        (num_tokens, 1, 1),
        (COPY_THREADS, 1, 1),
        (
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            _i32(row // unit),
            units(key.stride(0)),
            units(value.stride(0)),
            units(key_cache.stride(0)),
            units(key_cache.stride(1)),
            units(value_cache.stride(0)),
            units(value_cache.stride(1)),
            _i32(block_size),
            np.int64(num_blocks * block_size),
        ),
    )


def _page_copy(
    kernel_name: Callable[[int], str],
    pages: torch.Tensor,
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    block_ids: torch.Tensor,
) -> None:
    """Shared launch of gather_pages_kernel / scatter_pages_kernel: grid x = page * planes + plane."""
    num_pages = block_ids.shape[0]
    if num_pages == 0:
        return
    first = kv_caches[0][0]
    item = first.element_size()
    plane_bytes = first.shape[1] * first.shape[2] * first.shape[3] * item
    caches = [t for pair in kv_caches for t in pair]
    unit = planning.copy_unit_bytes(
        plane_bytes, first.stride(0) * item, pages.data_ptr(), *(t.data_ptr() for t in caches)
    )
    planes = len(caches)
    if num_pages * planes > MAX_GRID_X:
        raise ValueError(f"{num_pages} pages of {planes} planes exceed one launch's grid")
    # The table of 2 * num_layers cache addresses: one small copy per call, from pinned memory so that
    # it is asynchronous (a copy from pageable memory would wait for the stream to drain). torch's
    # pinned allocator keeps the host buffer until the copy has run.
    pointers = torch.tensor([t.data_ptr() for t in caches], dtype=torch.int64)
    if first.device.type == "cuda":  # (the launch-ABI test runs this on CPU tensors)
        pointers = pointers.pin_memory().to(first.device, non_blocking=True)
    _Launcher(first.device)(
        "cache_ops.cu",
        kernel_name(unit),
        (num_pages * planes, 1, 1),
        (COPY_THREADS, 1, 1),
        (
            pages,
            pointers,
            block_ids,
            _i32(planes),
            _i32(plane_bytes // unit),
            np.int64(first.stride(0) * item // unit),
            np.int64(first.shape[0]),
        ),
    )


def gather_pages(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], block_ids: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Launch gather_pages_kernel into `out` ([num_pages, num_layers, 2, ...]); block_ids int64."""
    _page_copy(gather_kernel_name, out, kv_caches, block_ids)
    return out


def scatter_pages(
    pages: torch.Tensor, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], block_ids: torch.Tensor
) -> None:
    """Launch scatter_pages_kernel; block_ids int64 on the caches' device."""
    _page_copy(scatter_kernel_name, pages, kv_caches, block_ids)


def quantize_fp8(pages: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """Launch quantize_fp8_kernel into q and scales (pages at any stride; see kernels.ops): one block per
    (plane, kv head)."""
    num_pages, num_layers, two, block_size, num_kv_heads, head_dim = pages.shape
    blocks = num_pages * num_layers * two * num_kv_heads
    if blocks == 0:
        return
    if blocks > MAX_GRID_X:
        raise ValueError(f"{blocks} (plane, head) slabs exceed one launch's grid")
    _Launcher(pages.device)(
        "fp8.cu",
        quantize_kernel_name(pages.dtype),
        (blocks, 1, 1),
        (QUANT_THREADS, 1, 1),
        (
            q,
            scales,
            pages,
            np.int64(q.stride(0)),
            np.int64(scales.stride(0)),
            _i32(num_layers * two),
            _i32(block_size),
            _i32(num_kv_heads),
            _i32(head_dim),
        ),
    )


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Launch dequantize_fp8_kernel (q and scales pages at any stride; see kernels.ops), grid-stride over
    groups of 8 values."""
    _, num_layers, two, block_size, num_kv_heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    groups = q.numel() // FP8_GROUP
    if groups == 0:
        return out
    grid = min(math.ceil(groups / DEQUANT_THREADS), DEQUANT_MAX_BLOCKS)
    _Launcher(q.device)(
        "fp8.cu",
        dequantize_kernel_name(dtype),
        (grid, 1, 1),
        (DEQUANT_THREADS, 1, 1),
        (
            out,
            q,
            scales,
            np.int64(groups),
            np.int64(q.stride(0)),
            np.int64(scales.stride(0)),
            _i32(num_layers * two),
            _i32(block_size),
            _i32(num_kv_heads),
            _i32(head_dim),
        ),
    )
    return out
