"""Block bookkeeping (pure) and the paged tensors: slots, tables, page export/import, page bytes."""

from __future__ import annotations

import random

import pytest
import torch

from kvstore.layout import DType, PageLayout
from workers.paged_cache import (
    BlockAllocator,
    BlockManager,
    CacheFullError,
    PagedKVCache,
    UnknownSequenceError,
    kv_dtype,
    pages_from_buffers,
    pages_to_buffers,
    torch_dtype,
)

pytestmark = pytest.mark.fast  # pure: no process, node or network (tests/conftest.py)

# ---------------------------------------------------------------------------------------- allocator


def test_allocator_hands_out_each_block_once_and_reuses_freed_last() -> None:
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert sorted(a) == [0, 1, 2] and alloc.num_free == 1
    alloc.free([a[0]])
    assert alloc.allocate(2) == [3, a[0]]  # FIFO: the long-free block first, the just-freed one last
    assert alloc.num_free == 0 and not alloc.can_allocate(1) and alloc.can_allocate(0)


def test_allocator_all_or_nothing_and_double_free() -> None:
    alloc = BlockAllocator(2)
    with pytest.raises(CacheFullError, match="need 3 free KV blocks, 2 of 2"):
        alloc.allocate(3)
    assert alloc.num_free == 2
    blocks = alloc.allocate(1)
    alloc.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(blocks)
    with pytest.raises(ValueError, match="outside"):
        alloc.free([7])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)


# ---------------------------------------------------------------------------------------- manager


def test_manager_slots_follow_block_tables() -> None:
    mgr = BlockManager(num_blocks=8, block_size=4)
    assert mgr.blocks_needed("a", 5) == 2
    slots = mgr.append("a", 5)
    blocks = mgr.get("a").blocks
    assert slots == [blocks[0] * 4 + i for i in range(4)] + [blocks[1] * 4]
    assert mgr.blocks_needed("a", 3) == 0 and mgr.blocks_needed("a", 4) == 1
    assert mgr.append("a", 3) == [blocks[1] * 4 + i for i in range(1, 4)]
    assert mgr.num_tokens("a") == 8 and mgr.num_full_blocks("a") == 2 and len(mgr.get("a").blocks) == 2
    assert mgr.free("a") == 2 and mgr.allocator.num_free == 8 and "a" not in mgr


def test_manager_batch_is_atomic_and_rejects_duplicates() -> None:
    mgr = BlockManager(num_blocks=3, block_size=2)
    mgr.append("a", 2)
    mgr.append("b", 2)  # both end on a block boundary: their next token needs a new block each
    with pytest.raises(CacheFullError, match="need 2 more KV blocks"):
        mgr.append_batch([("a", 1), ("b", 1)])
    assert (mgr.num_tokens("a"), mgr.num_tokens("b"), mgr.allocator.num_free) == (2, 2, 1)
    with pytest.raises(ValueError, match="twice"):
        mgr.append_batch([("a", 1), ("a", 1)])
    with pytest.raises(CacheFullError):
        mgr.append("new", 5)
    assert "new" not in mgr  # a failed append does not leave an empty sequence behind
    with pytest.raises(UnknownSequenceError):
        mgr.free("new")


def test_manager_full_blocks_only_on_a_boundary() -> None:
    mgr = BlockManager(num_blocks=8, block_size=4)
    assert len(mgr.append_full_blocks("a", 2)) == 2 and mgr.num_tokens("a") == 8
    mgr.append("a", 1)
    with pytest.raises(ValueError, match="block boundary"):
        mgr.append_full_blocks("a", 1)
    assert mgr.num_tokens("a") == 9


def test_manager_random_trace_keeps_invariants() -> None:
    """A replayed random trace: every block is free or owned by exactly one sequence, tables sized to tokens."""
    rng = random.Random(0)
    mgr = BlockManager(num_blocks=16, block_size=4)
    for _ in range(500):
        op = rng.random()
        live = mgr.seq_ids()
        if op < 0.6:
            seq = rng.choice([*live, f"s{rng.randrange(100)}"])
            n = rng.randrange(1, 9)
            if mgr.can_append(seq, n):
                mgr.append(seq, n)
            else:
                with pytest.raises(CacheFullError):
                    mgr.append(seq, n)
        elif live:
            mgr.free(rng.choice(live))
        owned = [b for s in mgr.seq_ids() for b in mgr.get(s).blocks]
        assert len(owned) == len(set(owned))
        assert len(owned) + mgr.allocator.num_free == 16
        for s in mgr.seq_ids():
            seq = mgr.get(s)
            assert len(seq.blocks) == -(-seq.num_tokens // 4)


# ---------------------------------------------------------------------------------------- tensors


def _cache(dtype: torch.dtype = torch.float32, num_blocks: int = 8) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=num_blocks, dtype=dtype)


def _fill(cache: PagedKVCache, seq: str, n: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Write n random tokens for seq through reshape_and_cache; returns what was written per layer."""
    import kernels

    gen = torch.Generator().manual_seed(seed)
    slots = cache.reserve(seq, n)
    keys, values = [], []
    for layer in range(cache.num_layers):
        k = torch.randn(n, 2, 8, generator=gen).to(cache.dtype)
        v = torch.randn(n, 2, 8, generator=gen).to(cache.dtype)
        kernels.reshape_and_cache(k, v, cache.key_caches[layer], cache.value_caches[layer], slots)
        keys.append(k)
        values.append(v)
    return keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_export_import_round_trip_is_exact(dtype: torch.dtype) -> None:
    src = _cache(dtype)
    keys, values = _fill(src, "a", 10, seed=1)  # 2 full blocks + 2 tokens
    pages = src.export_pages("a")
    assert tuple(pages.shape) == (2, 2, 2, 4, 2, 8) and pages.dtype == dtype
    for layer in range(2):  # page i, layer l, K/V: tokens 4i .. 4i+3 in order
        assert torch.equal(pages[:, layer, 0].reshape(8, 2, 8), keys[layer][:8])
        assert torch.equal(pages[:, layer, 1].reshape(8, 2, 8), values[layer][:8])
    assert torch.equal(src.export_pages("a", [1]), pages[1:])

    dst = _cache(dtype)
    dst.reserve("other", 3)  # so the imported blocks are not the same ids as in src
    assert dst.import_pages("b", pages) == 8
    assert torch.equal(dst.export_pages("b"), pages)
    k, v = dst.gather_kv(1, "b", 7)
    assert torch.equal(k, keys[1][:7]) and torch.equal(v, values[1][:7])


def test_page_layout_and_dtype_mapping() -> None:
    cache = _cache(torch.bfloat16)
    assert cache.page_layout() == PageLayout(DType.BFLOAT16, num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    for t, d in [
        (torch.float16, DType.FLOAT16),
        (torch.float32, DType.FLOAT32),
        (torch.float8_e4m3fn, DType.FLOAT8_E4M3),
    ]:
        assert kv_dtype(t) == d and torch_dtype(d) == t
    with pytest.raises(ValueError, match="no kvstore DType"):
        kv_dtype(torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pages_bytes_round_trip(dtype: torch.dtype) -> None:
    cache = _cache(dtype)
    _fill(cache, "a", 8, seed=2)
    pages = cache.export_pages("a")
    layout = cache.page_layout()
    buffers = pages_to_buffers(pages)
    assert [b.nbytes for b in buffers] == [layout.page_bytes] * 2 and all(b.readonly for b in buffers)
    assert torch.equal(pages_from_buffers([bytes(b) for b in buffers], layout), pages)
    with pytest.raises(ValueError, match="page 0 is 3 bytes"):
        pages_from_buffers([b"abc"], layout)


def test_block_tables_and_seq_lens() -> None:
    cache = _cache()
    cache.reserve("a", 9)
    cache.reserve("b", 2)
    table = cache.block_tables(["a", "b"])
    assert table.dtype == torch.int32 and table.shape == (2, 3)
    assert table[0].tolist() == cache.manager.get("a").blocks
    assert table[1, 1:].tolist() == [-1, -1]
    assert cache.seq_lens(["a", "b"]).tolist() == [9, 2]


def test_page_errors_name_the_problem() -> None:
    cache = _cache()
    _fill(cache, "a", 6, seed=3)
    with pytest.raises(ValueError, match=r"only its 1 full blocks"):
        cache.export_pages("a", [1])  # the partial block
    with pytest.raises(UnknownSequenceError):
        cache.export_pages("zzz")
    pages = cache.export_pages("a")
    with pytest.raises(ValueError, match="block boundary"):
        cache.import_pages("a", pages)  # "a" holds 6 tokens
    with pytest.raises(TypeError, match="dtype"):
        cache.import_pages("c", pages.half())
    with pytest.raises(ValueError, match="pages has shape"):
        cache.import_pages("c", pages[:, :1].contiguous())
    free = cache.num_free_blocks
    with pytest.raises(CacheFullError, match="importing 9 pages"):
        cache.import_pages("c", pages.expand(9, *pages.shape[1:]).contiguous())
    assert cache.num_free_blocks == free and "c" not in cache.manager
