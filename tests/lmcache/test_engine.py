"""LMCache's whole engine (token chunking and hashing, lookup, store, retrieve) on kvstore.

Two LMCacheEngine instances, as two serving engines: one stores a prompt's KV, the other (its own
empty LMCache) finds it through kvstore and loads it into its paged KV cache. The only stand-in is the
device copy: a GPU host's engine copies between HBM and LMCache's buffers with CUDA kernels; here
`CPUPagedConnector` does the same copies on a CPU paged cache (vLLM's layout: per layer [2, blocks,
block_size, heads, head_dim], addressed by a slot mapping).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from tests.integration.test_cluster import wait_for  # the suite's bounded poll
from tests.lmcache.conftest import CHUNK, HEAD_DIM, HEADS, LAYERS, metadata, plugin_config

pytest.importorskip("lmcache", reason="LMCache is an optional extra: ./dev test installs it")

import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

BLOCKS = 16  # paged cache: 16 blocks of CHUNK slots


class CPUPagedConnector(GPUConnectorInterface):
    """LMCache's device-copy interface on a CPU paged KV cache (kwargs: kvcaches, slot_mapping)."""

    def __init__(self, layers: int, hidden: int) -> None:
        self.layers, self.hidden, self.kvcaches = layers, hidden, None

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.hidden])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
        slots = kw["slot_mapping"][start:end]
        for layer in range(self.layers):
            memory_obj.tensor[:, layer, : end - start] = kw["kvcaches"][layer].view(2, -1, self.hidden)[:, slots]

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
        slots = kw["slot_mapping"][start:end]
        for layer in range(self.layers):
            kw["kvcaches"][layer].view(2, -1, self.hidden)[:, slots] = memory_obj.tensor[:, layer, : end - start]

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, s, e, **kw)

    def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, s, e, **kw)


def kv_cache(seed: int | None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (2, BLOCKS, CHUNK, HEADS, HEAD_DIM)
    return [
        torch.randn(shape, generator=gen).half() if gen else torch.zeros(shape, dtype=torch.half) for _ in range(LAYERS)
    ]


def token_kv(cache: list[torch.Tensor], n: int) -> torch.Tensor:
    """The first n tokens' K and V of every layer (slot i holds token i in these tests)."""
    return torch.stack([c.view(2, -1, HEADS * HEAD_DIM)[:, :n] for c in cache])


@pytest.fixture
def engines() -> Iterator[Callable[..., Any]]:
    """make(name, config) -> a post-initialised LMCacheEngine; all destroyed after the test."""
    start_method = multiprocessing.get_start_method(allow_none=True)  # LMCacheEngine forces "spawn"
    made: list[str] = []

    def make(name: str, config: Any) -> Any:
        engine = LMCacheEngineBuilder.get_or_create(name, config, metadata(), CPUPagedConnector(LAYERS, HEADS * HEAD_DIM),
                                                    None, None)  # fmt: skip
        engine.post_init()
        made.append(name)
        return engine

    yield make
    for name in made:
        LMCacheEngineBuilder.destroy(name)
    multiprocessing.set_start_method(start_method, force=True)


def store(engine: Any, tokens: list[int], cache: list[torch.Tensor], node: NodeProcess, pages: int) -> None:
    """The engine's store; its put is asynchronous, so wait (bounded) until the node holds `pages` pages."""
    engine.store(tokens, kvcaches=cache, slot_mapping=torch.arange(len(tokens)))
    with KVStoreClient(node.addr) as kv:
        wait_for(lambda: sum(p for _, _, p in kv.stats().namespaces) >= pages, what=f"{pages} pages on the node")


def test_two_engines_share_a_prompt_bit_exactly_with_its_partial_last_chunk(
        node: NodeProcess, engines: Callable[..., Any]) -> None:  # fmt: skip
    url = f"kvstore://{node.addr}"
    tokens = list(range(1000, 1000 + 3 * CHUNK + 5))  # 3 full chunks and a 5-token tail
    src = kv_cache(seed=1)
    store(engines("prefill", plugin_config(url, partial=True)), tokens, src, node, pages=4)

    other = engines("decode", plugin_config(url, partial=True))
    assert other.lookup(tokens) == len(tokens)
    dst = kv_cache(seed=None)
    mask = other.retrieve(torch.tensor(tokens), kvcaches=dst, slot_mapping=torch.arange(len(tokens)))
    assert int(mask.sum()) == len(tokens)
    assert torch.equal(token_kv(dst, len(tokens)), token_kv(src, len(tokens)))

    # partial prefix hit: a prompt sharing the first two chunks, then different
    fork = tokens[: 2 * CHUNK] + [7] * (CHUNK + 5)
    assert other.lookup(fork) == 2 * CHUNK
    dst = kv_cache(seed=None)
    mask = other.retrieve(torch.tensor(fork), kvcaches=dst, slot_mapping=torch.arange(len(fork)))
    assert mask.tolist() == [True] * (2 * CHUNK) + [False] * (CHUNK + 5)
    assert torch.equal(token_kv(dst, 2 * CHUNK), token_kv(src, 2 * CHUNK))


def test_without_partial_chunks_only_full_chunks_are_shared(node: NodeProcess, engines: Callable[..., Any]) -> None:
    url = f"kvstore://{node.addr}"
    tokens = list(range(5000, 5000 + 2 * CHUNK + 3))
    src = kv_cache(seed=2)
    store(engines("p2", plugin_config(url)), tokens, src, node, pages=2)
    other = engines("d2", plugin_config(url))
    assert other.lookup(tokens) == 2 * CHUNK
    dst = kv_cache(seed=None)
    mask = other.retrieve(torch.tensor(tokens), kvcaches=dst, slot_mapping=torch.arange(len(tokens)))
    assert int(mask.sum()) == 2 * CHUNK
    assert torch.equal(token_kv(dst, 2 * CHUNK), token_kv(src, 2 * CHUNK))
    with KVStoreClient(node.addr) as kv:
        assert [ns.endswith("/tail") for ns, _, _ in kv.stats().namespaces] == [False]
