"""Real LMCache (CPU) driving the kvstore plugin against real nodes on loopback.

Every node, redis-server, storage manager and engine a test starts is stopped by it. LMCache is an
optional extra: `./dev test` installs it; a bare `pytest` without it skips these modules with a reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.cli.waits import free_port
from kvstore.pageformat import slot_bytes_for

# Before LMCache is imported anywhere: no usage reporting from tests, and quiet INFO logs.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 2, 64, 16  # fp16: 1 KiB per token, 16 KiB per chunk
TOKEN_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * 2
CHUNK_BYTES = CHUNK * TOKEN_BYTES
SLOT = slot_bytes_for(CHUNK_BYTES)
MODEL = "it/tiny-llama"
REMOTE = "RemoteBackend-kvstore"  # the name LMCache's storage manager gives our backend
PLUGIN_LOGGER = "kvstore.integrations.lmcache"


def start_node(tmp_path: Path, name: str = "n0", *, dram_pages: int = 16, nvme_pages: int = 64,
               max_page_bytes: int = CHUNK_BYTES, port: int | None = None, **kw: Any) -> NodeProcess:  # fmt: skip
    """A node with DRAM and NVMe tiers sized in chunks; `port` fixed so a restart keeps the address."""
    extra = list(kw.pop("extra_args", []))
    if port is not None:
        extra += ["--port", str(port)]  # the last --port wins over NodeProcess's "--port 0"
    return NodeProcess(dram_bytes=dram_pages * SLOT, nvme_path=tmp_path / f"nvme-{name}", nvme_bytes=nvme_pages * SLOT,
                       max_page_bytes=max_page_bytes, node_id=name, extra_args=extra,
                       log_path=tmp_path / f"{name}.log", **kw).start()  # fmt: skip


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    n = start_node(tmp_path, port=free_port())
    try:
        yield n
    finally:
        n.close()


def plugin_config(url: str, *, partial: bool = False, local_cpu: bool = False, layerwise: bool = False,
                  **settings: object) -> Any:  # fmt: skip
    """An LMCache config whose remote tier is the kvstore plugin (what a user writes in the YAML)."""
    from lmcache.v1.config import LMCacheEngineConfig

    extra = {
        "remote_storage_plugin.kvstore.module_path": "kvstore.integrations.lmcache",
        "remote_storage_plugin.kvstore.class_name": "KVStoreConnectorAdapter",
        "remote_storage_plugin.kvstore.url": url,
        "remote_storage_plugin.kvstore.down_backoff": 0.2,  # tests wait for recovery; production default 2 s
        **{f"remote_storage_plugin.kvstore.{k}": v for k, v in settings.items()},
    }
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=local_cpu, max_local_cpu_size=0.05,
                                            remote_serde="naive", remote_storage_plugins=["kvstore"],
                                            save_unfull_chunk=partial, blocking_timeout_secs=10,
                                            use_layerwise=layerwise,
                                            extra_config=extra)  # fmt: skip
    cfg.validate()
    return cfg


def metadata(model: str = MODEL, worker_id: int = 0, world_size: int = 1) -> Any:
    import torch
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(model_name=model, world_size=world_size, local_world_size=world_size, worker_id=worker_id,
                           local_worker_id=worker_id, kv_dtype=torch.float16,
                           kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM), chunk_size=CHUNK)  # fmt: skip


@pytest.fixture
def storage_managers() -> Iterator[Callable[..., Any]]:
    """make(config, metadata) -> a real LMCache StorageManager; all are closed after the test."""
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    made: list[Any] = []

    def make(config: Any, meta: Any = None) -> Any:
        sm = StorageManager(config, meta if meta is not None else metadata(), event_manager=EventManager())
        made.append(sm)
        return sm

    yield make
    for sm in made:
        sm.close()


class Records(logging.Handler):
    """The plugin's log lines (LMCache's loggers do not propagate, so caplog cannot see them)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self, level: int = logging.WARNING) -> str:
        return "\n".join(r.getMessage() for r in self.records if r.levelno >= level)


@contextlib.contextmanager
def captured(logger_name: str) -> Iterator[Records]:
    """Everything `logger_name` logs at INFO and above while inside (LMCACHE_LOG_LEVEL=WARNING above
    would drop recovery lines)."""
    rec = Records()
    log = logging.getLogger(logger_name)
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(rec)
    try:
        yield rec
    finally:
        log.removeHandler(rec)
        log.setLevel(level)


@pytest.fixture
def plugin_log() -> Iterator[Records]:
    import kvstore.integrations.lmcache  # noqa: F401  # creates the logger with LMCache's handler

    with captured(PLUGIN_LOGGER) as rec:
        yield rec


def fill(obj: Any, seed: int) -> bytes:
    """Deterministic random bytes into a MemoryObj; returns them."""
    data = random.Random(seed).randbytes(obj.get_size())
    obj.byte_array.cast("B")[:] = data
    return data


def key(i: int, model: str = MODEL, worker_id: int = 0, world_size: int = 1) -> Any:
    import torch
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(model, world_size, worker_id, 0x5EED0000 + i, torch.float16)
