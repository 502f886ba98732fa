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
import functools
import hashlib
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
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

from kvstore.hashing import MAX_NAMESPACE_BYTES
from kvstore.integrations.groups import Run, groups_label, part_name, runs
from kvstore.integrations.lanes import SLICE_BYTES, Lanes, slices
from kvstore.integrations.lmcache_l2_mapping import (
    L2_MAPPING_VERSION,
    L2_PARAMS,
    L2Settings,
    MappingError,
    l2_layout_tag,
    l2_namespace,
    l2_namespace_salt_part,
    l2_page_key,
    l2_page_layout,
    l2_salt_part,
    parse_l2_params,
)
from kvstore.integrations.lmcache_mapping import model_part
from kvstore.integrations.outcome import Stored
from kvstore.integrations.remote import RemoteStore
from kvstore.layout import PageLayout
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


class KVStoreL2Adapter(L2AdapterInterface):
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

    # -- object groups: a chunk's groups in one task are one bundle (DESIGN.md §4.3, integrations/groups.py)

    def _store(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2StoreResult:
        plain, bundled = self._grouped(keys)
        if not bundled:
            return self._store_rows(keys, objects)
        res = self._store_rows([keys[i] for i in plain], [objects[i] for i in plain]) if plain else None
        ok, sent = (True, 0) if res is None else (res.is_successful(), res.bytes_transferred())
        stored: list[ObjectKey] = []
        sizes: list[int] = []
        for run in bundled:
            named = self._bundle_call(keys, run, {g: _object_tag(objects[i]) for g, i in run.items[0].items()})
            if named is None:
                ok = False
                continue
            ns, hashes = named
            parts = {g: objects[i].get_size() for g, i in run.items[0].items()}
            try:
                layout = PageLayout.bundle({part_name(g): l2_page_layout(n) for g, n in parts.items()}, block_size=1)
            except (MappingError, ValueError) as exc:
                self.store.say("bad-object", logging.ERROR, "kvstore L2 adapter: not stored: %s", exc)
                ok = False
                continue
            pages = [{part_name(g): objects[i].byte_array for g, i in items.items()} for items in run.items]
            done = self.store.put_bundle(ns, layout, hashes, pages)
            sent += done.count * layout.page_bytes
            ok = ok and done.ok
            for j, held in enumerate(done.held):
                if held:
                    stored += [keys[i] for i in run.items[j].values()]
                    sizes += [parts[g] for g in run.items[j]]
        if stored:
            self._notify_keys_stored(stored, sizes)
        return L2StoreResult(ok, sent)

    def _lookup(self, keys: list[ObjectKey], descs: dict[int, MemoryLayoutDesc]) -> Bitmap:
        plain, bundled = self._grouped(keys)
        if not bundled:
            return self._lookup_rows(keys, descs)
        bitmap = Bitmap(len(keys))
        if plain:
            for j in self._lookup_rows([keys[i] for i in plain], descs).get_indices_list():
                bitmap.set(plain[j])
        now = time.monotonic()
        for run in bundled:
            tags = {g: self._desc_tag(keys[i], descs) for g, i in run.items[0].items()}
            named = None if None in tags.values() else self._bundle_call(keys, run, tags)  # type: ignore[arg-type]
            if named is None:
                continue
            ns, hashes = named
            n = self._find(ns, hashes)
            if n and self.settings.lock:  # one pin per chunk, held by its first group's key (unlock releases it)
                first = [min(items.values()) for items in run.items[:n]]
                self._hold(keys, first, ns, hashes[:n], now + self.settings.remote.pin_lease)
            for items in run.items[:n]:
                for i in items.values():
                    bitmap.set(i)
        return bitmap

    def _load(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> Bitmap:
        plain, bundled = self._grouped(keys)
        if not bundled:
            return self._load_rows(keys, objects)
        bitmap = Bitmap(len(keys))
        if plain:
            for j in self._load_rows([keys[i] for i in plain], [objects[i] for i in plain]).get_indices_list():
                bitmap.set(plain[j])
        loaded: list[ObjectKey] = []
        for run in bundled:
            named = self._bundle_call(keys, run, {g: _object_tag(objects[i]) for g, i in run.items[0].items()})
            if named is None:
                continue
            ns, hashes = named
            sizes = {g: objects[i].get_size() for g, i in run.items[0].items()}
            try:
                layout = PageLayout.bundle({part_name(g): l2_page_layout(n) for g, n in sizes.items()}, block_size=1)
            except (MappingError, ValueError):
                continue
            pages = [{part_name(g): objects[i].byte_array for g, i in items.items()} for items in run.items]
            n = self.store.get_bundle_into(ns, layout, hashes, pages)
            for items in run.items[:n]:
                for i in items.values():
                    bitmap.set(i)
                    loaded.append(keys[i])
        if loaded:
            self._notify_keys_accessed(loaded)
        return bitmap

    def _grouped(self, keys: Sequence[ObjectKey]) -> tuple[list[int], list[Run]]:
        """The keys of chunks this task carries with one object group (`plain`: the rows above), and the runs of
        chunks it carries with several (each chunk one bundle of its groups)."""
        all_runs = runs(
            [((k.model_name, k.kv_rank, k.cache_salt, bytes(k.chunk_hash)), k.object_group_id) for k in keys]
        )
        plain = [i for r in all_runs if len(r.groups) == 1 for items in r.items for i in items.values()]
        return sorted(plain), [r for r in all_runs if len(r.groups) > 1]

    def _bundle_call(
        self, keys: Sequence[ObjectKey], run: Run, tags: Mapping[int, str]
    ) -> tuple[str, list[bytes]] | None:
        """(namespace, hashes) of a run's bundles: the namespace of its first group's row, then the groups and a
        digest of every group's layout tag; a chunk's hash is its group-0 page key (None: unnamed, logged)."""
        first = keys[run.items[0][run.groups[0]]]
        try:
            base = self._namespace(first, tags[run.groups[0]])
        except MappingError as exc:
            self.store.say("mapping", logging.ERROR, "kvstore L2 adapter: key of model %r cannot be mapped: %s; "
                           "treated as a miss", first.model_name, exc)  # fmt: skip
            return None
        if base is None:
            return None
        digest = hashlib.sha256(";".join(f"{g}={tags[g]}" for g in run.groups).encode()).hexdigest()[:12]
        ns = f"{base}/{groups_label(run.groups)}~{digest}"
        if len(ns.encode()) > MAX_NAMESPACE_BYTES:
            ns = f"{base[: MAX_NAMESPACE_BYTES - 30]}/{hashlib.sha256(ns.encode()).hexdigest()[:24]}"
        hashes = [l2_page_key(k.model_name, k.kv_rank, 0, k.chunk_hash, k.cache_salt)
                  for k in (keys[items[run.groups[0]]] for items in run.items)]  # fmt: skip
        return ns, hashes

    def _store_rows(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2StoreResult:
        """Store the objects; the task succeeds only when the node holds every one afterwards, and only the keys
        it holds are announced to LMCache as stored (outcome.py: a key a full node refused is a failure, so
        LMCache keeps its L1 copy and its L2 accounting never counts it)."""
        ok, sent, unstored = True, 0, 0
        stored: list[ObjectKey] = []
        sizes: list[int] = []
        for ns, idx, size in self._runs(keys, lambda k: None, objects):
            if ns is None:
                ok = False
                unstored += len(idx)
                continue
            try:
                layout = l2_page_layout(size)
            except MappingError as exc:
                self.store.say("bad-object", logging.ERROR, "kvstore L2 adapter: not stored: %s", exc)
                ok = False
                unstored += len(idx)
                continue
            self._warm_soon(size)
            hashes = [self._hash(keys[i]) for i in idx]
            bufs = [objects[i].byte_array for i in idx]
            for (a, b), done in self._put_slices(ns, layout, hashes, bufs, size):
                if done is None:
                    unstored += b - a
                    continue
                sent += done.count * size
                # NOTE: a Put says how many pages were new, not which: a chain's pages already present are
                # usually its leading ones (a shared prefix), so the last `new` held pages of the call count as
                # this adapter's bytes (LMCache's usage), the others as 0.
                held = [j for j, h in enumerate(done.held) if h]
                first_new = len(held) - done.new
                for n, j in enumerate(held):
                    stored.append(keys[idx[a + j]])
                    sizes.append(size if n >= first_new else 0)
                if not done.ok:
                    ok = False
                    unstored += (b - a) - done.count
        if stored:
            self._notify_keys_stored(stored, sizes)
        with self._lock:
            self.counters["stores"] += 1
            self.counters["stored_pages"] += sum(1 for n in sizes if n)
            self.counters["unstored_pages"] += unstored
            self.counters["bytes_stored"] += sent
            self.counters["store_failures"] += 0 if ok else 1
        return L2StoreResult(ok, sent)

    def _lookup_rows(self, keys: list[ObjectKey], descs: dict[int, MemoryLayoutDesc]) -> Bitmap:
        for desc in (descs or {}).values():
            self._warm_soon(_desc_bytes(desc))
        bitmap = Bitmap(len(keys))
        hits = 0
        now = time.monotonic()
        for ns, idx, _ in self._runs(keys, lambda k: self._desc_tag(k, descs)):
            if ns is None:
                continue
            hashes = [self._hash(keys[i]) for i in idx]
            n = self._find(ns, hashes)
            if n and self.settings.lock:
                self._hold(keys, idx[:n], ns, hashes[:n], now + self.settings.remote.pin_lease)
            for i in idx[:n]:
                bitmap.set(i)
            hits += n
        with self._lock:
            self.counters["lookups"] += 1
            self.counters["lookup_keys"] += len(keys)
            self.counters["lookup_hits"] += hits
        return bitmap

    def _load_rows(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> Bitmap:
        bitmap = Bitmap(len(keys))
        loaded: list[ObjectKey] = []
        nbytes = 0
        for ns, idx, size in self._runs(keys, lambda k: None, objects):
            if ns is None:
                continue
            hashes = [self._hash(keys[i]) for i in idx]
            bufs = [objects[i].byte_array for i in idx]
            short = False
            for (a, b), landed in self._get_slices(ns, hashes, bufs, size):  # consumed whole: see _get_slices
                if short:
                    continue  # past the row's first gap: nothing is reported (a slice in flight may have landed)
                got = 0
                for n in landed:
                    if n != size:  # only an explicit namespace can hold pages of another size
                        self.store.say(
                            "size",
                            logging.ERROR,
                            "kvstore L2 adapter: namespace %r holds %d-byte pages, "
                            "LMCache's objects are %d bytes; treated as a miss",
                            ns,
                            n,
                            size,
                        )
                        break
                    got += 1
                for i in idx[a : a + got]:
                    bitmap.set(i)
                    loaded.append(keys[i])
                nbytes += got * size
                short = got < b - a
        if loaded:
            self._notify_keys_accessed(loaded)
        with self._lock:
            self.counters["loads"] += 1
            self.counters["load_keys"] += len(keys)
            self.counters["load_hits"] += len(loaded)
            self.counters["bytes_loaded"] += nbytes
        return bitmap

    def _put_slices(
        self, ns: str, layout: PageLayout, hashes: list[bytes], bufs: list[memoryview], size: int
    ) -> Iterator[tuple[tuple[int, int], Stored | None]]:
        """A row's Puts, slice by slice with the store lanes' calls in flight (lanes.py), in order: ((a, b), what
        the node holds of pages a..b), or None for a slice not sent because an earlier one failed (the rest of
        the row would hang off a gap)."""
        failed = False

        def put(ab: tuple[int, int]) -> Stored | None:
            a, b = ab
            return None if failed else self.store.put_from(ns, layout, hashes[a:b], bufs[a:b], parent_chain=hashes[:a])

        cuts = slices(len(hashes), size)
        for ab, done in zip(cuts, self._store_lanes.ordered(put, cuts), strict=True):
            failed = failed or (done is not None and not done.ok)
            yield ab, done

    def _get_slices(
        self, ns: str, hashes: list[bytes], bufs: list[memoryview], size: int
    ) -> Iterator[tuple[tuple[int, int], list[int]]]:
        """A row's Gets into the objects, slice by slice with the load lanes' calls in flight (lanes.py), in
        order: ((a, b), the sizes of the leading pages of a..b that landed). After a slice that fell short the
        slices not yet started are not asked for (they come back empty). Consume it whole: it returns only once
        no call it started can still write into `bufs`."""
        short = False

        def get(ab: tuple[int, int]) -> list[int]:
            a, b = ab
            return [] if short else self.store.get_into(ns, hashes[a:b], bufs[a:b])

        cuts = slices(len(hashes), size)
        for (a, b), landed in zip(cuts, self._load_lanes.ordered(get, cuts), strict=True):
            short = short or len(landed) < b - a
            yield (a, b), landed

    def _find(self, ns: str, hashes: list[bytes]) -> int:
        """Leading pages of the row the node holds, pinned when `lock` (0 on any failure).

        One node, locking: Pin first. It pins every page present and says how many, so the common rows
        (all present, none present) cost one round trip; only a partial row also asks Lookup for its
        prefix, and releases the pins taken beyond it. A cluster (or no lock): Lookup, then Pin."""
        s = self.settings
        if not s.lock:
            return self.store.lookup(ns, hashes, prefetch=s.remote.prefetch)
        if s.remote.target.addr is None:
            n = self.store.lookup(ns, hashes, prefetch=s.remote.prefetch)
            return n if n and self.store.pin(ns, hashes[:n], s.remote.pin_lease) > 0 else 0
        pinned = self.store.pin(ns, hashes, s.remote.pin_lease)
        if pinned in (0, len(hashes)):
            return pinned
        n = self.store.lookup(ns, hashes, prefetch=s.remote.prefetch)
        self.store.unpin(ns, hashes[n:])  # pages present past the first gap: pinned above, not reported
        return n

    def _unpin(self, release: dict[str, list[bytes]]) -> None:
        for ns, hashes in release.items():
            self.store.unpin(ns, hashes)

    # -- mapping

    def _runs(
        self,
        keys: Sequence[ObjectKey],
        tag_of: Callable[[ObjectKey], str | None],
        objects: Sequence[MemoryObj] | None = None,
    ) -> Iterator[tuple[str | None, list[int], int]]:
        """(namespace, key indices, object size) of consecutive keys sharing a namespace and object size.
        With objects, the layout comes from each object; else from tag_of(key). A key whose namespace
        cannot be named comes as namespace None (logged)."""
        run: list[int] = []
        cur: tuple[str | None, int] | None = None
        for i, key in enumerate(keys):
            size = 0
            try:
                if objects is not None:
                    obj = objects[i]
                    size = obj.get_size()
                    tag = _object_tag(obj)
                else:
                    tag = tag_of(key)
                ns = self._namespace(key, tag)
            except MappingError as exc:
                self.store.say(
                    "mapping",
                    logging.ERROR,
                    "kvstore L2 adapter: key of model %r cannot be mapped: %s; treated as a miss",
                    key.model_name,
                    exc,
                )
                ns = None
            if cur is not None and (ns, size) != cur:
                yield cur[0], run, cur[1]
                run = []
            cur = (ns, size)
            run.append(i)
        if cur is not None:
            yield cur[0], run, cur[1]

    def _namespace(self, key: ObjectKey, tag: str | None) -> str | None:
        if tag is not None:
            self._tags[(key.model_name, key.kv_rank, key.object_group_id)] = tag
        if self.settings.namespace is not None:
            return self.settings.namespace
        if tag is None:
            return None
        if key.cache_salt:
            self._salts.setdefault(l2_salt_part(key.cache_salt), key.cache_salt)
        model = model_part(key.model_name, self.settings.revision_of(key.model_name))
        return _namespace_of(
            self.settings.namespace_prefix, model, key.kv_rank, key.object_group_id, key.cache_salt, tag
        )

    def _desc_tag(self, key: ObjectKey, descs: Mapping[int, MemoryLayoutDesc]) -> str | None:
        desc = descs.get(key.object_group_id) if descs else None
        if desc is not None and desc.shapes:
            return l2_layout_tag([list(s) for s in desc.shapes], [_dtype(d) for d in desc.dtypes])
        return self._tags.get((key.model_name, key.kv_rank, key.object_group_id))  # no layout given: the last seen

    @staticmethod
    def _hash(key: ObjectKey) -> bytes:
        return l2_page_key(key.model_name, key.kv_rank, key.object_group_id, key.chunk_hash, key.cache_salt)

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


# Every key of a row maps to the same namespace: validating it once per row, not once per key (bounded).
_namespace_of = functools.lru_cache(maxsize=4096)(l2_namespace)


def _object_tag(obj: MemoryObj) -> str:
    """The layout tag of a MemoryObj: its tensors' shapes and dtypes (older objects carry only one)."""
    meta = obj.metadata
    shapes = meta.shapes if meta.shapes else [meta.shape]
    dtypes = meta.dtypes if meta.dtypes else [meta.dtype]
    return l2_layout_tag([list(s) for s in shapes], [_dtype(d) for d in dtypes])


def _desc_bytes(desc: MemoryLayoutDesc) -> int:
    """Bytes of one object of a layout description (0 when it names none or a dtype of unknown size)."""
    total = 0
    for shape, dtype in zip(desc.shapes or (), desc.dtypes or (), strict=False):
        n = int(getattr(dtype, "itemsize", 0))
        for dim in shape:
            n *= int(dim)
        total += n
    return total


def _dtype(d: object) -> str:
    """`torch.bfloat16` -> "bfloat16" (any dtype, without importing torch here)."""
    return str(d).removeprefix("torch.")
