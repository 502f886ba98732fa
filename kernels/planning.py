"""Launch planning for the CUDA kernels: pure integer arithmetic, no torch, no CuPy.

Kept apart from the launchers so the choices (head tiles, split-K partitions, copy widths) can be
tested on any machine, and so the launcher and the explicit instantiations in the .cu files are
checked against one list of supported configurations (tests/kernels/test_planning.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Head dims the decode kernel is instantiated for (paged_attention.cu). A head_dim row must be a
# power-of-two number of 16-byte vectors per token group; these are the ones real models use.
SUPPORTED_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
# Query heads per thread block (all sharing one kv head), largest first.
HEADS_PER_BLOCK_CHOICES: tuple[int, ...] = (8, 4, 2, 1)
# NOTE: 8-head tiles read each K/V row once per kv head but need ~170 registers (2 resident blocks per
# SM); 4-head tiles read GQA-8 rows twice (the second read mostly from L2) with 128 registers and 4
# resident blocks. For a memory-bound decode the extra loads in flight are expected to win; the
# benchmark compares both on a GPU (benchmarks/kernel_bench.py), and callers may force 8.
DEFAULT_MAX_HEADS_PER_BLOCK = 4

# Split-K: a partition shorter than this costs more in the extra reduce pass (one fp32 head_dim row
# per partition, written and read back) than it gains in parallelism.
MIN_PARTITION_TOKENS = 256
# Partition sizes are rounded up to a multiple of this many tokens (a multiple of every warp step).
PARTITION_ALIGN_TOKENS = 64
# Split until about this many decode blocks per SM are in flight (the decode kernel fits 2-4 per SM).
TARGET_BLOCKS_PER_SM = 4
# The reduce kernel keeps one fp32 weight per partition in shared memory: 16 KiB at this bound.
MAX_PARTITIONS = 4096
# CUDA grid limits for the y and z dimensions (sequences, partitions).
MAX_GRID_YZ = 65535

COPY_UNIT_CHOICES: tuple[int, ...] = (16, 8, 4, 2, 1)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """How one decode launch splits its sequences.

    Invariant: `partition_size * num_partitions >= max_seq_len`, so every token of every sequence is in
    exactly one partition; `num_partitions == 1` means a single pass that writes the output directly.
    """

    partition_size: int
    num_partitions: int

    @property
    def split(self) -> bool:
        return self.num_partitions > 1


def heads_per_block(num_heads: int, num_kv_heads: int, max_heads: int = DEFAULT_MAX_HEADS_PER_BLOCK) -> int:
    """Query heads one decode block handles: the largest choice <= max_heads that divides the GQA group.

    Dividing the group guarantees every head of a tile shares one kv head (group 6 gives 2, group 3 gives 1).
    """
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    if max_heads not in HEADS_PER_BLOCK_CHOICES:
        raise ValueError(f"max_heads must be one of {HEADS_PER_BLOCK_CHOICES}, got {max_heads}")
    group = num_heads // num_kv_heads
    return next(h for h in HEADS_PER_BLOCK_CHOICES if h <= max_heads and group % h == 0)


def plan_decode(
    max_seq_len: int,
    num_seqs: int,
    num_head_tiles: int,
    num_sms: int,
    partition_size: int | None = None,
) -> DecodePlan:
    """Choose the split-K partitioning of a decode launch.

    With `partition_size` given, use it (a single pass when it covers `max_seq_len`). Otherwise split
    only while the grid (`num_seqs * num_head_tiles` blocks) is smaller than TARGET_BLOCKS_PER_SM
    blocks per SM, and never below MIN_PARTITION_TOKENS tokens per partition: a large batch runs in
    one pass however long its contexts (the online softmax has no length limit).
    """
    if max_seq_len < 0 or num_seqs < 0 or num_head_tiles <= 0 or num_sms <= 0:
        raise ValueError(
            f"bad decode geometry: max_seq_len={max_seq_len}, num_seqs={num_seqs}, "
            f"num_head_tiles={num_head_tiles}, num_sms={num_sms}"
        )
    longest = max(max_seq_len, 1)
    if partition_size is not None:
        if partition_size <= 0:
            raise ValueError(f"partition_size must be >= 1, got {partition_size}")
        parts = math.ceil(longest / partition_size)
        if parts > min(MAX_PARTITIONS, MAX_GRID_YZ):
            raise ValueError(
                f"partition_size {partition_size} splits {max_seq_len} tokens into {parts} partitions; "
                f"at most {MAX_PARTITIONS} are supported"
            )
        return DecodePlan(partition_size=partition_size if parts > 1 else longest, num_partitions=parts)
    base_blocks = max(num_seqs * num_head_tiles, 1)
    wanted = math.ceil(TARGET_BLOCKS_PER_SM * num_sms / base_blocks)
    parts = min(wanted, longest // MIN_PARTITION_TOKENS, MAX_PARTITIONS)
    if parts <= 1:
        return DecodePlan(partition_size=longest, num_partitions=1)
    size = _round_up(math.ceil(longest / parts), PARTITION_ALIGN_TOKENS)
    return DecodePlan(partition_size=size, num_partitions=math.ceil(longest / size))


def copy_unit_bytes(*byte_quantities: int) -> int:
    """Widest copy unit (16, 8, 4, 2 or 1 bytes) dividing every size, stride and address given."""
    for unit in COPY_UNIT_CHOICES:
        if all(q % unit == 0 for q in byte_quantities):
            return unit
    return 1


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
