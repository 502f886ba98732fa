"""workers.page_codec on CPU (the torch references): raw round trips exact, fp8 within the documented
bound, the packed page format as kvstore/layout.py writes it down, and bad input refused by name.
The CUDA half (the kernels writing packed pages in place) is in tests/gpu/test_kernels_cuda.py."""

from __future__ import annotations

import struct

import pytest
import torch

from kernels import FP8_REL_ERROR, FP8_SUBNORMAL_ABS_ERROR
from kvstore.layout import DType, PageEncoding, PageLayout
from workers.page_codec import PageCodec

pytestmark = pytest.mark.fast  # pure: no process, node or network (tests/conftest.py)

DTYPES = {DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16, DType.FLOAT32: torch.float32}
ULP = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}  # half an ulp, relative


def pages_for(layout: PageLayout, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Heads of different magnitudes: per-head scales matter.
    x = torch.randn((n, *layout.page_shape), generator=g)
    x = x * torch.logspace(-2, 1, layout.num_kv_heads)[None, None, None, None, :, None]
    return x.to(DTYPES[layout.dtype])


@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: d.name.lower())
@pytest.mark.parametrize("shape", [(2, 2, 64, 16), (3, 1, 5, 3)], ids=["aligned", "odd"])
def test_raw_round_trip_is_exact(dtype: DType, shape: tuple[int, int, int, int]) -> None:
    layout = PageLayout(dtype, *shape)
    codec = PageCodec(layout)
    pages = pages_for(layout, 3, seed=1)
    bufs = codec.encode_buffers(pages)
    assert [b.nbytes for b in bufs] == [layout.page_bytes] * 3
    back = codec.decode(bufs)
    assert back.dtype == pages.dtype and torch.equal(back.view(torch.uint8), pages.view(torch.uint8))


@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: d.name.lower())
@pytest.mark.parametrize("shape", [(2, 2, 64, 16), (3, 1, 5, 3), (1, 4, 128, 8)], ids=["aligned", "odd", "wide"])
def test_fp8_round_trip_within_bound(dtype: DType, shape: tuple[int, int, int, int]) -> None:
    layout = PageLayout(dtype, *shape)
    codec = PageCodec(layout, "fp8")
    assert codec.stored.encoding is PageEncoding.FP8_E4M3
    pages = pages_for(layout, 4, seed=2)
    bufs = codec.encode_buffers(pages)
    assert [b.nbytes for b in bufs] == [codec.stored.page_bytes] * 4
    back = codec.decode(bufs)
    assert back.dtype == pages.dtype and back.shape == pages.shape
    x, y = pages.double(), back.double()
    # scale per (page, layer, K/V, head): absmax over block and head_dim
    s = pages.double().abs().amax(dim=(3, 5), keepdim=True) / 448.0
    bound = FP8_REL_ERROR * x.abs() + FP8_SUBNORMAL_ABS_ERROR * s + ULP[pages.dtype] * y.abs()
    assert bool(((y - x).abs() <= bound).all())


def test_fp8_page_bytes_follow_the_layout() -> None:
    """Scales first (fp32, little endian), values at values_offset, zero padding: the format of
    kvstore/layout.py, readable without torch."""
    layout = PageLayout(DType.FLOAT32, 3, 1, 5, 3)  # odd sizes: both paddings present
    codec = PageCodec(layout, PageEncoding.FP8_E4M3)
    pages = pages_for(layout, 2, seed=3)
    raw = bytes(codec.encode_buffers(pages)[1])
    st = codec.stored
    scales = struct.unpack_from(f"<{3 * 2 * 1}f", raw, 0)
    expect = pages[1].abs().amax(dim=(2, 4)).flatten() / 448.0  # [layers, 2, heads]
    assert torch.equal(torch.tensor(scales), expect)
    assert raw[st.scales_bytes : st.values_offset] == bytes(st.values_offset - st.scales_bytes)
    assert raw[st.values_offset + st.num_values :] == bytes(st.page_bytes - st.values_offset - st.num_values)
    values = torch.frombuffer(bytearray(raw[st.values_offset : st.values_offset + st.num_values]), dtype=torch.uint8)
    decoded = values.view(torch.float8_e4m3fn).float().view(layout.page_shape) * torch.tensor(scales).view(
        3, 2, 1, 1, 1
    )
    assert torch.equal(codec.decode([raw])[0], decoded)
    # Equal pages give equal bytes (padding is zero, not leftovers).
    assert bytes(codec.encode_buffers(pages)[1]) == raw


def test_empty_and_bad_input() -> None:
    layout = PageLayout(DType.FLOAT16, 2, 2, 64, 16)
    codec = PageCodec(layout, "fp8")
    assert codec.decode([]).shape == (0, *layout.page_shape)
    assert codec.encode_buffers(torch.empty((0, *layout.page_shape), dtype=torch.float16)) == []
    with pytest.raises(ValueError, match=r"page 0 is 10 bytes; layout float16 as fp8-e4m3"):
        codec.decode([b"x" * 10])
    with pytest.raises(TypeError, match=r"pages have dtype torch\.float32"):
        codec.encode(torch.zeros((1, *layout.page_shape)))
    with pytest.raises(ValueError, match="pages has shape"):
        codec.encode(torch.zeros((1, 2, 2, 16, 2, 32), dtype=torch.float16))
    with pytest.raises(ValueError, match="the model's raw layout"):
        PageCodec(codec.stored)
    with pytest.raises(ValueError, match="unknown page encoding 'int4'"):
        PageCodec(layout, "int4")
    with pytest.raises(ValueError, match="encodes float16, bfloat16, float32"):
        PageCodec(PageLayout(DType.FLOAT8_E4M3, 2, 2, 64, 16), "fp8")


def test_fp8_non_finite_pages_are_refused_on_encode_and_bad_scales_on_decode() -> None:
    """NaN or inf KV is never stored in fp8 (its whole plane would decode as NaN); a stored page whose
    scale is not finite (another writer's, or damaged) is refused on decode, naming the page, so a worker
    uses the pages before it."""
    import numpy as np

    import kernels

    layout = PageLayout(DType.BFLOAT16, 2, 2, 64, 16)
    codec = PageCodec(layout, "fp8")
    pages = pages_for(layout, 3, seed=4)
    pages[1, 0, 1, 2, 0, 3] = float("inf")
    with pytest.raises(kernels.NonFiniteKV, match=r"pages\[1\] layer 0 V kv head 0") as err:
        codec.encode_buffers(pages)
    assert err.value.page == 1
    bufs = [bytearray(b) for b in codec.encode_buffers(pages[:1])] * 3
    bufs[2] = bytearray(bufs[2])
    np.frombuffer(bufs[2], dtype=np.float32, count=1)[:] = float("nan")  # the first scale of page 2
    with pytest.raises(kernels.NonFiniteKV, match=r"q\[2\] layer 0 K kv head 0") as err:
        codec.decode(bufs)
    assert err.value.page == 2
    assert codec.decode(bufs[:2]).shape == (2, *layout.page_shape)
