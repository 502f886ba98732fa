"""paged_attention_decode (CPU reference path) against a naive fp64 dense attention."""

from __future__ import annotations

import itertools

import pytest
import torch

import kernels
from kernels import reference
from tests.kernels._cases import DTYPES, dense_attention, make_attention_case, output_tolerance

BLOCK_SIZES = (8, 16, 32)
GQA_RATIOS = (1, 4, 8)
HEAD_DIMS = (64, 128)
NUM_KV_HEADS = 2


def ragged_lengths(block_size: int) -> list[int]:
    """One token, an exact multiple of the block size, one past it, and an unaligned longer one."""
    return [1, 2 * block_size, 2 * block_size + 1, 57]


@pytest.mark.parametrize(
    ("block_size", "group", "head_dim", "dtype"),
    list(itertools.product(BLOCK_SIZES, GQA_RATIOS, HEAD_DIMS, DTYPES)),
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_decode_matches_dense_attention(block_size: int, group: int, head_dim: int, dtype: torch.dtype) -> None:
    case = make_attention_case(
        ragged_lengths(block_size),
        num_kv_heads=NUM_KV_HEADS,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=block_size * 1000 + group * 10 + head_dim,
    )
    out = kernels.paged_attention_decode(*case.args(), scale=case.scale)
    assert out.dtype == dtype and out.shape == case.query.shape
    torch.testing.assert_close(out.double(), dense_attention(case), **output_tolerance(dtype))


@pytest.mark.parametrize("partition_size", [1, 7, 16, 64])
@pytest.mark.parametrize("query_gain", [1.0, 8.0])
def test_split_k_equals_unsplit(partition_size: int, query_gain: float) -> None:
    # fp32 so that only the merge order differs; gain 8 makes logits span ~±40, so a partition's own
    # max differs from the global one and the rescaling in the merge matters.
    case = make_attention_case(
        [1, 16, 33, 100, 257],
        num_kv_heads=2,
        group=4,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=7,
        query_gain=query_gain,
    )
    unsplit = reference.paged_attention_decode(*case.args(), scale=case.scale)
    split = kernels.paged_attention_decode(*case.args(), scale=case.scale, partition_size=partition_size)
    # fp32 logits of magnitude ~40 (gain 8) carry ~4e-6 absolute rounding error, which exp() turns into
    # a relative error of that size in the weights: the tolerances scale with the gain.
    torch.testing.assert_close(split, unsplit, rtol=1e-5, atol=1e-6 * query_gain)
    torch.testing.assert_close(split.double(), dense_attention(case), rtol=1e-5, atol=1e-6 * query_gain)


def test_sharp_softmax_matches_dense() -> None:
    case = make_attention_case(
        [5, 40, 129], num_kv_heads=1, group=8, head_dim=128, block_size=32, dtype=torch.float16, seed=3, query_gain=8.0
    )
    out = kernels.paged_attention_decode(*case.args(), scale=case.scale)
    torch.testing.assert_close(out.double(), dense_attention(case), **output_tolerance(torch.float16))


def test_empty_sequence_gives_zeros() -> None:
    case = make_attention_case(
        [0, 9, 0], num_kv_heads=2, group=2, head_dim=64, block_size=8, dtype=torch.bfloat16, seed=1
    )
    out = kernels.paged_attention_decode(*case.args(), scale=case.scale)
    assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[2]) == 0
    torch.testing.assert_close(out.double(), dense_attention(case), **output_tolerance(torch.bfloat16))
    split = kernels.paged_attention_decode(*case.args(), scale=case.scale, partition_size=4)
    torch.testing.assert_close(split, out, rtol=2.0**-7, atol=1e-4)


def test_no_sequences() -> None:
    case = make_attention_case([], num_kv_heads=2, group=1, head_dim=64, block_size=8, dtype=torch.float32)
    assert kernels.paged_attention_decode(*case.args(), scale=case.scale).shape == (0, 2, 64)


def test_non_power_of_two_head_dim_on_reference() -> None:
    # The reference (CPU) takes any head_dim; only the CUDA kernels are limited to 64/128/256.
    case = make_attention_case([3, 20], num_kv_heads=3, group=2, head_dim=80, block_size=16, dtype=torch.float32)
    out = kernels.paged_attention_decode(*case.args(), scale=case.scale)
    torch.testing.assert_close(out.double(), dense_attention(case), **output_tolerance(torch.float32))
