"""An engine that holds fp8 KV itself (vLLM `kv_cache_dtype=fp8`: LMCache's chunks are float8_e4m3fn):
the plugin passes its pages through untouched. They are stored as `raw` pages of dtype float8_e4m3
(never quantized again, never dequantized), in a namespace of their own (the key's dtype is part of it),
and come back bit for bit. kvstore's own `fp8-e4m3` encoding is for workers that own the quantization."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvstore.layout import DType, PageEncoding, PageLayout
from tests.integration.test_cluster import wait_for
from tests.lmcache.conftest import CHUNK, HEAD_DIM, HEADS, LAYERS, MODEL, REMOTE, fill, plugin_config
from tests.lmcache.test_plugin import release, stats

pytest.importorskip("lmcache", reason="LMCache is an optional extra: ./dev test installs it")

FP8 = torch.float8_e4m3fn


def fp8_metadata() -> Any:
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=FP8, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM), chunk_size=CHUNK)  # fmt: skip


def fp8_key(i: int) -> Any:
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(MODEL, 1, 0, 0x8F800000 + i, FP8)


def test_engine_fp8_kv_passes_through_untouched(node: Any, storage_managers: Callable[..., Any]) -> None:
    writer = storage_managers(plugin_config(f"kvstore://{node.addr}"), fp8_metadata())
    meta = writer.metadata
    objs = [writer.allocate(meta.get_shapes(CHUNK), meta.get_dtypes()) for _ in range(3)]
    assert all(o is not None and o.get_dtype() == FP8 for o in objs)
    data = [fill(o, 800 + i) for i, o in enumerate(objs)]  # any bytes: e4m3 bit patterns, NaNs included
    keys = [fp8_key(i) for i in range(3)]
    writer.batched_put(keys, objs)
    wait_for(lambda: writer.batched_contains(keys)[0] == 3, what="all 3 fp8 chunks visible")

    reader = storage_managers(plugin_config(f"kvstore://{node.addr}"), fp8_metadata())
    got = reader.batched_get(keys, location=REMOTE)
    assert [bytes(o.byte_array) for o in got] == data  # bit for bit: nothing re-quantized
    assert all(o.get_dtype() == FP8 for o in got)
    release(got)

    ((ns, layout, pages),) = stats(node).namespaces
    assert "/fp8_e4m3fn/" in ns and pages == 3
    assert layout == PageLayout(DType.FLOAT8_E4M3, LAYERS, HEADS, HEAD_DIM, CHUNK)
    assert layout.encoding is PageEncoding.RAW  # the engine's own bytes: one byte a value, no kvstore scales
    assert layout.page_bytes == 2 * LAYERS * CHUNK * HEADS * HEAD_DIM
