"""kvstore as SGLang HiCache's L3 storage: a `HiCacheStorage` loaded by `--hicache-storage-backend dynamic`.

Written against SGLang 0.5.23 (PyPI wheel `sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl`):
`python/sglang/srt/mem_cache/hicache_storage.py` (sha256 96b044b8...d67ed), the dynamic loader in
`storage/backend_factory.py` and the calls of `managers/cache_controller.py`; cross-checked against
sgl-project/sglang@001067ff (main, same interface). SGLang itself does not install on this machine (it pins
CUDA packages), but its HiCache code does without them: tests/engines/test_sglang_hicache_real.py runs SGLang's
own factory, host pools and HiCacheController (v1 and v2 calls) in a side venv (tools/sglang_venv.sh);
tests/integration/test_sglang_hicache.py reproduces the same call sequence in the project's venv. No SGLang
engine has run against this module (its CPU engine needs sgl-kernel's CPU build, which PyPI does not carry).

Launch (kvstore node on this host at 127.0.0.1:50051):

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-mem-layout page_first --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
            "module_path": "kvstore.integrations.sglang_hicache", "class_name": "KVStoreHiCacheStorage",
            "interface_v1": 1, "url": "kvstore://127.0.0.1:50051"}'

`interface_v1: 1` makes SGLang call the zero-copy `batch_get_v1` / `batch_set_v1` (pages move between the node
and SGLang's host memory pool with no staging on planes that cross a socket, and with one copy more on the
same-host plane, whose node can write only the client's registered memory: RemoteStore.get_into). Without it
SGLang calls the older `batch_get` / `batch_set` with one flat tensor per page (one copy more, in SGLang).
Other keys (all optional, as for the LMCache plugin): `url` (required: `kvstore://host:port`, or
`kvstore+redis://host:port/db` for a cluster), `namespace_prefix` (default `sglang`), `timeout`,
`lookup_timeout`, `transport`, `token`, `token_file`, `tls_ca`, `tls_cert`, `tls_key`, `tls_server_name`,
`local_node`, `down_backoff`, `model_revision`.

Mapping (v1):
- namespace: `{prefix}/sgl1/{model}[@{revision}]/{pool class}/{layout}/{kv dtype}/{geometry}/p{page}/{rank}/{mode}`
  where revision is the weights' identity where it is known (`engine_revision`: the extra config's
  `model_revision`, else the storage config's `model_identity_hash` in SGLang builds that have one, else the
  server's `--revision`), kv dtype the device pool's KV dtype (the host pool keeps fp8 as uint8), rank is
  `tp{r}of{n}` (`mla` for MLA models: every TP rank holds the same KV, one rank writes), plus pp/cp/dcp when
  used, and mode is `seg{n}x{bytes}` (zero-copy: each page as its n contiguous regions in the host pool, one
  kvstore page each) or `flat{bytes}` (the older calls: one kvstore page per flat page). A model, revision,
  layout, dtype, page size, shape or rank mismatch is therefore a cold miss, never wrong KV; a namespace longer
  than the node's limit keeps its readable head and a 16-hex digest of the rest. SGLang 0.5.23 hands storage
  no cache salt or LoRA id (its page keys hash the tokens alone): `namespace_prefix` per deployment, or a
  kvstore tenant per token, keeps those apart.
- hashes: SGLang's page key is the hex SHA-256 of the token prefix (`get_hash_str`): region 0 of a page
  is stored under those 32 bytes, region j > 0 under SHA-256(b"kvstore-sglang/v1\\x00" || key || u32le(j)).
  A key that is not 64 hex digits is hashed first. The regions of a batch form one chain, continuing the
  last region of the page before (`extra_info.prefix_keys`), so eviction takes chain tails first.
- `batch_exists` = the longest prefix of pages whose every region is held (one Lookup per <= 1024
  regions); `batch_get_v1` answers True for the pages of the longest stored prefix, False after it.

v2 (hybrid models: `register_mem_host_pool_v2`, `batch_set_v2` / `batch_get_v2` / `batch_exists_v2` over
SGLang's `PoolTransfer`s): each page of a call is one bundle (DESIGN.md §4.3) holding every pool's part that
the call names for its key (the KV pool `kv` too when the call names it), stored and loaded as one kvstore page:
all of a page's pools commit, or none; a get lands them all, or the page is a miss. A pool's part is its page's
`get_page_buffer_meta` regions in order (zero copy), or for a pool without regions its flat page
(`get_data_page` / `set_from_flat_data_page`, one copy). Namespaces: `{prefix}/sgl2/{model}[@{revision}]/{tp
rank}/{pool+pool...}/{digest of every part's geometry}` (the TP rank always: a Mamba state is TP-sharded even
beside replicated MLA KV). SGLang groups a call's pools by how many trailing keys they carry
(`_trailing_chain_groups`) in both directions, so a page's bundle is read with the pools it was written with;
`batch_exists_v2` reads the same groups: ALL_PAGES by one prefix Lookup, TRAILING_PAGES by probing the last N
pages before each length, longest first (MAX_TRAILING_PROBES Lookups per pool; a length not probed is not
restorable: the safe side); BLOCK_GROUPS never gates the hit. A transfer naming a pool no host pool provides,
or host indices that do not cover its keys, stores and loads nothing of the call (logged, all False).

Failures (node down, wrong token, a namespace bound to another layout, a full node): a logged miss
(`batch_exists` 0, `get` None, `batch_get_v1` False) or a failed store, never an exception into SGLang's
storage threads (kvstore/integrations/remote.py says which line each logs). `batch_set_v1` answers per page
what the node holds afterwards (kvstore/integrations/outcome.py): a page a full node did not admit is False,
so SGLang never moves its backup past a page the node did not keep.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import math
import struct
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvstore.hashing import MAX_NAMESPACE_BYTES
from kvstore.integrations.direct import ConfigError, byte_view, engine_settings, opaque_layout
from kvstore.integrations.hints import HintError, SessionHints, from_sglang
from kvstore.integrations.lanes import DEPTH, Lanes, slices
from kvstore.integrations.lmcache_mapping import PluginSettings, model_part
from kvstore.integrations.outcome import Stored, pages_held
from kvstore.integrations.remote import RemoteStore
from kvstore.layout import PageLayout

try:  # Inside SGLang the loader requires a subclass of its ABC; without SGLang (tests) a plain base.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:  # pragma: no cover - exercised where SGLang is installed
    _Base = object  # type: ignore[assignment,misc]

log = logging.getLogger("kvstore.sglang")

SGLANG_RELEASE = "0.5.23"
SEGMENT_TAG = b"kvstore-sglang/v1\x00"
MAX_REGIONS_PER_CALL = 1024  # below the node's max_pages_per_request default (4096)
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1"}  # SGLang's own extra_config keys
# The fetch budget (this door's keys): SGLang discards a prefetch from storage that completes after
# prefetch_timeout_base + prefetch_timeout_per_ki_token x tokens / 1024 seconds (its defaults 1.0 and 0.25; SGLang
# pops its own keys before the backend sees its extra_config, so the door takes them again under these names).
_BUDGET_KEYS = {"fit_fetch_budget": True, "fetch_budget_base": 1.0, "fetch_budget_per_ki_token": 0.25}
_DIGEST_HEX = 16


def parse_extra_config(extra: dict[str, Any] | None) -> PluginSettings:
    """Settings from SGLang's extra_config (keys as the LMCache plugin's); ConfigError names the key."""
    return engine_settings(
        extra, where="hicache extra_config", ignore=_SGLANG_KEYS | set(_BUDGET_KEYS), namespace_prefix="sglang"
    )


@dataclass(frozen=True, slots=True)
class FetchBudget:
    """SGLang's prefetch deadline for `pages` pages of `page_size` tokens: base + per_ki_token x tokens / 1024 s."""

    fit: bool = True
    base_s: float = 1.0
    per_ki_token_s: float = 0.25

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> FetchBudget:
        """From the extra_config's fit_fetch_budget / fetch_budget_base / fetch_budget_per_ki_token (ConfigError
        naming the key)."""
        extra = extra or {}
        fit = extra.get("fit_fetch_budget", True)
        if not isinstance(fit, bool):
            raise ConfigError(f"hicache extra_config fit_fetch_budget: true or false, got {fit!r}")
        values = []
        for k in ("fetch_budget_base", "fetch_budget_per_ki_token"):
            v = extra.get(k, _BUDGET_KEYS[k])
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"hicache extra_config {k}: a finite number of seconds >= 0, got {v!r}")
            values.append(float(v))
        return cls(fit, values[0], values[1])

    def fits(self, pages: int, page_size: int, fetch_ms: float) -> int:
        """How many of `pages` leading pages can be fetched before SGLang's deadline, at `fetch_ms` for all of them
        (the node's estimate, DESIGN.md §6.6: taken as even per page). All of them when it fits or `fit` is off."""
        if not self.fit or pages <= 0 or fetch_ms <= 0:
            return pages
        per_page_s = fetch_ms / 1000.0 / pages
        slope_s = self.per_ki_token_s * page_size / 1024.0  # budget per page
        if per_page_s * pages <= self.base_s + slope_s * pages:
            return pages
        if per_page_s <= slope_s:
            return pages  # NOTE: unreachable with a positive base; kept for base 0
        return max(0, min(pages, int(self.base_s / (per_page_s - slope_s))))


def key_bytes(key: str) -> bytes:
    """The 32-byte kvstore hash of an SGLang page key (its own digest when it is 64 hex digits)."""
    if len(key) == 64:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.sha256(key.encode()).digest()


def region_hashes(key: str, regions: int) -> list[bytes]:
    """The kvstore hashes of a page's `regions` regions: the key itself, then derived ones."""
    k = key_bytes(key)
    return [k] + [hashlib.sha256(SEGMENT_TAG + k + struct.pack("<I", j)).digest() for j in range(1, regions)]


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """What makes two host pools' pages byte-compatible, read from SGLang's host pool object."""

    pool_class: str
    layout: str
    dtype: str
    page_size: int
    shape: str  # layers, heads, head dims (whatever the pool has)
    regions: int  # contiguous regions per page in the pool (get_page_buffer_meta)
    region_bytes: int
    page_bytes: int  # a flat page (get_data_page)

    @classmethod
    def of(cls, pool: Any) -> PoolGeometry:
        import torch

        dims = [
            f"{n}{getattr(pool, a)}"
            for n, a in (
                ("L", "layer_num"),
                ("H", "head_num"),
                ("D", "head_dim"),
                ("V", "v_head_dim"),
                ("R", "kv_lora_rank"),
                ("Q", "qk_rope_head_dim"),
            )
            if getattr(pool, a, None)
        ]
        page = int(pool.page_size)
        regions, region_bytes = 0, 0
        if hasattr(pool, "get_page_buffer_meta"):
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
            regions, region_bytes = len(ptrs), (sizes[0] if len(set(sizes)) == 1 else -1)
        flat = pool.get_dummy_flat_data_page().numel() * pool.dtype.itemsize
        # NOTE: SGLang's host pool holds fp8 KV as uint8 (`dtype = device_pool.store_dtype`), so e4m3 and e5m2
        # pools look alike there; the device pool's `dtype` is the KV dtype itself.
        kv_dtype = getattr(getattr(pool, "device_pool", None), "dtype", None) or pool.dtype
        return cls(
            type(pool).__name__,
            str(pool.layout),
            str(kv_dtype).removeprefix("torch."),
            page,
            "x".join(dims) or "opaque",
            regions,
            region_bytes,
            flat,
        )


def namespace_for(
    prefix: str, model: str | None, geom: PoolGeometry, rank: str, mode: str, revision: str | None = None
) -> str:
    """The namespace of one pool's pages (module docstring); shortened with a digest when too long."""
    named = model_part((model or "model").replace(" ", "_"), revision)
    pool = f"{geom.pool_class}/{geom.layout}/{geom.dtype}/{geom.shape}/p{geom.page_size}"
    ns = f"{prefix}/sgl1/{named}/{pool}/{rank}/{mode}"
    if len(ns.encode()) <= MAX_NAMESPACE_BYTES:
        return ns
    digest = hashlib.sha256(ns.encode()).hexdigest()[:_DIGEST_HEX]
    return f"{prefix}/sgl1/{named[:48]}/{digest}/{mode}"[:MAX_NAMESPACE_BYTES]


def engine_revision(storage_config: Any, settings: PluginSettings) -> str | None:
    """The weights' identity SGLang knows, first found of: the `model_revision` key of the extra config (the
    operator's), the storage config's `model_identity_hash` (SGLang builds that carry one), the server's
    `--revision` (SGLang's process-global ServerArgs, set in the scheduler process that runs HiCache)."""
    if settings.model_revision:
        return settings.model_revision
    identity = getattr(storage_config, "model_identity_hash", None)
    if identity:
        return str(identity)
    revision = getattr(_server_args(), "revision", None)
    return str(revision) if revision else None


def _server_args() -> Any:
    """The server's ServerArgs in this process, or None (not SGLang, or not set here).

    NOTE: SGLang 0.5.23 retired `server_args.get_global_server_args()` (it raises RuntimeError pointing at
    `runtime_context.get_server_args()`); older builds have only the former. Found by running SGLang's own
    HiCacheController in tests/engines/test_sglang_hicache_real.py."""
    try:
        from sglang.srt.runtime_context import get_server_args
    except (ImportError, AttributeError):
        try:
            from sglang.srt.server_args import get_global_server_args as get_server_args
        except (ImportError, AttributeError):
            return None
    try:
        return get_server_args()
    except (ValueError, AttributeError, RuntimeError, LookupError):
        return None


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
    digest = hashlib.sha256(";".join(p.describe() for p in parts).encode()).hexdigest()[:_DIGEST_HEX]
    pools = "+".join(p.name for p in parts)
    ns = f"{prefix}/sgl2/{named}/{rank}/{pools}/{digest}"
    if len(ns.encode()) <= MAX_NAMESPACE_BYTES:
        return ns
    return f"{prefix}/sgl2/{named[:48]}/{rank}/{hashlib.sha256(ns.encode()).hexdigest()[:_DIGEST_HEX]}"[
        :MAX_NAMESPACE_BYTES
    ]


@dataclass(slots=True)
class _Group:
    """One bundle run of a v2 call: consecutive keys each named by exactly `pools` (sorted), with each pool's
    host indices per key and where each transfer's keys sit in the run."""

    pools: tuple[str, ...]
    keys: list[str]
    indices: dict[str, list[Any]]
    members: list[tuple[Any, list[int]]]


def _groups(transfers: list[Any]) -> list[_Group]:
    """Runs of keys (in order of first appearance) that the same pools name; pure."""
    order: list[str] = []
    where: dict[str, list[tuple[int, int]]] = {}  # key -> (transfer index, position in its keys)
    for ti, t in enumerate(transfers):
        for pos, k in enumerate(t.keys or ()):
            if k not in where:
                order.append(k)
                where[k] = []
            where[k].append((ti, pos))
    groups: list[_Group] = []
    for k in order:
        pools = tuple(sorted(pool_name(transfers[ti].name) for ti, _ in where[k]))
        if not groups or groups[-1].pools != pools:
            groups.append(_Group(pools, [], {p: [] for p in pools}, []))
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


def _exists_groups(transfers: list[Any], span: int) -> list[tuple[tuple[str, ...], list[Any]]]:
    """The pool sets an exists query reads, as SGLang groups its v2 calls: transfers with the same number of
    trailing keys (a transfer without keys covers the whole span) travel together (`_trailing_chain_groups`)."""
    by_len: dict[int, list[Any]] = {}
    for t in transfers:
        by_len.setdefault(len(t.keys) if t.keys else span, []).append(t)
    return [(tuple(sorted(pool_name(t.name) for t in ts)), ts) for ts in by_len.values()]


def _bytes_at(address: int, nbytes: int) -> np.ndarray:
    """A writable uint8 view of `nbytes` of an engine's host memory at `address` (SGLang's page buffer meta)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def _policy(transfer: Any) -> str:
    return str(getattr(transfer.hit_policy, "value", transfer.hit_policy or "all_pages"))


def _transfer_result(kv_hit_pages: int, hits: dict[Any, int], restorable: list[int]) -> Any:
    """SGLang's PoolTransferResult where SGLang is installed, else the same fields in a plain object."""
    try:
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult
    except ImportError:
        return SimpleNamespace(kv_hit_pages=kv_hit_pages, extra_pool_hit_pages=hits, restorable_prefix_pages=restorable)
    return PoolTransferResult(kv_hit_pages, hits, restorable)


class KVStoreHiCacheStorage(_Base):  # type: ignore[misc,valid-type]
    """SGLang HiCache L3 storage on a kvstore node or cluster. Constructed by SGLang's factory as
    `cls(storage_config, kwargs)`; `register_mem_pool_host` must come before any page call (SGLang calls
    it right after construction)."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.settings = parse_extra_config(extra)
        self.budget = FetchBudget.parse(extra)
        self.v1 = bool(int(extra.get("interface_v1", 0) or 0))  # SGLang's switch to the zero-copy calls
        self.config = storage_config
        self.store = RemoteStore(self.settings, log, setting_prefix="extra_config ")
        # A batch's pages move as calls in flight (lanes.py); gets and sets on lanes of their own, since SGLang
        # calls them from different threads (prefetch, backup) and a slow set must not hold a prefetch.
        self._get_lanes = Lanes("sglang-get-lane", DEPTH)
        self._set_lanes = Lanes("sglang-set-lane", DEPTH)
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        self.rank = self._rank_part(storage_config)
        self.revision = engine_revision(storage_config, self.settings)
        self.writer = bool(
            getattr(storage_config, "is_storage_writer", (not self.is_mla) or storage_config.tp_rank == 0)
        )
        self.mem_pool_host: Any = None
        self.geometry: PoolGeometry | None = None
        self._seg_ns = self._flat_ns = ""
        self._seg_layout: PageLayout | None = None
        self._flat_layout: PageLayout | None = None
        self.parts: dict[str, PoolPart] = {}  # v2: pool name -> how its page is a part of a bundle
        self.rank_v2 = self._rank_part(storage_config, sharded=True)
        log.info(
            "kvstore HiCache storage: %s, %s (SGLang interface %s)",
            self.settings.target.describe(),
            self.rank,
            SGLANG_RELEASE,
        )

    @staticmethod
    def _rank_part(cfg: Any, *, sharded: bool = False) -> str:
        """The rank in a namespace: `mla` for an MLA model's replicated KV (v1), else `tp{r}of{n}`; `sharded`: the
        TP rank always (v2 bundles: a Mamba state is TP-sharded even beside replicated MLA KV)."""
        mla = getattr(cfg, "is_mla_model", False) and not sharded
        parts = ["mla"] if mla else [f"tp{cfg.tp_rank}of{cfg.tp_size}"]
        if getattr(cfg, "pp_size", 1) > 1:
            parts.append(f"pp{cfg.pp_rank}of{cfg.pp_size}")
        if getattr(cfg, "attn_cp_size", 1) > 1:
            parts.append(f"cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}")
        if getattr(cfg, "dcp_size", 1) > 1:
            parts.append(f"dcp{cfg.dcp_rank}of{cfg.dcp_size}")
        return "-".join(parts)

    # -- SGLang's registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        with contextlib.suppress(ConfigError, ValueError, TypeError):  # the v1 calls still serve it as before
            self.parts[POOL_KV] = PoolPart.of(POOL_KV, mem_pool_host)  # the anchor: `kv` in v2 calls
        g = self.geometry = PoolGeometry.of(mem_pool_host)
        model, prefix = getattr(self.config, "model_name", None), self.settings.namespace_prefix
        self._flat_ns = namespace_for(prefix, model, g, self.rank, f"flat{g.page_bytes}", self.revision)
        self._flat_layout = opaque_layout(g.page_bytes)
        if g.regions > 0 and g.region_bytes > 0:
            mode = f"seg{g.regions}x{g.region_bytes}"
            self._seg_ns = namespace_for(prefix, model, g, self.rank, mode, self.revision)
            self._seg_layout = opaque_layout(g.region_bytes)
        log.info(
            "kvstore HiCache storage: pool %s %s, page %d tokens, %d region(s) of %d bytes; namespace %s",
            g.pool_class,
            g.layout,
            g.page_size,
            g.regions,
            g.region_bytes,
            self._seg_ns or self._flat_ns,
        )

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

    def on_host_pools_registered(self) -> None:
        if self.mem_pool_host is None:
            raise RuntimeError("kvstore HiCache storage: no host pool registered (register_mem_pool_host)")

    # -- zero-copy interface (SGLang's `interface_v1`)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of `keys` are held whole (every region), and can be fetched before SGLang's
        prefetch deadline by the node's own estimate (FetchBudget; DESIGN.md §6.6): a page that would arrive after
        it would be discarded, so it is reported a miss and recomputed instead. A request naming its session
        resumes it first (its pages back toward DRAM)."""
        if not keys:
            return 0
        hints = self._hints(extra_info)
        if hints is not None and hints.resume:
            self.store.resume(hints)
        ns, per = self._existence_namespace()
        hashes = [h for k in keys for h in region_hashes(k, per)]
        matched, fetch_ms = 0, 0.0
        for a in range(0, len(hashes), MAX_REGIONS_PER_CALL):
            part = hashes[a : a + MAX_REGIONS_PER_CALL]
            n, ms = self.store.lookup_estimate(ns, part)
            matched, fetch_ms = matched + n, fetch_ms + ms
            if n < len(part):
                break
        pages = matched // per
        page_size = self.geometry.page_size if self.geometry is not None else 1
        fit = self.budget.fits(pages, page_size, fetch_ms * pages * per / matched if matched else 0.0)
        if fit < pages:
            self.store.say("budget", logging.INFO, "kvstore HiCache storage: %d of %d held pages reported (the node "
                           "expects %.0f ms for them; SGLang's deadline is %.2f s + %.2f s per 1024 tokens)",
                           fit, pages, fetch_ms, self.budget.base_s, self.budget.per_ki_token_s)  # fmt: skip
        return fit

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Pages straight into the host pool at `host_indices` (page_size indices per key); True for the
        pages of the longest stored prefix."""
        if not keys:
            return []
        ns, layout = self._segments()
        views = self._region_views(host_indices, len(keys))
        per = len(views) // len(keys)
        hashes = [h for k in keys for h in region_hashes(k, per)]
        landed, short = 0, False

        def get(ab: tuple[int, int]) -> int:
            a, b = ab
            return 0 if short else len(self.store.get_into(ns, hashes[a:b], views[a:b]))

        cuts = self._calls(len(keys), per, layout.page_bytes)
        for (a, b), got in zip(cuts, self._get_lanes.ordered(get, cuts), strict=True):  # consumed whole: lanes.py
            if not short:
                landed += got
                short = got < b - a
        full = landed // per
        return [i < full for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Pages straight out of the host pool; per page, True only when the node holds every region of it
        (stored now or already held), False for a page it refused (a full node that did not admit it) or could
        not be reached for. A call that failed a page ends the batch: the pages after it are False, not sent."""
        if not keys:
            return []
        if not self.writer:
            return [True] * len(keys)  # MLA: one rank writes the pages every rank holds
        ns, layout = self._segments()
        views = self._region_views(host_indices, len(keys))
        per = len(views) // len(keys)
        hashes = [h for k in keys for h in region_hashes(k, per)]
        parent = self._parent(extra_info, per)
        held: list[bool] = []
        failed = False

        def put(ab: tuple[int, int]) -> Stored | None:
            if failed:
                return None  # a page of the batch failed: the pages after it are not sent
            a, b = ab
            first_parent = parent if a == 0 else hashes[a - 1]
            return self.store.put_from(ns, layout, hashes[a:b], views[a:b], [first_parent] if first_parent else ())

        cuts = self._calls(len(keys), per, layout.page_bytes)
        for done in self._set_lanes.ordered(put, cuts):  # consumed whole: lanes.py
            if done is None or failed:
                continue
            held += done.held
            failed = not done.ok
        held += [False] * (len(hashes) - len(held))
        self._after_store(extra_info, ns, hashes, held)
        return pages_held(held, per)

    # -- v2: a page's pools as one bundle (DESIGN.md §4.3)

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
        for pools, members in _exists_groups(transfers, len(keys)):
            if any(p not in self.parts for p in pools):
                unknown = next(p for p in pools if p not in self.parts)
                self.store.say("v2-pool", logging.ERROR, "kvstore HiCache storage: batch_exists_v2 names pool %r, "
                               "which no registered host pool provides: no hit", unknown)  # fmt: skip
                return _transfer_result(0, {}, [])
            ns, _ = self._bundle(pools)
            for t in members:
                policy = _policy(t)
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
        return _transfer_result(ordered[-1] if ordered else 0, hits, ordered)

    def _trailing(self, ns: str, hashes: list[bytes], n: int) -> set[int]:
        """Prefix lengths p whose last n pages (pages [p - n, p)) are all held, probed from the longest down."""
        found: set[int] = set()
        for p in range(len(hashes), 0, -1)[:MAX_TRAILING_PROBES]:
            window = hashes[max(0, p - n) : p]
            if self.store.lookup(ns, window) == len(window):
                found.add(p)
        return found

    def _plan(self, transfers: list[Any], op: str) -> list[_Group] | None:
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
        return _groups(transfers)

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

    def _part_buffers(self, group: _Group, name: str, j: int, *, for_write: bool) -> Any:
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

    def _settle_flat(self, group: _Group, j: int, parts: dict[str, Any]) -> None:
        """Pools without zero-copy regions: copy the landed flat page into the pool (SGLang's own call)."""
        for name in group.pools:
            if self.parts[name].mode == MODE_FLAT:
                import torch

                self._pools()[name].set_from_flat_data_page(
                    int(group.indices[name][j][0]), torch.from_numpy(parts[name])
                )

    # -- the older interface (flat pages; SGLang still calls it without interface_v1)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0] if got else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Flat pages into `target_locations` (SGLang passes one flat tensor per key); None after the
        longest stored prefix."""
        if not keys:
            return []
        ns, _layout = self._flat()
        targets = list(target_locations) if target_locations is not None else [self._dummy() for _ in keys]
        got = len(self.store.get_into(ns, [key_bytes(k) for k in keys], [byte_view(t) for t in targets]))
        return [targets[i] if i < got else None for i in range(len(keys))]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if not keys:
            return True
        if not self.writer:
            return True
        ns, layout = self._flat()
        views = [byte_view(v.contiguous()) for v in values]
        if any(v.nbytes != layout.page_bytes for v in views):
            log.error(
                "kvstore HiCache storage: flat pages of %s bytes, expected %d: nothing stored",
                sorted({v.nbytes for v in views}),
                layout.page_bytes,
            )
            return False
        return self.store.put_from(ns, layout, [key_bytes(k) for k in keys], views).ok  # every page held

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """Nothing: pages of other engines share the node; they age out by its eviction policy."""

    def get_stats(self) -> Any:
        return None

    def close(self) -> None:
        self._get_lanes.close()
        self._set_lanes.close()
        self.store.close()

    # -- retention (DESIGN.md §6.5; the hints' schema: kvstore/integrations/hints.py)

    def _hints(self, extra_info: Any) -> SessionHints | None:
        """The request's retention hints: SGLang's `extra_info.extra_info` (its `session_id`, and kvstore.<key>);
        a bad one is logged, never raised into SGLang's storage threads."""
        values = getattr(extra_info, "extra_info", None) if extra_info is not None else None
        if not values:
            return None
        try:
            return from_sglang(values)
        except HintError as exc:
            self.store.say("hints", logging.ERROR, "kvstore HiCache storage: %s; no retention for this call", exc)
            return None

    def _after_store(self, extra_info: Any, ns: str, hashes: list[bytes], held: Any, *, end: bool = True) -> None:
        """The pages a session's call stored, retained for it; with `end` (its last store) and the hint's end
        flag, the session ends instead."""
        hints = self._hints(extra_info)
        if hints is None:
            return
        kept = [h for h, ok in zip(hashes, held, strict=True) if ok]
        if kept and not hints.end:
            self.store.retain(ns, kept, hints)
        if end and hints.end:
            self.store.end_session(hints.session)

    # -- helpers

    def _existence_namespace(self) -> tuple[str, int]:
        if self.v1:  # SGLang then calls batch_get_v1 / batch_set_v1: the regions' namespace
            assert self.geometry is not None
            return self._segments()[0], self.geometry.regions
        return self._flat()[0], 1

    def _segments(self) -> tuple[str, PageLayout]:
        if not self._seg_ns or self._seg_layout is None:
            raise RuntimeError(
                "kvstore HiCache storage: this host pool has no uniform zero-copy regions "
                "(get_page_buffer_meta); run without interface_v1"
            )
        return self._seg_ns, self._seg_layout

    def _flat(self) -> tuple[str, PageLayout]:
        if self._flat_layout is None:
            raise RuntimeError("kvstore HiCache storage: register_mem_pool_host was not called")
        return self._flat_ns, self._flat_layout

    def _dummy(self) -> Any:
        return self.mem_pool_host.get_dummy_flat_data_page()

    def _region_views(self, host_indices: Any, pages: int) -> list[np.ndarray]:
        """Writable byte views over the host pool's regions of these pages (SGLang's own page meta)."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) % pages or (self.geometry and len(ptrs) != pages * self.geometry.regions):
            raise ValueError(f"host_indices: {len(ptrs)} regions for {pages} pages")
        return [_bytes_at(p, n) for p, n in zip(ptrs, sizes, strict=True)]

    @staticmethod
    def _calls(pages: int, per: int, region_bytes: int) -> list[tuple[int, int]]:
        """[a, b) region ranges of whole pages, at most MAX_REGIONS_PER_CALL regions and about SLICE_BYTES each (the
        calls a batch keeps in flight: integrations/lanes.py)."""
        cuts = slices(pages, per * region_bytes, max_pages=max(1, MAX_REGIONS_PER_CALL // per))
        return [(a * per, b * per) for a, b in cuts]

    @staticmethod
    def _parent(extra_info: Any, per: int) -> bytes | None:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        return region_hashes(prefix[-1], per)[-1] if prefix else None
