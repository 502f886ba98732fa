"""The paged KV cache of one worker: pure block bookkeeping, and the per-layer torch caches it indexes.

Two layers, kept apart on purpose (STYLE.md §2):

- `BlockAllocator` and `BlockManager` are plain Python: a free list and per-sequence block tables. No
  torch, so they can be tested and replayed anywhere.
- `PagedKVCache` owns the tensors, per layer `key_cache` / `value_cache` of shape
  `[num_blocks, block_size, num_kv_heads, head_dim]`, and turns the bookkeeping into slot mappings and
  block tables for the kernels, and into pages `[n, num_layers, 2, block_size, num_kv_heads, head_dim]`
  (DESIGN.md §4) for the cache service through `kernels.gather_pages` / `kernels.scatter_pages`.

Token `t` of a sequence lives in cache block `blocks[t // block_size]` at offset `t % block_size`, i.e.
slot `blocks[t // block_size] * block_size + t % block_size`, in every layer.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import torch

import kernels
from kvstore.layout import DType, PageLayout

__all__ = [
    "TORCH_TO_DTYPE",
    "BlockAllocator",
    "BlockManager",
    "CacheFullError",
    "PagedKVCache",
    "SeqId",
    "SequenceBlocks",
    "UnknownSequenceError",
    "kv_dtype",
    "pages_from_buffers",
    "pages_to_buffers",
    "torch_dtype",
]

SeqId: TypeAlias = int | str
"""A sequence's name inside one cache: a request id, or a counter."""

Buffer: TypeAlias = bytes | bytearray | memoryview
"""Page bytes as `kvstore.client` takes and returns them."""

TORCH_TO_DTYPE: dict[torch.dtype, DType] = {
    torch.float16: DType.FLOAT16,
    torch.bfloat16: DType.BFLOAT16,
    torch.float32: DType.FLOAT32,
    torch.float8_e4m3fn: DType.FLOAT8_E4M3,
    torch.uint8: DType.UINT8,
}
_DTYPE_TO_TORCH = {v: k for k, v in TORCH_TO_DTYPE.items()}


def kv_dtype(dtype: torch.dtype) -> DType:
    """The kvstore DType of a torch dtype (the dtype named in page layouts and namespaces)."""
    try:
        return TORCH_TO_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"no kvstore DType for torch dtype {dtype}; one of {list(TORCH_TO_DTYPE)}") from None


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype of a kvstore DType."""
    return _DTYPE_TO_TORCH[DType.parse(dtype)]


class CacheFullError(RuntimeError):
    """Not enough free blocks for a request. Raised before anything is allocated or written."""


class UnknownSequenceError(LookupError):
    """A sequence id that this cache does not hold (never added, or already freed)."""


# ---------------------------------------------------------------------------------------- pure bookkeeping


class BlockAllocator:
    """A free list over block ids `0 .. num_blocks - 1`.

    Invariant: every id is either free (in the free list, once) or handed out, never both; `free`
    of an id that is not handed out raises instead of corrupting the list. Allocation is FIFO over the
    free list, so a freed block is reused as late as possible (it helps debugging stale block tables).
    """

    __slots__ = ("_free", "_free_set", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._free_set: set[int] = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Hand out `n` blocks; raises CacheFullError (and hands out none) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if not self.can_allocate(n):
            raise CacheFullError(f"need {n} free KV blocks, {len(self._free)} of {self.num_blocks} are free")
        out = [self._free.popleft() for _ in range(n)]
        self._free_set.difference_update(out)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks to the free list. All are checked before any is returned."""
        blocks = list(blocks)
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} outside [0, {self.num_blocks})")
            if b in self._free_set:
                raise ValueError(f"block {b} is already free (double free)")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks freed twice in one call: {blocks}")
        self._free.extend(blocks)
        self._free_set.update(blocks)


@dataclass(slots=True)
class SequenceBlocks:
    """One sequence's block table. Invariant: `len(blocks) == ceil(num_tokens / block_size)`."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class BlockManager:
    """Per-sequence block tables over one BlockAllocator. Pure: no torch.

    Invariants: each allocated block belongs to exactly one sequence; a sequence holds exactly the
    blocks its tokens need (a block is taken when its first token arrives); every mutating call
    either succeeds entirely or raises before changing anything.
    """

    __slots__ = ("_seqs", "allocator", "block_size")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self._seqs: dict[SeqId, SequenceBlocks] = {}

    # queries

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[SeqId]:
        return list(self._seqs)

    def get(self, seq_id: SeqId) -> SequenceBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"sequence {seq_id!r} is not in this cache") from None

    def num_tokens(self, seq_id: SeqId) -> int:
        """Tokens held for the sequence; 0 for an unknown one."""
        seq = self._seqs.get(seq_id)
        return seq.num_tokens if seq else 0

    def num_full_blocks(self, seq_id: SeqId) -> int:
        """Blocks of the sequence that hold block_size tokens (the ones that may be exported)."""
        return self.num_tokens(seq_id) // self.block_size

    def blocks_needed(self, seq_id: SeqId, num_new_tokens: int) -> int:
        """New blocks that appending `num_new_tokens` to the sequence would take."""
        have = self.num_tokens(seq_id)
        return math.ceil((have + num_new_tokens) / self.block_size) - math.ceil(have / self.block_size)

    def can_append(self, seq_id: SeqId, num_new_tokens: int) -> bool:
        return self.allocator.can_allocate(self.blocks_needed(seq_id, num_new_tokens))

    # commands

    def append(self, seq_id: SeqId, num_new_tokens: int) -> list[int]:
        """Reserve room for `num_new_tokens` more tokens (adding the sequence if new); returns their slots.

        Raises CacheFullError, leaving the sequence as it was (and not added), when blocks run out.
        """
        return self.append_batch([(seq_id, num_new_tokens)])[0]

    def append_batch(self, requests: Sequence[tuple[SeqId, int]]) -> list[list[int]]:
        """`append` for several distinct sequences at once: all succeed, or none changes."""
        ids = [s for s, _ in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a sequence appears twice in one batch: {ids}")
        for s, n in requests:
            if n < 0:
                raise ValueError(f"cannot append {n} tokens to sequence {s!r}")
        needed = sum(self.blocks_needed(s, n) for s, n in requests)
        if not self.allocator.can_allocate(needed):
            total = sum(n for _, n in requests)
            raise CacheFullError(
                f"{total} new tokens need {needed} more KV blocks of {self.block_size} tokens; "
                f"{self.allocator.num_free} of {self.allocator.num_blocks} are free"
            )
        out: list[list[int]] = []
        for s, n in requests:
            seq = self._seqs.setdefault(s, SequenceBlocks())
            seq.blocks.extend(self.allocator.allocate(self.blocks_needed(s, n)))
            start = seq.num_tokens
            bs = self.block_size
            out.append([seq.blocks[t // bs] * bs + t % bs for t in range(start, start + n)])
            seq.num_tokens += n
        return out

    def append_full_blocks(self, seq_id: SeqId, num_blocks: int) -> list[int]:
        """Take `num_blocks` whole blocks for the sequence's next tokens (for imported pages); returns them.

        The sequence must be new or end on a block boundary: a page is a whole block, and a partial
        last block cannot be followed by a page.
        """
        have = self.num_tokens(seq_id)
        if have % self.block_size:
            raise ValueError(
                f"sequence {seq_id!r} holds {have} tokens, not a multiple of block_size {self.block_size}: "
                "pages can only be imported at a block boundary"
            )
        if not self.allocator.can_allocate(num_blocks):
            raise CacheFullError(
                f"importing {num_blocks} pages needs {num_blocks} KV blocks; "
                f"{self.allocator.num_free} of {self.allocator.num_blocks} are free"
            )
        self.append(seq_id, num_blocks * self.block_size)
        return self._seqs[seq_id].blocks[-num_blocks:] if num_blocks else []

    def free(self, seq_id: SeqId) -> int:
        """Drop the sequence and return its blocks to the free list; returns how many."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequenceError(f"sequence {seq_id!r} is not in this cache")
        self.allocator.free(seq.blocks)
        return len(seq.blocks)


# ---------------------------------------------------------------------------------------- tensors


class PagedKVCache:
    """Per-layer paged K/V tensors on one device, indexed by a BlockManager.

    `key_caches[l]` and `value_caches[l]` are `[num_blocks, block_size, num_kv_heads, head_dim]`,
    contiguous, in `dtype` (the kernels' layout). Slots a sequence has not written hold garbage;
    attention never reads past a sequence's `num_tokens`.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.manager = BlockManager(num_blocks, block_size)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = torch.device(device)
        self._layout = PageLayout(kv_dtype(dtype), num_layers, num_kv_heads, head_dim, block_size)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # NOTE: zeros rather than empty: a bug that reads an unwritten slot then gives a wrong number
        # rather than a NaN that depends on what the allocator left there.
        self.key_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(key_cache, value_cache)] per layer: the `kv_caches` argument of gather/scatter_pages."""
        return list(zip(self.key_caches, self.value_caches, strict=True))

    def page_layout(self) -> PageLayout:
        """Layout of the pages export_pages produces and import_pages takes."""
        return self._layout

    @property
    def num_free_blocks(self) -> int:
        return self.manager.allocator.num_free

    def num_tokens(self, seq_id: SeqId) -> int:
        return self.manager.num_tokens(seq_id)

    # slots and tables for the kernels

    def reserve(self, seq_id: SeqId, num_new_tokens: int) -> torch.Tensor:
        """Room for the sequence's next tokens; returns their slot_mapping, int64 [num_new_tokens]."""
        slots = self.manager.append(seq_id, num_new_tokens)
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def reserve_batch(self, seq_ids: Sequence[SeqId]) -> torch.Tensor:
        """One more token for each of several distinct sequences (decode); int64 slot_mapping [len(seq_ids)]."""
        slots = self.manager.append_batch([(s, 1) for s in seq_ids])
        return torch.tensor([s[0] for s in slots], dtype=torch.int64, device=self.device)

    def block_tables(self, seq_ids: Sequence[SeqId]) -> torch.Tensor:
        """int32 [len(seq_ids), max blocks among them]; a row's unused tail is -1 (ignored by the kernel)."""
        rows = [self.manager.get(s).blocks for s in seq_ids]
        width = max((len(r) for r in rows), default=0)
        table = torch.full((len(rows), max(width, 1)), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return table.to(self.device)

    def seq_lens(self, seq_ids: Sequence[SeqId]) -> torch.Tensor:
        """int32 [len(seq_ids)]: tokens held per sequence."""
        return torch.tensor([self.manager.get(s).num_tokens for s in seq_ids], dtype=torch.int32, device=self.device)

    def gather_kv(self, layer: int, seq_id: SeqId, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense copies of tokens `0 .. length - 1` of one layer: (keys, values), each
        [length, num_kv_heads, head_dim]."""
        seq = self.manager.get(seq_id)
        if not 0 <= length <= seq.num_tokens:
            raise ValueError(f"sequence {seq_id!r} holds {seq.num_tokens} tokens; cannot read {length}")
        n = math.ceil(length / self.block_size)
        ids = torch.tensor(seq.blocks[:n], dtype=torch.int64, device=self.device)
        flat = (n * self.block_size, self.num_kv_heads, self.head_dim)
        keys = self.key_caches[layer].index_select(0, ids).reshape(flat)[:length]
        values = self.value_caches[layer].index_select(0, ids).reshape(flat)[:length]
        return keys, values

    # pages

    def export_pages(self, seq_id: SeqId, block_indices: Sequence[int] | None = None) -> torch.Tensor:
        """Pages of the sequence's full blocks, `[n, num_layers, 2, block_size, num_kv_heads, head_dim]`.

        block_indices are positions in the sequence (block i holds tokens i*B .. i*B + B - 1), default
        all full blocks. Only full blocks can be exported: a partial last block is never cached
        (DESIGN.md §3). The result is a fresh contiguous tensor on the cache's device.
        """
        seq = self.manager.get(seq_id)
        full = seq.num_tokens // self.block_size
        indices = list(range(full)) if block_indices is None else list(block_indices)
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < full:
                raise ValueError(
                    f"block index {i!r} of sequence {seq_id!r}: only its {full} full blocks "
                    f"(0 .. {full - 1}) can be exported ({seq.num_tokens} tokens, block_size {self.block_size})"
                )
        if not indices:
            return torch.empty((0, *self._layout.page_shape), dtype=self.dtype, device=self.device)
        return kernels.gather_pages(self.kv_caches, [seq.blocks[i] for i in indices])

    def import_pages(self, seq_id: SeqId, pages: torch.Tensor) -> int:
        """Append whole pages as the sequence's next blocks (a new sequence, or one on a block boundary).

        pages: `[n, num_layers, 2, block_size, num_kv_heads, head_dim]` in the cache dtype, on any device
        (copied to the cache's). Returns the sequence's token count afterwards. Nothing is allocated
        when the pages do not fit or do not match the layout.
        """
        if not isinstance(pages, torch.Tensor):
            raise TypeError(f"pages must be a torch.Tensor, got {type(pages).__name__}")
        expected = self._layout.page_shape
        if pages.dim() != 6 or tuple(pages.shape[1:]) != expected:
            raise ValueError(
                f"pages has shape {tuple(pages.shape)}; this cache takes [n, *{expected}] ({self._layout.describe()})"
            )
        if pages.dtype != self.dtype:
            # NOTE: no silent cast: the dtype is part of the namespace, so a mismatch means pages from
            # another model configuration.
            raise TypeError(f"pages have dtype {pages.dtype}; this cache holds {self.dtype}")
        # Device copy first, then the (atomic) reservation, so nothing after it can fail.
        pages = pages.to(self.device).contiguous()
        blocks = self.manager.append_full_blocks(seq_id, pages.shape[0])
        if blocks:
            kernels.scatter_pages(pages, self.kv_caches, blocks)
        return self.manager.num_tokens(seq_id)

    def free(self, seq_id: SeqId) -> int:
        """Release the sequence's blocks (their contents stay until overwritten); returns how many."""
        return self.manager.free(seq_id)


# ---------------------------------------------------------------------------------------- page bytes


def pages_to_buffers(pages: torch.Tensor) -> list[memoryview]:
    """One read-only byte view per page (for `KVStoreClient.put`); copies to host memory when needed.

    pages: `[n, num_layers, 2, block_size, num_kv_heads, head_dim]`. Each view is `page_bytes` long and
    holds the page's elements in C order, in their own dtype (bf16 included: it is viewed as bytes).
    """
    host = pages.detach().to("cpu").contiguous()
    raw = host.view(torch.uint8).reshape(host.shape[0], -1).numpy()
    return [memoryview(row).toreadonly() for row in raw]


def pages_from_buffers(
    buffers: Sequence[Buffer], layout: PageLayout, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Inverse of pages_to_buffers: `[len(buffers), *layout.page_shape]` in the layout's dtype on `device`."""
    size = layout.page_bytes
    out = torch.empty((len(buffers), size), dtype=torch.uint8)
    for i, buf in enumerate(buffers):
        view = memoryview(buf).cast("B")
        if view.nbytes != size:
            raise ValueError(f"page {i} is {view.nbytes} bytes; layout {layout.describe()} needs {size}")
        out[i] = torch.frombuffer(bytearray(view), dtype=torch.uint8)
    pages = out.view(torch_dtype(layout.dtype)).reshape(len(buffers), *layout.page_shape)
    return pages.to(device)
