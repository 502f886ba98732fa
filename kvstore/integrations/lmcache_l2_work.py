"""The work of the LMCache L2 adapter's tasks, on its thread pools: store, lookup-and-lock and load of a task's
keys, as rows (one page per key) or, for a chunk carried with several object groups, as bundles (one page per
chunk, DESIGN.md §4.3). Part of `KVStoreL2Adapter` (lmcache_l2.py), which supplies the pools, lanes, pins,
counters and LMCache's notifications that `L2Work` annotates.

Invariant: a key is reported stored, found or loaded only for a page the node holds (a store: what the Put says
it kept, outcome.py), found from its row's first chunk on, or that arrived whole, verified and exactly its
object's size; a task's pages move as calls of about SLICE_BYTES (integrations/lanes.py) and a task ends only
once none of its calls can still write into LMCache's objects.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.memory_management import MemoryObj

from kvstore.integrations.groups import part_name
from kvstore.integrations.lanes import Lanes, slices
from kvstore.integrations.lmcache_l2_mapping import MappingError, l2_page_layout
from kvstore.integrations.lmcache_l2_names import L2Names, desc_bytes, object_tag
from kvstore.integrations.outcome import Stored
from kvstore.layout import PageLayout


class L2Work(L2Names):
    """The tasks' work for `KVStoreL2Adapter`; the adapter supplies the attributes annotated here, `_hold` (a
    found row's pins), `_warm_soon` and LMCache's `_notify_keys_stored` / `_notify_keys_accessed`."""

    _lock: threading.Lock
    counters: dict[str, float]
    _store_lanes: Lanes
    _load_lanes: Lanes
    _hold: Callable[..., None]
    _warm_soon: Callable[[int], None]
    _notify_keys_stored: Callable[..., Any]
    _notify_keys_accessed: Callable[..., Any]

    def _store(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2StoreResult:
        plain, bundled = self._grouped(keys)
        if not bundled:
            return self._store_rows(keys, objects)
        res = self._store_rows([keys[i] for i in plain], [objects[i] for i in plain]) if plain else None
        ok, sent = (True, 0) if res is None else (res.is_successful(), res.bytes_transferred())
        stored: list[ObjectKey] = []
        sizes: list[int] = []
        for run in bundled:
            named = self._bundle_call(keys, run, {g: object_tag(objects[i]) for g, i in run.items[0].items()})
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
            named = self._bundle_call(keys, run, {g: object_tag(objects[i]) for g, i in run.items[0].items()})
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
            self._warm_soon(desc_bytes(desc))
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
