"""What the SGLang HiCache door's keys, pools and settings are in kvstore terms (mapping v1, and the door's
extra_config). No kvstore I/O: it reads SGLang's host pool objects and ServerArgs, and computes names.

Invariant: everything that makes two pages' bytes incompatible is in the namespace, so a mismatch is a cold
miss, never wrong KV handed to SGLang (DESIGN.md §3).

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
- `batch_exists` (sglang_hicache.py) = the longest prefix of pages whose every region is held (one Lookup per <= 1024
  regions); `batch_get_v1` answers True for the pages of the longest stored prefix, False after it.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Any

from kvstore.hashing import MAX_NAMESPACE_BYTES
from kvstore.integrations.direct import ConfigError, engine_settings
from kvstore.integrations.lmcache_mapping import PluginSettings, model_part

SEGMENT_TAG = b"kvstore-sglang/v1\x00"
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1"}  # SGLang's own extra_config keys
# The fetch budget (this door's keys): SGLang discards a prefetch from storage that completes after
# prefetch_timeout_base + prefetch_timeout_per_ki_token x tokens / 1024 seconds (its defaults 1.0 and 0.25; SGLang
# pops its own keys before the backend sees its extra_config, so the door takes them again under these names).
_BUDGET_KEYS = {"fit_fetch_budget": True, "fetch_budget_base": 1.0, "fetch_budget_per_ki_token": 0.25}
DIGEST_HEX = 16  # hex digits of SHA-256 that stand for a namespace's shortened tail


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
    prefix: str, model: str | None, geom: PoolGeometry, rank: str, mode: str, *, revision: str | None = None
) -> str:
    """The namespace of one pool's pages (module docstring); shortened with a digest when too long."""
    named = model_part((model or "model").replace(" ", "_"), revision)
    pool = f"{geom.pool_class}/{geom.layout}/{geom.dtype}/{geom.shape}/p{geom.page_size}"
    ns = f"{prefix}/sgl1/{named}/{pool}/{rank}/{mode}"
    if len(ns.encode()) <= MAX_NAMESPACE_BYTES:
        return ns
    digest = hashlib.sha256(ns.encode()).hexdigest()[:DIGEST_HEX]
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
