"""kvstore as LMCache's remote tier: a `remote_storage_plugins` connector for LMCache 0.5.x.

vLLM (LMCacheConnectorV1) and SGLang (in-process LMCache) reach kvstore through it with no patch to
LMCache. The LMCache YAML:

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5                    # GB of LMCache's own CPU tier in front of kvstore
    remote_serde: naive
    remote_storage_plugins: ["kvstore"]
    extra_config:
      remote_storage_plugin.kvstore.module_path: kvstore.integrations.lmcache
      remote_storage_plugin.kvstore.class_name: KVStoreConnectorAdapter
      remote_storage_plugin.kvstore.url: kvstore://10.0.0.5:50051      # or kvstore+redis://10.0.0.9:6379/0

Other settings (`remote_storage_plugin.kvstore.<name>`, all optional): timeout, lookup_timeout,
transport (auto|grpc|shm|tcp|ucx), token, token_file, tls_ca, tls_cert, tls_key, tls_server_name (default:
the KVSTORE_* environment), namespace_prefix (a tenant's or deployment's salt), local_node (a
cluster's node on this host, preferred for stores), threads, down_backoff, pin_lease, prefetch,
tune_malloc (default true: raise glibc's mmap/trim thresholds in the engine process), model_revision (the
weights' revision or digest: LMCache's keys carry only the model's name, so weights changed under the same name
need it to be a cold miss). A
plugin named `kvstore.<instance>` reads `remote_storage_plugin.kvstore.<instance>.<name>`.

Why `remote_storage_plugins` (a RemoteConnector behind LMCache's RemoteBackend) and not
`storage_plugins` (a whole StoragePluginInterface backend): the remote slot is where LMCache expects
a shared, networked tier, and RemoteBackend gives every engine LMCache's own handling of one for
free: the health monitor (our `ping`; `fallback_policy` recompute / local_cpu), reconnection, a
deadline on blocking gets with a miss on timeout, de-duplication of in-flight puts, the MLA
"one copy for all ranks" mode, remote read/write metrics, write-back of remote hits into the local CPU
tier, and serde (naive or CacheGen compression). A `storage_plugins` backend is loaded once with no
retry (a failing constructor just drops it), runs on the engine's calling threads, gets no health
check, and would have to re-implement all of the above. LMCache also marks `remote_url` deprecated in
favour of `remote_storage_plugins`. Cost of the choice: RemoteBackend drops the `pin` flag of
synchronous lookups (pins reach us only from the asynchronous lookup path, as leases).

Keys, namespaces and partial chunks: see kvstore/integrations/lmcache_mapping.py (mapping v1).
Errors: see kvstore/integrations/remote.py; LMCache never sees an exception from this plugin for a
remote failure, only misses, and its log gets one clear line per kind of failure.

Threads: LMCache calls the async methods on its storage manager's event loop; each runs the blocking
kvstore client on this plugin's thread pool, so the loop never blocks on the network.
`batched_contains` and `exists_sync` are called from the engine's threads and run inline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from lmcache.logging import init_logger
from lmcache.utils import TORCH_DTYPE_TO_STR_DTYPE, CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.health_monitor.constants import PING_GENERIC_ERROR_CODE
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from kvstore.integrations.hints import HintError, SessionHints, from_lmcache
from kvstore.integrations.lmcache_mapping import (
    TAIL_TRAILER,
    Geometry,
    MappingError,
    PluginSettings,
    chunked_geometry,
    layerwise_geometry,
    model_part,
    namespace_for,
    pack_tail,
    page_key,
    parse_settings,
    tail_tokens,
)
from kvstore.integrations.outcome import Stored
from kvstore.integrations.remote import RemoteStore, call_slices
from kvstore.layout import PageLayout
from kvstore.memtune import tune_malloc_for_bulk_io
from kvstore.wire.streams import Buffer, FetchedPage

logger = init_logger(__name__)
PLUGIN_TYPE = "kvstore"
T = TypeVar("T")


class KVStoreConnectorAdapter(ConnectorAdapter):
    """What `remote_storage_plugin.<name>.class_name` names: LMCache instantiates it with no arguments
    and asks it to build the connector for `plugin://<name>`, for names `kvstore` and `kvstore.<instance>`."""

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_TYPE}")

    def can_parse(self, url: str) -> bool:
        return url.startswith("plugin://") and extract_plugin_type(url.removeprefix("plugin://")) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        name = context.plugin_name or context.url.removeprefix("plugin://")
        return KVStoreConnector(context.loop, context.local_cpu_backend, context.config, context.metadata, name)


def engine_geometry(config: LMCacheEngineConfig, metadata: LMCacheMetadata) -> tuple[Geometry, list[Any]]:
    """The chunk geometry LMCache's engine uses (memory format as LMCacheEngine picks it) and the torch
    dtypes to allocate its MemoryObjs with."""
    _layers, kv, _, heads, head_dim = metadata.kv_shape
    if metadata.use_mla:
        heads = head_dim = 0  # one latent vector per token: no K/V heads to describe
    if config.use_layerwise:
        fmt = "KV_MLA_FMT" if metadata.use_mla else ("KV_2TD" if config.enable_blending else "KV_T2D")
        dtype = metadata.kv_dtype
        geo = layerwise_geometry(
            fmt,
            kv,
            metadata.kv_shape[3] * metadata.kv_shape[4],
            TORCH_DTYPE_TO_STR_DTYPE[dtype],
            dtype.itemsize,
            config.chunk_size,
            heads,
            head_dim,
        )
        return geo, [dtype]
    fmt = "KV_MLA_FMT" if metadata.use_mla else "KV_2LTD"
    dtypes = metadata.get_dtypes()
    geo = chunked_geometry(
        fmt,
        [tuple(s) for s in metadata.get_shapes(config.chunk_size)],
        [TORCH_DTYPE_TO_STR_DTYPE[d] for d in dtypes],
        [d.itemsize for d in dtypes],
        config.chunk_size,
        heads,
        head_dim,
    )
    return geo, list(dtypes)


@dataclass(frozen=True, slots=True)
class EngineShape:
    """Everything derived from the engine's chunk geometry. Replaced as a whole, never mutated, when
    LMCache registers the engine's KV layer groups after the plugin started (vLLM's V3 GPU connector
    does so on its first transfer), so a call always sees one consistent geometry, layout and namespaces."""

    geometry: Geometry
    layout: PageLayout
    dtypes: list[Any]  # torch dtypes to allocate MemoryObjs with
    fmt: MemoryFormat
    groups_from: object  # the KVLayerGroupsManager it was derived from (None: the legacy kv_shape)
    namespaces: dict[tuple[str, int, int, str], tuple[str, str]]

    @classmethod
    def derive(cls, config: LMCacheEngineConfig, metadata: LMCacheMetadata) -> EngineShape:
        geometry, dtypes = engine_geometry(config, metadata)
        return cls(
            geometry, geometry.page_layout(), dtypes, MemoryFormat[geometry.fmt], metadata.kv_layer_groups_manager, {}
        )


Runs = list[tuple[tuple[str, str], list[bytes]]]  # (namespace, tail namespace), kvstore hashes


class KVStoreConnector(RemoteConnector):
    """LMCache RemoteConnector over kvstore. Invariants: every page it stores is `layout.page_bytes`
    long and checksummed by the client; every MemoryObj it returns came from LMCache's local CPU
    allocator and holds exactly the bytes that were stored (verified on the way); a failure is a miss."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: LocalCPUBackend,
        config: LMCacheEngineConfig,
        metadata: LMCacheMetadata | None,
        plugin_name: str = PLUGIN_TYPE,
    ) -> None:
        metadata = metadata if metadata is not None else getattr(local_cpu_backend, "metadata", None)
        if metadata is None:
            raise IrrecoverableException(f"kvstore plugin {plugin_name!r}: LMCache gave no engine metadata")
        super().__init__(config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.config = config
        self.metadata = metadata
        self.name = plugin_name
        self.hint = f"remote_storage_plugin.{plugin_name}."
        self.partial = bool(config.save_unfull_chunk)
        self._shape_lock = threading.Lock()
        try:
            self.settings: PluginSettings = parse_settings(
                config.extra_config, plugin_name, float(config.blocking_timeout_secs)
            )
            self._shape = self._checked(EngineShape.derive(config, metadata))
            probe = self._namespace_pair(
                self._shape,
                metadata.model_name,
                metadata.world_size,
                metadata.worker_id,
                TORCH_DTYPE_TO_STR_DTYPE[metadata.kv_dtype],
            )
            self.store = RemoteStore(self.settings, logger, setting_prefix=self.hint)  # reads token / TLS files
        except (MappingError, ValueError, KeyError, OSError) as exc:
            raise IrrecoverableException(f"kvstore plugin {plugin_name!r}: {exc}") from None
        if self.settings.tune_malloc:
            # NOTE: the client allocates one buffer per fetched page; with glibc's default thresholds each
            # 1-32 MiB buffer is a fresh mmap, faulted in page by page and unmapped again. Measured on a
            # 2-vCPU VM: 16 x 1 MiB of such buffers cost 18 ms untuned, 6 ms tuned (benchmarks/RESULTS-archive.md).
            tune_malloc_for_bulk_io()
        self._pool = ThreadPoolExecutor(self.settings.threads, thread_name_prefix=f"kvstore-{plugin_name}")
        self._closed = False
        # What the node kept of this plugin's stores (LMCache 0.5.6's batched_put has no result to report into).
        self.counts = {"stores": 0, "stored_chunks": 0, "unstored_chunks": 0}
        self._counts_lock = threading.Lock()
        logger.info(
            "kvstore plugin %r: %s, namespace %r, pages of %s, partial chunks %s",
            plugin_name,
            self.store.where,
            probe[0],
            self._shape.layout.describe(),
            "on (/tail)" if self.partial else "off",
        )
        if config.pre_caching_hash_algorithm == "builtin" and os.environ.get("PYTHONHASHSEED") is None:
            logger.warning(
                "kvstore plugin %r: LMCache hashes chunks with Python's builtin hash and PYTHONHASHSEED is "
                "not set, so every engine process computes different keys and finds nothing another one "
                "stored. Start every engine with PYTHONHASHSEED=0.",
                plugin_name,
            )

    # -- the mapping

    def _checked(self, shape: EngineShape) -> EngineShape:
        if self.partial and shape.geometry.token_bytes < TAIL_TRAILER.size:
            raise MappingError(
                f"save_unfull_chunk needs >= {TAIL_TRAILER.size} bytes per token for the tail "
                f"trailer; this model has {shape.geometry.token_bytes}"
            )
        return shape

    def _current(self) -> EngineShape:
        """The engine's shape, re-derived once LMCache has registered its KV layer groups."""
        shape = self._shape
        if self.metadata.kv_layer_groups_manager is shape.groups_from:
            return shape
        with self._shape_lock:
            if self.metadata.kv_layer_groups_manager is not self._shape.groups_from:
                try:
                    new = self._checked(EngineShape.derive(self.config, self.metadata))
                except (MappingError, ValueError, KeyError) as exc:
                    self.store.say(
                        "geometry",
                        logging.ERROR,
                        "kvstore plugin %r: the engine's KV layer groups cannot be mapped (%s); keeping %s",
                        self.name,
                        exc,
                        self._shape.geometry.shape_tag(),
                    )
                    new = dataclasses.replace(self._shape, groups_from=self.metadata.kv_layer_groups_manager)
                if new.geometry != self._shape.geometry:
                    logger.info(
                        "kvstore plugin %r: the engine registered its KV layer groups: chunks are now %s",
                        self.name,
                        new.geometry.shape_tag(),
                    )
                self._shape = new
            return self._shape

    def _namespace_pair(
        self, shape: EngineShape, model: str, world_size: int, worker_id: int, dtype: str
    ) -> tuple[str, str]:
        k = (model, world_size, worker_id, dtype)
        pair = shape.namespaces.get(k)
        if pair is None:
            named = model_part(model, self.settings.model_revision)
            args = (self.settings.namespace_prefix, named, world_size, worker_id, dtype, shape.geometry)
            pair = (namespace_for(*args), namespace_for(*args, tail=True))
            shape.namespaces[k] = pair
        return pair

    def _runs(self, shape: EngineShape, keys: Sequence[CacheEngineKey]) -> Runs:
        """Consecutive keys of one namespace pair, with their kvstore hashes (order kept)."""
        runs: Runs = []
        for key in keys:
            pair = self._namespace_pair(
                shape, key.model_name, key.world_size, key.worker_id, TORCH_DTYPE_TO_STR_DTYPE[key.dtype]
            )
            if not runs or runs[-1][0] != pair:
                runs.append((pair, []))
            runs[-1][1].append(page_key(key.to_string()))
        return runs

    # -- blocking cores (run on the pool, or inline for LMCache's synchronous calls)

    def _hints(self, keys: Sequence[CacheEngineKey]) -> SessionHints | None:
        """The retention hints of the request these keys belong to (LMCache keeps its request configs, the
        `lmcache.*` entries of vLLM's kv_transfer_params, on every key: integrations/hints.py); a bad one is logged."""
        configs = getattr(keys[0], "request_configs", None) if keys else None
        if not configs:
            return None
        try:
            return from_lmcache(configs)
        except HintError as exc:
            self.store.say(
                "hints", logging.ERROR, "kvstore plugin %r: %s; no retention for this request", self.name, exc
            )
            return None

    def _contains(self, keys: Sequence[CacheEngineKey], prefetch: bool) -> int:
        """Leading keys held: full chunks, then (partial chunks on) the rest of the chain in the tail. A request
        naming a session resumes it first (its pages back toward DRAM, its lease renewed)."""
        hints = self._hints(keys)
        if hints is not None and hints.resume:
            self.store.resume(hints)
        total = 0
        for (ns, tail), hashes in self._runs(self._current(), keys):
            n = self.store.lookup(ns, hashes, prefetch=prefetch)
            if n < len(hashes) and self.partial:
                n += self.store.lookup(tail, hashes[n:], prefetch=prefetch)
            total += n
            if n < len(hashes):
                break
        return total

    def _fetch(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        """MemoryObjs of the longest retrievable prefix of `keys`, then Nones."""
        shape = self._current()
        out: list[MemoryObj | None] = []
        for (ns, tail), hashes in self._runs(shape, keys):
            got = self._fetch_chain(shape, ns, hashes, tail=False)
            if len(got) < len(hashes) and self.partial:
                got += self._fetch_chain(shape, tail, hashes[len(got) :], tail=True)
            out += got
            if len(got) < len(hashes):
                break
        return out + [None] * (len(keys) - len(out))

    def _fetch_chain(self, shape: EngineShape, ns: str, hashes: list[bytes], *, tail: bool) -> list[MemoryObj]:
        """The longest prefix of one namespace's chain, fetched and placed slice by slice (memory bound)."""
        out: list[MemoryObj] = []
        for a, b in call_slices(len(hashes), shape.layout.page_bytes):
            if tail:  # a partial chunk's size is in its bytes: fetched, then copied into a MemoryObj of that size
                got = self._objs(shape, ns, self.store.get(ns, hashes[a:b]), tail=True)
            else:
                got = self._fetch_into(shape, ns, hashes[a:b])
            out += got
            if len(got) < b - a:
                break
        return out

    def _fetch_into(self, shape: EngineShape, ns: str, hashes: list[bytes]) -> list[MemoryObj]:
        """Full chunks received straight into MemoryObjs from LMCache's CPU allocator (DESIGN.md §9.1: one copy, by the
        network or the node, and one verification); the objects past the stored prefix go back at once."""
        geo = shape.geometry
        objs: list[MemoryObj] = []
        for _ in hashes:
            obj = self.local_cpu_backend.allocate(
                [torch.Size(s) for s in geo.shapes(geo.chunk_size)],
                shape.dtypes,
                shape.fmt,
                eviction=True,
                busy_loop=False,
            )
            if obj is None:
                logger.debug("kvstore plugin %r: LMCache's CPU buffer is full; the rest is a miss", self.name)
                break
            objs.append(obj)
        got = 0
        try:
            views = [obj.byte_array.cast("B")[: shape.layout.page_bytes] for obj in objs]
            got = len(self.store.get_into(ns, hashes[: len(objs)], views))
        finally:
            for obj in objs[got:]:
                obj.ref_count_down()  # ours until returned: give it back to LMCache's allocator
        return objs[:got]

    def _objs(self, shape: EngineShape, ns: str, pages: list[FetchedPage], *, tail: bool) -> list[MemoryObj]:
        """Copy fetched pages into MemoryObjs from LMCache's CPU allocator; stops at the first page that
        cannot be placed (no memory: LMCache is full; a malformed page: logged)."""
        geo, out = shape.geometry, []
        for page in pages:
            try:
                if len(page.data) != shape.layout.page_bytes:
                    raise MappingError(
                        f"page of {len(page.data)} B, the namespace's layout has {shape.layout.page_bytes} B"
                    )
                tokens = tail_tokens(page.data, geo.chunk_size) if tail else geo.chunk_size
            except MappingError as exc:
                self.store.say(
                    "malformed",
                    logging.ERROR,
                    "kvstore plugin %r: %s in namespace %r: %s; treated as a miss",
                    self.name,
                    self.store.where,
                    ns,
                    exc,
                )
                break
            obj = self.local_cpu_backend.allocate(
                [torch.Size(s) for s in geo.shapes(tokens)], shape.dtypes, shape.fmt, eviction=True, busy_loop=False
            )
            if obj is None:
                logger.debug("kvstore plugin %r: LMCache's CPU buffer is full; the rest is a miss", self.name)
                break
            nbytes = tokens * geo.token_bytes
            try:
                obj.byte_array.cast("B")[:nbytes] = memoryview(page.data)[:nbytes]
            except BaseException:
                obj.ref_count_down()  # ours until returned: give it back to LMCache's allocator
                raise
            out.append(obj)
        return out

    def _store(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> Stored:
        """Put full chunks into their namespace and partial ones into its tail, one chain per namespace; per
        chunk put (full chunks first, then tails, in key order within each), whether the node holds it now.
        A chunk a full node refused is counted (`counts`) and logged, and stays a miss to LMCache's lookups."""
        shape = self._current()
        geo = shape.geometry
        batches: dict[str, tuple[list[bytes], list[Buffer]]] = {}
        start = 0
        for (ns, tail), hashes in self._runs(shape, keys):
            for h, obj in zip(hashes, objs[start : start + len(hashes)], strict=True):
                try:
                    tokens = geo.tokens_of(
                        obj.get_shapes(),
                        [TORCH_DTYPE_TO_STR_DTYPE[d] for d in obj.get_dtypes()],
                        obj.get_memory_format().name,
                    )
                    data = obj.byte_array
                    if len(data) != tokens * geo.token_bytes:
                        raise MappingError(f"{len(data)} B for {tokens} tokens, expected {tokens * geo.token_bytes}")
                except (MappingError, KeyError) as exc:
                    self.store.say(
                        "bad-chunk",
                        logging.ERROR,
                        "kvstore plugin %r: chunk not stored, it is not this engine's geometry (%s): %s",
                        self.name,
                        geo.shape_tag(),
                        exc,
                    )
                    continue
                if tokens == geo.chunk_size:
                    batch = batches.setdefault(ns, ([], []))
                    batch[0].append(h)
                    batch[1].append(data)
                elif self.partial:
                    batch = batches.setdefault(tail, ([], []))
                    batch[0].append(h)
                    batch[1].append(pack_tail(data, tokens, shape.layout.page_bytes))
                else:
                    self.store.say(
                        "partial-off",
                        logging.WARNING,
                        "kvstore plugin %r: a partial chunk (%d tokens) was not stored: save_unfull_chunk is off",
                        self.name,
                        tokens,
                    )
            start += len(hashes)
        outcome = Stored(())
        hints = self._hints(keys)
        for ns, (hashes, pages) in batches.items():
            for a, b in call_slices(len(hashes), shape.layout.page_bytes):
                done = self.store.put(ns, shape.layout, hashes[a:b], pages[a:b], parent_chain=hashes[:a])
                outcome += done
                kept = [h for h, ok in zip(hashes[a:b], done.held, strict=True) if ok]
                if hints is not None and not hints.end and kept:
                    self.store.retain(ns, kept, hints)  # the session's pages are the ones its writer put
                if not done.ok:  # the rest of this chain would hang off a gap no lookup gets past
                    outcome += Stored.failed(len(hashes) - b)
                    break
        if hints is not None and hints.end:  # the request's last store: its session ends with it
            self.store.end_session(hints.session)
        with self._counts_lock:
            self.counts["stores"] += 1
            self.counts["stored_chunks"] += outcome.count
            self.counts["unstored_chunks"] += len(keys) - outcome.count
        return outcome

    def _pin(self, keys: Sequence[CacheEngineKey]) -> int:
        pinned = 0
        for (ns, tail), hashes in self._runs(self._current(), keys):
            pinned += self.store.pin(ns, hashes, self.settings.pin_lease)
            if self.partial:  # the chain's partial chunk(s) are in the tail namespace
                pinned += self.store.pin(tail, hashes, self.settings.pin_lease)
        return pinned

    async def _run(self, fn: Callable[..., T], *args: object, miss: T) -> T:
        """fn(*args) on the pool. LMCache gets `miss` instead of an exception: a closed plugin, or a bug
        here (logged with its traceback, at most once per LOG_INTERVAL)."""
        if self._closed:
            return miss
        try:
            return await asyncio.wrap_future(self._pool.submit(fn, *args))
        except Exception as exc:
            if self._closed:
                return miss
            self.store.say(
                "bug",
                logging.ERROR,
                "kvstore plugin %r: %s failed: %s",
                self.name,
                fn.__name__,
                "".join(traceback.format_exception(exc)),
            )
            return miss

    # -- RemoteConnector

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._run(self._contains, [key], False, miss=0) > 0

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._contains([key], False) > 0

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self._run(self._fetch, [key], miss=[None]))[0]

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self._run(self._store, [key], [memory_obj], miss=Stored.failed(1))

    async def list(self) -> list[str]:
        raise NotImplementedError("kvstore holds 32-byte digests of LMCache keys; it cannot list the keys themselves")

    async def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        return 0 if await self._run(self.store.ping, miss=False) else PING_GENERIC_ERROR_CODE

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return await self._run(self._fetch, keys, miss=[None] * len(keys))

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        await self._run(self._store, keys, memory_objs, miss=Stored.failed(len(keys)))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self._contains(keys, self.settings.prefetch)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        n = await self._run(self._contains, keys, self.settings.prefetch, miss=0)
        if pin and n:
            await self._run(self._pin, keys[:n], miss=0)
        return n

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        objs = await self._run(self._fetch, keys, miss=[])
        return [o for o in objs if o is not None]  # _fetch returns a prefix, then Nones

    def remove_sync(self, key: CacheEngineKey) -> bool:
        (((ns, tail), hashes),) = self._runs(self._current(), [key])
        removed = self.store.delete(ns, hashes)
        if self.partial:
            removed += self.store.delete(tail, hashes)
        return removed > 0

    def __repr__(self) -> str:
        return f"<KVStoreConnector {self.name} {self.store.where}>"
