"""The LMCache engine's chunk geometry as the plugin stores it (mapping v1: kvstore/integrations/lmcache_mapping.py):
the memory format and shapes LMCache's engine picks, the page layout they make, and the namespaces already named
for them. No I/O.

Invariant: an `EngineShape` is replaced whole, never mutated but for its memo of namespaces, so a call sees one
consistent geometry, layout and namespaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmcache.utils import TORCH_DTYPE_TO_STR_DTYPE
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata

from kvstore.integrations.lmcache_mapping import Geometry, chunked_geometry, layerwise_geometry
from kvstore.layout import PageLayout


def engine_geometry(config: LMCacheEngineConfig, metadata: LMCacheMetadata) -> tuple[Geometry, list[Any]]:
    """The chunk geometry LMCache's engine uses (memory format as LMCacheEngine picks it) and the torch
    dtypes to allocate its MemoryObjs with."""
    _layers, kv, _, heads, head_dim = metadata.kv_shape
    if metadata.use_mla:
        heads = head_dim = 0  # one latent vector per token: no K/V heads to describe
    if config.use_layerwise:
        fmt = "KV_MLA_FMT" if metadata.use_mla else ("KV_2TD" if config.enable_blending else "KV_T2D")
        dtype = metadata.kv_dtype
        geo = layerwise_geometry(
            fmt,
            kv,
            metadata.kv_shape[3] * metadata.kv_shape[4],
            TORCH_DTYPE_TO_STR_DTYPE[dtype],
            dtype.itemsize,
            chunk_size=config.chunk_size,
            kv_heads=heads,
            head_dim=head_dim,
        )
        return geo, [dtype]
    fmt = "KV_MLA_FMT" if metadata.use_mla else "KV_2LTD"
    dtypes = metadata.get_dtypes()
    geo = chunked_geometry(
        fmt,
        [tuple(s) for s in metadata.get_shapes(config.chunk_size)],
        [TORCH_DTYPE_TO_STR_DTYPE[d] for d in dtypes],
        [d.itemsize for d in dtypes],
        config.chunk_size,
        kv_heads=heads,
        head_dim=head_dim,
    )
    return geo, list(dtypes)


@dataclass(frozen=True, slots=True)
class EngineShape:
    """Everything derived from the engine's chunk geometry. Replaced as a whole, never mutated, when
    LMCache registers the engine's KV layer groups after the plugin started (vLLM's V3 GPU connector
    does so on its first transfer), so a call always sees one consistent geometry, layout and namespaces."""

    geometry: Geometry
    layout: PageLayout
    dtypes: list[Any]  # torch dtypes to allocate MemoryObjs with
    fmt: MemoryFormat
    groups_from: object  # the KVLayerGroupsManager it was derived from (None: the legacy kv_shape)
    namespaces: dict[tuple[str, int, int, str], tuple[str, str]]

    @classmethod
    def derive(cls, config: LMCacheEngineConfig, metadata: LMCacheMetadata) -> EngineShape:
        geometry, dtypes = engine_geometry(config, metadata)
        return cls(
            geometry, geometry.page_layout(), dtypes, MemoryFormat[geometry.fmt], metadata.kv_layer_groups_manager, {}
        )


Runs = list[tuple[tuple[str, str], list[bytes]]]  # (namespace, tail namespace), kvstore hashes
