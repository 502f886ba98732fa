"""A real engine through kvstore: vLLM (CPU build) -> LMCacheMPConnector -> `lmcache server` -> kvstore's L2
adapter -> a real kvstore node, all on loopback: what the adapter and the node do under it.

The engines are the session's conformance flow (`vllm_conformance`, tests/engines/conftest.py and
devkit/conformance.py; engine starts cost tens of seconds on 2 cores, so the checks share them):
1. store: a fresh LMCache server and engine serve request A (a 1,024-token prefix + 3 tokens) and another
   request under another cache salt; their full chunks reach the node through the adapter;
2. load: another fresh LMCache server (empty memory) and a fresh engine serve B (the same prefix, another
   suffix): the prefix comes from the node (test_conformance.py compares the outputs with a recompute);
   then, in that engine, with the node restarted under it and LMCache's memory cleared before each: B again
   (from NVMe), B with a prefix page's payload flipped on NVMe, B with a prefix page misfiled, B with a wrong
   page put through the API (the control).
Here: the chunks reach the node, the node counts the hits and bytes it serves, a restarted node serves from
NVMe, a damaged page is counted by the node's checksum; and a bad adapter parameter stops LMCache's server.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from devkit.conformance import DoorRun, Scenario
from devkit.engines import CHUNK, LMCacheServer, kvstore_l2
from kvstore.names import TierKind
from kvstore.stats import NodeStats
from tests.engines.conftest import kv_bytes_per_token

PREFIX_CHUNKS = 4  # the conformance flow's prefix (vllm_conformance)
PAGE = CHUNK * kv_bytes_per_token()  # one LMCache chunk = one kvstore page
# Five engine starts and three LMCache servers: several minutes on 2 quiet cores, far more on a shared box.
pytestmark = pytest.mark.timeout(2400)


def total(st: NodeStats, counter: str, tier: TierKind | None = None) -> int:
    return sum(getattr(t.counters, counter) for t in st.tiers if tier is None or t.tier is tier)


def delta(run: DoorRun, scenario: Scenario, counter: str, tier: TierKind | None = None) -> int:
    before, after = run.stats[f"before {scenario}"], run.stats[f"after {scenario}"]
    return total(after, counter, tier) - total(before, counter, tier)


def test_request_a_stores_the_prefix_on_the_node(vllm_conformance: DoorRun) -> None:
    assert vllm_conformance.results["store"]["num_cached_tokens"] == 0  # a fresh engine and server: nothing cached
    assert vllm_conformance.facts["pages_after_store"] == 2 * PREFIX_CHUNKS  # A's prefix and the other request's


def test_the_node_shows_the_hits_and_bytes_out(vllm_conformance: DoorRun) -> None:
    hits = delta(vllm_conformance, Scenario.ENGINE_RESTART, "hits")
    out = delta(vllm_conformance, Scenario.ENGINE_RESTART, "bytes_out")
    assert hits >= PREFIX_CHUNKS and out >= PREFIX_CHUNKS * PAGE, (hits, out)


def test_a_restarted_node_serves_the_prefix_from_nvme(vllm_conformance: DoorRun) -> None:
    assert delta(vllm_conformance, Scenario.NODE_RESTART, "hits", TierKind.NVME) >= PREFIX_CHUNKS - 1
    assert vllm_conformance.results[Scenario.NODE_RESTART]["num_cached_tokens"] == PREFIX_CHUNKS * CHUNK


def test_a_damaged_page_is_refused_by_the_nodes_checksum(vllm_conformance: DoorRun) -> None:
    """The flipped page fails its checksum on the node's NVMe read (counted once); LMCache recomputes from it."""
    assert vllm_conformance.facts["checksum_failures"][Scenario.DAMAGED] == 1
    got = vllm_conformance.results[Scenario.DAMAGED]
    assert got["num_cached_tokens"] < PREFIX_CHUNKS * CHUNK and got["num_cached_tokens"] % CHUNK == 0, got


def test_lmcache_server_refuses_bad_adapter_params_naming_the_field(vllm_python: Path, tmp_path: Path) -> None:
    """The real `lmcache server` stops at start, and says which parameter is wrong and why."""
    spec = kvstore_l2("127.0.0.1:1", timeout_s="soon")
    with pytest.raises(RuntimeError, match="exited") as err:
        LMCacheServer(vllm_python, tmp_path / "server.log", [spec], l1_size_gb=0.1, timeout=240)
    assert "adapter_params.timeout_s: a number > 0, got 'soon'" in str(err.value), str(err.value)
