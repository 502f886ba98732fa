"""kvstore as SGLang HiCache's L3 storage (kvstore/integrations/sglang_hicache.py) against a real node.

SGLang 0.5.23 does not install here (it pins CUDA packages), so this test reproduces what SGLang does:
- `StorageBackendFactory._create_dynamic_backend`: import `module_path`, take `class_name`, construct
  `cls(storage_config, kwargs)` with SGLang's `HiCacheStorageConfig` fields;
- `HiCacheController.attach_storage_backend`: `register_mem_pool_host(host_pool)`,
  `on_host_pools_registered()`;
- `_page_backup` / `_storage_hit_query` / `_page_transfer`: batches of at most 128 page keys (hex SHA-256 of
  the token prefix), `extra_info.prefix_keys` the keys before the batch, `host_indices` page_size token
  indices per key; `batch_set_v1`, `batch_exists`, `batch_get_v1` (interface_v1), or `batch_set` /
  `batch_get` with flat pages (without it);
- `MHATokenToKVPoolHost`'s buffers for the layouts `layer_first` [2, L, size, H, D], `page_first`
  [2, size, L, H, D] and `page_first_direct` [2, pages, L, page, H, D], with its `get_page_buffer_meta`,
  `get_data_page`, `get_dummy_flat_data_page` and `set_from_flat_data_page`, and the MLA pool
  (`page_first` [size, L, 1, R+Q], one region per page).
An engine A stores through one backend instance; a fresh instance on another pool (engine B) finds and
loads the pages bit-exact.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.integrations.direct import ConfigError
from kvstore.integrations.sglang_hicache import KVStoreHiCacheStorage, region_hashes
from kvstore.layout import DType, PageLayout
from kvstore.pageformat import slot_bytes_for
from kvstore.security import ClientSecurity

PAGE = 16  # tokens per page
LAYERS, HEADS, DIM = 3, 2, 32
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE


@dataclass
class HiCacheStorageConfig:  # SGLang 0.5.23's fields
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = True
    model_name: str | None = "meta-llama/Llama-3.1-8B-Instruct"
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    dp_rank: int = 0
    extra_config: dict[str, Any] | None = None
    dcp_size: int = 1
    dcp_rank: int = 0
    logical_page_size: int | None = None


@dataclass
class ForkStorageConfig(HiCacheStorageConfig):  # SGLang builds that name the weights (model_identity_hash)
    model_identity_hash: str | None = None


@dataclass
class HiCacheStorageExtraInfo:
    prefix_keys: list[str] | None = None
    extra_info: dict[str, Any] | None = None


class MHAHostPool:
    """SGLang 0.5.23's MHATokenToKVPoolHost buffers and the page methods HiCache storage uses. `kv_dtype`: the
    device pool's KV dtype where it differs from what the host pool stores (SGLang keeps fp8 KV as uint8 there:
    `dtype = device_pool.store_dtype`)."""

    def __init__(self, layout: str, pages: int, dtype: torch.dtype = torch.bfloat16, *, page: int = PAGE,
                 heads: int = HEADS, kv_dtype: torch.dtype | None = None) -> None:  # fmt: skip
        self.layout, self.page_size, self.dtype = layout, page, dtype
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = LAYERS, heads, DIM, DIM
        self.page_num, self.size = pages, pages * page
        if kv_dtype is not None:
            self.device_pool = SimpleNamespace(dtype=kv_dtype, store_dtype=dtype)
        dims = {"layer_first": (2, LAYERS, self.size, heads, DIM), "page_first": (2, self.size, LAYERS, heads, DIM),
                "page_first_direct": (2, pages, LAYERS, page, heads, DIM)}[layout]  # fmt: skip
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        page, heads = self.page_size, self.head_num
        assert len(indices) % page == 0
        item, base, idx = self.dtype.itemsize, self.kv_buffer.data_ptr(), indices.tolist()
        v_offset = self.layer_num * self.size * heads * self.head_dim * item
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for i in range(0, len(idx), page):
                for layer in range(self.layer_num):
                    k = base + idx[i] * heads * DIM * item + layer * self.size * heads * DIM * item
                    ptrs += [k, k + v_offset]
            return ptrs, [item * page * heads * DIM] * len(ptrs)
        for i in range(0, len(idx), page):
            k = base + idx[i] * LAYERS * heads * DIM * item
            ptrs += [k, k + v_offset]
        return ptrs, [LAYERS * item * page * heads * DIM] * len(ptrs)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.page_size
        if self.layout == "layer_first":
            data = self.kv_buffer[:, :, index : index + page]
        elif self.layout == "page_first":
            data = self.kv_buffer[:, index : index + page]
        else:
            data = self.kv_buffer[:, index // page : index // page + 1]
        return data.flatten() if flat else data

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, LAYERS, self.page_size, self.head_num, DIM), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page, heads = self.page_size, self.head_num
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + page] = data_page.reshape(2, LAYERS, page, heads, DIM)
        elif self.layout == "page_first":
            self.kv_buffer[:, index : index + page] = data_page.reshape(2, page, LAYERS, heads, DIM)
        else:
            p = index // page
            self.kv_buffer[:, p : p + 1] = data_page.reshape(2, 1, LAYERS, page, heads, DIM)


class MLAHostPool:
    """SGLang 0.5.23's MLATokenToKVPoolHost, `page_first`: [size, L, 1, kv_lora_rank + qk_rope_head_dim]."""

    def __init__(self, pages: int) -> None:
        self.layout, self.page_size, self.dtype = "page_first", PAGE, torch.bfloat16
        self.layer_num, self.kv_lora_rank, self.qk_rope_head_dim = LAYERS, 48, 16
        self.size = pages * PAGE
        self.kv_buffer = torch.zeros((self.size, LAYERS, 1, 64), dtype=self.dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        idx, n = indices.tolist(), LAYERS * 64 * 2
        ptrs = [self.kv_buffer.data_ptr() + idx[i] * n for i in range(0, len(idx), PAGE)]
        return ptrs, [n * PAGE] * len(ptrs)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.kv_buffer[index : index + PAGE].flatten()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((PAGE, LAYERS, 1, 64), dtype=self.dtype).flatten()


def page_keys(tokens: list[int]) -> list[str]:
    """Chained SHA-256 page keys (hex), as SGLang's get_hash_str gives them."""
    keys, prior = [], b""
    for i in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        prior = hashlib.sha256(prior + np.asarray(tokens[i : i + PAGE], dtype=np.int64).tobytes()).digest()
        keys.append(prior.hex())
    return keys


def create_backend(
    extra: dict[str, Any], storage_config: type = HiCacheStorageConfig, **cfg: Any
) -> KVStoreHiCacheStorage:
    """StorageBackendFactory._create_dynamic_backend, then attach_storage_backend's registration."""
    extra = {"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang_hicache",
             "class_name": "KVStoreHiCacheStorage", **extra}  # fmt: skip
    for name in ("backend_name", "module_path", "class_name"):
        assert name in extra
    cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    return cls(storage_config(extra_config=extra, **cfg), {})


def attach(backend: KVStoreHiCacheStorage, pool: Any) -> KVStoreHiCacheStorage:
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def backup(backend: KVStoreHiCacheStorage, keys: list[str], host_indices: torch.Tensor, v1: bool = True) -> bool:
    """HiCacheController._page_backup: batches of BATCH keys, prefix_keys growing."""
    prefix: list[str] = []
    for i in range(0, len(keys), BATCH):
        batch = keys[i : i + BATCH]
        idx = host_indices[i * PAGE : (i + len(batch)) * PAGE]
        info = HiCacheStorageExtraInfo(prefix_keys=list(prefix))
        if v1:
            ok = all(backend.batch_set_v1(batch, idx, info))
        else:
            ok = backend.batch_set(
                batch, [backend.mem_pool_host.get_data_page(int(idx[j * PAGE])) for j in range(len(batch))]
            )
        if not ok:
            return False
        prefix += batch
    return True


def prefetch(backend: KVStoreHiCacheStorage, keys: list[str], host_indices: torch.Tensor, v1: bool = True) -> int:
    """_storage_hit_query then _page_transfer: pages of the stored prefix loaded; returns how many."""
    hit: list[str] = []
    prefix: list[str] = []
    for i in range(0, len(keys), BATCH):
        batch = keys[i : i + BATCH]
        n = backend.batch_exists(batch, HiCacheStorageExtraInfo(prefix_keys=list(prefix)))
        hit += batch[:n]
        if n < len(batch):
            break
        prefix += batch
    done = 0
    for i in range(0, len(hit), BATCH):
        batch = hit[i : i + BATCH]
        idx = host_indices[i * PAGE : (i + len(batch)) * PAGE]
        if v1:
            res = backend.batch_get_v1(batch, idx, HiCacheStorageExtraInfo(prefix_keys=hit[:i]))
        else:
            pages = backend.batch_get(batch, [backend.mem_pool_host.get_dummy_flat_data_page() for _ in batch])
            res = [p is not None for p in pages]
            for j, p in enumerate(pages):
                if p is not None:
                    backend.mem_pool_host.set_from_flat_data_page(int(idx[j * PAGE]), p)
        n = res.index(False) if False in res else len(res)
        done += n
        if n < len(batch):
            break
    return done


def fill(pool: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.kv_buffer.dtype))


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int64) for p in pages])


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Any:
    n = NodeProcess(dram_bytes="192MiB", max_page_bytes=16 << 10, node_id="sgl").start()  # ~9600 slots: no eviction
    try:
        yield n
    finally:
        n.close()


@pytest.mark.parametrize("transport", ["tcp", "shm", "grpc"])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_zero_copy_round_trip_to_a_fresh_engine(node: NodeProcess, layout: str, transport: str) -> None:
    salt = sum(map(ord, layout + transport))  # each case its own prompt (the node is shared)
    tokens = [salt] + [(i * 31) % 5000 for i in range(PAGE * 140 + 4)]  # 140 pages: 2 batches
    keys = page_keys(tokens)
    a_pool, b_pool = MHAHostPool(layout, 160), MHAHostPool(layout, 160)
    fill(a_pool, 1)
    extra = {"interface_v1": 1, "url": f"kvstore://{node.addr}", "transport": transport}
    a = attach(create_backend(extra), a_pool)
    b = attach(create_backend(extra), b_pool)
    try:
        a_slots, b_slots = list(range(10, 150)), [159 - i for i in range(140)]  # B's pages elsewhere, reversed
        assert prefetch(b, keys, indices(b_slots)) == 0  # nothing stored yet: a miss
        assert backup(a, keys, indices(a_slots))
        assert b.batch_exists(keys[:BATCH]) == BATCH
        assert prefetch(b, keys, indices(b_slots)) == len(keys)
        assert a.store.plane == b.store.plane == transport  # shm: through the registered staging buffer
        for ka, kb in zip(a_slots, b_slots, strict=True):
            assert torch.equal(a_pool.get_data_page(ka * PAGE).view(torch.int16),
                               b_pool.get_data_page(kb * PAGE).view(torch.int16))  # fmt: skip
        # Region 0 of every page is stored under SGLang's own page hash.
        with KVStoreClient(node.addr, transport="grpc") as kv:
            assert kv.lookup(b._seg_ns, [bytes.fromhex(keys[0])]) == 1
        # A longer prompt: the stored prefix hits, the rest is False (SGLang's partial-hit path).
        more = page_keys(tokens + list(range(PAGE * 3)))
        res = b.batch_get_v1(more[-5:], indices([0, 1, 2, 3, 4]))
        assert res == [True, True, False, False, False]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_flat_interface_round_trip(node: NodeProcess, layout: str) -> None:
    keys = page_keys([len(layout)] + [(i * 7) % 3000 for i in range(PAGE * 20)])
    a_pool, b_pool = MHAHostPool(layout, 32), MHAHostPool(layout, 32)
    fill(a_pool, 2)
    extra = {"url": f"kvstore://{node.addr}"}
    a, b = attach(create_backend(extra), a_pool), attach(create_backend(extra), b_pool)
    try:
        assert backup(a, keys, indices(list(range(20))), v1=False)
        assert b.exists(keys[0]) and b.batch_exists(keys) == 20
        assert prefetch(b, keys, indices(list(range(31, 11, -1))), v1=False) == 20
        for i in range(20):
            assert torch.equal(a_pool.get_data_page(i * PAGE).view(torch.int16),
                               b_pool.get_data_page((31 - i) * PAGE).view(torch.int16))  # fmt: skip
        got = b.get(keys[3], b_pool.get_dummy_flat_data_page())
        assert got is not None and torch.equal(got.view(torch.int16), a_pool.get_data_page(3 * PAGE).view(torch.int16))
    finally:
        a.close()
        b.close()


def test_mla_one_writer_every_reader(node: NodeProcess) -> None:
    keys = page_keys([(i * 13) % 2000 for i in range(PAGE * 8)])
    pools = [MLAHostPool(16) for _ in range(3)]
    fill(pools[1], 3)
    extra = {"interface_v1": 1, "url": f"kvstore://{node.addr}"}
    r0, r1, r2 = (attach(create_backend(extra, tp_rank=r, tp_size=2, is_mla_model=True), p)
                  for r, p in zip([0, 1, 0], pools, strict=True))  # fmt: skip
    try:
        assert backup(r1, keys, indices(list(range(8))))  # rank 1 is not the writer: success, nothing stored
        assert r0.batch_exists(keys) == 0
        fill(pools[0], 3)
        assert backup(r0, keys, indices(list(range(8))))
        assert prefetch(r2, keys, indices(list(range(8, 16)))) == 8
        assert torch.equal(
            pools[2].kv_buffer[8 * PAGE :].view(torch.int16), pools[0].kv_buffer[: 8 * PAGE].view(torch.int16)
        )
    finally:
        for b in (r0, r1, r2):
            b.close()


def test_node_down_is_a_logged_miss(caplog: pytest.LogCaptureFixture) -> None:
    pool = MHAHostPool("page_first", 8)
    fill(pool, 4)
    keys = page_keys(list(range(PAGE * 4)))
    b = attach(
        create_backend({"interface_v1": 1, "url": "kvstore://127.0.0.1:9", "timeout": 2, "lookup_timeout": 2}), pool
    )
    try:
        with caplog.at_level(logging.INFO, logger="kvstore.sglang"):
            assert b.batch_exists(keys) == 0
            assert b.batch_get_v1(keys, indices([0, 1, 2, 3])) == [False] * 4
            assert b.batch_set_v1(keys, indices([0, 1, 2, 3])) == [False] * 4
        assert any(r.levelno >= logging.ERROR and "127.0.0.1:9" in r.getMessage() for r in caplog.records)
    finally:
        b.close()


def test_wrong_token_and_wrong_layout_store_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("good-token-0123456789abcdef\n")
    tokens.chmod(0o600)
    n = NodeProcess(dram_bytes="16MiB", max_page_bytes=16 << 10, node_id="auth",
                    extra_args=["--auth-tokens-file", str(tokens)]).start()  # fmt: skip
    try:
        pool = MHAHostPool("page_first", 8)
        fill(pool, 5)
        keys = page_keys(list(range(PAGE * 4)))
        bad = attach(
            create_backend({"interface_v1": 1, "url": f"kvstore://{n.addr}", "token": "wrong-token-0123456789abcdef"}),
            pool,
        )
        with caplog.at_level(logging.INFO, logger="kvstore.sglang"):
            assert bad.batch_set_v1(keys, indices([0, 1, 2, 3])) == [False] * 4
            assert bad.batch_exists(keys) == 0
        assert any("token" in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
        bad.close()
        good = attach(
            create_backend({"interface_v1": 1, "url": f"kvstore://{n.addr}", "token": "good-token-0123456789abcdef"}),
            pool,
        )
        try:
            # Another writer bound the namespace to a different page layout first: a refused store, logged.
            with KVStoreClient(
                n.addr, transport="grpc", security=ClientSecurity(token="good-token-0123456789abcdef")
            ) as kv:
                other = PageLayout(DType.FLOAT16, 1, 1, 64, 16)
                kv.put(good._seg_ns, other, [b"\x01" * 32], [bytes(other.page_bytes)])
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="kvstore.sglang"):
                assert good.batch_set_v1(keys, indices([0, 1, 2, 3])) == [False] * 4
            assert any("rejected" in r.getMessage() for r in caplog.records)
            assert good.batch_exists(keys) == 0
        finally:
            good.close()
    finally:
        n.close()


@pytest.mark.parametrize(
    ("extra", "named"),
    [({}, "url"), ({"url": "http://x:1"}, "url"), ({"url": "kvstore://h:1", "timeout": -1}, "timeout"),
     ({"url": "kvstore://h:1", "transport": "carrier-pigeon"}, "transport"),
     ({"url": "kvstore://h:1", "nope": 1}, "nope"),
     ({"url": "kvstore://h:1", "fetch_budget_base": -1}, "fetch_budget_base"),
     ({"url": "kvstore://h:1", "fetch_budget_per_ki_token": "x"}, "fetch_budget_per_ki_token"),
     ({"url": "kvstore://h:1", "fit_fetch_budget": "yes"}, "fit_fetch_budget")],
)  # fmt: skip
def test_bad_extra_config_names_the_key(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        create_backend(extra)


def test_region_hashes_keep_sglang_keys() -> None:
    k = hashlib.sha256(b"x").hexdigest()
    hs = region_hashes(k, 3)
    assert hs[0] == bytes.fromhex(k) and len(set(hs)) == 3 and all(len(h) == 32 for h in hs)
    assert region_hashes("not-hex", 1)[0] == hashlib.sha256(b"not-hex").digest()


REGION = LAYERS * 2 * PAGE * HEADS * DIM  # one page_first region (K or V of a page), bf16


def test_a_full_node_reports_false_for_every_page_it_did_not_keep(caplog: pytest.LogCaptureFixture) -> None:
    """A DRAM-only node whose DRAM is full and whose policy refuses what it has not seen before (second sight,
    for a deterministic pattern; the default policy refuses by its learned threshold): `batch_set_v1` is True
    exactly for the pages whose every region the node holds afterwards, and `batch_exists` agrees."""
    n = NodeProcess(dram_bytes=16 * slot_bytes_for(16 << 10), max_page_bytes=16 << 10, node_id="full",
                    extra_args=["--policy", "second-sight"]).start()  # fmt: skip
    try:
        pool = MHAHostPool("page_first", 32)
        fill(pool, 6)
        extra = {"interface_v1": 1, "url": f"kvstore://{n.addr}", "transport": "tcp"}
        b = attach(create_backend(extra), pool)
        try:
            filler = page_keys([7, *range(PAGE * 8)])
            assert backup(b, filler, indices(list(range(8))))  # fills DRAM exactly (16 slots: 8 pages of 2 regions)
            p = page_keys([8, *range(PAGE * 3)])
            q = page_keys([9, *range(PAGE * 3)])
            with caplog.at_level(logging.WARNING, logger="kvstore.sglang"):
                assert b.batch_set_v1(p, indices([12, 13, 14])) == [False] * 3  # first sight: none admitted
            assert b.batch_exists(p) == 0
            assert any("did not keep 6 of 6 pages" in r.getMessage() for r in caplog.records)
            # Second sight of p's pages admits them; q's are new: refused. Interleaved in one batch.
            mixed = [k for pair in zip(p, q, strict=True) for k in pair]
            got = b.batch_set_v1(mixed, indices([12, 20, 13, 21, 14, 22]))
            assert got == [True, False] * 3, got  # before: all True (the node's counts were not read)
            assert [b.batch_exists([k]) for k in mixed] == [int(x) for x in got]
            assert b.batch_exists(p) == 3
            # The older (flat) call: one bool for the batch, False when any page was refused.
            assert not b.batch_set(q[:1], [pool.get_data_page(20 * PAGE)])
        finally:
            b.close()
    finally:
        n.close()


def sglang_server_args(monkeypatch: pytest.MonkeyPatch, revision: str | None) -> None:
    """SGLang's process-global server args (0.5.23: `sglang.srt.runtime_context.get_server_args`), as the scheduler
    process that runs HiCache has them: only `revision` is read. (tests/engines/test_sglang_hicache_real.py runs
    SGLang's own.)"""
    mods = {name: SimpleNamespace(__path__=[]) for name in ("sglang", "sglang.srt")}
    mods["sglang.srt.runtime_context"] = SimpleNamespace(get_server_args=lambda: SimpleNamespace(revision=revision))
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


Variant = tuple[dict[str, Any], dict[str, Any], Callable[[], Any], str | None]
BASE_POOL: Callable[[], Any] = lambda: MHAHostPool("page_first", 8)  # noqa: E731
VARIANTS: dict[str, Variant] = {  # field -> (storage config overrides, extra config, host pool, server --revision)
    "model": ({"model_name": "meta-llama/Llama-3.1-70B-Instruct"}, {}, BASE_POOL, None),
    "revision (extra config)": ({}, {"model_revision": "0e9e39f"}, BASE_POOL, None),
    "revision (server --revision)": ({}, {}, BASE_POOL, "0e9e39f"),
    "weights digest (model_identity_hash)": ({"model_identity_hash": "abc123def456"}, {}, BASE_POOL, None),
    "kv layout": ({}, {}, lambda: MHAHostPool("page_first_direct", 8), None),
    "dtype (same size)": ({}, {}, lambda: MHAHostPool("page_first", 8, torch.float16), None),
    "page size": ({}, {}, lambda: MHAHostPool("page_first", 8, page=32), None),
    "kv heads (tp shard)": ({}, {}, lambda: MHAHostPool("page_first", 8, heads=1), None),
    "tp rank": ({"tp_rank": 1, "tp_size": 2}, {}, BASE_POOL, None),
    "tp size": ({"tp_rank": 0, "tp_size": 2}, {}, BASE_POOL, None),
    "pp rank": ({"pp_rank": 1, "pp_size": 2}, {}, BASE_POOL, None),
    "namespace_prefix (a deployment's salt)": ({}, {"namespace_prefix": "tenant-b"}, BASE_POOL, None),
}


@pytest.mark.parametrize("field", list(VARIANTS))
def test_every_identity_field_is_a_cold_miss(node: NodeProcess, monkeypatch: pytest.MonkeyPatch, field: str) -> None:
    """Engine A (Llama-3.1-8B, bf16 page_first, TP 1, no revision) stores a prompt; an engine that differs in
    one field of its identity gets its own namespace, so a miss, never A's bytes; the same identity hits."""
    cfg, extra, pool_of, server_revision = VARIANTS[field]
    keys = page_keys([sum(map(ord, field)), *range(PAGE * 4)])
    base = {"interface_v1": 1, "url": f"kvstore://{node.addr}", "transport": "grpc"}
    a_pool = MHAHostPool("page_first", 8)
    fill(a_pool, 9)
    with contextlib.ExitStack() as closing:
        a = attach(create_backend(base), a_pool)
        closing.callback(a.close)
        assert backup(a, keys, indices([0, 1, 2, 3]))
        same = attach(create_backend(base), MHAHostPool("page_first", 8))
        closing.callback(same.close)
        if server_revision is not None:
            sglang_server_args(monkeypatch, server_revision)
        storage_cfg = {"storage_config": ForkStorageConfig} if "model_identity_hash" in cfg else {}
        b = attach(create_backend({**base, **extra}, **storage_cfg, **cfg), pool_of())
        closing.callback(b.close)
        assert b._seg_ns != a._seg_ns and b._flat_ns != a._flat_ns, (field, b._seg_ns)
        assert b.batch_exists(keys) == 0, f"{field}: another identity must not find A's pages"
        assert same.batch_exists(keys) == 4  # the control: the same identity hits


def test_fp8_kinds_are_apart_though_the_host_pool_holds_both_as_uint8(node: NodeProcess) -> None:
    keys = page_keys([77, *range(PAGE * 2)])
    extra = {"interface_v1": 1, "url": f"kvstore://{node.addr}", "transport": "grpc"}
    e4m3 = MHAHostPool("page_first", 4, torch.uint8, kv_dtype=torch.float8_e4m3fn)
    fill(e4m3, 10)
    a = attach(create_backend(extra), e4m3)
    b = attach(create_backend(extra), MHAHostPool("page_first", 4, torch.uint8, kv_dtype=torch.float8_e5m2))
    try:
        assert "/float8_e4m3fn/" in a._seg_ns and "/float8_e5m2/" in b._seg_ns
        assert backup(a, keys, indices([0, 1]))
        assert a.batch_exists(keys) == 2 and b.batch_exists(keys) == 0
    finally:
        a.close()
        b.close()


def test_a_sessions_pages_are_retained_resumed_and_ended(node: NodeProcess, caplog: pytest.LogCaptureFixture) -> None:
    """Retention hints in `extra_info.extra_info` (SGLang's `session_id`, as its Mooncake linker passes it, and
    kvstore.<key>: DESIGN.md §6.5, kvstore/integrations/hints.py)."""
    keys = page_keys([777] + [(i * 11) % 4000 for i in range(PAGE * 6)])
    pool = MHAHostPool("page_first", 8)
    fill(pool, 5)
    extra = {"interface_v1": 1, "url": f"kvstore://{node.addr}", "transport": "grpc"}
    b = attach(create_backend(extra), pool)
    hints = {"session_id": "agent-9", "kvstore.ttl_s": 60, "kvstore.mode": "demote", "kvstore.priority": 60}
    try:
        assert all(b.batch_set_v1(keys, indices(list(range(6))), HiCacheStorageExtraInfo(extra_info=hints)))
        with KVStoreClient(node.addr, transport="grpc") as kv:
            state = kv.update_session("agent-9").state
            per = b.geometry.regions  # type: ignore[union-attr]
            assert state is not None and (state.pages, state.priority, state.mode.label) == (6 * per, 60, "demote")
            resumed = kv.stats().retention.calls
            nxt = HiCacheStorageExtraInfo(extra_info={"session_id": "agent-9", "kvstore.priority": 95})
            assert b.batch_exists(keys, nxt) == 6  # its next turn: resumed first
            assert kv.update_session("agent-9").state.priority == 95  # type: ignore[union-attr]
            assert kv.stats().retention.calls > resumed
            last = HiCacheStorageExtraInfo(extra_info={"kvstore.session": "agent-9", "kvstore.end": True})
            assert all(b.batch_set_v1(keys[:1], indices([0]), last))
            assert kv.stats().retention.sessions == 0
            bad = HiCacheStorageExtraInfo(extra_info={"session_id": "x", "kvstore.mode": "keep-forever"})
            assert all(b.batch_set_v1(keys[:2], indices([0, 1]), bad))  # stored, without retention
            assert kv.stats().retention.sessions == 0
        assert "extra_info.kvstore.mode" in caplog.text
    finally:
        b.close()


def test_batch_exists_reports_what_arrives_before_sglangs_deadline(node: NodeProcess) -> None:
    """The node's fetch-time estimate (DESIGN.md §6.6) against SGLang's prefetch deadline (base + per 1024
    tokens): pages that would arrive after it are reported misses (SGLang would discard them)."""
    keys = page_keys([4242] + [(i * 17) % 4000 for i in range(PAGE * 8)])
    pool = MHAHostPool("page_first", 8)
    fill(pool, 6)
    base = {"interface_v1": 1, "url": f"kvstore://{node.addr}", "transport": "grpc"}
    writer = attach(create_backend(base), pool)
    tight = attach(create_backend({**base, "fetch_budget_base": 0.0001, "fetch_budget_per_ki_token": 0.0}), pool)
    off = attach(create_backend({**base, "fetch_budget_base": 0.0001, "fit_fetch_budget": False}), pool)
    try:
        assert backup(writer, keys, indices(list(range(8))))
        assert writer.batch_exists(keys) == 8  # SGLang's defaults: 1 s + 0.25 s per 1024 tokens, room for all
        with KVStoreClient(node.addr, transport="grpc") as kv:
            regions = [h for k in keys for h in region_hashes(k, writer.geometry.regions)]  # type: ignore[union-attr]
            assert kv.lookup_detail(writer._seg_ns, regions).fetch_ms > 0.1  # more than a 0.1 ms budget
        assert 0 <= tight.batch_exists(keys) < 8
        assert off.batch_exists(keys) == 8
    finally:
        for b in (writer, tight, off):
            b.close()
