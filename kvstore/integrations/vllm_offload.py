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

Mapping (vllm2): one kvstore page per CPU-tier chunk row (all workers' bytes of `blocks_per_chunk` blocks, in
rank order, as vLLM lays them in its shared offload region: so no rank in the namespace). Namespace
`{prefix}/vllm2/{model}[@{revision}]/{kv dtype}/{kv layout}/t{tokens per block}h{tokens per hash}x{blocks per
chunk}/g{groups}~{digest of the groups' ids, block sizes and layer names}/{parallelism}[-rep]/r{row bytes}`,
everything from vLLM's OffloadingConfig: kv dtype is vLLM's cache dtype (the model's when `auto`), kv layout the
resolved KVCacheLayout (`nhd`, `hnd`, ...; `canonical-v1-nhd` for the canonical host layout: vLLM's own format
id), parallelism `ws{world}tp{tp}pp{pp}pcp{pcp}dcp{dcp}` (`any` when vLLM says the bytes are
parallelism-agnostic; `-rep` for its single-copy replicated layout); the revision is the tier setting
`model_revision` (vLLM's offloading config carries the model's name only). Shortened with a digest past the
node's limit. vllm1 (before) named neither the layers nor the resolved layout: its pages are a cold miss.
Hash: the key's vLLM block hash itself when it is 32 bytes (sha256 prefix caching) and the group is 0, so the
node and its KV events (kvstore/node/kv_events.py) name blocks as vLLM does; else
SHA-256(b"kvstore-vllm/v1\\x00" || key). vLLM's block hash already covers the request's cache salt, LoRA and
multimodal inputs, so the key carries them.

Hybrid models (several KV cache groups; vLLM's OffloadKey is a block hash and a group index): the chunks of one
block hash that one job or lookup carries, one per group, are one bundle (DESIGN.md §4.3,
kvstore/integrations/groups.py): a part `g{i}` per group, each a row, stored and loaded together (a block's
groups all land in the CPU tier, or none). Its namespace is the one above with `/{g0+g1...}` (the groups it
holds) and its hash the block hash (as above, with the group left out). A model with one group keeps the pages
above, unchanged.

Non-blocking: lookups go through vLLM's own `AsyncLookupManager` (one batched kvstore Lookup per engine step,
RETRY meanwhile); stores and loads run on this tier's threads, straight between the CPU tier's rows and the
node (RemoteStore.get_into / put_from, kvstore/integrations/remote.py), and finish through
`get_finished_jobs`. A failed load marks its keys missing (no promotion livelock); a store job succeeds only when
the node holds every chunk of it afterwards (a chunk a full node did not admit fails the job:
kvstore/integrations/outcome.py). Every remote failure is a logged miss, never an exception into the scheduler.

Why not the engine test here: vLLM 0.32's CPU build refuses the offloading worker
(`CPUOffloadingSpec.get_worker`: "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"),
so tests/engines/test_vllm_offload.py drives this tier through vLLM's own TieringOffloadingSpec and
TieringOffloadingManager (real objects, real shared offload region) with the GPU->CPU copy done by the test.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
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
from kvstore.integrations.groups import groups_label, part_name, runs
from kvstore.integrations.hints import HintError, SessionHints, from_vllm
from kvstore.integrations.lanes import Lanes, slices
from kvstore.integrations.lmcache_mapping import model_part
from kvstore.integrations.outcome import Stored
from kvstore.integrations.remote import RemoteStore
from kvstore.layout import PageLayout

log = logging.getLogger("kvstore.vllm")

VLLM_RELEASE = "0.32.0"
MAPPING = "vllm2"  # the namespace's version: vllm1 named neither the layers nor the resolved KV cache layout
KEY_TAG = b"kvstore-vllm/v1\x00"
_LAYOUT_FAMILY = {"LBNHC": "nhd", "LBHNC": "hnd"}  # vLLM's historical names (canonical_mapping.canonical_format_id)
_GROUPS_HEX = 12
_VLLM_KEYS = {"type", "module_path", "locality", "backpressure", "threads"}  # vLLM's (and ours, not the store's)
_MAX_KEYS_PER_LOOKUP = 4096


def page_hash(key: bytes) -> bytes:
    """The kvstore hash of a vLLM OffloadKey (block hash + 4-byte group index)."""
    block, group = key[:-4], key[-4:]
    if len(block) == 32 and group == b"\x00\x00\x00\x00":
        return bytes(block)
    return hashlib.sha256(KEY_TAG + bytes(key)).digest()


def layout_part(kv_cache_layout: str | None, canonical: bool) -> str:
    """How the bytes of a row are laid out: vLLM's resolved KV cache layout (`nhd` / `hnd`, vLLM's own spellings
    of LBNHC / LBHNC, else the layout's name) and, for the canonical host layout, vLLM's canonical format id
    (its version and family); `unresolved` where vLLM has not resolved the layout (the engine core always has
    by the time an offloading tier exists; tests that build a config by hand may not)."""
    if kv_cache_layout is None:
        return "unresolved"
    family = _LAYOUT_FAMILY.get(kv_cache_layout, kv_cache_layout.lower())
    if not canonical:
        return family
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id

    return f"canonical-{canonical_format_id(kv_cache_layout)}"


def groups_part(groups: Any) -> str:
    """Which layers a row holds, in which order, per KV cache group (id, tokens per block, layer names): another
    model, a hybrid model's other groups or a pipeline stage's other layers is another namespace."""
    spec = [(g.group_id, g.tokens_per_block, list(g.layer_names)) for g in groups or ()]
    digest = hashlib.sha256(json.dumps(spec, separators=(",", ":")).encode()).hexdigest()[:_GROUPS_HEX]
    return f"g{len(spec)}~{digest}"


def namespace_for(prefix: str, spec: Any, row_bytes: int, revision: str | None = None) -> str:
    """The namespace of one engine configuration's chunks (see the module docstring)."""
    cfg = spec.config
    model = model_part(str(cfg.model.name), revision)
    layout = layout_part(cfg.kv_cache_layout, bool(cfg.canonical_layout))
    tokens = "x".join(str(t) for t in spec.tokens_per_block) or "t"
    par = cfg.parallel
    if par.is_parallelism_agnostic:
        parallel = "any"
    else:
        parallel = f"ws{par.world_size}tp{par.tp_size}pp{par.pp_size}pcp{par.pcp_size}dcp{par.dcp_size}"
    if cfg.replicated_layout:
        parallel += "-rep"  # one copy of the (identical) bytes of every worker per row
    tail = f"{cfg.model.dtype}/{layout}/t{tokens}h{cfg.cache.tokens_per_hash}x{spec.blocks_per_chunk}"
    ns = f"{prefix}/{MAPPING}/{model}/{tail}/{groups_part(cfg.groups)}/{parallel}/r{row_bytes}"
    if len(ns.encode()) <= MAX_NAMESPACE_BYTES:
        return ns
    digest = hashlib.sha256(ns.encode()).hexdigest()[:16]
    return f"{prefix}/{MAPPING}/{model[:48]}/{digest}"


def block_hash(key: bytes) -> bytes:
    """The kvstore hash of a bundle of a block's groups: the block hash itself when it is 32 bytes, else its
    SHA-256 under this mapping's tag (the group is in the bundle, not in the key)."""
    block = bytes(key[:-4])
    return block if len(block) == 32 else hashlib.sha256(KEY_TAG + block).digest()


def bundle_namespace(base: str, groups: tuple[int, ...]) -> str:
    """The namespace of bundles holding exactly `groups`: `{base}/{g0+g1...}`, shortened with a digest."""
    ns = f"{base}/{groups_label(groups)}"
    if len(ns.encode()) <= MAX_NAMESPACE_BYTES:
        return ns
    return f"{base[: MAX_NAMESPACE_BYTES - 18]}/{hashlib.sha256(ns.encode()).hexdigest()[:16]}"


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup state machine; the batch is one kvstore Lookup (longest stored prefix)."""

    def __init__(self, tier: KVStoreSecondaryTier) -> None:
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        found = [False] * len(keys)
        if self._tier.hybrid:  # a block's groups in one bundle: found together
            for run in runs([(block_hash(k), int.from_bytes(k[-4:], "big")) for k in keys]):
                ns, _ = self._tier.bundle(run.groups)
                n = self._tier.store.lookup(ns, list(run.chunks))  # type: ignore[arg-type]
                for items in run.items[:n]:
                    for i in items.values():
                        found[i] = True
            return found
        hashes = [page_hash(k) for k in keys]
        for a in range(0, len(hashes), _MAX_KEYS_PER_LOOKUP):
            part = hashes[a : a + _MAX_KEYS_PER_LOOKUP]
            n = self._tier.store.lookup(self._tier.namespace, part)
            found[a : a + n] = [True] * n
            if n < len(part):
                break
        return found


@dataclass(slots=True)
class _Session:
    """A request's retention hints, kept in its ReqContext (vLLM's per-request state, keyed by type). `ended`: the
    request finished with `end`, so a store of it still running retains nothing (it would renew the session)."""

    hints: SessionHints
    ended: bool = False


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
        *,
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
        self.namespace = namespace_for(
            self.settings.namespace_prefix, offloading_spec, self.row_bytes, self.settings.model_revision
        )
        self.hybrid = len(offloading_spec.config.groups or ()) > 1
        self.block_tokens = int(offloading_spec.config.cache.tokens_per_hash)
        self.store = RemoteStore(self.settings, log, setting_prefix="secondary_tiers[kvstore].")
        self.lookups = _Lookups(self)
        self._pool = ThreadPoolExecutor(max_workers=int(threads), thread_name_prefix="kvstore-tier")
        # A job's chunks move as calls in flight (lanes.py), stores and loads on lanes of their own.
        self._store_lanes = Lanes("vllm-store-lane", int(threads))
        self._load_lanes = Lanes("vllm-load-lane", int(threads))
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
        """A request's retention hints are read once here (kv_transfer_params or kv_hints: integrations/hints.py)
        and kept in its context; a session's next turn promotes its pages back to DRAM, off this thread."""
        hints = self._hints_of(req_context)
        if hints is not None:
            req_context.set_state(_Session(hints))
            if hints.resume:
                self._pool.submit(self.store.resume, hints)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.lookups.cleanup(req_context.req_id)
        state = req_context.get_state(_Session)
        if state is not None and state.hints.end:
            state.ended = True
            self._pool.submit(self.store.end_session, state.hints.session)

    def _hints_of(self, req_context: ReqContext) -> SessionHints | None:
        try:
            return from_vllm(req_context.kv_transfer_params, getattr(req_context, "kv_hints", None))
        except HintError as exc:
            self.store.say("hints", logging.ERROR, "kvstore vLLM tier: request %s: %s; no retention for it",
                           req_context.req_id, exc)  # fmt: skip
            return None

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
        self._store_lanes.close()
        self._load_lanes.close()
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

    def bundle(self, groups: tuple[int, ...]) -> tuple[str, PageLayout]:
        """Namespace and layout of bundles holding exactly these groups' rows."""
        layout = PageLayout.bundle({part_name(g): self.layout for g in groups}, block_size=self.block_tokens)
        return bundle_namespace(self.namespace, groups), layout

    def _bundles(self, job: TransferJob) -> list[tuple[str, PageLayout, list[bytes], list[dict[str, Any]], list]]:
        """A hybrid job's keys as bundle calls: (namespace, layout, hashes, each hash's rows by part, each
        hash's key indices)."""
        keys = list(job.keys)
        out = []
        for run in runs([(block_hash(k), int.from_bytes(k[-4:], "big")) for k in keys]):
            ns, layout = self.bundle(run.groups)
            rows = [{part_name(g): self.rows[int(job.chunk_ids[i])] for g, i in items.items()} for items in run.items]
            out.append((ns, layout, list(run.chunks), rows, [list(items.values()) for items in run.items]))
        return out

    def _store(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        if self.hybrid:
            ok, held = True, 0
            for ns, layout, hashes, rows, _ in self._bundles(job):
                done = self.store.put_bundle(ns, layout, hashes, rows, chain=False)
                ok, held = ok and done.ok, held + done.count * len(layout.parts)
                self._retain(job, ns, hashes, done.held)
            return JobResult(job_id=job.job_id, success=ok, transfer_bytes=held * self.row_bytes)
        views = [self.rows[int(c)] for c in job.chunk_ids]
        hashes = [page_hash(k) for k in keys]

        def put(ab: tuple[int, int]) -> Stored:
            a, b = ab  # independent chunks (chain=False): a slice's failure does not stop the others
            return self.store.put_from(self.namespace, self.layout, hashes[a:b], views[a:b], chain=False)

        done = list(self._store_lanes.ordered(put, slices(len(keys), self.row_bytes)))
        self._retain(job, self.namespace, hashes, tuple(h for d in done for h in d.held))
        # NOTE: vLLM reads `successful_keys` of promotion jobs only; a store job is a success only when the node
        # holds every chunk (outcome.py: a chunk a full node refused fails the job, and lookups miss it).
        return JobResult(
            job_id=job.job_id,
            success=all(d.ok for d in done),
            transfer_bytes=sum(d.count for d in done) * self.row_bytes,
        )

    def _retain(self, job: TransferJob, ns: str, hashes: list[bytes], held: tuple[bool, ...]) -> None:
        """The chunks a session's request stored, retained for its session (on this tier's thread, after the put)."""
        state = job.req_context.get_state(_Session) if job.req_context is not None else None
        kept = [h for h, ok in zip(hashes, held, strict=True) if ok]
        if state is not None and kept and not state.ended:
            self.store.retain(ns, kept, state.hints)

    def _load(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        if self.hybrid:
            landed: list[int] = []
            for ns, layout, hashes, rows, where in self._bundles(job):
                n = self.store.get_bundle_into(ns, layout, hashes, rows)
                landed += [i for idx in where[:n] for i in idx]
            ok = len(landed) == len(keys)
            kept = None if ok else [keys[i] for i in sorted(landed)]
            return JobResult(
                job_id=job.job_id, success=ok, successful_keys=kept, transfer_bytes=len(landed) * self.row_bytes
            )
        views = [self.rows[int(c)] for c in job.chunk_ids]
        hashes = [page_hash(k) for k in keys]
        short = False

        def get(ab: tuple[int, int]) -> int:
            a, b = ab
            return 0 if short else len(self.store.get_into(self.namespace, hashes[a:b], views[a:b]))

        got = 0
        cuts = slices(len(keys), self.row_bytes)
        for (a, b), n in zip(cuts, self._load_lanes.ordered(get, cuts), strict=True):  # consumed whole: lanes.py
            if not short:
                got += n
                short = n < b - a
        return JobResult(
            job_id=job.job_id,
            success=got == len(keys),
            successful_keys=None if got == len(keys) else keys[:got],
            transfer_bytes=got * self.row_bytes,
        )
