"""kvstore's vLLM secondary tier (kvstore/integrations/vllm_offload.py) driven through vLLM 0.32's own offloading
objects, timed: runs in the engine venv (tools/vllm_venv.sh) and prints one JSON line (`TIERRESULT {...}`).

    python benchmarks/vllm_tier_driver.py --url kvstore://127.0.0.1:50051 --row-bytes 2097152 --batch 16

vLLM's `TieringOffloadingSpec` builds the CPU tier (its shared offload region) and loads the tier from its
module_path, as `vllm serve` does. Per round: a store job of `--batch` chunk rows (`submit_store`, what vLLM's
cascade submits), then a promotion job loading them into other rows (`submit_load`), each timed from submit until
`get_finished_jobs` hands its result back; beside them the client alone (the tier's own RemoteStore: put_from and
get_into of the same rows), alternated, so the door's cost over its plane reads off one run. GB/s (10^9) = batch x
row bytes / median seconds. Rows checked byte for byte after the first load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

import numpy as np

try:  # NOTE: vLLM lives in the engine venv; without it --help still works and a run says where to go
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    NO_VLLM = None
except ImportError as exc:
    NO_VLLM = exc


def make_spec(url: str, row: int, rows: int, transport: str | None) -> TieringOffloadingSpec:
    tier: dict[str, Any] = {"type": "KVStoreSecondaryTier", "module_path": "kvstore.integrations.vllm_offload",
                            "url": url, "timeout": 60}  # fmt: skip
    if transport:
        tier["transport"] = transport
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": rows * row, "secondary_tiers": [tier]}
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=row, enable_kv_cache_events=False, extra_config=extra,
        engine_id=f"kvstore-bench-{uuid.uuid4().hex[:8]}", model=OffloadingModelConfig(name="bench", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False),
        replicated_layout=False, canonical_layout=False, kv_cache_layout=None,
    )  # fmt: skip
    return TieringOffloadingSpec(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--row-bytes", type=int, nargs="+", default=[2 << 20])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--transport", default=None)
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args()
    if NO_VLLM is not None:
        ap.error(f"needs vLLM ({NO_VLLM}): run it with the engine venv's python (tools/vllm_venv.sh)")
    out = [run(args, row) for row in args.row_bytes]
    print("TIERRESULT " + json.dumps({"results": out}), flush=True)


def run(args: argparse.Namespace, row: int) -> dict[str, Any]:
    n = args.batch
    mgr = make_spec(args.url, row, 2 * n + 2, args.transport).get_manager()
    tier = mgr.secondary_tiers[0]
    assert tier.row_bytes == row, (tier.row_bytes, row)
    rows = np.asarray(mgr.primary_tier.get_kv_memoryview())
    rows[:n] = np.random.default_rng(row).integers(0, 256, (n, row), dtype=np.uint8)
    req = ReqContext(req_id="bench")
    src, dst = np.arange(n), np.arange(n, 2 * n)
    job_ids = iter(range(1, 1 << 30))

    def job(keys: list, chunks: np.ndarray, promotion: bool) -> float:
        j = TransferJob(job_id=next(job_ids), keys=keys, chunk_ids=chunks, is_promotion=promotion, req_context=req)
        t0 = time.perf_counter()
        (tier.submit_load if promotion else tier.submit_store)(j)
        deadline = time.monotonic() + args.timeout
        while True:
            done = [r for r in tier.get_finished_jobs() if r.job_id == j.job_id]
            if done:
                assert done[0].success, f"{'load' if promotion else 'store'} job failed"
                return time.perf_counter() - t0
            if time.monotonic() > deadline:
                raise TimeoutError("the tier finished no job in time")
            time.sleep(0.0002)

    def keys(tag: str) -> list:
        return [make_offload_key(f"{tag}-{i}".encode().ljust(32, b"."), 0) for i in range(n)]

    from kvstore.integrations.vllm_offload import page_hash

    def client(tag: str) -> tuple[float, float]:
        hs = [page_hash(k) for k in keys(tag)]
        views = [rows[int(c)] for c in src]
        t0 = time.perf_counter()
        assert tier.store.put_from(tier.namespace, tier.layout, hs, views, chain=False).ok
        t1 = time.perf_counter()
        assert len(tier.store.get_into(tier.namespace, hs, [rows[int(c)] for c in dst])) == n
        t2 = time.perf_counter()
        tier.store.delete(tier.namespace, hs)
        return t1 - t0, t2 - t1

    warm = keys("warm")
    job(warm, src, False)
    job(warm, dst, True)
    tier.store.delete(tier.namespace, [page_hash(k) for k in warm])
    client("warm-client")
    sets, gets, csets, cgets = [], [], [], []
    exact = None
    for r in range(args.rounds):
        ks = keys(f"r{r}")
        rows[n : 2 * n] = 0
        sets.append(job(ks, src, False))
        gets.append(job(ks, dst, True))
        if exact is None:
            exact = bool(np.array_equal(rows[:n], rows[n : 2 * n]))
        tier.store.delete(tier.namespace, [page_hash(k) for k in ks])
        cs, cg = client(f"c{r}")
        csets.append(cs)
        cgets.append(cg)
    plane = tier.store.plane
    rows = np.empty((0, 0), np.uint8)  # no export of the region may outlive the manager (it unmaps it on shutdown)
    mgr.shutdown()
    gb = n * row / 1e9
    med = statistics.median
    return {"row_bytes": row, "batch": n, "rounds": args.rounds, "plane": plane, "bit_exact": exact,
            "store_gbs": gb / med(sets), "load_gbs": gb / med(gets),
            "client_put_gbs": gb / med(csets), "client_get_gbs": gb / med(cgets)}  # fmt: skip


if __name__ == "__main__":
    main()
