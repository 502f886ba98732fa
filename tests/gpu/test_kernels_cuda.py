"""CUDA kernels against their torch references (the references run on CPU copies of the inputs).

Skipped where torch sees no CUDA device or CuPy is not installed (the `gpu` extra).

Tolerances (CUDA vs reference, both fp32 math, summed in different orders, then one rounding):
    attention fp32: rtol 1e-4, atol 2e-5; fp16: rtol 2^-9, atol 1e-3; bf16: rtol 2^-6, atol 8e-3
    (about two output ulps); reshape_and_cache, gather, scatter: exact; fp8 quantize / dequantize:
    identical bits and scales (both compute the same IEEE fp32 quotient and product and round to
    nearest even).
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

import kernels
from kernels import cuda, reference
from tests.kernels._cases import DTYPES, make_attention_case, make_caches, make_fp8_pages

CUDA_OK = torch.cuda.is_available()
CUPY_OK = importlib.util.find_spec("cupy") is not None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA device (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(not CUPY_OK, reason="needs CuPy for the CUDA kernels: pip install 'kvstore[gpu]'"),
]

ATTENTION_TOLERANCE = {
    torch.float32: {"rtol": 1e-4, "atol": 2e-5},
    torch.float16: {"rtol": 2.0**-9, "atol": 1e-3},
    torch.bfloat16: {"rtol": 2.0**-6, "atol": 8e-3},
}
DEVICE = "cuda"


def _ids(value: object) -> str:
    return str(value).removeprefix("torch.")


@pytest.mark.parametrize(
    ("dtype", "head_dim", "group", "block_size"),
    [
        *itertools.product(DTYPES, (64, 128, 256), (1, 4, 8), (16,)),
        *((torch.float16, 128, 4, bs) for bs in (8, 32)),
        (torch.bfloat16, 128, 6, 16),  # a group that 4 does not divide: 2-head tiles
    ],
    ids=_ids,
)
def test_decode_matches_reference(dtype: torch.dtype, head_dim: int, group: int, block_size: int) -> None:
    case = make_attention_case(
        [1, block_size, 2 * block_size + 3, 300, 1000],
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=head_dim + group,
    )
    expected = reference.paged_attention_decode(*case.args(), scale=case.scale)
    got = kernels.paged_attention_decode(*case.to(DEVICE).args(), scale=case.scale)
    torch.testing.assert_close(got.cpu(), expected, **ATTENTION_TOLERANCE[dtype])


@pytest.mark.parametrize("partition_size", [64, 256, 448, None])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_split_k_matches_reference(partition_size: int | None, dtype: torch.dtype) -> None:
    # One long and a few short sequences: None lets the planner split (a small batch); the explicit
    # sizes force the partition + reduce path, with empty partitions for the short sequences.
    case = make_attention_case(
        [4000, 0, 1, 257], num_kv_heads=2, group=4, head_dim=128, block_size=16, dtype=dtype, seed=5, query_gain=4.0
    )
    expected = reference.paged_attention_decode(*case.args(), scale=case.scale)
    got = kernels.paged_attention_decode(*case.to(DEVICE).args(), scale=case.scale, partition_size=partition_size)
    torch.testing.assert_close(got.cpu(), expected, **ATTENTION_TOLERANCE[dtype])
    assert torch.count_nonzero(got[1]) == 0


@pytest.mark.parametrize("heads_per_block", [8, 4, 2, 1])
def test_every_head_tile_matches(heads_per_block: int) -> None:
    case = make_attention_case([77, 600], num_kv_heads=2, group=8, head_dim=128, block_size=16, dtype=torch.float16)
    expected = reference.paged_attention_decode(*case.args(), scale=case.scale)
    on = case.to(DEVICE)
    got = cuda.paged_attention_decode(
        *on.args(), scale=on.scale, max_seq_len=600, partition_size=None, heads_per_block=heads_per_block
    )
    torch.testing.assert_close(got.cpu(), expected, **ATTENTION_TOLERANCE[torch.float16])


def test_decode_runs_on_the_current_stream() -> None:
    case = make_attention_case([100, 200], num_kv_heads=2, group=4, head_dim=64, block_size=16, dtype=torch.float16)
    expected = reference.paged_attention_decode(*case.args(), scale=case.scale)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        on = case.to(DEVICE)
        got = kernels.paged_attention_decode(*on.args(), scale=on.scale, max_seq_len=200)
    stream.synchronize()
    torch.testing.assert_close(got.cpu(), expected, **ATTENTION_TOLERANCE[torch.float16])


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=_ids)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.uint8], ids=_ids)
def test_reshape_and_cache_matches_reference(slot_dtype: torch.dtype, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 16, 16, 4, 128, 100
    key = torch.randint(0, 200, (num_tokens, num_kv_heads, head_dim), generator=gen).to(dtype)
    value = torch.randint(0, 200, (num_tokens, num_kv_heads, head_dim), generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(slot_dtype)
    slots[::7] = -1
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    on = [t.to(DEVICE) for t in (key, value, *caches, slots)]
    reference.reshape_and_cache(key, value, caches[0], caches[1], slots)
    kernels.reshape_and_cache(*on)
    assert torch.equal(on[2].cpu(), caches[0]) and torch.equal(on[3].cpu(), caches[1])


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float8_e4m3fn], ids=_ids)
def test_gather_scatter_match_reference(dtype: torch.dtype) -> None:
    build = torch.float16 if dtype == torch.float8_e4m3fn else dtype
    caches = [(k.to(dtype), v.to(dtype)) for k, v in make_caches(4, 12, 16, 2, 128, build, seed=2)]
    ids = [11, 0, 5, 5, 3]
    on = [(k.to(DEVICE), v.to(DEVICE)) for k, v in caches]
    pages = kernels.gather_pages(on, torch.tensor(ids, device=DEVICE))
    expected = reference.gather_pages(
        [(k.view(torch.uint8), v.view(torch.uint8)) for k, v in caches], torch.tensor(ids)
    )
    assert torch.equal(pages.cpu().view(torch.uint8), expected)

    # Index and fill through byte views: not every op is implemented for fp8.
    distinct = pages.view(torch.uint8)[[0, 1, 2, 4]].view(dtype)
    fresh = [tuple(torch.zeros_like(t.view(torch.uint8)).view(dtype) for t in pair) for pair in on]
    kernels.scatter_pages(distinct, fresh, [1, 2, 3, 4])
    back = kernels.gather_pages(fresh, [1, 2, 3, 4])
    assert torch.equal(back.cpu().view(torch.uint8), distinct.cpu().view(torch.uint8))


@pytest.mark.parametrize("in_dtype", DTYPES, ids=_ids)
def test_fp8_matches_reference_bit_for_bit(in_dtype: torch.dtype) -> None:
    pages = make_fp8_pages((5, 3, 2, 16, 4, 128), in_dtype, seed=3)
    q_ref, scales_ref = reference.quantize_fp8(pages)
    q, scales = kernels.quantize_fp8(pages.to(DEVICE))
    assert torch.equal(scales.cpu(), scales_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    for out_dtype in DTYPES:
        expected = reference.dequantize_fp8(q_ref, scales_ref, out_dtype)
        got = kernels.dequantize_fp8(q, scales, out_dtype)
        assert torch.equal(got.cpu(), expected), out_dtype


def test_cuda_rejects_unsupported_head_dim() -> None:
    case = make_attention_case([5], num_kv_heads=1, group=1, head_dim=80, block_size=16, dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim 80 is not supported on CUDA"):
        kernels.paged_attention_decode(*case.to(DEVICE).args(), scale=case.scale)


@pytest.mark.parametrize("in_dtype", DTYPES, ids=_ids)
def test_fp8_packed_pages_match_reference(in_dtype: torch.dtype) -> None:
    """Quantize into, and dequantize from, views at a page stride (packed encoded pages)."""
    shape = (5, 3, 2, 16, 4, 128)
    pages = make_fp8_pages(shape, in_dtype, seed=4)
    q_ref, scales_ref = reference.quantize_fp8(pages)
    values = pages[0].numel()
    values_at, page_bytes = 96, 96 + values + 16
    packed = torch.zeros((shape[0], page_bytes), dtype=torch.uint8, device=DEVICE)
    q = packed[:, values_at : values_at + values].view(torch.float8_e4m3fn).view(shape)
    scales = packed[:, : 3 * 2 * 4 * 4].view(torch.float32).view(5, 3, 2, 4)
    kernels.quantize_fp8(pages.to(DEVICE), out=q, out_scales=scales)
    assert torch.equal(scales.cpu(), scales_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert int(packed[:, 3 * 2 * 4 * 4 : values_at].count_nonzero()) == 0  # padding untouched
    for out_dtype in DTYPES:
        expected = reference.dequantize_fp8(q_ref, scales_ref, out_dtype)
        assert torch.equal(kernels.dequantize_fp8(q, scales, out_dtype).cpu(), expected), out_dtype


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("in_dtype", DTYPES, ids=_ids)
def test_fp8_refuses_non_finite_pages_like_the_reference(in_dtype: torch.dtype, bad: float) -> None:
    """The kernel's absmax propagates NaN (fmaxf would drop it), so a NaN or inf anywhere in a slab gives a
    non-finite scale and the launcher refuses the pages, naming the same slab as on CPU."""
    pages = make_fp8_pages((3, 2, 2, 16, 4, 128), in_dtype, seed=5)
    pages[1, 1, 0, 9, 2, 100] = bad
    with pytest.raises(kernels.NonFiniteKV, match=r"pages\[1\] layer 1 K kv head 2: holds NaN or inf"):
        kernels.quantize_fp8(pages)
    with pytest.raises(kernels.NonFiniteKV, match=r"pages\[1\] layer 1 K kv head 2: holds NaN or inf"):
        kernels.quantize_fp8(pages.to(DEVICE))


def test_fp8_tiny_slab_is_zeros_bit_for_bit_with_the_reference() -> None:
    pages = make_fp8_pages((2, 2, 2, 16, 4, 128), torch.bfloat16, seed=6)
    pages[0, 1] = 0
    pages[0, 1, 0, 0, 0, 0] = 1e-40  # 448 / absmax overflows fp32
    q_ref, scales_ref = reference.quantize_fp8(pages)
    q, scales = kernels.quantize_fp8(pages.to(DEVICE))
    assert torch.equal(scales.cpu(), scales_ref) and scales_ref[0, 1, 0, 0] == 0
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
