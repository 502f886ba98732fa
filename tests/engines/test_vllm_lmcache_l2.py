"""A real engine through kvstore: vLLM (CPU build) -> LMCacheMPConnector -> `lmcache server` -> kvstore's
L2 adapter -> a real kvstore node, all on loopback.

One flow, three engines (each engine start costs tens of seconds on 2 cores, so the checks share them):
1. baseline: vLLM without a connector serves request B (a 1,024-token prefix + 3 tokens): the reference
   tokens and log-probabilities;
2. store: a fresh LMCache server and engine serve request A (the same prefix, another suffix); its four
   full chunks reach the node through the adapter;
3. load: another fresh LMCache server (empty memory) and a fresh engine serve B: the prefix comes from the
   node (num_cached_tokens = 1,024; the node counts the hits and bytes out) and B's log-probabilities
   match the baseline. Then, in that engine, with LMCache's memory cleared before each:
   - a prefix page flipped on the node's NVMe (bit rot) is refused by the node's checksum and recomputed,
     never served: fewer cached tokens, the same outputs as the baseline;
   - the control: two prefix pages swapped on the node (each with a valid checksum, so served) change
     B's log-probabilities, which shows this model (INIT_RANGE 0.3) would reveal a wrong KV cache.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from devkit.engines import CHUNK, Engine, LMCacheServer, kvstore_l2, prompt, run_engine
from devkit.faults import damage_page
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.pageformat import HEADER_BYTES, slot_bytes_for
from kvstore.stats import NodeStats
from kvstore.tiers.nvme_meta import SEGMENT_RE, SlotState, classify
from tests.engines.conftest import kv_bytes_per_token
from tests.security.conftest import wait_for

PREFIX = prompt(4 * CHUNK)  # four full LMCache chunks
REQ_A = [*PREFIX, 11, 12, 13]
REQ_B = [*PREFIX, 21, 22, 23]
WARM = prompt(32, salt=104729)  # shorter than a chunk: warms the engine, stores nothing
PAGE = CHUNK * kv_bytes_per_token()  # one LMCache chunk = one kvstore page
# Three engine starts and two LMCache servers: about 3 minutes on 2 quiet cores, far more on a shared box.
pytestmark = pytest.mark.timeout(1800)
LOGPROB_TOL = 0.02  # bf16 prefill of 1,027 tokens vs 3 tokens over loaded KV: same bytes, other kernels' sums


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest difference between two runs' log-probabilities of their (equal) output tokens."""
    return max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))


def req(name: str, tokens: list[int], **kw: object) -> dict[str, object]:
    return {"name": name, "tokens": tokens, "max_tokens": 4, "logprobs": 5, **kw}


@dataclass
class Flow:
    baseline: dict[str, Any] = field(default_factory=dict)
    store: dict[str, Any] = field(default_factory=dict)
    load: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, NodeStats] = field(default_factory=dict)
    pages_after_store: int = 0
    damaged_index: int = -1
    seconds: dict[str, float] = field(default_factory=dict)


def node_stats(node: NodeProcess) -> NodeStats:
    with KVStoreClient(node.addr, timeout=10, transport="grpc") as kv:
        return kv.stats()


def l2_pages(st: NodeStats) -> int:
    return sum(n for ns, _, n in st.namespaces if "/l2v1/" in ns)


def nvme_pages(nvme: Path) -> list[tuple[str, bytes]]:
    """(namespace, hash) of every page on the node's NVMe, from the slot headers."""
    out = []
    for seg in sorted(p for p in nvme.iterdir() if SEGMENT_RE.fullmatch(p.name)):
        with open(seg, "rb") as f:
            for off in range(0, seg.stat().st_size - HEADER_BYTES + 1, slot_bytes_for(PAGE)):
                f.seek(off)
                state, header, _ = classify(f.read(HEADER_BYTES))
                if state is SlotState.PAGE and header is not None:
                    out.append((header.namespace, header.hash))
    return out


def clear_lmcache_memory(server: LMCacheServer) -> None:
    """LMCache's own admin API: drop what its L1 holds, so the next lookup goes to L2 (the node)."""
    r = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/cache/clear", data=b"{}", method="POST",
                               headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(r, timeout=30) as resp:
        assert json.loads(resp.read())["status"] == "ok"


@pytest.fixture(scope="module")
def flow(vllm_python: Path, engine_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Flow]:
    d = tmp_path_factory.mktemp("vllm-l2")
    f = Flow()
    # The baseline engine (no connector) shares nothing with the store phase: it runs beside it, in a thread of
    # its own (most of an engine's start is one process importing at a time: two overlap well on 2 cores).
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="baseline-engine")
    t_base = time.monotonic()
    baseline = pool.submit(run_engine, vllm_python, engine_model, [req("W", WARM), req("B", REQ_B)], d / "baseline.log")
    baseline.add_done_callback(lambda _: f.seconds.setdefault("baseline engine", time.monotonic() - t_base))

    # One DRAM page: the chain lives on NVMe, where a page can be damaged under the running node.
    slot = slot_bytes_for(PAGE)
    node = NodeProcess(dram_bytes=slot, nvme_path=d / "nvme", nvme_bytes=16 * slot, max_page_bytes=PAGE,
                       node_id="n0", log_path=d / "node.log").start()  # fmt: skip
    servers: list[LMCacheServer] = []
    try:
        t = time.monotonic()
        servers.append(LMCacheServer(vllm_python, d / "server-a.log", [kvstore_l2(node.addr)]))
        run = run_engine(vllm_python, engine_model, [req("W", WARM), req("A", REQ_A)], d / "engine-a.log",
                         connector_port=servers[-1].port)  # fmt: skip
        f.store = run.results
        # LMCache stores to L2 behind the engine: wait for the four chunks to reach the node.
        f.pages_after_store = wait_for(lambda: (n := l2_pages(node_stats(node))) >= 4 and n, 120, "4 pages on the node")
        servers.pop().stop()
        f.seconds["store: server + engine"] = time.monotonic() - t
        f.baseline = baseline.result(timeout=900).results  # bounded: run_engine bounds each engine's run too

        t = time.monotonic()
        f.stats["before"] = node_stats(node)
        servers.append(LMCacheServer(vllm_python, d / "server-b.log", [kvstore_l2(node.addr)]))
        engine = Engine(vllm_python, engine_model, [req("W", WARM), req("B", REQ_B),
                        req("B-damaged", REQ_B, pause=True), req("B-swapped", REQ_B, pause=True)],
                        d / "engine-b.log", connector_port=servers[-1].port)  # fmt: skip
        try:
            f.load["B"] = engine.result("B")
            f.seconds["load: server + engine + B"] = time.monotonic() - t
            f.stats["after B"] = node_stats(node)

            # Bit rot in one prefix page on NVMe: the node must refuse it (checksum), LMCache recompute.
            on_nvme = [(ns, h) for ns, h in nvme_pages(d / "nvme") if "/l2v1/" in ns]
            assert len(on_nvme) >= 3, f"expected the chain on NVMe, found {len(on_nvme)} pages there"
            ns, victim = on_nvme[0]
            damage_page(d / "nvme", victim)
            clear_lmcache_memory(servers[-1])
            engine.go("B-damaged")
            f.load["B-damaged"] = engine.result("B-damaged")
            f.stats["after damage"] = node_stats(node)

            # The control: two intact pages swapped (valid checksums, wrong places) are served.
            (_, h1), (_, h2) = on_nvme[1], on_nvme[2]
            with KVStoreClient(node.addr, timeout=30, transport="grpc") as kv:
                layout = next(lay for name, lay, _ in kv.stats().namespaces if name == ns)
                p1, p2 = bytes(kv.get(ns, [h1])[0]), bytes(kv.get(ns, [h2])[0])
                assert p1 != p2
                assert kv.delete(ns, [h1, h2]).deleted == 2
                kv.put(ns, layout, [h1], [p2], chain=False)
                kv.put(ns, layout, [h2], [p1], chain=False)
            clear_lmcache_memory(servers[-1])
            engine.go("B-swapped")
            f.load["B-swapped"] = engine.result("B-swapped")
            engine.finish(120)
        finally:
            engine.stop()
        yield f
    finally:
        for s in servers:
            s.stop()
        node.close()
        pool.shutdown(wait=True)  # the baseline engine, if the store phase failed first: run_engine stops it
        print("\nengine flow timings (s):", json.dumps({k: round(v, 1) for k, v in f.seconds.items()}))
        ref = f.baseline.get("B")
        for name, r in [("baseline B", ref), *[(k, v) for k, v in f.load.items()]]:
            if r and ref:
                print(f"  {name}: cached {r['num_cached_tokens']}, TTFT {r['ttft_ms']:.1f} ms, tokens "
                      f"{'=' if r['tokens'] == ref['tokens'] else '!='} baseline, max |logprob - baseline| "
                      f"{max_diff(r, ref) if r['tokens'] == ref['tokens'] else float('nan'):.4f}")  # fmt: skip


def test_request_a_stores_the_prefix_on_the_node(flow: Flow) -> None:
    assert flow.store["A"]["num_cached_tokens"] == 0  # a fresh engine and server: nothing cached
    assert flow.pages_after_store == len(PREFIX) // CHUNK


def test_a_fresh_engine_gets_the_prefix_from_the_node_and_the_same_outputs(flow: Flow) -> None:
    b, ref = flow.load["B"], flow.baseline["B"]
    assert b["num_cached_tokens"] == len(PREFIX), b
    assert b["tokens"] == ref["tokens"]
    assert max_diff(b, ref) <= LOGPROB_TOL, (b, ref)


def test_the_node_shows_the_hits_and_bytes_out(flow: Flow) -> None:
    before, after = flow.stats["before"], flow.stats["after B"]
    hits = sum(t.counters.hits for t in after.tiers) - sum(t.counters.hits for t in before.tiers)
    out = sum(t.counters.bytes_out for t in after.tiers) - sum(t.counters.bytes_out for t in before.tiers)
    assert hits >= 4 and out >= 4 * PAGE, (hits, out)


def test_a_damaged_page_is_refused_and_recomputed_never_served(flow: Flow) -> None:
    d, ref = flow.load["B-damaged"], flow.baseline["B"]
    failures = [t.counters.checksum_failures for t in flow.stats["after damage"].tiers]
    assert sum(failures) - sum(t.counters.checksum_failures for t in flow.stats["after B"].tiers) == 1
    assert d["num_cached_tokens"] < len(PREFIX) and d["num_cached_tokens"] % CHUNK == 0, d
    assert d["tokens"] == ref["tokens"]
    assert max_diff(d, ref) <= LOGPROB_TOL, (d, ref)


def test_the_control_a_wrong_kv_cache_would_change_the_outputs(flow: Flow) -> None:
    """Without this, equal outputs after the damage would prove nothing: swapped pages pass every check
    and are served (num_cached_tokens = the prefix), and this model's outputs move with them."""
    w, ref = flow.load["B-swapped"], flow.baseline["B"]
    assert w["num_cached_tokens"] == len(PREFIX), w
    assert w["tokens"] != ref["tokens"] or max_diff(w, ref) > LOGPROB_TOL, (w, ref)


def test_lmcache_server_refuses_bad_adapter_params_naming_the_field(vllm_python: Path, tmp_path: Path) -> None:
    """The real `lmcache server` stops at start, and says which parameter is wrong and why."""
    spec = kvstore_l2("127.0.0.1:1", timeout_s="soon")
    with pytest.raises(RuntimeError, match="exited") as err:
        LMCacheServer(vllm_python, tmp_path / "server.log", [spec], l1_size_gb=0.1, timeout=240)
    assert "adapter_params.timeout_s: a number > 0, got 'soon'" in str(err.value), str(err.value)
