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

Mapping: `sglang_mapping.py` (v1: namespaces, region hashes, the extra_config and the fetch budget);
`sglang_pools.py` (v2, hybrid models: `register_mem_host_pool_v2`, `batch_set_v2` / `batch_get_v2` /
`batch_exists_v2` over SGLang's `PoolTransfer`s, each page of a call one bundle of every pool it names: all of a
page's pools commit, or none). `batch_exists` = the longest prefix of pages whose every region is held (one
Lookup per <= 1024 regions); `batch_get_v1` answers True for the pages of the longest stored prefix, False
after it.

Failures (node down, wrong token, a namespace bound to another layout, a full node): a logged miss
(`batch_exists` 0, `get` None, `batch_get_v1` False) or a failed store, never an exception into SGLang's
storage threads (kvstore/integrations/remote.py says which line each logs). `batch_set_v1` answers per page
what the node holds afterwards (kvstore/integrations/outcome.py): a page a full node did not admit is False,
so SGLang never moves its backup past a page the node did not keep.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from typing import Any

import numpy as np

from kvstore.integrations.direct import ConfigError, byte_view, opaque_layout
from kvstore.integrations.hints import HintError, SessionHints, from_sglang
from kvstore.integrations.lanes import DEPTH, Lanes, slices
from kvstore.integrations.outcome import Stored, pages_held
from kvstore.integrations.remote import RemoteStore
from kvstore.integrations.sglang_mapping import (
    FetchBudget,
    PoolGeometry,
    engine_revision,
    key_bytes,
    namespace_for,
    parse_extra_config,
    region_hashes,
)
from kvstore.integrations.sglang_pools import POOL_KV, PoolPart
from kvstore.integrations.sglang_v2 import PoolCalls
from kvstore.layout import PageLayout

try:  # Inside SGLang the loader requires a subclass of its ABC; without SGLang (tests) a plain base.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:  # pragma: no cover - exercised where SGLang is installed
    _Base = object  # type: ignore[assignment,misc]

log = logging.getLogger("kvstore.sglang")

SGLANG_RELEASE = "0.5.23"
MAX_REGIONS_PER_CALL = 1024  # below the node's max_pages_per_request default (4096)


def _bytes_at(address: int, nbytes: int) -> np.ndarray:
    """A writable uint8 view of `nbytes` of an engine's host memory at `address` (SGLang's page buffer meta)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


class KVStoreHiCacheStorage(PoolCalls, _Base):  # type: ignore[misc,valid-type]
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
        self._flat_ns = namespace_for(prefix, model, g, self.rank, f"flat{g.page_bytes}", revision=self.revision)
        self._flat_layout = opaque_layout(g.page_bytes)
        if g.regions > 0 and g.region_bytes > 0:
            mode = f"seg{g.regions}x{g.region_bytes}"
            self._seg_ns = namespace_for(prefix, model, g, self.rank, mode, revision=self.revision)
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
