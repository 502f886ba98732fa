"""kvstore as a secondary tier of vLLM's native offloading (vLLM 0.32, `vllm/v1/kv_offload/tiering/`).

vLLM without LMCache offloads KV blocks GPU -> CPU (its primary tier, `TieringOffloadingSpec`) and from
there to secondary tiers (`SecondaryTierManager`: lookup / submit_store / submit_load / get_finished_jobs /
touch, all run in the scheduler process and must not block). This module is such a tier: CPU chunks are
stored on a kvstore node (or a cluster) and promoted back into the CPU tier on a hit, so a fresh engine,
or another engine, gets the prefix from kvstore.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
            "secondary_tiers": [{"type": "KVStoreSecondaryTier",
                                 "module_path": "kvstore.integrations.vllm_offload",
                                 "url": "kvstore://127.0.0.1:50051"}]}}'

Tier settings (besides vLLM's `type`, `module_path`, `locality`, `backpressure`): `url` (required:
`kvstore://host:port` or `kvstore+redis://host:port/db`), `namespace_prefix` (default `vllm`), `timeout`,
`lookup_timeout`, `transport`, `token`, `token_file`, `tls_*`, `local_node`, `down_backoff`, `threads`
(transfer threads, default 4) — the LMCache plugin's names and rules (kvstore/integrations/direct.py).

Mapping (v1): one kvstore page per CPU-tier chunk row (all workers' bytes of `blocks_per_chunk` blocks, as
vLLM lays them in its shared offload region). Namespace `{prefix}/vllm1/{model}/{kv dtype}/{kv layout}/
t{tokens per block}x{blocks per chunk}/{parallelism}/r{row bytes}` (`any` for parallelism when vLLM says
the bytes are parallelism-agnostic), shortened with a digest past the node's limit. Hash: the key's vLLM
block hash itself when it is 32 bytes (sha256 prefix caching) and the group is 0, so the node and its KV
events (kvstore/node/kv_events.py) name blocks as vLLM does; else SHA-256(b"kvstore-vllm/v1\\x00" || key).

Non-blocking: lookups go through vLLM's own `AsyncLookupManager` (one batched kvstore Lookup per engine step,
RETRY meanwhile); stores and loads run on this tier's threads, straight between the CPU tier's rows and the
node (RemoteStore.get_into / put_from, kvstore/integrations/remote.py), and finish through
`get_finished_jobs`. A failed load marks its keys missing (no promotion livelock); a failed store is reported
as such. Every remote failure is a logged miss, never an exception into the scheduler.

Why not the engine test here: vLLM 0.32's CPU build refuses the offloading worker
(`CPUOffloadingSpec.get_worker`: "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"),
so tests/engines/test_vllm_offload.py drives this tier through vLLM's own TieringOffloadingSpec and
TieringOffloadingManager (real objects, real shared offload region) with the GPU->CPU copy done by the test.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvstore.hashing import MAX_NAMESPACE_BYTES
from kvstore.integrations.direct import ConfigError, engine_settings, opaque_layout
from kvstore.integrations.remote import RemoteStore

log = logging.getLogger("kvstore.vllm")

VLLM_RELEASE = "0.32.0"
KEY_TAG = b"kvstore-vllm/v1\x00"
_VLLM_KEYS = {"type", "module_path", "locality", "backpressure", "threads"}  # vLLM's (and ours, not the store's)
_MAX_KEYS_PER_LOOKUP = 4096


def page_hash(key: bytes) -> bytes:
    """The kvstore hash of a vLLM OffloadKey (block hash + 4-byte group index)."""
    block, group = key[:-4], key[-4:]
    if len(block) == 32 and group == b"\x00\x00\x00\x00":
        return bytes(block)
    return hashlib.sha256(KEY_TAG + bytes(key)).digest()


def namespace_for(prefix: str, spec: Any, row_bytes: int) -> str:
    """The namespace of one engine configuration's chunks (see the module docstring)."""
    cfg = getattr(spec, "config", None)
    model = getattr(getattr(cfg, "model", None), "name", None) or "model"
    dtype = getattr(getattr(cfg, "model", None), "dtype", None) or "dtype"
    layout = (getattr(cfg, "kv_cache_layout", None) or "default") + (
        "-canonical" if getattr(cfg, "canonical_layout", False) else ""
    )
    tokens = "x".join(str(t) for t in getattr(spec, "tokens_per_block", ()) or ()) or "t"
    chunk = getattr(spec, "blocks_per_chunk", 1)
    par = getattr(cfg, "parallel", None)
    if par is None or getattr(par, "is_parallelism_agnostic", False):
        parallel = "any"
    else:
        parallel = f"ws{par.world_size}tp{par.tp_size}pp{par.pp_size}pcp{par.pcp_size}dcp{par.dcp_size}"
    ns = f"{prefix}/vllm1/{model}/{dtype}/{layout}/t{tokens}x{chunk}/{parallel}/r{row_bytes}"
    if len(ns.encode()) <= MAX_NAMESPACE_BYTES:
        return ns
    digest = hashlib.sha256(ns.encode()).hexdigest()[:16]
    return f"{prefix}/vllm1/{str(model)[:48]}/{digest}"


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup state machine; the batch is one kvstore Lookup (longest stored prefix)."""

    def __init__(self, tier: KVStoreSecondaryTier) -> None:
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        found = [False] * len(keys)
        hashes = [page_hash(k) for k in keys]
        for a in range(0, len(hashes), _MAX_KEYS_PER_LOOKUP):
            part = hashes[a : a + _MAX_KEYS_PER_LOOKUP]
            n = self._tier.store.lookup(self._tier.namespace, part)
            found[a : a + n] = [True] * n
            if n < len(part):
                break
        return found


class KVStoreSecondaryTier(SecondaryTierManager):
    """A kvstore node (or cluster) behind vLLM's CPU offloading tier (see the module docstring).

    Threads: every SecondaryTierManager method runs on the scheduler thread and returns at once;
    transfers run on `threads` worker threads and report through a thread-safe queue.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        locality: str | None = None,
        threads: int = 4,
        **settings: Any,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        self.settings = engine_settings(
            settings, where="secondary_tiers[kvstore]", ignore=_VLLM_KEYS, namespace_prefix="vllm"
        )
        if not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"secondary_tiers[kvstore] threads: an int >= 1, got {threads!r}")
        self.locality = (
            Locality(locality)
            if locality
            else (
                Locality.LOCAL
                if self.settings.target.addr and self.settings.target.addr.startswith(("127.", "localhost", "[::1]"))
                else Locality.REMOTE
            )
        )
        self.rows = np.asarray(primary_kv_view)  # (num_chunks, row bytes), shares the CPU tier's memory
        self.row_bytes = int(self.rows.shape[1]) if self.rows.ndim == 2 else self.block_size_bytes
        self.layout = opaque_layout(self.row_bytes)
        self.namespace = namespace_for(self.settings.namespace_prefix, offloading_spec, self.row_bytes)
        self.store = RemoteStore(self.settings, log, setting_prefix="secondary_tiers[kvstore].")
        self.lookups = _Lookups(self)
        self._pool = ThreadPoolExecutor(max_workers=int(threads), thread_name_prefix="kvstore-tier")
        self._done: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._inflight: dict[int, tuple[Future[None], TransferJob]] = {}
        self._lock = threading.Lock()
        log.info(
            "kvstore vLLM tier: %s, namespace %s, %d-byte chunks (vLLM %s interface)",
            self.settings.target.describe(),
            self.namespace,
            self.row_bytes,
            VLLM_RELEASE,
        )

    # -- lookups (non-blocking: vLLM's AsyncLookupManager, one batched Lookup per step)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self.lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.lookups.flush()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.lookups.cleanup(req_context.req_id)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # the node's own policy sees every read; nothing to tell it

    # -- transfers (on this tier's threads)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._load)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = []
        while True:
            try:
                res = self._done.get_nowait()
            except queue.Empty:
                return out
            with self._lock:
                _, job = self._inflight.pop(res.job_id, (None, None))
            if job is not None and job.is_promotion and not res.success:
                kept = set(res.successful_keys or ())
                # vLLM's guard against re-promoting a doomed chunk (lookup state is the scheduler thread's)
                self.lookups.mark_miss([k for k in job.keys if k not in kept])
            out.append(res)

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._inflight)

    def drain_jobs(self) -> None:
        with self._lock:
            pending = [fut for fut, _ in self._inflight.values()]
        for fut in pending:
            fut.result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.lookups.shutdown()
        self.store.close()
        self.rows = np.empty((0, 0), np.uint8)  # drop our export of the CPU tier's mmap so vLLM can close it

    def _submit(self, job: TransferJob, fn: Any) -> None:
        def run() -> None:
            t0 = time.monotonic()
            try:
                res = fn(job)
            except Exception as exc:  # never into the scheduler: a failed job
                log.error("kvstore vLLM tier: job %d failed: %s: %s", job.job_id, type(exc).__name__, exc)
                res = JobResult(job_id=job.job_id, success=False)
            res.transfer_time = time.monotonic() - t0
            self._done.put(res)

        with self._lock:
            self._inflight[job.job_id] = (self._pool.submit(run), job)

    def _store(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        views = [self.rows[int(c)] for c in job.chunk_ids]
        stored = self.store.put_from(self.namespace, self.layout, [page_hash(k) for k in keys], views, chain=False)
        ok = stored is not None
        return JobResult(job_id=job.job_id, success=ok, transfer_bytes=len(keys) * self.row_bytes if ok else 0)

    def _load(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        views = [self.rows[int(c)] for c in job.chunk_ids]
        got = len(self.store.get_into(self.namespace, [page_hash(k) for k in keys], views))
        return JobResult(
            job_id=job.job_id,
            success=got == len(keys),
            successful_keys=None if got == len(keys) else keys[:got],
            transfer_bytes=got * self.row_bytes,
        )
