"""quantize_fp8 / dequantize_fp8 (CPU reference path): scales, round-trip error bound, byte form.

The bound tested (kernels.ops.FP8_REL_ERROR, FP8_SUBNORMAL_ABS_ERROR): for a value x of a
(page, layer, K/V, kv head) slab with scale s = absmax / 448, the value x' read back in dtype `out` obeys
    |x' - x| <= 2^-4 |x| + 2^-10 s + u_out |x'| + t_out
2^-4: half a step of e4m3's 3-bit mantissa, relative (normal range); 2^-10 s: half the subnormal step;
u_out, t_out: rounding of the result to the output dtype (half an ulp relative, and half its smallest
subnormal step in absolute terms).
"""

from __future__ import annotations

import pickle

import pytest
import torch

import kernels
from kernels import FP8_E4M3_MAX, FP8_REL_ERROR, FP8_SUBNORMAL_ABS_ERROR
from tests.kernels._cases import DTYPES, make_fp8_pages

SHAPE = (3, 2, 2, 16, 4, 64)  # [num_pages, num_layers, 2, block_size, num_kv_heads, head_dim]
OUTPUT_ROUNDING = {  # dtype -> (u_out, t_out)
    torch.float32: (2.0**-24, 2.0**-150),
    torch.float16: (2.0**-11, 2.0**-25),
    torch.bfloat16: (2.0**-8, 2.0**-134),
}


@pytest.mark.parametrize("in_dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("out_dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_within_bound(in_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    pages = make_fp8_pages(SHAPE, in_dtype, seed=11)
    q, scales = kernels.quantize_fp8(pages)
    assert q.dtype == torch.float8_e4m3fn and q.shape == pages.shape
    assert scales.dtype == torch.float32 and scales.shape == (3, 2, 2, 4)

    x = pages.double()
    back = kernels.dequantize_fp8(q, scales, out_dtype)
    assert back.dtype == out_dtype and back.shape == pages.shape
    s = scales.double()[:, :, :, None, :, None]
    u_out, t_out = OUTPUT_ROUNDING[out_dtype]
    err = (back.double() - x).abs()
    bound = FP8_REL_ERROR * x.abs() + FP8_SUBNORMAL_ABS_ERROR * s + u_out * back.double().abs() + t_out
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g}"

    # The bound is tight, not vacuous: normal-range values do reach close to 2^-4 relative error.
    normal = (x.abs() >= 2.0**-6 * s) & (s > 0)
    worst = (err[normal] / x.abs()[normal]).max().item()
    assert worst > 2.0**-5


def test_scales_are_slab_absmax_over_448() -> None:
    pages = make_fp8_pages(SHAPE, torch.float32, seed=12)
    _, scales = kernels.quantize_fp8(pages)
    absmax = pages.abs().amax(dim=(3, 5))  # over block_size and head_dim
    torch.testing.assert_close(scales, absmax / FP8_E4M3_MAX, rtol=0, atol=0)
    assert scales[0, 0, 0, 0] == 0  # the all-zero slab


def test_zero_slab_and_absmax_values() -> None:
    pages = make_fp8_pages(SHAPE, torch.float16, seed=13)
    q, scales = kernels.quantize_fp8(pages)
    back = kernels.dequantize_fp8(q, scales, torch.float16)
    assert torch.count_nonzero(back[0, 0, 0, :, 0, :]) == 0
    # Each slab's absmax element maps to +-448 exactly.
    bits = q.view(torch.uint8)
    assert bool(((bits & 0x7F) <= 0x7E).all())  # 0x7F is NaN in e4m3fn: never produced
    assert torch.equal(q.float().abs().amax(dim=(3, 5))[scales > 0], torch.full_like(scales[scales > 0], 448.0))


def test_uint8_bytes_dequantize_like_fp8() -> None:
    pages = make_fp8_pages(SHAPE, torch.bfloat16, seed=14)
    q, scales = kernels.quantize_fp8(pages)
    assert torch.equal(
        kernels.dequantize_fp8(q.view(torch.uint8), scales, torch.bfloat16),
        kernels.dequantize_fp8(q, scales, torch.bfloat16),
    )


def test_no_pages() -> None:
    q, scales = kernels.quantize_fp8(torch.empty(0, 2, 2, 16, 4, 64, dtype=torch.float16))
    assert q.shape == (0, 2, 2, 16, 4, 64) and scales.shape == (0, 2, 2, 4)
    assert kernels.dequantize_fp8(q, scales).shape == q.shape


def _packed_views(packed: torch.Tensor, shape: tuple[int, ...], values_at: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) views into packed pages [n, page_bytes]: scales at byte 0, values at `values_at`."""
    n, layers, two, block, heads, dim = shape
    values = layers * two * block * heads * dim
    q = packed[:, values_at : values_at + values].view(torch.float8_e4m3fn).view(shape)
    scales = packed[:, : layers * two * heads * 4].view(torch.float32).view(n, layers, two, heads)
    return q, scales


def test_into_packed_pages_equals_separate_tensors() -> None:
    """out / out_scales may be views at a page stride (encoded pages): same bits as the plain result,
    bytes outside the views untouched, and dequantize reads the views back."""
    pages = make_fp8_pages(SHAPE, torch.bfloat16, seed=15)
    q_ref, scales_ref = kernels.quantize_fp8(pages)
    values_at = 64
    page_bytes = values_at + pages[0].numel() + 32
    packed = torch.full((SHAPE[0], page_bytes), 0xA5, dtype=torch.uint8)
    q, scales = _packed_views(packed, SHAPE, values_at)
    got_q, got_scales = kernels.quantize_fp8(pages, out=q, out_scales=scales)
    assert got_q.data_ptr() == q.data_ptr() and got_scales.data_ptr() == scales.data_ptr()
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scales, scales_ref)
    assert bool((packed[:, 2 * 2 * 4 * 4 : values_at] == 0xA5).all())  # the gap
    assert bool((packed[:, values_at + pages[0].numel() :] == 0xA5).all())  # the tail
    assert torch.equal(kernels.dequantize_fp8(q, scales, torch.bfloat16),
                       kernels.dequantize_fp8(q_ref, scales_ref, torch.bfloat16))  # fmt: skip


def test_out_arguments_checked() -> None:
    pages = make_fp8_pages(SHAPE, torch.float16, seed=16)
    q = torch.empty(SHAPE, dtype=torch.float8_e4m3fn)
    scales = torch.empty((3, 2, 2, 4), dtype=torch.float32)
    with pytest.raises(ValueError, match="both out and out_scales"):
        kernels.quantize_fp8(pages, out=q)
    with pytest.raises(ValueError, match="out_scales has shape"):
        kernels.quantize_fp8(pages, out=q, out_scales=scales[:, :1])
    with pytest.raises(TypeError, match="out must have dtype"):
        kernels.quantize_fp8(pages, out=q.float(), out_scales=scales)
    strided = torch.empty((3, 2, 2, 16, 4, 128), dtype=torch.float8_e4m3fn)[..., ::2]
    with pytest.raises(ValueError, match="each page contiguously"):
        kernels.quantize_fp8(pages, out=strided, out_scales=scales)
    overlapping = torch.empty(SHAPE[1:], dtype=torch.uint8).expand(SHAPE)
    with pytest.raises(ValueError, match="each page contiguously"):
        kernels.dequantize_fp8(overlapping, scales)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("in_dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_non_finite_values_are_refused_naming_the_slab_and_change_nothing(in_dtype: torch.dtype, bad: float) -> None:
    """One non-finite activation used to be stored with a NaN or inf scale, decoding its whole (layer, K/V,
    head) plane as NaN or 0. Now quantization refuses it, saying where, and leaves `out` as it was."""
    pages = make_fp8_pages(SHAPE, in_dtype, seed=21)
    pages[2, 1, 1, 5, 3, 7] = bad  # page 2, layer 1, V, token 5, kv head 3
    out = torch.full(SHAPE, 7, dtype=torch.uint8)
    out_scales = torch.full((3, 2, 2, 4), -1.0)
    with pytest.raises(kernels.NonFiniteKV, match=r"pages\[2\] layer 1 V kv head 3: holds NaN or inf") as err:
        kernels.quantize_fp8(pages, out=out, out_scales=out_scales)
    assert (err.value.page, err.value.layer, err.value.kv, err.value.head) == (2, 1, 1, 3)
    assert bool((out == 7).all()) and bool((out_scales == -1).all())
    back = pickle.loads(pickle.dumps(err.value))  # as a Ray actor hands it to the driver
    assert type(back) is kernels.NonFiniteKV and str(back) == str(err.value)
    assert (back.page, back.layer, back.kv, back.head) == (2, 1, 1, 3)
    with pytest.raises(kernels.NonFiniteKV):
        kernels.quantize_fp8(pages)


def test_a_slab_too_small_to_scale_is_stored_as_zeros_not_nan() -> None:
    """bf16 and fp32 hold magnitudes below 448 / FLT_MAX, where 448 / absmax overflows: the slab's zeros
    became NaN (0 * inf). Such a slab is now stored as zeros, off by less than FP8_MIN_ABSMAX."""
    for dtype in (torch.bfloat16, torch.float32):
        pages = torch.zeros(SHAPE, dtype=dtype)
        pages[0, 0, 0, 0, 0, 0] = 1e-40
        pages[1] = make_fp8_pages(SHAPE, dtype, seed=22)[1]
        q, scales = kernels.quantize_fp8(pages)
        assert not bool(torch.isnan(q.float()).any()), dtype
        assert scales[0, 0, 0, 0] == 0
        back = kernels.dequantize_fp8(q, scales, dtype)
        assert bool(torch.isfinite(back).all()) and float(back[0].abs().max()) < kernels.FP8_MIN_ABSMAX
        assert torch.equal(back[1], kernels.dequantize_fp8(*kernels.quantize_fp8(pages[1:2]), dtype)[0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0], ids=["nan", "inf", "negative"])
def test_dequantize_refuses_a_scale_no_quantizer_writes(bad: float) -> None:
    q, scales = kernels.quantize_fp8(make_fp8_pages(SHAPE, torch.float16, seed=23))
    scales[1, 0, 1, 2] = bad
    with pytest.raises(kernels.NonFiniteKV, match=r"q\[1\] layer 0 V kv head 2: has a scale that is not a finite"):
        kernels.dequantize_fp8(q, scales, torch.float16)
