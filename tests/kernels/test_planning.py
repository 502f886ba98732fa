"""Launch planning (pure) and the launcher <-> CUDA source contract, checked without a GPU."""

from __future__ import annotations

import importlib.util
import math
import re
import shutil
import subprocess

import pytest

from kernels import cuda, planning
from kernels.planning import DecodePlan, copy_unit_bytes, heads_per_block, plan_decode


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "max_heads", "expected"),
    [
        (8, 8, 4, 1),  # MHA
        (32, 8, 4, 4),  # GQA 4
        (64, 8, 4, 4),  # GQA 8, default cap
        (64, 8, 8, 8),  # GQA 8, 8-head tiles
        (24, 4, 4, 2),  # GQA 6: 4 does not divide it
        (12, 4, 8, 1),  # GQA 3
        (64, 4, 8, 8),  # GQA 16
        (32, 1, 4, 4),  # MQA
    ],
)
def test_heads_per_block_divides_the_group(num_heads: int, num_kv_heads: int, max_heads: int, expected: int) -> None:
    tile = heads_per_block(num_heads, num_kv_heads, max_heads)
    assert tile == expected and (num_heads // num_kv_heads) % tile == 0


def test_heads_per_block_rejects_bad_geometry() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        heads_per_block(6, 4)
    with pytest.raises(ValueError, match="max_heads"):
        heads_per_block(8, 2, max_heads=3)


def test_large_batch_runs_in_one_pass_however_long() -> None:
    plan = plan_decode(max_seq_len=131072, num_seqs=256, num_head_tiles=8, num_sms=132)
    assert plan == DecodePlan(partition_size=131072, num_partitions=1) and not plan.split


def test_small_batch_long_context_splits() -> None:
    plan = plan_decode(max_seq_len=32768, num_seqs=1, num_head_tiles=8, num_sms=132)
    assert plan.split
    assert plan.partition_size >= planning.MIN_PARTITION_TOKENS
    assert plan.partition_size % planning.PARTITION_ALIGN_TOKENS == 0
    assert plan.num_partitions * 8 >= planning.TARGET_BLOCKS_PER_SM * 132 // 2  # fills the GPU
    assert plan.partition_size * plan.num_partitions >= 32768


def test_short_context_never_splits_below_min_partition() -> None:
    plan = plan_decode(max_seq_len=300, num_seqs=1, num_head_tiles=1, num_sms=132)
    assert plan.num_partitions == 1 and plan.partition_size == 300


@pytest.mark.parametrize("max_seq_len", [0, 1, 255, 256, 257, 1000, 4097, 65536])
@pytest.mark.parametrize("num_seqs", [1, 3, 64])
def test_plan_covers_every_token(max_seq_len: int, num_seqs: int) -> None:
    plan = plan_decode(max_seq_len, num_seqs, num_head_tiles=2, num_sms=108)
    assert plan.partition_size * plan.num_partitions >= max_seq_len
    assert (plan.num_partitions - 1) * plan.partition_size < max(max_seq_len, 1)  # no empty partitions
    assert 1 <= plan.num_partitions <= planning.MAX_PARTITIONS


def test_explicit_partition_size() -> None:
    assert plan_decode(1000, 1, 1, 100, partition_size=64) == DecodePlan(64, math.ceil(1000 / 64))
    assert plan_decode(50, 1, 1, 100, partition_size=64) == DecodePlan(50, 1)
    with pytest.raises(ValueError, match="at most"):
        plan_decode(10**7, 1, 1, 100, partition_size=1)
    with pytest.raises(ValueError, match="partition_size must be >= 1"):
        plan_decode(10, 1, 1, 100, partition_size=0)


def test_copy_unit_bytes() -> None:
    assert copy_unit_bytes(4096, 65536, 0x7F0000001000) == 16
    assert copy_unit_bytes(4096, 24) == 8
    assert copy_unit_bytes(6, 4) == 2
    assert copy_unit_bytes(3) == 1


def test_cuda_module_imports_without_cupy() -> None:
    # Importing the launchers never needs CuPy; only launching does.
    assert callable(cuda.paged_attention_decode)
    if importlib.util.find_spec("cupy") is None:
        with pytest.raises(RuntimeError, match=r"kvstore\[gpu\]"):
            cuda._cupy()


def test_load_source_pastes_the_common_header_once() -> None:
    for filename in cuda.all_kernel_names():
        text = cuda.load_source(filename)
        assert '#include "common.cuh"' not in text
        assert text.count("struct VecTraits<__half>") == 1


def _instantiated(filename: str) -> set[str]:
    """Explicit instantiations of a .cu file as nvcc sees them (macros expanded by its preprocessor)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: cannot expand the .cu instantiation macros")
    expanded = subprocess.run(
        [nvcc, "-E", "-std=c++17", "--cuda", str(cuda.KERNEL_DIR / filename), "-o", "-"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    found = re.findall(r"template\s+__attribute__\(\(global\)\)\s+void\s+(kvstore::\w+\s*<[^>]*>)", expanded)
    return {re.sub(r"\s+", " ", name).replace("< ", "<").replace(" >", ">") for name in found}


@pytest.mark.parametrize("filename", sorted(cuda.all_kernel_names()))
def test_launcher_names_are_exactly_the_instantiations(filename: str) -> None:
    # CI compiles each .cu with nvcc and fails on register spills; that check covers a kernel only if
    # it is instantiated there, so every name the launcher may request must be, and nothing else.
    assert _instantiated(filename) == set(cuda.all_kernel_names()[filename])
