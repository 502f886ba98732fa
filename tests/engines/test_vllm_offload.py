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

from devkit.engines import REPO as ROOT
from devkit.engines import engine_env
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
from kvstore.pageformat import slot_bytes_for
from kvstore.security import ClientSecurity
from tests.integration.conftest import InProcessNode

DRIVER = ROOT / "tests" / "engines" / "vllm_offload_driver.py"
# What the tier computes for the driver's engine (tiny-llama, bf16, layout not resolved by hand-built configs,
# 16-token blocks and hashes, one block per chunk, layers l0 and l1 in group 0, TP 1, 32 KiB chunk rows).
TIER_NAMESPACE = "vllm/vllm2/tiny-llama/bfloat16/unresolved/t16h16x1/g1~e1f109098b3f/ws1tp1pp1pcp1dcp1/r32768"


TOKEN = "tier-token-0123456789abcdef"
Nodes = dict[str, NodeProcess]


@pytest.fixture(scope="module")
def results(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], Nodes]]:
    """One driver run (importing vLLM is the slow part) against a live node, a dead address, a node that
    wants a token the tier lacks, a node whose tier namespace another writer bound to another layout, a full
    node, and a node for the identity scenario."""
    tokens = tmp_path_factory.mktemp("tier") / "tokens"
    tokens.write_text(TOKEN + "\n")
    tokens.chmod(0o600)
    nodes: Nodes = {}
    specs = {
        "node": NodeProcess(dram_bytes="32MiB", max_page_bytes=64 << 10, node_id="vllm-tier"),
        "auth": NodeProcess(dram_bytes="8MiB", max_page_bytes=64 << 10, node_id="auth",
                            extra_args=["--auth-tokens-file", str(tokens)]),
        "bound": NodeProcess(dram_bytes="8MiB", max_page_bytes=64 << 10, node_id="bound"),
        # A DRAM-only node of 4 rows refusing first sights (second sight: a deterministic refusal pattern).
        "full": NodeProcess(dram_bytes=4 * slot_bytes_for(64 << 10), max_page_bytes=64 << 10, node_id="full",
                            extra_args=["--policy", "second-sight"]),
        "identity": NodeProcess(dram_bytes="8MiB", max_page_bytes=64 << 10, node_id="identity"),
    }  # fmt: skip
    try:
        for name, n in specs.items():
            nodes[name] = n.start()
        node, auth, bound, full, ident = (nodes[k] for k in ("node", "auth", "bound", "full", "identity"))
        with KVStoreClient(bound.addr, transport="grpc") as kv:  # the namespace the tier will compute
            other = PageLayout(DType.FLOAT16, 1, 1, 64, 16)
            kv.put(TIER_NAMESPACE, other, [b"\x01" * 32], [bytes(other.page_bytes)])
        cmd = [str(vllm_python), str(DRIVER), "--url", f"kvstore://{node.addr}", "--down-url", "kvstore://127.0.0.1:9",
               "--auth-url", f"kvstore://{auth.addr}", "--bound-url", f"kvstore://{bound.addr}",
               "--full-url", f"kvstore://{full.addr}", "--identity-url", f"kvstore://{ident.addr}"]  # fmt: skip
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=280, env=engine_env(), cwd=ROOT)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        assert proc.returncode == 0 and line, (
            f"driver failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
        res = json.loads(line.removeprefix("RESULT "))
        res["log"] = proc.stderr
        yield res, nodes
    finally:
        for n in nodes.values():
            n.close()


def test_fresh_engine_gets_the_prefix_from_kvstore(results: tuple[dict[str, Any], Nodes]) -> None:
    all_res, node = results[0], results[1]["node"]
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


def test_a_sessions_requests_retain_resume_and_end_through_the_tier(results: tuple[dict[str, Any], Nodes]) -> None:
    """kv_transfer_params and kv_hints reach the node as retention (DESIGN.md §6.5; integrations/hints.py)."""
    res = results[0]["retention"]
    assert res["turn1"] == {"pages": 6, "priority": 70, "mode": "demote"}  # every chunk the request stored
    assert res["turn2"] == {"pages": 6, "priority": 90, "mode": "demote"}  # kv_hints: the next turn resumed
    assert res["ended"] is None  # kvstore.end: released and forgotten
    assert res["bad_hint"] == {"store_jobs": [True], "session": None}  # served, without retention
    assert "kv_transfer_params.kvstore.priority" in results[0]["log"], results[0]["log"][-3000:]
    with KVStoreClient(results[1]["identity"].addr, transport="grpc") as kv:
        r = kv.stats().retention
        assert (r.sessions, r.retained_pages, r.ended) == (0, 0, 1)
        assert kv.lookup(res["namespace"], [bytes.fromhex(h) for h in res["hashes"]]) == 6  # still stored


def test_node_down_is_a_miss_and_a_failed_store(results: tuple[dict[str, Any], Nodes]) -> None:
    res = results[0]["down"]
    assert res["lookup"] == ["MISS"]
    assert res["store_jobs"] == [False]  # the cascade job reports failure; vLLM keeps its CPU copy
    assert res["seconds"] < 60


@pytest.mark.parametrize("case", ["wrong_token", "wrong_layout"])
def test_refused_store_is_a_failed_job_and_stores_nothing(results: tuple[dict[str, Any], Nodes], case: str) -> None:
    res = results[0][case]
    assert res["namespace"] == TIER_NAMESPACE
    assert res["store_jobs"] == [False] and res["lookup"] == ["MISS"]
    target = results[1]["auth" if case == "wrong_token" else "bound"]
    with KVStoreClient(target.addr, transport="grpc", security=ClientSecurity(token=TOKEN)) as kv:
        held = {n: pages for n, _, pages in kv.stats().namespaces}
        assert held.get(TIER_NAMESPACE, 0) == (1 if case == "wrong_layout" else 0)  # only the other writer's page
        assert kv.lookup(TIER_NAMESPACE, [bytes.fromhex(h) for h in res["hashes"]]) == 0
    said = "refused put" if case == "wrong_token" else "rejected put"  # one log line naming what to fix
    assert said in results[0]["log"], results[0]["log"][-3000:]


def test_a_full_node_fails_the_store_job_and_lookups_miss_what_it_refused(
    results: tuple[dict[str, Any], Nodes],
) -> None:
    """A DRAM-only node of 4 rows, full, refusing what it has not seen before (second sight: a deterministic
    pattern). A store job succeeds only when the node keeps every chunk of it (vLLM's backpressure and metrics
    read it); a fresh engine's lookups find exactly what the node kept."""
    res = results[0]["full"]
    assert res["fill"] == [True]
    assert res["first_sight"] == [False]  # before: True, though the node kept none of it
    assert res["mixed"] == [False]  # p's chunks kept on second sight, q's refused
    assert res["lookups"] == {"p": ["HIT"] * 3, "q": ["MISS"] * 3}


def test_every_identity_field_is_a_cold_miss(results: tuple[dict[str, Any], Nodes]) -> None:
    res = results[0]["identity"]
    assert res["base"] == TIER_NAMESPACE
    assert res["same"] == {"namespace": TIER_NAMESPACE, "lookup": ["HIT"] * 4}  # the control
    seen = {TIER_NAMESPACE}
    for field, got in res["fields"].items():
        assert got["lookup"] == ["MISS"], (field, got)
        assert got["namespace"] not in seen, (field, got["namespace"])
        seen.add(got["namespace"])
    nhd, hnd = res["layouts"]
    assert "/nhd/" in nhd and "/hnd/" in hnd


def test_bad_tier_settings_are_refused_naming_the_key(results: tuple[dict[str, Any], Nodes]) -> None:
    for key, said in results[0]["bad_config"].items():
        assert said.startswith("ConfigError") and key in said, (key, said)


def test_vllm_cpu_build_refuses_the_offloading_worker(results: tuple[dict[str, Any], Nodes]) -> None:
    """Why no vLLM engine runs this tier here: on the CPU platform, vLLM 0.32's CPUOffloadingSpec.get_worker
    (inherited by TieringOffloadingSpec) raises before any transfer handler exists. Measured with the real
    engine too (README): `LLM(..., kv_transfer_config=OffloadingConnector + this tier)` dies at start with
    this message. Pinned here (cheaply, the same call the engine's worker makes) so a vLLM that runs it is
    noticed, and the engine test can then be written."""
    res = results[0]["worker"]
    assert res["platform"] == "cpu"
    assert res["error"] == "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"


def test_a_hybrid_models_groups_are_one_bundle_per_block(results: tuple[dict[str, Any], Nodes]) -> None:
    """Two KV cache groups (vLLM's OffloadKey: block hash + group index): each block's groups are stored as one
    page (a bundle of parts g0, g1) and come back together into a fresh engine's CPU tier, bit-exact; a lookup
    of one group alone is a miss, never half a block."""
    res, nodes = results
    h = res["hybrid"]
    assert h["stored"] and h["parts"] == ["g0", "g1"]
    assert h["alone"] == ["MISS"]
    assert h["second"] == ["HIT"] * h["keys"]
    assert h["exact"] == h["keys"] == 16
    assert h["namespace"].endswith("/g0+g1") and "/g2~" in h["namespace"]
    with KVStoreClient(nodes["node"].addr, transport="grpc") as kv:
        pages = {ns: n for ns, _, n in kv.stats().namespaces}
        layouts = {ns: lay for ns, lay, _ in kv.stats().namespaces}
    assert pages[h["namespace"]] == 8  # one page per block, both groups in it
    assert layouts[h["namespace"]].is_bundle
    assert h["plain_namespace"] not in pages  # no row stored as a page of its own


def test_a_misfiled_chunk_is_a_miss_never_another_chunks_bytes(vllm_python: Path, tmp_path: Path) -> None:
    """A mapping bug at the node (DESIGN.md §8: a page's checksum binds its namespace and key): engine A stores
    a 4-chunk prompt; chunk 2's record is filed under chunk 3's key and chunk 3's under chunk 2's (each with
    its own bytes and checksum); a fresh engine B gets chunks 0-1 bit-exact and a miss from chunk 2 on, the
    node counts what it found and drops it, and a third engine's lookup stops at chunk 2."""
    node = InProcessNode(tmp_path, page_bytes=64 << 10)
    cmd = [str(vllm_python), str(DRIVER), "--misfiled-url", f"kvstore://{node.addr}"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=engine_env(), cwd=ROOT)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = ""
        for _ in range(10_000):  # bounded: the driver prints a line per scenario step at most
            line = proc.stdout.readline()
            if not line or line.startswith("STORED "):
                break
        assert line.startswith("STORED "), f"driver ended early ({proc.wait(60)}): {proc.stderr.read()[-4000:]}"
        stored = json.loads(line.removeprefix("STORED "))
        assert stored["stored"], "engine A's store jobs did not finish"
        ns, hashes = stored["namespace"], [bytes.fromhex(h) for h in stored["hashes"]]
        table = node.node.manager.table

        def misfile() -> None:
            e2, e3 = table.get((ns, hashes[2])), table.get((ns, hashes[3]))
            assert e2 is not None and e3 is not None
            table.entries[(ns, hashes[2])], table.entries[(ns, hashes[3])] = e3, e2  # the bug under test

        node.call(misfile)
        before = sum(t.counters.checksum_failures for t in node.call(node.node.manager.stats).tiers)
        out, err = proc.communicate("go\n", timeout=240)
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        assert proc.returncode == 0 and line, f"driver failed ({proc.returncode}):\n{out[-3000:]}\n{err[-6000:]}"
        res = json.loads(line.removeprefix("RESULT "))["misfiled"]
        assert res["second"] == ["HIT", "HIT", "MISS"], res  # promoted: chunks 0-1; chunk 2 failed its checksum
        assert res["exact"] == [True, True], res
        assert res["third"] == ["HIT", "HIT", "MISS"], res  # dropped at the node: never found again
        after = sum(t.counters.checksum_failures for t in node.call(node.node.manager.stats).tiers)
        assert after > before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        node.close()
