"""Pages straight into and out of an engine's own memory (SGLang's host pool, vLLM's offload buffers).

`DirectStore` is `RemoteStore` (same error policy: every remote failure is a logged miss or a dropped
store, never an exception into the engine) plus two calls over caller memory:

    n = store.get_into(ns, hashes, views)      # pages of the longest stored prefix land in views[i]
    k = store.put_from(ns, layout, hashes, views, parent=h)   # stored count, None when refused

Where the bytes go (one node): on planes that cross a socket (TCP, UCX, gRPC) the client receives each
page straight into `views[i]` and sends straight out of it: the engine's memory is the only buffer on
this side. On the same-host shared-memory plane the node can only write into memory it maps (a
`shared_buffer` of the client), so pages cross through a bounded registered staging buffer: the node
copies tier -> staging (verified in that pass), then one memcpy staging -> view (and the reverse on a
put). A cluster (Redis index) has no zero-copy call: pages are fetched and copied into the views once.

Views are writable, C-contiguous byte buffers (numpy uint8 arrays over torch tensors: `byte_view`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.integrations.lmcache_mapping import MappingError, PluginSettings, parse_settings
from kvstore.integrations.remote import CALL_BYTES, RemoteStore
from kvstore.layout import DType, PageLayout

STAGING_BYTES = CALL_BYTES  # the shm plane's registered staging buffer per store (one call's worth)


class ConfigError(ValueError):
    """A bad engine-side setting; the message names the key as the engine's config spells it."""


_PLUGIN = "kvstore"  # engine doors take the LMCache plugin's settings: one validator, one set of names


def engine_settings(
    config: dict[str, Any] | None, *, where: str, ignore: set[str], namespace_prefix: str
) -> PluginSettings:
    """Validate an engine's kvstore settings (`url`, `timeout`, `transport`, `token`, ... as the LMCache plugin
    reads them), skipping the engine's own keys in `ignore`. ConfigError names the key, prefixed by `where`."""
    prefix = f"remote_storage_plugin.{_PLUGIN}."
    raw = {f"{prefix}{k}": v for k, v in (config or {}).items() if k not in ignore}
    raw.setdefault(f"{prefix}namespace_prefix", namespace_prefix)
    try:
        return parse_settings(raw, _PLUGIN, default_timeout=10.0)
    except MappingError as exc:
        raise ConfigError(f"{where} {str(exc).replace(prefix, '')}") from None


def opaque_layout(nbytes: int) -> PageLayout:
    """A layout whose page is `nbytes` bytes of uint8 (the engine's real geometry lives in the namespace)."""
    if nbytes <= 0 or nbytes % 2:
        raise ConfigError(f"pages of {nbytes} bytes cannot be stored (a positive even size is needed)")
    return PageLayout(DType.UINT8, 1, 1, nbytes // 2, 1)


def byte_view(tensor: Any) -> np.ndarray:
    """A writable uint8 numpy array over a contiguous CPU torch tensor's memory (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("a page view must be contiguous")
    return tensor.reshape(-1).view(dtype=_torch_uint8()).numpy()


def _torch_uint8() -> Any:
    import torch

    return torch.uint8


class DirectStore(RemoteStore):
    """A RemoteStore with zero-copy `get_into` / `put_from` over caller memory (see the module docstring).

    Thread-safety: as RemoteStore; the staging buffer is used under a lock (one staged call at a time).
    """

    def __init__(self, settings: PluginSettings, log: logging.Logger, *, setting_prefix: str = "") -> None:
        super().__init__(settings, log, setting_prefix=setting_prefix)
        self._staging_lock = threading.Lock()
        self._staging: Any = None  # SharedBuffer once the shm plane asked for registered memory
        self._staged = False  # True once this store's data plane is the shm plane

    @property
    def plane(self) -> str | None:
        """The data plane of the node client (None for a cluster, or before the first transfer)."""
        return self._data.plane if self._data is not None else None

    def get_into(self, ns: str, hashes: Sequence[bytes], views: Sequence[Any]) -> int:
        """Write the pages of the longest stored prefix of `hashes` into `views` (page i into views[i]);
        returns how many landed (0 on any failure: a logged miss)."""
        if not hashes:
            return 0
        if self._data is None:
            return self._guard("get", ns, lambda: self._copy_in(self._cluster().get_pages(ns, hashes), views), 0)
        return self._guard("get", ns, lambda: self._direct_get(ns, hashes, views), 0)

    def put_from(
        self,
        ns: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        views: Sequence[Any],
        *,
        parent: bytes | None = None,
        chain: bool = True,
    ) -> int | None:
        """Store the pages lying in `views` (each exactly layout.page_bytes) as one chain after `parent`;
        returns how many were new, None when nothing was stored (a logged failure)."""
        if not hashes:
            return 0
        if self._data is None:
            chain_before = [parent] if parent is not None else []
            res = self._guard(
                "put", ns, lambda: self._cluster().put(ns, layout, hashes, views, parent_chain=chain_before)[1], None
            )
        else:
            res = self._guard("put", ns, lambda: self._direct_put(ns, layout, hashes, views, parent, chain), None)
        return None if res is None else res.stored

    def close(self) -> None:
        with self._staging_lock:
            if self._staging is not None:
                self._staging.close()
                self._staging = None
        super().close()

    # -- one node

    def _direct_get(self, ns: str, hashes: Sequence[bytes], views: Sequence[Any]) -> int:
        assert self._data is not None
        if not self._staged:
            try:
                return len(self._data.get_into(ns, hashes, views))
            except ValueError:
                if self._data.plane != "shm":
                    raise
                self._staged = True  # the shm plane wants registered memory: stage from now on
        done = 0
        for a, b in self._staged_slices(views):
            with self._staging_lock:
                bufs = self._staging_views(views[a:b])
                got = len(self._data.get_into(ns, hashes[a:b], bufs))
                for i in range(got):
                    _copy(bufs[i], views[a + i])
            done += got
            if got < b - a:
                break
        return done

    def _direct_put(
        self,
        ns: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        views: Sequence[Any],
        parent: bytes | None,
        chain: bool,
    ) -> Any:
        assert self._data is not None
        if not self._staged:
            try:
                return self._data.put_from(ns, layout, hashes, views, parent=parent, chain=chain)
            except ValueError:
                if self._data.plane != "shm":
                    raise
                self._staged = True
        stored = present = 0
        for a, b in self._staged_slices(views):
            with self._staging_lock:
                bufs = self._staging_views(views[a:b])
                for i in range(b - a):
                    _copy(views[a + i], bufs[i])
                res = self._data.put_from(
                    ns, layout, hashes[a:b], bufs, parent=parent if a == 0 else hashes[a - 1], chain=chain
                )
            stored, present = stored + res.stored, present + res.already_present
        return type(res)(stored, present)

    def _staged_slices(self, views: Sequence[Any]) -> list[tuple[int, int]]:
        """[a, b) ranges of views whose pages fit the staging buffer together."""
        out, a, used = [], 0, 0
        for i, v in enumerate(views):
            n = _aligned(memoryview(v).nbytes)
            if i > a and used + n > STAGING_BYTES:
                out.append((a, i))
                a, used = i, 0
            used += n
        out.append((a, len(views)))
        return out

    def _staging_views(self, views: Sequence[Any]) -> list[memoryview]:
        """Page-aligned views of the registered staging buffer, one per view, each of its size."""
        sizes = [memoryview(v).nbytes for v in views]
        need = sum(_aligned(n) for n in sizes)
        if self._staging is None or self._staging.nbytes < need:
            if self._staging is not None:
                self._staging.close()
            assert self._data is not None
            self._staging = self._data.shared_buffer(max(need, STAGING_BYTES))
        out, off = [], 0
        for n in sizes:
            out.append(self._staging.view[off : off + n])
            off += _aligned(n)
        return out

    @staticmethod
    def _copy_in(pages: Sequence[Any], views: Sequence[Any]) -> int:
        for page, view in zip(pages, views, strict=False):
            _copy(page.data, view)
        return len(pages)


def _aligned(n: int) -> int:
    return (n + 4095) & ~4095


def _copy(src: Any, dst: Any) -> None:
    """memcpy of a page between two byte buffers of the same size (numpy does it without the GIL)."""
    s = np.frombuffer(src, dtype=np.uint8)
    d = np.frombuffer(dst, dtype=np.uint8)
    if s.nbytes != d.nbytes:
        raise ValueError(f"page of {s.nbytes} bytes into a view of {d.nbytes} bytes")
    d[...] = s
