"""SGLang HiCache's v2 calls (hybrid models): `register_mem_host_pool_v2`, `batch_set_v2`, `batch_get_v2`,
`batch_exists_v2`, as a part of `KVStoreHiCacheStorage` (sglang_hicache.py), which supplies the store, the
settings and the retention hooks this class names.

Invariant: each page of a call is one bundle (DESIGN.md §4.3) of every pool's part the call names for its key:
all of a page's pools commit, or none; a get lands them all, or the page is a miss. A transfer naming a pool no
host pool provides, or host indices that do not cover its keys, stores and loads nothing of the call (logged,
all False). How keys group and what each bundle is named: sglang_pools.py (pure).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np

from kvstore.integrations.direct import ConfigError, byte_view
from kvstore.integrations.lmcache_mapping import PluginSettings
from kvstore.integrations.remote import RemoteStore
from kvstore.integrations.sglang_mapping import key_bytes
from kvstore.integrations.sglang_pools import (
    MAX_TRAILING_PROBES,
    MODE_FLAT,
    MODE_REGIONS,
    POOL_KV,
    Group,
    PoolPart,
    bundle_layout,
    bundle_namespace,
    call_groups,
    exists_groups,
    hit_policy,
    pool_name,
    transfer_result,
)
from kvstore.layout import PageLayout

log = logging.getLogger("kvstore.sglang")


class PoolCalls:
    """The v2 calls of `KVStoreHiCacheStorage`. The storage class supplies the attributes annotated here and
    `batch_exists` (the KV prefix), `_parent` (a call's chain parent) and `_after_store` (retention)."""

    store: RemoteStore
    settings: PluginSettings
    config: Any
    mem_pool_host: Any
    parts: dict[str, PoolPart]  # pool name -> how its page is a part of a bundle
    rank_v2: str
    revision: str | None

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A host pool the v2 calls name (`kv`, `mamba`, `swa`, `indexer`, DeepSeek V4's, ...): how one page of it
        becomes one part of a bundle (PoolPart). A pool whose page cannot be stored is logged and left out: a
        v2 call naming it stores nothing and answers False (its pages are recomputed)."""
        if not hasattr(self, "registered_pools"):
            self.registered_pools: dict[Any, Any] = {}
        self.registered_pools[host_pool_name] = host_pool
        name = pool_name(host_pool_name)
        try:
            self.parts[name] = PoolPart.of(name, host_pool)
        except (ConfigError, ValueError, TypeError) as exc:
            self.parts.pop(name, None)
            log.error(
                "kvstore HiCache storage: host pool %r cannot be stored (%s); its v2 calls store nothing", name, exc
            )
            return
        log.info("kvstore HiCache storage: v2 pool %s", self.parts[name].describe())

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Per transfer, per key: True only when the node holds that page's bundle, every pool's part of it (the
        pools of this call that name the key, one atomic page). A transfer of a pool this backend cannot store,
        or whose host indices do not match its keys, stores nothing of the call (logged, all False)."""
        out = {t.name: [False] * len(t.keys or ()) for t in transfers}
        plan = self._plan(transfers, "batch_set_v2")
        if plan is None:
            return out
        parent = self._parent(extra_info, 1)
        for group in plan:
            ns, layout = self._bundle(group.pools)
            pages = [{name: self._part_buffers(group, name, j, for_write=False) for name in group.pools}
                     for j in range(len(group.keys))]  # fmt: skip
            chain = [parent] if parent else []
            done = self.store.put_bundle(ns, layout, [key_bytes(k) for k in group.keys], pages, chain)
            self._after_store(extra_info, ns, [key_bytes(k) for k in group.keys], done.held, end=False)
            for t, positions in group.members:
                for j, pos in enumerate(positions):
                    out[t.name][pos] = done.held[j]
        self._after_store(extra_info, "", [], ())
        return out

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Per transfer, per key: True for the pages of the longest stored prefix, every pool's part of each
        landed in its host pool (all of a page's pools or none of them), False after it."""
        out = {t.name: [False] * len(t.keys or ()) for t in transfers}
        plan = self._plan(transfers, "batch_get_v2")
        if plan is None:
            return out
        for group in plan:
            ns, layout = self._bundle(group.pools)
            pages = [{name: self._part_buffers(group, name, j, for_write=True) for name in group.pools}
                     for j in range(len(group.keys))]  # fmt: skip
            landed = self.store.get_bundle_into(ns, layout, [key_bytes(k) for k in group.keys], pages)
            for j in range(landed):
                self._settle_flat(group, j, pages[j])
            for t, positions in group.members:
                for j, pos in enumerate(positions):
                    out[t.name][pos] = j < landed
        return out

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[Any] | None = None, extra_info: Any = None) -> Any:
        """SGLang's PoolTransferResult: the KV prefix (as `batch_exists`), each pool's hit boundary under its hit
        policy, and the prefix lengths every pool can restore (ALL_PAGES: a prefix Lookup; TRAILING_PAGES: the
        last N pages before a length, probed from the longest down, at most MAX_TRAILING_PROBES Lookups per
        pool: a length not probed is reported not restorable, the safe side)."""
        transfers = list(pool_transfers or ())
        kv_pages = self.batch_exists(keys, extra_info) if keys else 0
        hits: dict[Any, int] = {POOL_KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        hashes = [key_bytes(k) for k in keys[:kv_pages]]
        for pools, members in exists_groups(transfers, len(keys)):
            if any(p not in self.parts for p in pools):
                unknown = next(p for p in pools if p not in self.parts)
                self.store.say("v2-pool", logging.ERROR, "kvstore HiCache storage: batch_exists_v2 names pool %r, "
                               "which no registered host pool provides: no hit", unknown)  # fmt: skip
                return transfer_result(0, {}, [])
            ns, _ = self._bundle(pools)
            for t in members:
                policy = hit_policy(t)
                if policy == "all_pages":
                    boundary = self.store.lookup(ns, hashes)
                    pool_ok = set(range(1, boundary + 1))
                elif policy == "trailing_pages":
                    pool_ok = self._trailing(ns, hashes, max(1, len(t.keys or ())))
                    boundary = max(pool_ok, default=0)
                else:  # BLOCK_GROUPS: its verdict never gates the KV hit (SGLang's PoolHitPolicy)
                    continue
                if boundary:
                    hits[t.name] = boundary
                restorable &= pool_ok
        ordered = sorted(restorable)
        return transfer_result(ordered[-1] if ordered else 0, hits, ordered)

    def _trailing(self, ns: str, hashes: list[bytes], n: int) -> set[int]:
        """Prefix lengths p whose last n pages (pages [p - n, p)) are all held, probed from the longest down."""
        found: set[int] = set()
        for p in range(len(hashes), 0, -1)[:MAX_TRAILING_PROBES]:
            window = hashes[max(0, p - n) : p]
            if self.store.lookup(ns, window) == len(window):
                found.add(p)
        return found

    def _plan(self, transfers: list[Any], op: str) -> list[Group] | None:
        """The bundles of one v2 call: runs of consecutive keys named by the same pools; None (logged) when a
        pool is unknown or a transfer's host indices do not cover its keys."""
        for t in transfers:
            name = pool_name(t.name)
            if name not in self.parts or name not in self._pools():
                self.store.say("v2-pool", logging.ERROR, "kvstore HiCache storage: %s names pool %r, which no "
                               "registered host pool provides: nothing stored or loaded", op, name)  # fmt: skip
                return None
            want = len(t.keys or ()) * self.parts[name].page_size
            got = 0 if t.host_indices is None else int(t.host_indices.numel())
            if got != want:
                self.store.say("v2-indices", logging.ERROR, "kvstore HiCache storage: %s pool %r: %d host indices "
                               "for %d keys (%d expected): nothing stored or loaded", op, name, got,
                               len(t.keys or ()), want)  # fmt: skip
                return None
        return call_groups(transfers)

    def _pools(self) -> dict[str, Any]:
        pools = {pool_name(k): v for k, v in getattr(self, "registered_pools", {}).items()}
        if self.mem_pool_host is not None:
            pools.setdefault(POOL_KV, self.mem_pool_host)
        return pools

    def _bundle(self, pools: tuple[str, ...]) -> tuple[str, PageLayout]:
        """The namespace and bundle layout of pages made of these pools' parts (in this order)."""
        parts = [self.parts[p] for p in pools]
        model, prefix = getattr(self.config, "model_name", None), self.settings.namespace_prefix
        return bundle_namespace(prefix, model, parts, self.rank_v2, self.revision), bundle_layout(parts)

    def _part_buffers(self, group: Group, name: str, j: int, *, for_write: bool) -> Any:
        """The host memory of key j's page in pool `name`: its regions (zero copy), or for a pool without them
        a flat page (SGLang's get_data_page when storing; a scratch page to set from when loading)."""
        part, pool = self.parts[name], self._pools()[name]
        index = group.indices[name][j]
        if part.mode == MODE_REGIONS:
            ptrs, sizes = pool.get_page_buffer_meta(index)
            return [
                np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(a)) for a, n in zip(ptrs, sizes, strict=True)
            ]
        if for_write:
            return byte_view(pool.get_dummy_flat_data_page())
        return byte_view(pool.get_data_page(int(index[0]), flat=True).contiguous())

    def _settle_flat(self, group: Group, j: int, parts: dict[str, Any]) -> None:
        """Pools without zero-copy regions: copy the landed flat page into the pool (SGLang's own call)."""
        for name in group.pools:
            if self.parts[name].mode == MODE_FLAT:
                import torch

                self._pools()[name].set_from_flat_data_page(
                    int(group.indices[name][j][0]), torch.from_numpy(parts[name])
                )
