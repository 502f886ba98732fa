"""What each of the LMCache plugin's calls does, blocking (on the plugin's pool, or inline for LMCache's
synchronous calls): lookups, fetches into MemoryObjs of LMCache's CPU allocator, stores of full and partial
chunks, pins. Part of `KVStoreConnector` (lmcache.py), which supplies the attributes `ChunkCalls` annotates
and the engine's current shape (`_current`) and key runs (`_runs`).

Invariant: a fetch returns the longest prefix whose every chunk arrived whole and verified, each in a MemoryObj
of LMCache's allocator holding exactly the bytes stored (an object not returned goes back to the allocator at
once); a store puts each namespace's chunks as one chain and reports per chunk what the node kept (a refused
chunk is counted and logged, and stays a miss); a failure is a miss, never an exception.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch
from lmcache.utils import TORCH_DTYPE_TO_STR_DTYPE, CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from kvstore.integrations.hints import HintError, SessionHints, from_lmcache
from kvstore.integrations.lmcache_mapping import MappingError, PluginSettings, pack_tail, tail_tokens
from kvstore.integrations.lmcache_shape import EngineShape, Runs
from kvstore.integrations.outcome import Stored
from kvstore.integrations.remote import RemoteStore, call_slices
from kvstore.wire.streams import Buffer, FetchedPage

logger = logging.getLogger("kvstore.integrations.lmcache")  # NOTE: the plugin's logger (lmcache.py): one name


class ChunkCalls:
    """The blocking cores of `KVStoreConnector`; the connector supplies what is annotated here."""

    store: RemoteStore
    settings: PluginSettings
    name: str
    partial: bool
    local_cpu_backend: LocalCPUBackend
    counts: dict[str, int]
    _counts_lock: threading.Lock
    _current: Callable[[], EngineShape]
    _runs: Callable[[EngineShape, Sequence[CacheEngineKey]], Runs]

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
