"""kvstore as a secondary tier of vLLM 0.32's native offloading (kvstore/integrations/vllm_offload.py).

vLLM's own TieringOffloadingSpec / TieringOffloadingManager load the tier from its module_path and drive it
(tests/engines/vllm_offload_driver.py, in the vLLM venv) against a real node: engine A offloads chunks,
vLLM cascades them to kvstore; a fresh engine B (its own CPU tier) finds them there, vLLM promotes them
into B's CPU tier, and the bytes are A's, bit for bit. The real vLLM CPU engine refuses offloading
altogether (its worker needs CUDA or XPU): the last test pins that, so the day it runs, this file says so.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import KVStoreClient
from kvstore.launch import NodeProcess
from tests.engines.conftest import ROOT, engine_env

DRIVER = ROOT / "tests" / "engines" / "vllm_offload_driver.py"


@pytest.fixture(scope="module")
def results(vllm_python: Path) -> Iterator[tuple[dict[str, Any], NodeProcess]]:
    """One driver run (importing vLLM is the slow part) against a live node and a dead address."""
    node = NodeProcess(dram_bytes="32MiB", max_page_bytes=64 << 10, node_id="vllm-tier").start()
    try:
        cmd = [str(vllm_python), str(DRIVER), "--url", f"kvstore://{node.addr}", "--down-url", "kvstore://127.0.0.1:9"]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=280, env=engine_env(), cwd=ROOT)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        assert proc.returncode == 0 and line, (
            f"driver failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
        yield json.loads(line.removeprefix("RESULT ")), node
    finally:
        node.close()


def test_fresh_engine_gets_the_prefix_from_kvstore(results: tuple[dict[str, Any], NodeProcess]) -> None:
    all_res, node = results
    res = all_res["round_trip"]
    assert res["before"] == ["MISS"] and res["stored"]
    assert res["second"] == ["HIT"] * 24, res  # after vLLM's promotion from kvstore into B's CPU tier
    assert res["exact"], "promoted chunks differ from the chunks engine A offloaded"
    assert res["sources"] == ["DISK"]  # vLLM labels hits from a STORAGE tier as disk hits
    assert res["partial"] == ["HIT"] * 24 + ["MISS"]  # a longer prompt: its new tail is a miss
    with KVStoreClient(node.addr, transport="grpc") as kv:
        hashes = [bytes.fromhex(h) for h in res["hashes"]]
        assert kv.lookup(res["namespace"], hashes) == 24  # under vLLM's own block hashes
        st = kv.stats()
        ns = {n: (layout.page_bytes, pages) for n, layout, pages in st.namespaces}
        assert ns[res["namespace"]] == (res["row_bytes"], 24)
        dram = next(t for t in st.tiers if t.tier.label == "dram")
        assert dram.counters.hits >= 24 and dram.counters.bytes_out >= 24 * res["row_bytes"]


def test_node_down_is_a_miss_and_a_failed_store(results: tuple[dict[str, Any], NodeProcess]) -> None:
    res = results[0]["down"]
    assert res["lookup"] == ["MISS"]
    assert res["store_jobs"] == [False]  # the cascade job reports failure; vLLM keeps its CPU copy
    assert res["seconds"] < 60


def test_vllm_cpu_build_refuses_the_offloading_worker(results: tuple[dict[str, Any], NodeProcess]) -> None:
    """Why no vLLM engine runs this tier here: on the CPU platform, vLLM 0.32's CPUOffloadingSpec.get_worker
    (inherited by TieringOffloadingSpec) raises before any transfer handler exists. Measured with the real
    engine too (README): `LLM(..., kv_transfer_config=OffloadingConnector + this tier)` dies at start with
    this message. Pinned here (cheaply, the same call the engine's worker makes) so a vLLM that runs it is
    noticed, and the engine test can then be written."""
    res = results[0]["worker"]
    assert res["platform"] == "cpu"
    assert res["error"] == "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
