"""What the engine doors (SGLang HiCache, vLLM offloading) share besides `RemoteStore`: their settings (the
LMCache plugin's names and rules, one validator), the opaque layout of an engine's page bytes, and byte
views over engine tensors. Pages move straight into and out of engine memory with RemoteStore.get_into /
put_from (kvstore/integrations/remote.py).

Views are writable, C-contiguous byte buffers (numpy uint8 arrays over torch tensors: `byte_view`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.integrations.lmcache_mapping import MappingError, PluginSettings, parse_settings
from kvstore.integrations.remote import CALL_BYTES
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
