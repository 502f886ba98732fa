"""Drive kvstore's vLLM secondary tier through vLLM 0.32's own offloading objects (run in the vLLM venv).

    python tests/engines/vllm_offload_driver.py --url kvstore://H:P --down-url kvstore://H:P2 --auth-url kvstore://H:P3 \
        --bound-url kvstore://H:P4 --full-url kvstore://H:P5 --identity-url kvstore://H:P6

vLLM's CPU build refuses the offloading worker (GPU <-> CPU copies), so this script stands in for the
worker alone: it writes each stored chunk's bytes into the CPU tier's row, as the worker's GPU->CPU copy
would, and reads promoted rows back. Everything else is vLLM's: `TieringOffloadingSpec` (its shared
offload region, `CPUPrimaryTierOffloadingManager`, `SecondaryTierFactory` loading our tier from its
`module_path`) and `TieringOffloadingManager` (lookup, prepare_store / complete_store and the cascade,
promotion on a secondary hit, prepare_load / complete_load, on_schedule_end). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import uuid
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvstore.integrations.vllm_offload import page_hash

BLOCK_TOKENS = 16
KV_BYTES_PER_BLOCK = 2 * 2 * BLOCK_TOKENS * 4 * 64 * 2  # 2 layers, K+V, 16 tokens, 4 heads, dim 64, bf16


def make_spec(url: str, *, engine: dict[str, Any] | None = None, **tier: Any) -> TieringOffloadingSpec:
    """vLLM's TieringOffloadingSpec over a hand-built OffloadingConfig (what vLLM derives from its VllmConfig):
    tiny-llama, bf16, 16-token blocks, 2 layers, TP 1. `engine` changes one identity field (IDENTITY_FIELDS)."""
    e = {"model": "tiny-llama", "dtype": "bfloat16", "kv_cache_layout": None, "canonical_layout": False,
         "tokens_per_block": BLOCK_TOKENS, "tokens_per_hash": BLOCK_TOKENS, "blocks_per_chunk": 1,
         "layers": ("l0", "l1"), "kv_bytes": KV_BYTES_PER_BLOCK, "world_size": 1, "tp_size": 1, "pp_size": 1,
         "agnostic": False, "replicated_layout": False, "groups": 1, **(engine or {})}  # fmt: skip
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64 * 1024 * e["kv_bytes"] // 16,
             "secondary_tiers": [{"type": "KVStoreSecondaryTier", "module_path": "kvstore.integrations.vllm_offload",
                                  "url": url, "timeout": 5, "lookup_timeout": 2, **tier}]}  # fmt: skip
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=e["tokens_per_block"], layer_names=e["layers"], group_id=0),
                *(OffloadingGroupConfig(tokens_per_block=e["tokens_per_block"], layer_names=(f"sw{g}",), group_id=g)
                  for g in range(1, e["groups"]))),
        worker_kv_bytes_per_block=e["kv_bytes"], enable_kv_cache_events=False, extra_config=extra,
        engine_id=f"kvstore-test-{uuid.uuid4().hex[:8]}", model=OffloadingModelConfig(name=e["model"], dtype=e["dtype"]),
        cache=OffloadingCacheConfig(tokens_per_hash=e["tokens_per_hash"], blocks_per_chunk=e["blocks_per_chunk"]),
        parallel=OffloadingParallelConfig(rank=0, world_size=e["world_size"], tp_size=e["tp_size"],
                                          pp_size=e["pp_size"], pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=e["agnostic"]),
        replicated_layout=e["replicated_layout"], canonical_layout=e["canonical_layout"],
        kv_cache_layout=e["kv_cache_layout"],
    )  # fmt: skip
    return TieringOffloadingSpec(cfg)


# One field of the engine's identity changed at a time (what vLLM's OffloadingConfig carries, and the tier's
# model_revision): each must be a cold miss for what the base engine stored.
IDENTITY_FIELDS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # name -> (engine fields, tier settings)
    "model": ({"model": "tiny-llama-2"}, {}),
    "revision (tier setting)": ({}, {"model_revision": "0e9e39f"}),
    "kv dtype (same size)": ({"dtype": "float16"}, {}),
    "kv layout NHD": ({"kv_cache_layout": "LBNHC"}, {}),
    "block size": ({"tokens_per_block": 2 * BLOCK_TOKENS, "tokens_per_hash": 2 * BLOCK_TOKENS}, {}),
    "tokens per hash": ({"tokens_per_hash": BLOCK_TOKENS // 2}, {}),
    "blocks per chunk": ({"blocks_per_chunk": 2, "kv_bytes": KV_BYTES_PER_BLOCK // 2}, {}),
    "layers (another model or pp stage)": ({"layers": ("l1", "l2")}, {}),
    "tp size": ({"world_size": 2, "tp_size": 2, "kv_bytes": KV_BYTES_PER_BLOCK // 2}, {}),
    "pp size": ({"world_size": 2, "pp_size": 2, "kv_bytes": KV_BYTES_PER_BLOCK // 2}, {}),
    "parallelism-agnostic bytes": ({"agnostic": True}, {}),
    "namespace_prefix (a deployment's salt)": ({}, {"namespace_prefix": "tenant-b"}),
}
LAYOUT_PAIRS = {"LBNHC": "LBHNC"}  # NHD against HND: the same bytes per block, another order


def keys_for(n: int, salt: bytes) -> list[OffloadKey]:
    out, prev = [], salt
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()  # a 32-byte chained block hash
        out.append(make_offload_key(prev, 0))
    return out


def step(mgr: Any) -> None:
    mgr.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def settle(mgr: Any, pred: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        step(mgr)
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())


def lookup_all(mgr: Any, keys: list[OffloadKey], req: ReqContext, timeout: float = 20.0) -> list[str]:
    """The scheduler's prefix lookup, repeated each step until nothing is deferred (RETRY/HIT_PENDING)."""
    deadline = time.monotonic() + timeout
    while True:
        results = []
        for k in keys:
            r = mgr.lookup(k, req)
            results.append(r.name)
            if r is LookupResult.MISS:
                break
        if all(r in ("HIT", "MISS") for r in results) or time.monotonic() > deadline:
            return results
        step(mgr)
        time.sleep(0.01)


def store(mgr: Any, keys: list[OffloadKey], req: ReqContext, data: dict[OffloadKey, bytes]) -> None:
    """GPU -> CPU offload of `keys` (the worker's copy done here), then vLLM cascades to the tier."""
    out = mgr.prepare_store(keys, req)
    assert out is not None, "primary tier full"
    rows = np.asarray(mgr.primary_tier.get_kv_memoryview())
    for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
        rows[int(cid)][:] = np.frombuffer(data[k], dtype=np.uint8)
    del rows  # no export of the region may outlive the manager (it unmaps it on shutdown)
    mgr.complete_store(keys, req)


def record_jobs(tier: Any) -> list[Any]:
    """Every JobResult the tier hands vLLM from now on (vLLM consumes them; this keeps a copy)."""
    jobs: list[Any] = []
    orig = tier.get_finished_jobs

    def spy() -> Any:
        got = list(orig())
        jobs.extend(got)
        return got

    tier.get_finished_jobs = spy
    return jobs


def round_trip(url: str) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    a_spec, b_spec = make_spec(url), make_spec(url)
    a, b = a_spec.get_manager(), b_spec.get_manager()
    tier_a, tier_b = a.secondary_tiers[0], b.secondary_tiers[0]
    row = tier_a.row_bytes
    keys = keys_for(24, b"prompt-1")
    data = {k: rng.integers(0, 256, row, dtype=np.uint8).tobytes() for k in keys}
    req_a = ReqContext(req_id="A")
    a.on_new_request(req_a)
    before = lookup_all(a, keys[:1], req_a)  # nothing anywhere yet
    store(a, keys, req_a, data)
    stored = settle(a, lambda: not tier_a.has_pending_work() and not a.has_pending_work())
    a.on_request_finished(req_a)
    # A fresh engine B: its own CPU tier (a new shared region), nothing in it.
    req_b = ReqContext(req_id="B")
    b.on_new_request(req_b)
    first = lookup_all(b, keys, req_b)
    settle(b, lambda: not tier_b.has_pending_work() and not b.has_pending_work())
    second = lookup_all(b, keys, req_b)
    spec = b.prepare_load(keys, req_b)
    rows = np.asarray(b.primary_tier.get_kv_memoryview())
    exact = all(rows[int(c)].tobytes() == data[k] for k, c in zip(keys, spec.chunk_ids, strict=True))
    del rows
    b.complete_load(keys, req_b)
    sources = sorted({b.get_load_source(k, req_b).name for k in keys})
    # A longer prompt: the stored prefix hits, the new tail misses.
    longer = keys + keys_for(3, b"tail")
    req_c = ReqContext(req_id="C")
    b.on_new_request(req_c)
    partial = lookup_all(b, longer, req_c)
    b.on_request_finished(req_c)
    b.on_request_finished(req_b)
    ns = tier_b.namespace
    for m in (a, b):
        m.shutdown()
    return {"before": before, "stored": stored, "first": first, "second": second, "exact": exact,
            "sources": sources, "partial": partial, "namespace": ns, "row_bytes": row,
            "hashes": [bytes(k[:32]).hex() for k in keys]}  # fmt: skip


def down(url: str) -> dict[str, Any]:
    spec = make_spec(url, down_backoff=0.2)
    mgr = spec.get_manager()
    tier = mgr.secondary_tiers[0]
    keys = keys_for(4, b"down")
    data = {k: bytes(tier.row_bytes) for k in keys}
    req = ReqContext(req_id="D")
    mgr.on_new_request(req)
    t0 = time.monotonic()
    looked = lookup_all(mgr, keys, req)
    store(mgr, keys, req, data)
    jobs = record_jobs(tier)
    settle(mgr, lambda: not tier.has_pending_work())
    mgr.on_request_finished(req)
    mgr.shutdown()
    return {"lookup": looked, "store_jobs": [j.success for j in jobs], "seconds": time.monotonic() - t0}


def refused(url: str, **tier: Any) -> dict[str, Any]:
    """A store the node refuses (wrong token, or a namespace bound to another layout): a failed cascade job,
    lookups miss, nothing is stored."""
    mgr = make_spec(url, **tier).get_manager()
    t = mgr.secondary_tiers[0]
    keys = keys_for(3, b"refused")
    req = ReqContext(req_id="R")
    mgr.on_new_request(req)
    jobs = record_jobs(t)
    store(mgr, keys, req, {k: bytes(t.row_bytes) for k in keys})
    settle(mgr, lambda: not t.has_pending_work())
    looked = lookup_all(mgr, keys_for(3, b"refused-2"), req)
    mgr.on_request_finished(req)
    ns = t.namespace
    mgr.shutdown()
    return {"store_jobs": [j.success for j in jobs], "lookup": looked, "namespace": ns,
            "hashes": [bytes(k[:32]).hex() for k in keys]}  # fmt: skip


def full(url: str) -> dict[str, Any]:
    """A DRAM-only node, full, whose policy refuses what it has not seen before (second sight): a store job
    succeeds only when the node keeps every chunk of it; lookups miss what it refused."""
    mgr = make_spec(url).get_manager()
    t = mgr.secondary_tiers[0]
    jobs = record_jobs(t)
    req = ReqContext(req_id="F")
    mgr.on_new_request(req)
    rows: dict[str, list[OffloadKey]] = {"fill": keys_for(4, b"fill"), "p": keys_for(3, b"p"), "q": keys_for(3, b"q")}
    data = {k: bytes(t.row_bytes) for ks in rows.values() for k in ks}
    out: dict[str, Any] = {}
    for name, ks in (("fill", rows["fill"]), ("first_sight", rows["p"])):
        store(mgr, ks, req, data)
        settle(mgr, lambda: not t.has_pending_work())
        out[name] = [j.success for j in jobs]
        jobs.clear()
    mixed = [k for pair in zip(rows["p"], rows["q"], strict=True) for k in pair]
    store(mgr, mixed, req, data)  # one job: p's chunks admitted on second sight, q's refused
    settle(mgr, lambda: not t.has_pending_work())
    out["mixed"] = [j.success for j in jobs]
    mgr.on_request_finished(req)
    mgr.shutdown()
    fresh = make_spec(url).get_manager()  # another engine: its CPU tier empty, so lookups reach the node
    out["lookups"] = {}
    for name in ("p", "q"):
        req = ReqContext(req_id=f"L{name}")
        fresh.on_new_request(req)
        out["lookups"][name] = [lookup_all(fresh, [k], req)[0] for k in rows[name]]
        fresh.on_request_finished(req)
    fresh.shutdown()
    return out


def identity(url: str) -> dict[str, Any]:
    """A base engine stores a prompt; an engine that differs in one identity field misses it (its own
    namespace), an engine with the same identity hits. And NHD against HND."""
    keys = keys_for(4, b"identity")
    base = make_spec(url).get_manager()
    t = base.secondary_tiers[0]
    req = ReqContext(req_id="I")
    base.on_new_request(req)
    store(base, keys, req, {k: bytes([7]) * t.row_bytes for k in keys})
    settle(base, lambda: not t.has_pending_work() and not base.has_pending_work())
    base.on_request_finished(req)
    out: dict[str, Any] = {"base": t.namespace, "fields": {}}
    base.shutdown()

    def probe(engine: dict[str, Any], tier: dict[str, Any]) -> dict[str, Any]:
        mgr = make_spec(url, engine=engine, **tier).get_manager()
        r = ReqContext(req_id="P")
        mgr.on_new_request(r)
        looked = lookup_all(mgr, keys, r)
        mgr.on_request_finished(r)
        ns = mgr.secondary_tiers[0].namespace
        mgr.shutdown()
        return {"namespace": ns, "lookup": looked}

    for name, (engine, tier) in IDENTITY_FIELDS.items():
        out["fields"][name] = probe(engine, tier)
    out["same"] = probe({}, {})
    for a, b in LAYOUT_PAIRS.items():
        out["layouts"] = [
            probe({"kv_cache_layout": a}, {})["namespace"],
            probe({"kv_cache_layout": b}, {})["namespace"],
        ]
    return out


def bad_config(url: str) -> dict[str, str]:
    """A bad tier setting refuses the manager at start, naming the key."""
    out = {}
    for key, value in (("transport", "carrier-pigeon"), ("threads", 0), ("timeout", -1), ("url", "http://x:1")):
        try:
            make_spec(value if key == "url" else url, **({} if key == "url" else {key: value})).get_manager()
            out[key] = "accepted"
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    return out


def hybrid(url: str) -> dict[str, Any]:
    """A hybrid model (two KV cache groups): each block's two groups are one bundle on the node; a fresh engine
    gets both back; a lookup of one group alone is a miss (never one group of a block without the other)."""
    rng = np.random.default_rng(1)
    a, b = make_spec(url, engine={"groups": 2}).get_manager(), make_spec(url, engine={"groups": 2}).get_manager()
    tier_a, tier_b = a.secondary_tiers[0], b.secondary_tiers[0]
    blocks = [bytes(k[:32]) for k in keys_for(8, b"hybrid")]
    keys = [make_offload_key(h, g) for h in blocks for g in (0, 1)]
    data = {k: rng.integers(0, 256, tier_a.row_bytes, dtype=np.uint8).tobytes() for k in keys}
    req_a = ReqContext(req_id="HA")
    a.on_new_request(req_a)
    store(a, keys, req_a, data)
    stored = settle(a, lambda: not tier_a.has_pending_work() and not a.has_pending_work())
    a.on_request_finished(req_a)
    req_x = ReqContext(req_id="HX")  # a request asking for group 0 alone (its lookup state is its own)
    b.on_new_request(req_x)
    alone = lookup_all(b, [make_offload_key(h, 0) for h in blocks[:2]], req_x)
    b.on_request_finished(req_x)
    req_b = ReqContext(req_id="HB")
    b.on_new_request(req_b)
    lookup_all(b, keys, req_b)
    settle(b, lambda: not tier_b.has_pending_work() and not b.has_pending_work())
    second = lookup_all(b, keys, req_b)
    spec = b.prepare_load(keys, req_b)
    rows = np.asarray(b.primary_tier.get_kv_memoryview())
    exact = sum(rows[int(c)].tobytes() == data[k] for k, c in zip(keys, spec.chunk_ids, strict=True))
    del rows
    b.complete_load(keys, req_b)
    b.on_request_finished(req_b)
    ns, layout = tier_b.bundle((0, 1))
    for m in (a, b):
        m.shutdown()
    return {"stored": stored, "alone": alone, "second": second, "exact": exact, "keys": len(keys),
            "namespace": ns, "plain_namespace": tier_b.namespace, "parts": list(layout.part_names)}  # fmt: skip


def retention(url: str) -> dict[str, Any]:
    """A conversation's requests name their session (kv_transfer_params, then kv_hints, then the flat form):
    its stored chunks are retained on the node, raised on its next turn (resumed), released when it ends; a bad
    hint is logged and its request served without retention. Reads the node's side with a client."""
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    from kvstore.client import KVStoreClient
    from kvstore.errors import SessionNotFound

    mgr = make_spec(url).get_manager()
    t = mgr.secondary_tiers[0]
    jobs = record_jobs(t)
    keys = keys_for(6, b"session")
    data = {k: bytes([3]) * t.row_bytes for k in keys}
    out: dict[str, Any] = {"namespace": t.namespace, "hashes": [bytes(k[:32]).hex() for k in keys]}
    kv = KVStoreClient(url.removeprefix("kvstore://"), transport="grpc")

    def state(session: str) -> Any:
        try:
            s = kv.update_session(session).state
            return None if s is None else {"pages": s.pages, "priority": s.priority, "mode": s.mode.label}
        except SessionNotFound:
            return None

    hints = {"session": "conv-1", "ttl_s": 120, "priority": 70, "mode": "demote"}
    r1 = ReqContext(req_id="S1", kv_transfer_params={"kvstore": hints})
    mgr.on_new_request(r1)
    store(mgr, keys, r1, data)
    settle(mgr, lambda: not t.has_pending_work() and (state("conv-1") or {}).get("pages") == 6)
    mgr.on_request_finished(r1)
    out["turn1"] = state("conv-1")
    action = KvHintAction(action_id="a1", action_type="kvstore.retain", action_version="1",
                          payload={"session": "conv-1", "priority": 90})  # fmt: skip
    r2 = ReqContext(req_id="S2", kv_hints=KvHintsEnvelope(protocol_version="1", message_id="m1", actions=[action]))
    mgr.on_new_request(r2)  # the next turn: resumed (its lease renewed, priority raised)
    settle(mgr, lambda: (state("conv-1") or {}).get("priority") == 90)
    out["turn2"] = state("conv-1")
    mgr.on_request_finished(r2)
    r3 = ReqContext(req_id="S3", kv_transfer_params={"kvstore.session": "conv-1", "kvstore.end": True})
    mgr.on_new_request(r3)
    mgr.on_request_finished(r3)  # the last turn: the session ends
    settle(mgr, lambda: state("conv-1") is None)
    out["ended"] = state("conv-1")
    jobs.clear()
    r4 = ReqContext(req_id="S4", kv_transfer_params={"kvstore": {"session": "bad", "priority": 500}})
    mgr.on_new_request(r4)
    other = keys_for(2, b"bad-hint")
    store(mgr, other, r4, {k: bytes(t.row_bytes) for k in other})
    settle(mgr, lambda: not t.has_pending_work())
    mgr.on_request_finished(r4)
    out["bad_hint"] = {"store_jobs": [j.success for j in jobs], "session": state("bad")}
    out["stats"] = {"calls": kv.stats().retention.calls, "resumed": kv.stats().retention.resumed}
    kv.close()
    mgr.shutdown()
    return out


def worker(url: str) -> dict[str, Any]:
    """What the engine's worker does at start on this platform: ask the spec for its GPU<->CPU worker."""
    from vllm.platforms import current_platform

    try:
        make_spec(url).get_worker(None)  # type: ignore[arg-type]
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "platform": current_platform.device_type}
    return {"error": None, "platform": current_platform.device_type}


def misfiled(url: str) -> dict[str, Any]:
    """Engine A stores a 4-chunk prompt; this prints `STORED {json}` (the tier's namespace and the chunks'
    kvstore hashes) and waits for a line on stdin, while the test files chunk 2's record under chunk 3's key
    and chunk 3's under chunk 2's at the node, as a mapping bug would; then a fresh engine B looks the prompt
    up and loads what vLLM promotes. The bytes B gets are A's or nothing."""
    rng = np.random.default_rng(2)
    a = make_spec(url).get_manager()
    tier_a = a.secondary_tiers[0]
    keys = keys_for(4, b"misfiled")
    data = {k: rng.integers(0, 256, tier_a.row_bytes, dtype=np.uint8).tobytes() for k in keys}
    req_a = ReqContext(req_id="MA")
    a.on_new_request(req_a)
    store(a, keys, req_a, data)
    stored = settle(a, lambda: not tier_a.has_pending_work() and not a.has_pending_work())
    a.on_request_finished(req_a)
    ns = tier_a.namespace
    hashes = [page_hash(k).hex() for k in keys]
    a.shutdown()
    print("STORED " + json.dumps({"stored": stored, "namespace": ns, "hashes": hashes}), flush=True)
    sys.stdin.readline()
    b = make_spec(url).get_manager()
    tier_b = b.secondary_tiers[0]
    req_b = ReqContext(req_id="MB")
    b.on_new_request(req_b)
    first = lookup_all(b, keys, req_b)
    settle(b, lambda: not tier_b.has_pending_work() and not b.has_pending_work())
    second = lookup_all(b, keys, req_b)
    hits = keys[: second.count("HIT")]
    exact = None
    if hits:
        spec = b.prepare_load(hits, req_b)
        rows = np.asarray(b.primary_tier.get_kv_memoryview())
        exact = [rows[int(c)].tobytes() == data[k] for k, c in zip(hits, spec.chunk_ids, strict=True)]
        del rows
        b.complete_load(hits, req_b)
    b.on_request_finished(req_b)
    req_c = ReqContext(req_id="MC")  # a third engine's view: what the node holds now
    c = make_spec(url).get_manager()
    c.on_new_request(req_c)
    third = lookup_all(c, keys, req_c)
    c.on_request_finished(req_c)
    for m in (b, c):
        m.shutdown()
    return {"first": first, "second": second, "exact": exact, "third": third}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--misfiled-url", help="run only the misfiled scenario against this node (see misfiled())")
    ap.add_argument("--url", help="a live node")
    ap.add_argument("--down-url", help="where no node answers")
    ap.add_argument("--auth-url", help="a node that wants a token (this one is wrong)")
    ap.add_argument("--bound-url", help="a node whose namespace for this tier has another layout")
    ap.add_argument("--full-url", help="a DRAM-only node, small, refusing first sights")
    ap.add_argument("--identity-url", help="a node for the identity scenario alone")
    args = ap.parse_args()  # one process for every scenario: importing vLLM is the slow part
    if args.misfiled_url:
        print("RESULT " + json.dumps({"misfiled": misfiled(args.misfiled_url)}), flush=True)
        return 0
    urls = ("url", "down_url", "auth_url", "bound_url", "full_url", "identity_url")
    if missing := [u for u in urls if not getattr(args, u)]:
        ap.error(f"needs --{' --'.join(m.replace('_', '-') for m in missing)} (or --misfiled-url alone)")
    res = {"round_trip": round_trip(args.url), "down": down(args.down_url), "worker": worker(args.down_url),
           "wrong_token": refused(args.auth_url, token="wrong-token-0123456789abcdef"),
           "wrong_layout": refused(args.bound_url), "bad_config": bad_config(args.down_url),
           "full": full(args.full_url), "identity": identity(args.identity_url), "hybrid": hybrid(args.url),
           "retention": retention(args.identity_url)}  # fmt: skip
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
