"""kvstore as an L2 adapter of LMCache's multiprocess server (`lmcache server`, LMCache 0.5.6).

LMCache's multiprocess mode (vLLM's `LMCacheMPConnector`, SGLang's LMCache integration) keeps chunks in
the server's own memory (L1) and takes storage beyond it only as L2 adapters. This is one:

    lmcache server --l1-size-gb 8 --l2-adapter '{"type": "plugin",
        "module_path": "kvstore.integrations.lmcache_l2", "class_name": "KVStoreL2Adapter",
        "adapter_params": {"target": "10.0.0.5:50051"}}'            # or {"redis_url": "redis://..."}

LMCache's plugin loader finds KVStoreL2AdapterConfig (class name + "Config") and validates the
parameters with it: a bad one stops the server at start with a message naming `adapter_params.<field>`
(the fields and defaults: lmcache_l2_mapping.L2_PARAMS). Keys and namespaces: mapping l2v1 in
kvstore/integrations/lmcache_l2_mapping.py.

The interface (lmcache/v1/distributed/l2_adapters/base.py): store, lookup-and-lock and load are
submitted as tasks and never block the caller; each kind signals completion on its own event fd and
keeps its results until LMCache pops them. Here every task runs on a thread pool (one for stores, one for
loads, one for lookups and unlocks: a slow store never delays a prefill's loads, and a request's lookup never
queues behind other requests' loads) through RemoteStore,
whose error policy is the engine's: a node that is down, slow or refusing is a miss (or a failed store),
logged once per kind, never an exception into LMCache; after a node stopped answering, tasks complete
at once as misses for `down_backoff_s` (one probe per period). No call waits longer than `timeout_s`
(data) or `lookup_timeout_s` (lookups, pins), so no task outlives those bounds by more than its queue.

Invariants:
- loads receive each page into the MemoryObj LMCache hands over (`get_into` on its buffer: over TCP straight
  into it, verified on arrival; on the node's host the node copies it, verified in that pass, into the
  client's registered receive memory and the client copies it on, since the node writes only memory
  registered as a sealed memfd and LMCache's arena is not one), and report a key loaded only when its page
  arrived whole, verified and exactly the object's size;
- a task's pages move as calls of about SLICE_BYTES, two in flight (integrations/lanes.py), so on one host
  the node's copy of one call and the client's of the one before run at once; a task completes only once
  none of its calls can still write into LMCache's objects;
- a lookup reports a prefix of each (model, rank, group, salt) row: what the node holds from the row's
  first chunk on; with `lock` (default) those pages are pinned with a lease until LMCache unlocks them
  (or the lease ends: an unlock lost in a crash never leaks a pin), in one round trip for a row found
  whole or not at all (see _find);
- usage (`get_usage`) is what the node says this adapter's namespaces hold, per cache salt too, read
  from the node's Stats at most every `usage_interval_s` off the caller's thread; where the token is
  bound to a tenant, the node lists only that tenant's namespaces and the capacity reported is the
  tenant's share (DRAM + NVMe), else `max_capacity_gb` (0: unknown, so LMCache runs no global eviction).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Any, TypeVar

from lmcache.lmcache_native import Bitmap
from lmcache.logging import init_logger
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from kvstore.integrations.lanes import SLICE_BYTES, Lanes
from kvstore.integrations.lmcache_l2_mapping import (
    L2_MAPPING_VERSION,
    L2_PARAMS,
    L2Settings,
    MappingError,
    l2_namespace_salt_part,
    parse_l2_params,
)
from kvstore.integrations.lmcache_l2_work import L2Work
from kvstore.integrations.remote import RemoteStore
from kvstore.scoping import DEFAULT_TENANT
from kvstore.stats import NodeStats

logger = init_logger(__name__)
T = TypeVar("T")
_BUG_KIND = "bug"


class KVStoreL2AdapterConfig(L2AdapterConfigBase):
    """`adapter_params` of the plugin, validated (LMCache's plugin loader builds it with from_dict)."""

    def __init__(self, settings: L2Settings) -> None:
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict) -> KVStoreL2AdapterConfig:
        try:
            return cls(parse_l2_params(d))
        except MappingError as exc:
            raise ValueError(f"kvstore L2 adapter: {exc}") from None

    @classmethod
    def help(cls) -> str:
        return "kvstore L2 adapter parameters (adapter_params):\n" + "\n".join(
            f"- {name}: {what}" for name, what in L2_PARAMS.items()
        )


class _Completions:
    """Finished tasks of one kind and the event fd that says so. Thread-safe."""

    def __init__(self) -> None:
        self.notifier = create_event_notifier()
        self._done: dict[L2TaskId, Any] = {}
        self._lock = threading.Lock()
        self.closed = False

    def finish(self, task_id: L2TaskId, result: object) -> None:
        with self._lock:
            if self.closed:
                return
            self._done[task_id] = result
            self.notifier.notify()

    def pop(self, task_id: L2TaskId) -> Any:
        with self._lock:
            return self._done.pop(task_id, None)

    def pop_all(self) -> dict[L2TaskId, Any]:
        with self._lock:
            done, self._done = self._done, {}
        return done

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._done.clear()
        self.notifier.close()


class KVStoreL2Adapter(L2Work, L2AdapterInterface):
    """LMCache L2 adapter over one kvstore node or a cluster (see the module docstring)."""

    def __init__(self, config: KVStoreL2AdapterConfig | Mapping[str, object], l1_memory_desc: object = None) -> None:
        if not isinstance(config, KVStoreL2AdapterConfig):
            config = KVStoreL2AdapterConfig.from_dict(dict(config))
        s = config.settings
        super().__init__(max_capacity_bytes=s.max_capacity_bytes)
        self.settings = s
        try:
            self.store = RemoteStore(s.remote, logger, setting_prefix="adapter_params.")  # reads token / TLS files
        except (OSError, ValueError) as exc:
            raise ValueError(f"kvstore L2 adapter: adapter_params (token_file / tls_*): {exc}") from None
        self._stores, self._lookups, self._loads = _Completions(), _Completions(), _Completions()
        threads = s.remote.threads
        self._store_pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-l2-store")
        self._read_pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-l2-read")
        # NOTE: lookups (and unlocks, usage) on threads of their own: a request's lookup-and-lock is one short round
        # trip that must not queue behind other requests' loads of many MiB.
        self._control_pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-l2-lookup")
        # A task's pages move as several calls in flight (lanes.py), on lanes of their own per kind of work.
        self._store_lanes = Lanes("l2-store-lane", threads)
        self._load_lanes = Lanes("l2-load-lane", threads)
        self._lock = threading.Lock()
        self._next_id = 0
        self._closed = False
        self._warmed: set[int] = set()  # object sizes whose transfer memory was set up ahead (_warm_soon)
        # Pins this adapter holds: key -> (namespace, hash, count, lease end). Entries past their lease
        # are dropped (the node dropped the pin too), so a lock LMCache never releases cannot grow this.
        self._pins: dict[ObjectKey, tuple[str, bytes, int, float]] = {}
        # Last layout tag seen per (model, kv rank, group): for calls that carry no layout (unlock,
        # delete, a lookup with an empty layout description).
        self._tags: dict[tuple[str, int, int], str] = {}
        self._salts: dict[str, str] = {}  # namespace salt component -> the salt, for usage per salt
        self._usage: AdapterUsage | None = None
        self._usage_at = -float("inf")
        self._usage_busy = False
        self.tenant: str | None = None  # the node's tenant for this token, once Stats were read
        self.counters: dict[str, float] = {
            k: 0
            for k in (
                "stores",
                "stored_pages",
                "unstored_pages",
                "store_failures",
                "bytes_stored",
                "store_seconds",
                "lookups",
                "lookup_keys",
                "lookup_hits",
                "lookup_seconds",
                "loads",
                "load_keys",
                "load_hits",
                "bytes_loaded",
                "load_seconds",
            )
        }
        where = s.namespace or f"{s.namespace_prefix}/{L2_MAPPING_VERSION}/<model>/r<rank>/g<group>/<layout>[/s=<salt>]"
        logger.info(
            "kvstore L2 adapter: %s, namespace %s, transport %s, timeouts %gs (data) / %gs (lookup)%s",
            self.store.where,
            where,
            s.remote.transport,
            s.remote.timeout,
            s.remote.lookup_timeout,
            ", pages pinned while locked" if s.lock else "",
        )
        self._warm_soon(0)

    # -- event fds

    def get_store_event_fd(self) -> int:
        return self._stores.notifier.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookups.notifier.fileno()

    def get_load_event_fd(self) -> int:
        return self._loads.notifier.fileno()

    # -- tasks

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(self._store_pool, self._stores, self._store, (keys, objects), L2StoreResult(False, 0))

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        return self._stores.pop_all()

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        args = (keys, group_layout_descs)
        return self._submit(self._control_pool, self._lookups, self._lookup, args, Bitmap(len(keys)))

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._lookups.pop(task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            release: dict[str, list[bytes]] = {}
            for key in keys:
                held = self._pins.get(key)
                if held is None:
                    continue
                ns, h, count, until = held
                if count > 1:
                    self._pins[key] = (ns, h, count - 1, until)
                else:
                    del self._pins[key]
                release.setdefault(ns, []).append(h)
        if release and not self._closed:
            with contextlib.suppress(RuntimeError):  # shutting down: the pins' leases end them
                self._control_pool.submit(self._unpin, release)

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(self._read_pool, self._loads, self._load, (keys, objects), Bitmap(len(keys)))

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._loads.pop(task_id)

    def delete(self, keys: list[ObjectKey]) -> None:
        """Delete keys from the node (LMCache's L2 eviction, when configured). Synchronous, as LMCache
        calls it; keys of a layout this process never saw cannot be named and are skipped."""
        deleted: list[ObjectKey] = []
        sizes: list[int] = []
        for ns, idx, size in self._runs(keys, lambda k: self._tags.get((k.model_name, k.kv_rank, k.object_group_id))):
            if ns is None:
                continue
            if self.store.delete(ns, [self._hash(keys[i]) for i in idx]) > 0:
                deleted += [keys[i] for i in idx]
                sizes += [size] * len(idx)
        if deleted:
            self._notify_keys_deleted(deleted, sizes)

    # -- usage and status

    def get_usage(self) -> AdapterUsage:
        """The last usage read from the node (see the module docstring); LMCache's own accounting of what
        this adapter stored until the first read. Never blocks: a stale snapshot schedules a refresh."""
        self._refresh_usage_soon()
        return self._usage if self._usage is not None else super().get_usage()

    def report_status(self) -> dict:
        with self._lock:
            counters = dict(self.counters)
        down = self.store.outage.down_since is not None
        return {
            "is_healthy": not down,
            "type": "kvstore",
            "target": self.store.where,
            "tenant": self.tenant,
            "namespace": self.settings.namespace or f"{self.settings.namespace_prefix}/{L2_MAPPING_VERSION}/...",
            "transport": self.settings.remote.transport,
            "pinned_keys": len(self._pins),
            "misses_while_down": self.store.outage.skipped,
            **counters,
        }

    def close(self) -> None:
        self._closed = True
        self._store_pool.shutdown(wait=False, cancel_futures=True)
        self._read_pool.shutdown(wait=False, cancel_futures=True)
        self._control_pool.shutdown(wait=False, cancel_futures=True)
        self._store_lanes.close()
        self._load_lanes.close()
        self.store.close()  # cuts calls in flight short: their tasks end as misses nobody reads
        for c in (self._stores, self._lookups, self._loads):
            c.close()

    # -- the work (on the pools)

    def _submit(
        self, pool: ThreadPoolExecutor, done: _Completions, fn: Callable[..., T], args: tuple, failed: T
    ) -> L2TaskId:
        with self._lock:
            task_id = self._next_id
            self._next_id += 1

        kind = fn.__name__.strip("_")  # store, lookup, load

        def run() -> None:
            t0 = time.monotonic()
            try:
                result = fn(*args)
            except Exception as exc:  # a bug here must not leave LMCache waiting on the task forever
                self.store.say(
                    _BUG_KIND,
                    logging.ERROR,
                    "kvstore L2 adapter: %s failed: %s",
                    fn.__name__,
                    "".join(traceback.format_exception(exc)),
                )
                result = failed
            with self._lock:
                self.counters[f"{kind}_seconds"] += time.monotonic() - t0  # task time, queueing excluded
            done.finish(task_id, result)

        try:
            pool.submit(run)
        except RuntimeError:  # closed
            done.finish(task_id, failed)
        return task_id

    def _unpin(self, release: dict[str, list[bytes]]) -> None:
        for ns, hashes in release.items():
            self.store.unpin(ns, hashes)

    def _hold(
        self, keys: Sequence[ObjectKey], idx: Sequence[int], ns: str, hashes: Sequence[bytes], until: float
    ) -> None:
        with self._lock:
            now = time.monotonic()
            if len(self._pins) > 4096:  # drop what the node has released on its own (lease over)
                self._pins = {k: v for k, v in self._pins.items() if v[3] > now}
            for i, h in zip(idx, hashes, strict=True):
                held = self._pins.get(keys[i])
                count = held[2] + 1 if held is not None and held[3] > now else 1
                self._pins[keys[i]] = (ns, h, count, until)

    # -- usage

    def _warm_soon(self, size: int) -> None:
        """Set up, off the caller's thread and once per object size, what the first transfer of that size would
        otherwise pay for on its own clock (RemoteStore.warm: the plane and its connection at start; receive
        memory for the calls one task keeps in flight, once a size is known: a lookup names it first)."""
        with self._lock:
            if self._closed or size in self._warmed:
                return
            self._warmed.add(size)
        pages = self._load_lanes.depth * max(1, SLICE_BYTES // size) if size else 0
        with contextlib.suppress(RuntimeError):  # closed
            self._store_pool.submit(self.store.warm, size, pages)

    def _refresh_usage_soon(self) -> None:
        with self._lock:
            if self._closed or self._usage_busy or time.monotonic() - self._usage_at < self.settings.usage_interval:
                return
            self._usage_busy = True
        try:
            self._control_pool.submit(self._refresh_usage)
        except RuntimeError:
            self._usage_busy = False

    def _refresh_usage(self) -> None:
        try:
            stats = self.store.stats()
            if stats:
                self._usage = self._usage_from(stats)
        finally:
            with self._lock:
                self._usage_at = time.monotonic()
                self._usage_busy = False

    def _usage_from(self, stats: Sequence[NodeStats]) -> AdapterUsage:
        """This adapter's namespaces on the node(s), in bytes, in total and per cache salt."""
        s = self.settings
        mine = (
            (lambda ns: ns == s.namespace)
            if s.namespace
            else (lambda ns: ns.startswith(f"{s.namespace_prefix}/{L2_MAPPING_VERSION}/"))
        )
        total, by_part, capacity = 0, {}, 0
        bound = True
        for st in stats:
            for ns, layout, pages in st.namespaces:
                if mine(ns):
                    used = pages * layout.page_bytes
                    total += used
                    part = l2_namespace_salt_part(ns)
                    by_part[part] = by_part.get(part, 0) + used
            tenants = [t for t in st.tenants if t.tenant != DEFAULT_TENANT]
            if len(st.tenants) == 1 and tenants:
                self.tenant = tenants[0].tenant
                capacity += sum(tenants[0].quota_bytes.values())
            else:
                bound = False
        if s.namespace:  # one namespace for every salt: only LMCache's own accounting can split it
            per_salt = dict(super().get_usage().bytes_by_cache_salt)
        else:
            per_salt = {self._salts.get(p, p) if p else "": n for p, n in by_part.items() if n > 0}
        cap = capacity if bound and capacity > 0 else s.max_capacity_bytes
        return AdapterUsage(
            total_bytes_used=total, total_capacity_bytes=cap, bytes_by_cache_salt=MappingProxyType(per_salt)
        )
