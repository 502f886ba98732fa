"""kvstore as SGLang HiCache's L3 storage, driven by SGLang 0.5.23's own code (tests/engines/sglang_hicache_driver.py,
run by the SGLang venv's python: tools/sglang_venv.sh) against a real node.

SGLang's factory loads the backend (`StorageBackendFactory.create_backend("dynamic", ...)`), SGLang's
`HiCacheController` picks the zero-copy page calls and runs them (`_page_set_zero_copy`, `_page_get_zero_copy`)
over SGLang's own host pools for every host layout (layer_first, page_first, page_first_direct, MLA), and the
v2 calls move SGLang's KV, sliding-window and Mamba pools (`MHATokenToKVPoolHost`, `MambaPoolHost`) as one
bundle per page. Engine A stores, engine B (fresh pools) loads; every page is compared byte for byte.

The node is sized for these pages (64 KiB slots): a node whose slots are much larger than the pages it holds
fills its slots long before its bytes (every page takes a whole `--max-page-bytes` slot).

No SGLang engine runs here: its CPU engine needs sgl-kernel's CPU build (not on PyPI) and its model runner
imports CUDA-only packages (`test_an_sglang_engine_does_not_start_on_this_machine` pins what stops it).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devkit.engines import REPO
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.pageformat import slot_bytes_for

DRIVER = REPO / "tests" / "engines" / "sglang_hicache_driver.py"
SLOT = 64 << 10


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    n = NodeProcess(dram_bytes=1024 * slot_bytes_for(SLOT), max_page_bytes=SLOT, node_id="sglang-real").start()
    try:
        yield n
    finally:
        n.close()


@pytest.fixture(scope="module")
def results(sglang_python: Path, node: NodeProcess) -> dict[str, Any]:
    """One driver run (importing SGLang is the slow part): every scenario against the node."""
    proc = subprocess.run([str(sglang_python), "-W", "ignore", str(DRIVER), node.addr], capture_output=True,
                          text=True, timeout=600, cwd=REPO, check=False)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, (
        f"driver failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    )
    result: dict[str, Any] = json.loads(lines[-1])
    result["log"] = proc.stderr
    return result


def test_a_session_named_in_sglangs_extra_info_is_retained(results: dict[str, Any], node: NodeProcess) -> None:
    r = results["session"]
    assert r == {"stored": True, "exists": 8}
    with KVStoreClient(node.addr, transport="grpc") as kv:
        state = kv.update_session("sgl-s1").state
        assert state is not None and state.mode.label == "demote" and state.priority == 80 and state.pages >= 8


def test_sglangs_factory_loads_the_backend(results: dict[str, Any]) -> None:
    assert results["factory"]["class"] == "kvstore.integrations.sglang_hicache.KVStoreHiCacheStorage"


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "mla"])
def test_the_controllers_zero_copy_pages_come_back_exact(results: dict[str, Any], layout: str) -> None:
    r = results["v1"][layout]
    assert r["stored"] is True
    assert (r["exists"], r["loaded"], r["exact"]) == (64, 64, 64), r


def test_v2_moves_kv_swa_and_mamba_as_one_bundle_per_page(results: dict[str, Any]) -> None:
    r = results["v2"]
    assert r["kv_v1"] is True
    assert r["set_v2"] == [{"kv": [True] * 4, "swa": [True] * 4}, {"kv": [True], "swa": [True], "mamba": [True]}]
    # bad input stores nothing: a pool no host pool provides, indices that do not cover the keys
    assert r["bad_sets"] == [{"mamba": [False], "indexer": [False]}, {"swa": [False]}]
    assert "'indexer'" in results["log"] and "15 host indices for 1 keys" in results["log"]
    window, last, mamba_pair = r["exists"]
    assert window == {"kv": 16, "pools": {"kv": 16, "swa": 16}, "restorable": [16]}  # TRAILING_PAGES, 4 pages
    assert last == {"kv": 16, "pools": {"kv": 16, "swa": 16, "mamba": 16}, "restorable": [16]}
    assert mamba_pair["restorable"] == [] and mamba_pair["kv"] == 0  # two trailing Mamba pages were never stored
    assert r["kv_v1_loaded"] == 16
    assert r["get_v2"] == [{"kv": [True] * 4, "swa": [True] * 4}, {"kv": [True], "swa": [True], "mamba": [True]}]
    assert r["get_partial"] == {"swa": [False]}  # one pool of a 3-pool bundle is a miss, never a part alone
    assert r["exact"] == {"kv": 16, "swa": 4, "mamba": 1}
