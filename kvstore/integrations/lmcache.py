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

The blocking work of each call: kvstore/integrations/lmcache_chunks.py.

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
from typing import TypeVar

from lmcache.logging import init_logger
from lmcache.utils import TORCH_DTYPE_TO_STR_DTYPE, CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.health_monitor.constants import PING_GENERIC_ERROR_CODE
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from kvstore.integrations.lmcache_chunks import ChunkCalls
from kvstore.integrations.lmcache_mapping import (
    TAIL_TRAILER,
    MappingError,
    PluginSettings,
    model_part,
    namespace_for,
    page_key,
    parse_settings,
)
from kvstore.integrations.lmcache_shape import EngineShape, Runs
from kvstore.integrations.outcome import Stored
from kvstore.integrations.remote import RemoteStore
from kvstore.memtune import tune_malloc_for_bulk_io

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


class KVStoreConnector(ChunkCalls, RemoteConnector):
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
            args = (self.settings.namespace_prefix, named, world_size, worker_id, dtype)
            pair = (
                namespace_for(*args, geometry=shape.geometry),
                namespace_for(*args, geometry=shape.geometry, tail=True),
            )
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

    # -- LMCache's asynchronous calls, on the pool

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
