"""kvstore as SGLang HiCache's L3 storage: a `HiCacheStorage` loaded by `--hicache-storage-backend dynamic`.

Written against SGLang 0.5.23 (PyPI wheel `sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl`):
`python/sglang/srt/mem_cache/hicache_storage.py` (sha256 96b044b8...d67ed), the dynamic loader in
`storage/backend_factory.py` and the calls of `managers/cache_controller.py`; cross-checked against
sgl-project/sglang@001067ff (main, same interface). SGLang itself does not install on this machine (it pins
CUDA packages), so the tests reproduce its call sequence and host memory pool shapes against a real node
(tests/integration/test_sglang_hicache.py); no SGLang engine has run against this module.

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

Failures (node down, wrong token, a namespace bound to another layout, a full node): a logged miss
(`batch_exists` 0, `get` None, `batch_get_v1` False) or a failed store, never an exception into SGLang's
storage threads (kvstore/integrations/remote.py says which line each logs). `batch_set_v1` answers per page
what the node holds afterwards (kvstore/integrations/outcome.py): a page a full node did not admit is False,
so SGLang never moves its backup past a page the node did not keep.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.hashing import MAX_NAMESPACE_BYTES
from kvstore.integrations.direct import byte_view, engine_settings, opaque_layout
from kvstore.integrations.lmcache_mapping import PluginSettings, model_part
from kvstore.integrations.outcome import pages_held
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
_DIGEST_HEX = 16


def parse_extra_config(extra: dict[str, Any] | None) -> PluginSettings:
    """Settings from SGLang's extra_config (keys as the LMCache plugin's); ConfigError names the key."""
    return engine_settings(extra, where="hicache extra_config", ignore=_SGLANG_KEYS, namespace_prefix="sglang")


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
    try:
        from sglang.srt.server_args import get_global_server_args

        revision = getattr(get_global_server_args(), "revision", None)
    except (ImportError, ValueError, AttributeError):  # not SGLang, or its server args are not set in this process
        return None
    return str(revision) if revision else None


class KVStoreHiCacheStorage(_Base):  # type: ignore[misc,valid-type]
    """SGLang HiCache L3 storage on a kvstore node or cluster. Constructed by SGLang's factory as
    `cls(storage_config, kwargs)`; `register_mem_pool_host` must come before any page call (SGLang calls
    it right after construction)."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.settings = parse_extra_config(extra)
        self.v1 = bool(int(extra.get("interface_v1", 0) or 0))  # SGLang's switch to the zero-copy calls
        self.config = storage_config
        self.store = RemoteStore(self.settings, log, setting_prefix="extra_config ")
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
        log.info(
            "kvstore HiCache storage: %s, %s (SGLang interface %s)",
            self.settings.target.describe(),
            self.rank,
            SGLANG_RELEASE,
        )

    @staticmethod
    def _rank_part(cfg: Any) -> str:
        parts = ["mla"] if getattr(cfg, "is_mla_model", False) else [f"tp{cfg.tp_rank}of{cfg.tp_size}"]
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
        """Extra pools (Mamba, SWA, indexer) are not stored: their v2 calls are not implemented."""
        if not hasattr(self, "registered_pools"):
            self.registered_pools: dict[Any, Any] = {}
        self.registered_pools[host_pool_name] = host_pool

    def on_host_pools_registered(self) -> None:
        if self.mem_pool_host is None:
            raise RuntimeError("kvstore HiCache storage: no host pool registered (register_mem_pool_host)")

    # -- zero-copy interface (SGLang's `interface_v1`)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of `keys` are held whole (every region)."""
        if not keys:
            return 0
        ns, per = self._existence_namespace()
        hashes = [h for k in keys for h in region_hashes(k, per)]
        matched = 0
        for a in range(0, len(hashes), MAX_REGIONS_PER_CALL):
            part = hashes[a : a + MAX_REGIONS_PER_CALL]
            n = self.store.lookup(ns, part)
            matched += n
            if n < len(part):
                break
        return matched // per

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Pages straight into the host pool at `host_indices` (page_size indices per key); True for the
        pages of the longest stored prefix."""
        if not keys:
            return []
        ns, _layout = self._segments()
        views = self._region_views(host_indices, len(keys))
        per = len(views) // len(keys)
        hashes = [h for k in keys for h in region_hashes(k, per)]
        landed = 0
        for a, b in self._calls(len(keys), per):
            got = len(self.store.get_into(ns, hashes[a:b], views[a:b]))
            landed += got
            if got < b - a:
                break
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
        for a, b in self._calls(len(keys), per):
            first_parent = parent if a == 0 else hashes[a - 1]
            done = self.store.put_from(ns, layout, hashes[a:b], views[a:b], [first_parent] if first_parent else ())
            held += done.held
            if not done.ok:
                break
        held += [False] * (len(hashes) - len(held))
        return pages_held(held, per)

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
        self.store.close()

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
        return [np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(p)) for p, n in zip(ptrs, sizes, strict=True)]

    @staticmethod
    def _calls(pages: int, per: int) -> list[tuple[int, int]]:
        """[a, b) region ranges of whole pages, at most MAX_REGIONS_PER_CALL regions each."""
        step = max(1, MAX_REGIONS_PER_CALL // per) * per
        return [(a, min(a + step, pages * per)) for a in range(0, pages * per, step)]

    @staticmethod
    def _parent(extra_info: Any, per: int) -> bytes | None:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        return region_hashes(prefix[-1], per)[-1] if prefix else None
