"""How the SGLang HiCache door's v2 calls map a page's pools onto one kvstore bundle (DESIGN.md §4.3). Pure
planning: which keys of a call travel together, under which namespace and layout; the calls themselves are
`KVStoreHiCacheStorage`'s (sglang_hicache.py).

v2 (hybrid models: `register_mem_host_pool_v2`, `batch_set_v2` / `batch_get_v2` / `batch_exists_v2` over
SGLang's `PoolTransfer`s): each page of a call is one bundle (DESIGN.md §4.3) holding every pool's part that
the call names for its key (the KV pool `kv` too when the call names it), stored and loaded as one kvstore page:
all of a page's pools commit, or none; a get lands them all, or the page is a miss. A pool's part is its page's
`get_page_buffer_meta` regions in order (zero copy), or for a pool without regions its flat page
(`get_data_page` / `set_from_flat_data_page`, one copy). Namespaces: `{prefix}/sgl2/{model}[@{revision}]/{tp
rank}/{pool+pool...}/{digest of every part's geometry}` (the TP rank always: a Mamba state is TP-sharded even
beside replicated MLA KV). SGLang groups a call's pools by how many trailing keys they carry
(`_trailing_chain_groups`; `exists_groups` here) in both directions, so a page's bundle is read with the pools
it was written with;
`batch_exists_v2` reads the same groups: ALL_PAGES by one prefix Lookup, TRAILING_PAGES by probing the last N
pages before each length, longest first (MAX_TRAILING_PROBES Lookups per pool; a length not probed is not
restorable: the safe side); BLOCK_GROUPS never gates the hit. A transfer naming a pool no host pool provides,
or host indices that do not cover its keys, stores and loads nothing of the call (logged, all False).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from kvstore.hashing import MAX_NAMESPACE_BYTES
from kvstore.integrations.direct import opaque_layout
from kvstore.integrations.lmcache_mapping import model_part
from kvstore.integrations.sglang_mapping import DIGEST_HEX, PoolGeometry
from kvstore.layout import PageLayout

POOL_KV = "kv"  # SGLang's PoolName.KV: the anchor pool (register_mem_pool_host)
MODE_REGIONS = "regions"  # a pool page's bytes: its get_page_buffer_meta regions, in order (zero copy)
MODE_FLAT = "flat"  # its get_data_page(flat=True) bytes (pools without regions: one copy, as SGLang's file backend)
# NOTE: a TRAILING_PAGES pool (a Mamba state at node boundaries) is present at a few prefix lengths only, and a
# Lookup answers prefixes, not single pages: one Lookup per length probed (~0.3 ms on loopback), longest first.
MAX_TRAILING_PROBES = 16


def pool_name(name: Any) -> str:
    """SGLang's PoolName (a str Enum) or a plain string, as the string it stands for."""
    return str(getattr(name, "value", name))


@dataclass(frozen=True, slots=True)
class PoolPart:
    """How one page of an SGLang host pool is one part of a bundle: its bytes (regions or flat), its size, and
    the geometry that makes two pools' pages byte-compatible (named in the namespace)."""

    name: str
    geometry: PoolGeometry
    mode: str
    nbytes: int
    page_size: int

    @classmethod
    def of(cls, name: str, pool: Any) -> PoolPart:
        import torch

        geom = PoolGeometry.of(pool)
        page = int(getattr(pool, "page_size", 1) or 1)
        try:
            _, sizes = pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
            mode, nbytes = MODE_REGIONS, int(sum(sizes))
        except (NotImplementedError, ValueError, AssertionError, AttributeError):
            mode, nbytes = MODE_FLAT, geom.page_bytes  # NOTE: SGLang says which pools have no regions by raising
        opaque_layout(nbytes)  # ConfigError for a size no page can have
        return cls(name, geom, mode, nbytes, page)

    def describe(self) -> str:
        g = self.geometry
        return f"{self.name}={g.pool_class}/{g.layout}/{g.dtype}/{g.shape}/p{g.page_size}/{self.mode}{self.nbytes}"


def bundle_layout(parts: list[PoolPart]) -> PageLayout:
    """The bundle of these pools' parts, in order, each opaque bytes (the geometry is in the namespace)."""
    return PageLayout.bundle({p.name: opaque_layout(p.nbytes) for p in parts}, block_size=1)


def bundle_namespace(prefix: str, model: str | None, parts: list[PoolPart], rank: str, revision: str | None) -> str:
    """`{prefix}/sgl2/{model}[@{revision}]/{rank}/{pool+pool...}/{digest}`: the digest (16 hex) covers every
    part's geometry and mode, so a change in any is a cold miss."""
    named = model_part((model or "model").replace(" ", "_"), revision)
    digest = hashlib.sha256(";".join(p.describe() for p in parts).encode()).hexdigest()[:DIGEST_HEX]
    pools = "+".join(p.name for p in parts)
    ns = f"{prefix}/sgl2/{named}/{rank}/{pools}/{digest}"
    if len(ns.encode()) <= MAX_NAMESPACE_BYTES:
        return ns
    return f"{prefix}/sgl2/{named[:48]}/{rank}/{hashlib.sha256(ns.encode()).hexdigest()[:DIGEST_HEX]}"[
        :MAX_NAMESPACE_BYTES
    ]


@dataclass(slots=True)
class Group:
    """One bundle run of a v2 call: consecutive keys each named by exactly `pools` (sorted), with each pool's
    host indices per key and where each transfer's keys sit in the run."""

    pools: tuple[str, ...]
    keys: list[str]
    indices: dict[str, list[Any]]
    members: list[tuple[Any, list[int]]]


def call_groups(transfers: list[Any]) -> list[Group]:
    """Runs of keys (in order of first appearance) that the same pools name; pure."""
    order: list[str] = []
    where: dict[str, list[tuple[int, int]]] = {}  # key -> (transfer index, position in its keys)
    for ti, t in enumerate(transfers):
        for pos, k in enumerate(t.keys or ()):
            if k not in where:
                order.append(k)
                where[k] = []
            where[k].append((ti, pos))
    groups: list[Group] = []
    for k in order:
        pools = tuple(sorted(pool_name(transfers[ti].name) for ti, _ in where[k]))
        if not groups or groups[-1].pools != pools:
            groups.append(Group(pools, [], {p: [] for p in pools}, []))
        g = groups[-1]
        g.keys.append(k)
        for ti, pos in where[k]:
            t = transfers[ti]
            name = pool_name(t.name)
            size = len(t.host_indices) // max(1, len(t.keys))
            g.indices[name].append(t.host_indices[pos * size : (pos + 1) * size])
            member = next((m for m in g.members if m[0] is t), None)
            if member is None:
                member = (t, [])
                g.members.append(member)
            member[1].append(pos)
    return groups


def exists_groups(transfers: list[Any], span: int) -> list[tuple[tuple[str, ...], list[Any]]]:
    """The pool sets an exists query reads, as SGLang groups its v2 calls: transfers with the same number of
    trailing keys (a transfer without keys covers the whole span) travel together (`_trailing_chain_groups`)."""
    by_len: dict[int, list[Any]] = {}
    for t in transfers:
        by_len.setdefault(len(t.keys) if t.keys else span, []).append(t)
    return [(tuple(sorted(pool_name(t.name) for t in ts)), ts) for ts in by_len.values()]


def hit_policy(transfer: Any) -> str:
    return str(getattr(transfer.hit_policy, "value", transfer.hit_policy or "all_pages"))


def transfer_result(kv_hit_pages: int, hits: dict[Any, int], restorable: list[int]) -> Any:
    """SGLang's PoolTransferResult where SGLang is installed, else the same fields in a plain object."""
    try:
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult
    except ImportError:
        return SimpleNamespace(kv_hit_pages=kv_hit_pages, extra_pool_hit_pages=hits, restorable_prefix_pages=restorable)
    return PoolTransferResult(kv_hit_pages, hits, restorable)
