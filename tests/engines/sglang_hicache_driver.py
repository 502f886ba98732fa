"""SGLang 0.5.23's own HiCache code against a kvstore node: run by the SGLang venv's python (tools/sglang_venv.sh)
from tests/engines/test_sglang_hicache_real.py, which starts the node and reads the one JSON line this prints.

    python sglang_hicache_driver.py NODE_ADDR

prints {"factory": ..., "v1": {layout: ...}, "v2": ...} (one process: importing SGLang is the slow part).

Everything engine-side is SGLang's: its device pools (`MHATokenToKVPool`, `MLATokenToKVPool` on "cpu"), its
host pools (`MHATokenToKVPoolHost`, `MLATokenToKVPoolHost`, `MambaPoolHost`), its `HiCacheController` built with
`storage_backend="dynamic"` (so `StorageBackendFactory.create_backend` loads kvstore's backend from the extra
config, as `--hicache-storage-backend dynamic` does), the controller's own page calls
(`_page_set_zero_copy`, `_page_get_zero_copy`), and its `PoolTransfer` / `PoolName` / `PoolHitPolicy` for the
v2 calls. Two engines (A stores, B loads into fresh pools) share nothing but the node.

What is not SGLang's: the parallel topology is published with SGLang's own `runtime_context.publish` for one
rank (what `sglang.test.test_utils.published_topology` does; that module itself imports SGLang's benchmark
datasets), torch.distributed runs gloo with one rank, and the Mamba state buffers handed to `MambaPoolHost`
are CPU tensors shaped as a device `MambaPool` exposes them (a device pool needs CUDA kernels).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
from sglang.srt.server_args import ServerArgs

PAGE, LAYERS, HEADS, DIM = 16, 3, 2, 32
TOKENS = 2048
PAGES = 64


def extra(addr: str, **more: Any) -> dict[str, Any]:
    return {"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang_hicache",
            "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "url": f"kvstore://{addr}", **more}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def setup() -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    reset_context()
    publish(ServerArgs(model_path="dummy"), role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))


def mha_engine(addr: str, layout: str, model: str) -> tuple[HiCacheController, Any]:
    """SGLang's device pool, host pool and controller, the storage backend loaded by SGLang's factory."""
    device = MHATokenToKVPool(TOKENS, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False)
    host = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout,
                                device_capacity_tokens=device.size, start_layer=device.start_layer,
                                end_layer=device.end_layer, write_back_staging=device.hicache_write_back_staging,
                                pin_memory=False)  # fmt: skip
    return controller(device, host, addr, model), host


def mla_engine(addr: str, model: str) -> tuple[HiCacheController, Any]:
    device = MLATokenToKVPool(TOKENS, PAGE, torch.bfloat16, 64, 16, LAYERS, "cpu", False)
    host = MLATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, "page_first",
                                pin_memory=False, device_capacity_tokens=device.size, start_layer=device.start_layer,
                                end_layer=device.end_layer, target_layer_num=LAYERS)  # fmt: skip
    return controller(device, host, addr, model), host


def controller(device: Any, host: Any, addr: str, model: str) -> HiCacheController:
    alloc = TokenToKVPoolAllocator(TOKENS, device.dtype, "cpu", device, False)
    c = HiCacheController(alloc, host, PAGE, dist.group.WORLD, threading.Event(), storage_backend="dynamic",
                          model_name=model, storage_backend_extra_config=extra(addr))  # fmt: skip
    assert type(c.storage_backend).__name__ == "KVStoreHiCacheStorage", type(c.storage_backend)
    assert c.page_set_func == c._page_set_zero_copy and c.page_get_func == c._page_get_zero_copy
    return c


def fill(host: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name in ("kv_buffer", "temporal_buffer"):
        buf = getattr(host, name, None)
        if isinstance(buf, torch.Tensor):
            flat = buf.view(-1).view(torch.uint8)
            flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))
    for buf in getattr(host, "conv_buffer", None) or ():
        flat = buf.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))


def page_keys(n: int, salt: str) -> list[str]:
    import hashlib

    keys, prev = [], salt.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        keys.append(prev.hex())
    return keys


def pages_equal(a: Any, ia: torch.Tensor, b: Any, ib: torch.Tensor, page: int = PAGE) -> int:
    """How many pages of host pool `b` at `ib` hold exactly the bytes of pool `a` at `ia` (SGLang's get_data_page)."""
    same = 0
    for i in range(len(ia) // page):
        pa = a.get_data_page(int(ia[i * page]), flat=True).view(torch.uint8)
        pb = b.get_data_page(int(ib[i * page]), flat=True).view(torch.uint8)
        same += bool(torch.equal(pa, pb))
    return same


def v1(addr: str, layout: str) -> dict[str, Any]:
    """Engine A backs up PAGES pages with the controller's _page_set_zero_copy; engine B, fresh pools, finds them
    (batch_exists) and loads them with _page_get_zero_copy; every page compared byte for byte."""
    make = (
        (lambda: mla_engine(addr, "sgl-real-mla"))
        if layout == "mla"
        else (lambda: mha_engine(addr, layout, "sgl-real"))
    )
    a, host_a = make()
    fill(host_a, 1)
    keys = page_keys(PAGES, layout)
    ia = host_a.alloc(PAGES * PAGE)
    stored = a._page_set_zero_copy(keys, ia, HiCacheStorageExtraInfo(prefix_keys=[]))
    b, host_b = make()
    exists = b.storage_backend.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[]))
    ib = host_b.alloc(PAGES * PAGE)
    got = b._page_get_zero_copy(SimpleNamespace(request_id="r1"), keys, ib, HiCacheStorageExtraInfo(prefix_keys=[]))
    same = pages_equal(host_a, ia, host_b, ib)
    for c in (a, b):
        c.detach_storage_backend()
    return {"stored": stored, "exists": exists, "loaded": got, "exact": same}


def mamba_host(seed: int) -> MambaPoolHost:
    info = MambaStateBufferInfo(temporal=torch.zeros(2, 9, 4, 16, dtype=torch.float32),
                                conv=(torch.zeros(2, 9, 32, 3, dtype=torch.bfloat16),))  # fmt: skip
    host = MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, layout="page_first")
    fill(host, seed)
    return host


def swa_host(seed: int) -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(TOKENS, PAGE, torch.bfloat16, 1, 64, 2, "cpu", False)
    host = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, "page_first",
                                device_capacity_tokens=device.size, start_layer=0, end_layer=1, pin_memory=False,
                                pool_label="swa")  # fmt: skip
    fill(host, seed)
    return host


def hybrid(addr: str, seed: int) -> tuple[HiCacheController, Any, dict[str, Any]]:
    """A hybrid engine's pools registered as SGLang's HybridCacheController registers them: the KV anchor through
    the factory's attach, then every other pool with register_mem_host_pool_v2, then on_host_pools_registered."""
    c, kv_host = mha_engine(addr, "page_first", "sgl-real-hybrid")
    fill(kv_host, seed)
    pools = {"kv": kv_host, "swa": swa_host(seed + 1), "mamba": mamba_host(seed + 2)}
    for name in ("swa", "mamba"):
        c.storage_backend.register_mem_host_pool_v2(pools[name], PoolName(name))
    c.storage_backend.on_host_pools_registered()
    return c, kv_host, pools


def v2(addr: str) -> dict[str, Any]:
    """v2 bundles: one call carrying kv, swa and mamba for the trailing pages of a span (one atomic bundle per
    page: kv+swa for pages 12..14, kv+swa+mamba for page 15), SGLang's own sidecar calls (mamba alone, swa alone),
    exists with both hit policies, and a load into a fresh engine's pools, compared byte for byte."""
    out: dict[str, Any] = {}
    a, _, pa = hybrid(addr, 10)
    keys = page_keys(16, "v2")
    ia = {n: pa[n].alloc(len(keys) * pa[n].page_size) for n in ("kv", "swa")}
    ia["mamba"] = pa["mamba"].alloc(1)
    # the KV pages of the span as SGLang stores them (v1), then the sidecars with v2 (hybrid controller's order)
    out["kv_v1"] = a._page_set_zero_copy(keys, ia["kv"], HiCacheStorageExtraInfo(prefix_keys=[]))
    # as SGLang's hybrid controller groups sidecars (_trailing_chain_groups: equal tail lengths travel together):
    # kv and swa over the last 4 pages, then kv, swa and mamba at the span's last page: one bundle per page
    tail = keys[12:]
    window = [
        PoolTransfer(name=PoolName.KV, host_indices=ia["kv"][12 * PAGE :], keys=tail),
        PoolTransfer(name=PoolName.SWA, host_indices=ia["swa"][12 * PAGE :], keys=tail,
                     hit_policy=PoolHitPolicy.TRAILING_PAGES),
    ]  # fmt: skip
    last = [
        PoolTransfer(name=PoolName.KV, host_indices=ia["kv"][15 * PAGE :], keys=keys[-1:]),
        PoolTransfer(name=PoolName.SWA, host_indices=ia["swa"][15 * PAGE :], keys=keys[-1:]),
        PoolTransfer(name=PoolName.MAMBA, host_indices=ia["mamba"], keys=keys[-1:],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES),
    ]  # fmt: skip
    res = a.storage_backend.batch_set_v2(window, HiCacheStorageExtraInfo(prefix_keys=keys[:12]))
    res2 = a.storage_backend.batch_set_v2(last, HiCacheStorageExtraInfo(prefix_keys=keys[:15]))
    out["set_v2"] = [{str(k): v for k, v in r.items()} for r in (res, res2)]
    # bad input: an unregistered pool, and indices that do not cover the keys: nothing stored, all False
    bad = a.storage_backend.batch_set_v2(
        [PoolTransfer(name=PoolName.MAMBA, host_indices=ia["mamba"], keys=keys[:1]),
         PoolTransfer(name=PoolName.INDEXER, host_indices=ia["kv"][:PAGE], keys=keys[:1])]
    )  # fmt: skip
    short = a.storage_backend.batch_set_v2(
        [PoolTransfer(name=PoolName.SWA, host_indices=ia["swa"][: PAGE - 1], keys=keys[:1])]
    )
    out["bad_sets"] = [{str(k): v for k, v in bad.items()}, {str(k): v for k, v in short.items()}]

    b, _, pb = hybrid(addr, 99)
    st = b.storage_backend

    def probe(n: int, pools: tuple[PoolName, ...]) -> dict[str, Any]:
        transfers = [PoolTransfer(name=p, keys=["__placeholder__"] * n, hit_policy=PoolHitPolicy.TRAILING_PAGES)
                     for p in pools]  # fmt: skip
        hit = st.batch_exists_v2(keys, transfers, HiCacheStorageExtraInfo(prefix_keys=[]))
        return {"kv": hit.kv_hit_pages, "pools": {str(k): v for k, v in hit.extra_pool_hit_pages.items()},
                "restorable": hit.restorable_prefix_pages}  # fmt: skip

    out["exists"] = [probe(4, (PoolName.KV, PoolName.SWA)), probe(1, (PoolName.KV, PoolName.SWA, PoolName.MAMBA)),
                     probe(2, (PoolName.MAMBA,))]  # fmt: skip
    ib = {n: pb[n].alloc(len(keys) * pb[n].page_size) for n in ("kv", "swa")}
    ib["mamba"] = pb["mamba"].alloc(1)
    out["kv_v1_loaded"] = b._page_get_zero_copy(SimpleNamespace(request_id="r2"), keys, ib["kv"])
    got = [
        st.batch_get_v2(
            [PoolTransfer(name=PoolName.KV, host_indices=ib["kv"][12 * PAGE :], keys=tail),
             PoolTransfer(name=PoolName.SWA, host_indices=ib["swa"][12 * PAGE :], keys=tail)]
        ),
        st.batch_get_v2(
            [PoolTransfer(name=PoolName.KV, host_indices=ib["kv"][15 * PAGE :], keys=keys[-1:]),
             PoolTransfer(name=PoolName.SWA, host_indices=ib["swa"][15 * PAGE :], keys=keys[-1:]),
             PoolTransfer(name=PoolName.MAMBA, host_indices=ib["mamba"], keys=keys[-1:])]
        ),
    ]  # fmt: skip
    out["get_v2"] = [{str(k): v for k, v in g.items()} for g in got]
    # a get that leaves out a pool the page's bundle holds is a miss, never the other pools alone
    partial = st.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=ib["swa"][15 * PAGE :], keys=keys[-1:])])
    out["get_partial"] = {str(k): v for k, v in partial.items()}
    out["exact"] = {
        "kv": pages_equal(pa["kv"], ia["kv"], pb["kv"], ib["kv"]),
        "swa": pages_equal(pa["swa"], ia["swa"][12 * PAGE :], pb["swa"], ib["swa"][12 * PAGE :]),
        "mamba": pages_equal(pa["mamba"], ia["mamba"], pb["mamba"], ib["mamba"], page=1),
    }
    for c in (a, b):
        c.detach_storage_backend()
    return out


def session(addr: str) -> dict[str, Any]:
    """Retention hints in SGLang's own HiCacheStorageExtraInfo (`extra_info`, with its `session_id` key, as its
    Mooncake linker fills it) through the controller's _page_set_zero_copy, then a next turn's batch_exists."""
    a, host = mha_engine(addr, "page_first", "sgl-session")
    fill(host, 7)
    keys = page_keys(8, "session")
    ia = host.alloc(8 * PAGE)
    info = HiCacheStorageExtraInfo(prefix_keys=[], extra_info={"session_id": "sgl-s1", "kvstore.mode": "demote"})
    stored = a._page_set_zero_copy(keys, ia, info)
    nxt = HiCacheStorageExtraInfo(prefix_keys=[], extra_info={"session_id": "sgl-s1", "kvstore.priority": 80})
    exists = a.storage_backend.batch_exists(keys, nxt)
    a.detach_storage_backend()
    return {"stored": stored, "exists": exists}


def factory(addr: str) -> dict[str, Any]:
    """StorageBackendFactory.create_backend("dynamic", ...) on its own, as SGLang calls it."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="m", extra_config=extra(addr))  # fmt: skip
    _, host = mha_engine(addr, "page_first", "m")
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    return {"class": f"{type(backend).__module__}.{type(backend).__name__}"}


def main() -> None:
    addr = sys.argv[1]
    setup()
    try:
        result = {
            "factory": factory(addr),
            "v1": {layout: v1(addr, layout) for layout in ("layer_first", "page_first", "page_first_direct", "mla")},
            "v2": v2(addr),
            "session": session(addr),
        }
    finally:
        dist.destroy_process_group()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
