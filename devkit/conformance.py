"""Conformance of kvstore with real engines: after the events that make other stores hand out another request's
KV, does an engine that loads its prefix from kvstore produce what it produces computing that prefix itself, and
is a page that must not be served a miss? (benchmarks/conformance.py prints the table; tests/engines runs it small.)

Doors, one function each, returning a `DoorRun` (rows plus the raw results and node counters behind them):
- `vllm_l2_door`: vLLM's CPU build -> LMCacheMPConnector -> `lmcache server` -> kvstore's L2 adapter
  (kvstore/integrations/lmcache_l2.py) -> a real node (the only engine door that runs on a CPU here);
- `workers_door`: kvstore's own Ray workers (PrefillWorker, DecodeWorker and the Router: the path of
  `kvstore generate`) against a real node and a real Redis index.

Every row compares a request whose prompt starts with a prefix of `n` cache pages against the recompute: the
same model, dtype and settings with no cache (vLLM without a connector; for the workers, the model's own
prefill and decode in this process). "Same outputs" = the greedy tokens equal and every generated token's
log-probability within the door's tolerance. Scenarios, in order (each needs the state the previous left):

  cold              (workers) nothing cached yet: a miss, and the workers' outputs equal the recompute
  engine restart    a fresh engine (vLLM: and a fresh LMCache server, empty memory) loads the prefix another
                    engine stored: every page from the cache, same outputs
  node restart      the node stopped gracefully (DRAM spills to NVMe) and started on its files: every page from
                    the cache (from NVMe), same outputs
  damaged page      node stopped, one payload bit of one prefix page flipped in its NVMe segment file, node
                    started: that page fails its checksum; the prefix is served up to it and recomputed from it,
                    same outputs
  misfiled page     node stopped, the slot headers of a prefix page and of a page of another request (other
                    tokens; for vLLM also another cache salt, so another namespace) rewritten so each claims
                    the other's namespace and key (each header's own checksum re-sealed: a metadata bug's write),
                    node started: both payloads are intact, so only a checksum that binds the page's namespace,
                    key and layout (DESIGN.md §8) refuses them; expected: a miss from that page on, same outputs
  control           the other request's page stored under the prefix page's key through the API (a client's Put:
                    valid checksums, so served): the outputs must change. Without it, equal outputs above would
                    not show that this model reveals a wrong KV cache (random weights with a wide initializer).
                    NOTE: the wrong page comes from another prompt: two pages of one prompt swapped are invisible
                    to attention, which sums over its (key, value) pairs in any order (K carries its position)
  changed dtype     the same model served in another dtype (bf16 -> fp16 for vLLM, fp32 -> bf16 for the workers):
                    the stored pages are not its KV; a miss, never a hit, same outputs as its own recompute
  changed block     (workers) another block size: a miss, same outputs as its own recompute

Every process started here is stopped here, by PID or process group; every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import enum
import json
import math
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from devkit.engines import CHUNK, Engine, LMCacheServer, kvstore_l2, prompt, run_engine
from devkit.slot_edits import PageId, damage_payload, live_pages, misfile
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.pageformat import slot_bytes_for
from kvstore.stats import NodeStats

# Tolerances on |logprob(cache) - logprob(recompute)| per generated token.
# NOTE: a prefix loaded from the cache holds the same KV bytes, but prefilling the suffix over loaded KV and
# prefilling the whole prompt may sum in other orders. Measured here (vLLM 0.32's CPU build, bf16): 0 on a full
# hit, up to 6e-4 when the prefix is partly recomputed; the workers (fp32): at most ~2e-6. The bounds leave room
# for other kernels, while a wrong page moves log-probabilities by 0.7 to 1.5 on these models (the control rows).
VLLM_LOGPROB_TOL = 0.02
WORKERS_LOGPROB_TOL = 1e-3
L2_NAMESPACE_PART = "/l2v1/"  # what every namespace of the L2 adapter's derived mapping contains
OTHER_SALT = "conformance-other"  # the other request's cache salt
SETTLE_S = 120.0  # the longest to wait for LMCache's background stores to reach the node
ADAPTER_TIMEOUT_S = 30.0  # the L2 adapter's lookup and data-call timeouts in these runs (see server() below)


class Scenario(enum.StrEnum):
    COLD = "cold (nothing cached)"
    ENGINE_RESTART = "engine restart"
    NODE_RESTART = "node restart (warm from NVMe)"
    DAMAGED = "damaged page (bit flip on NVMe)"
    MISFILED = "misfiled page (another request's, re-sealed)"
    CONTROL = "control: that page put via the API"
    CHANGED_DTYPE = "changed dtype"
    CHANGED_BLOCK = "changed block size"


class Expect(enum.StrEnum):
    """What a scenario must show (see `Row.passed`)."""

    HIT = "hit"  # every prefix page from the cache, same outputs as the recompute
    RECOMPUTED = "miss from the bad page"  # fewer pages from the cache than the prefix holds, same outputs
    MISS = "miss"  # no page from the cache, same outputs
    CHANGED = "served, outputs change"  # the control: every page served, outputs not the recompute's


@dataclass(slots=True)
class Row:
    """One line of the conformance table."""

    door: str
    scenario: str
    expect: Expect
    prefix_pages: int  # cache pages the prompt's prefix fills (LMCache chunks, worker blocks)
    cached_pages: int  # of those, pages the request took from the cache
    tokens_equal: bool  # greedy tokens equal to the recompute's
    max_logprob_diff: float  # max over generated tokens of |logprob - recompute's logprob|
    tolerance: float
    detail: str = ""  # what the node saw (hits by tier, checksum failures), which page was refused
    ttft_ms: float | None = None

    @property
    def outcome(self) -> str:
        if self.cached_pages == 0:
            return "miss"
        return "hit" if self.cached_pages >= self.prefix_pages else "partial"

    @property
    def same_outputs(self) -> bool:
        return self.tokens_equal and self.max_logprob_diff <= self.tolerance

    @property
    def passed(self) -> bool:
        if self.expect is Expect.HIT:
            return self.cached_pages == self.prefix_pages and self.same_outputs
        if self.expect is Expect.RECOMPUTED:
            return self.cached_pages < self.prefix_pages and self.same_outputs
        if self.expect is Expect.MISS:
            return self.cached_pages == 0 and self.same_outputs
        return self.cached_pages == self.prefix_pages and not self.same_outputs

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(expect=str(self.expect), outcome=self.outcome, same_outputs=self.same_outputs, passed=self.passed)
        if math.isnan(self.max_logprob_diff):
            d["max_logprob_diff"] = None
        return d


@dataclass(slots=True)
class DoorRun:
    """One door's rows, the raw per-request results behind them, node counters, and where time went."""

    door: str
    rows: list[Row] = field(default_factory=list)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # scenario (and "store", "recompute") -> result
    stats: dict[str, NodeStats] = field(default_factory=dict)  # node Stats at named points
    facts: dict[str, Any] = field(default_factory=dict)  # other observations (pages stored, keys edited)
    seconds: dict[str, float] = field(default_factory=dict)

    def row(self, scenario: Scenario) -> Row:
        """The row of a scenario (a changed-setting row's name goes on to say what changed)."""
        return next(r for r in self.rows if r.scenario.startswith(scenario))

    def as_dict(self) -> dict[str, Any]:
        return {"door": self.door, "rows": [r.as_dict() for r in self.rows], "results": self.results,
                "facts": self.facts, "seconds": {k: round(v, 1) for k, v in self.seconds.items()}}  # fmt: skip


def compare(got: dict[str, Any], ref: dict[str, Any]) -> tuple[bool, float]:
    """(greedy tokens equal, max |logprob difference| over the generated positions)."""
    diffs = [abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"], strict=False)]
    return got["tokens"] == ref["tokens"], max(diffs) if diffs else math.nan


def _quiet(_: str) -> None:
    pass


# -- node helpers


def node_stats(addr: str) -> NodeStats:
    with KVStoreClient(addr, timeout=10, transport="grpc") as kv:
        return kv.stats()


def _sum(st: NodeStats, counter: str) -> int:
    return sum(getattr(t.counters, counter) for t in st.tiers)


def node_delta(before: NodeStats, after: NodeStats) -> str:
    """What the node did between two Stats of one process: hits by tier, checksum failures."""
    hits = {t.tier.name.lower(): t.counters.hits for t in after.tiers}
    for t in before.tiers:
        hits[t.tier.name.lower()] -= t.counters.hits
    by_tier = ", ".join(f"{k} {v}" for k, v in hits.items() if v)
    bad = _sum(after, "checksum_failures") - _sum(before, "checksum_failures")
    return f"node served {sum(hits.values())} pages ({by_tier or 'none'}), checksum failures {bad}"


def _pages_in(st: NodeStats, which: Callable[[str], bool]) -> int:
    return sum(n for ns, _, n in st.namespaces if which(ns))


def wait_pages(addr: str, n: int, which: Callable[[str], bool], what: str, timeout: float = SETTLE_S) -> int:
    """Wait (bounded) until the node holds at least n pages in the namespaces `which` accepts."""
    deadline = time.monotonic() + timeout
    while True:
        have = _pages_in(node_stats(addr), which)
        if have >= n:
            return have
        if time.monotonic() > deadline:
            raise TimeoutError(f"the node holds {have} pages of {what} after {timeout:g}s, expected {n}")
        time.sleep(0.2)


def refile_through_api(addr: str, src: PageId, dst: PageId) -> None:
    """Store page `src`'s bytes under `dst`'s namespace and key through a client's Put (dst's old page deleted):
    a checksum computed for that identity, so the node serves it. Both namespaces hold one layout."""
    with KVStoreClient(addr, timeout=30, transport="grpc") as kv:
        layout = next(lay for name, lay, _ in kv.stats().namespaces if name == dst[0])
        data = bytes(kv.get(src[0], [src[1]])[0])
        if data == bytes(kv.get(dst[0], [dst[1]])[0]):
            raise RuntimeError("control: the two pages hold equal bytes; refiling one would change nothing")
        if kv.delete(dst[0], [dst[1]]).deleted != 1:
            raise RuntimeError("control: the node did not hold the page to replace")
        kv.put(dst[0], layout, [dst[1]], [data], chain=False)


# -- vLLM through LMCache's multiprocess server and kvstore's L2 adapter


def clear_lmcache_memory(server: LMCacheServer) -> None:
    """LMCache's own admin API: drop what its L1 holds, so the next lookup goes to L2 (the node)."""
    r = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/cache/clear", data=b"{}", method="POST",
                               headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(r, timeout=30) as resp:
        if json.loads(resp.read()).get("status") != "ok":
            raise RuntimeError("LMCache did not clear its memory")


def model_page_bytes(model: Path, dtype_bytes: int = 2) -> int:
    """Bytes of one LMCache chunk of a Hugging Face Llama: chunk x layers x (K, V) x KV heads x head dim."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return CHUNK * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * dtype_bytes


def _req(name: str, tokens: list[int], max_tokens: int, **kw: object) -> dict[str, object]:
    return {"name": name, "tokens": tokens, "max_tokens": max_tokens, "logprobs": 1, **kw}


def vllm_l2_door(python: Path, model: Path, work: Path, *, prefix_chunks: int = 4, max_tokens: int = 4,
                 changed_dtype: str = "float16", log: Callable[[str], None] = _quiet) -> DoorRun:  # fmt: skip
    """The vLLM door's rows (module docstring). `python`: the engine venv's; `model`: a Hugging Face Llama
    (run in bf16 and in `changed_dtype`); the prefix is `prefix_chunks` LMCache chunks (= pages) long.

    Five engine processes: two recomputes without a connector (bf16, `changed_dtype`) in a thread beside the
    rest, the store engine, the load engine (engine restart, node restart, damaged, misfiled, control: one
    process, paused between requests while the node is restarted and its files edited) and the
    changed-dtype engine. Rows are made once the recomputes are in."""
    run = DoorRun("vLLM 0.32 (CPU) > LMCache MP > kvstore L2")
    work.mkdir(parents=True, exist_ok=True)
    prefix = prompt(prefix_chunks * CHUNK)
    req_a, req_b = [*prefix, 11, 12, 13], [*prefix, 21, 22, 23]
    # Another request: other tokens under another cache salt (so another namespace), whose pages get misfiled.
    req_o = [*prompt(prefix_chunks * CHUNK, salt=6007), 31, 32, 33]
    warm = _req("W", prompt(32, salt=104729), 1)  # shorter than a chunk: warms the engine, stores nothing
    page = model_page_bytes(model)
    t_all = time.monotonic()
    done: list[tuple[Scenario, Expect, str, str]] = []  # (scenario, expectation, recompute's dtype, detail)
    failures: dict[str, int] = run.facts.setdefault("checksum_failures", {})

    # The recomputes (no connector) share nothing with the rest: they run beside it, in a thread.
    def recompute() -> dict[str, dict[str, Any]]:
        out = {}
        for dtype in ("bfloat16", changed_dtype):
            t = time.monotonic()
            got = run_engine(python, model, [warm, _req("B", req_b, max_tokens)], work / f"recompute-{dtype}.log",
                             dtype=dtype)  # fmt: skip
            out[dtype] = got.results["B"]
            run.seconds[f"recompute {dtype} (beside)"] = time.monotonic() - t
        return out

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="recompute-engines")
    refs_f = pool.submit(recompute)
    slot = slot_bytes_for(page)
    nvme = work / "nvme"
    # One DRAM page: the chains live on NVMe, where the scenarios edit them.
    node = NodeProcess(dram_bytes=slot, nvme_path=nvme, nvme_bytes=(4 * prefix_chunks + 8) * slot,
                       max_page_bytes=page, node_id="conformance", log_path=work / "node.log").start()  # fmt: skip
    servers: list[LMCacheServer] = []
    engine: Engine | None = None

    def server(name: str) -> LMCacheServer:
        # NOTE: generous adapter timeouts: this flow asks what is served, not how fast. With the defaults (1 s for
        # lookups and pins) a pin right after a node restart on a loaded 2-core box ran out once, and the request
        # was a (correct) miss where the row needs a hit.
        spec = kvstore_l2(node.addr, lookup_timeout_s=ADAPTER_TIMEOUT_S, timeout_s=ADAPTER_TIMEOUT_S)
        servers.append(LMCacheServer(python, work / f"server-{name}.log", [spec], l1_size_gb=0.5))
        return servers[-1]

    def record(scenario: Scenario, expect: Expect, got: dict[str, Any], before: NodeStats, note: str = "",
               ref: str = "bfloat16") -> None:  # fmt: skip
        after = node_stats(node.addr)
        run.stats[f"before {scenario}"], run.stats[f"after {scenario}"] = before, after
        failures[str(scenario)] = _sum(after, "checksum_failures") - _sum(before, "checksum_failures")
        run.results[str(scenario)] = got
        done.append((scenario, expect, ref, "; ".join(x for x in (note, node_delta(before, after)) if x)))
        log(f"{scenario}: {got['num_cached_tokens'] // CHUNK}/{prefix_chunks} pages from the cache")

    def pages(ns: str) -> list[PageId]:
        """The namespace's pages on NVMe (all of them while the node is down), in key order."""
        return sorted(p for p in live_pages(nvme, L2_NAMESPACE_PART) if p[0] == ns)

    try:
        t = time.monotonic()
        log(f"node {node.addr}; engine #1 stores the {prefix_chunks}-chunk prefix and another request's")
        s = server("store")
        stored = run_engine(python, model, [warm, _req("A", req_a, 1), _req("O", req_o, 1, cache_salt=OTHER_SALT)],
                            work / "engine-store.log", connector_port=s.port)  # fmt: skip
        run.results["store"] = stored.results["A"]
        run.facts["pages_after_store"] = wait_pages(node.addr, 2 * prefix_chunks, lambda ns: L2_NAMESPACE_PART in ns,
                                                    "the L2 adapter's namespaces")  # fmt: skip
        s.stop()
        names = [n for n, _, _ in node_stats(node.addr).namespaces if L2_NAMESPACE_PART in n]
        main_ns = next(n for n in names if "/s=" not in n)
        other_ns = next(n for n in names if f"/s={OTHER_SALT}" in n)
        run.facts["namespaces"] = {"prefix": main_ns, "other request": other_ns}
        run.seconds["store: server + engine"] = time.monotonic() - t

        def settle() -> None:
            """Wait for what the last request recomputed to be stored again (LMCache stores behind the engine).
            Only the prefix's namespace: a node may have dropped the other request's misfiled page for good."""
            wait_pages(node.addr, prefix_chunks, lambda ns: ns == main_ns, "the prefix")

        t = time.monotonic()
        log("engine #2 (fresh, with a fresh LMCache server) loads the prefix; then the node restarts under it")
        s = server("load")
        steps = [Scenario.ENGINE_RESTART, Scenario.NODE_RESTART, Scenario.DAMAGED, Scenario.MISFILED, Scenario.CONTROL]
        engine = Engine(python, model, [warm, *[_req(str(sc), req_b, max_tokens, pause=i > 0)
                                               for i, sc in enumerate(steps)]],
                        work / "engine-load.log", connector_port=s.port)  # fmt: skip
        before = node_stats(node.addr)
        record(Scenario.ENGINE_RESTART, Expect.HIT, engine.result(str(Scenario.ENGINE_RESTART)), before)
        run.seconds["engine restart: server + engine + request"] = time.monotonic() - t

        def after_node_restart(scenario: Scenario, expect: Expect, edit: Callable[[], str] | None) -> None:
            t = time.monotonic()
            settle()
            note = ""

            def offline() -> None:
                nonlocal note
                note = edit() if edit else ""

            node.restart(edit=offline)
            clear_lmcache_memory(s)
            before = node_stats(node.addr)
            assert engine is not None
            engine.go(str(scenario))
            record(scenario, expect, engine.result(str(scenario)), before, note)
            run.seconds[str(scenario)] = time.monotonic() - t

        after_node_restart(Scenario.NODE_RESTART, Expect.HIT, None)

        def damage() -> str:
            victim = pages(main_ns)[0]
            damage_payload(nvme, victim)
            run.facts["damaged"] = victim[1].hex()
            return f"flipped a bit of prefix page {victim[1].hex()[:8]}"

        after_node_restart(Scenario.DAMAGED, Expect.RECOMPUTED, damage)

        def misfiled() -> str:
            a, b = pages(main_ns)[0], pages(other_ns)[0]
            misfile(nvme, a, b)
            run.facts["misfiled"] = [a[1].hex(), b[1].hex()]
            return f"prefix page {a[1].hex()[:8]} holds other request's page {b[1].hex()[:8]} and vice versa"

        after_node_restart(Scenario.MISFILED, Expect.RECOMPUTED, misfiled)

        t = time.monotonic()
        settle()
        node.restart()  # every page on NVMe, where live_pages finds it
        a, b = pages(main_ns)[1], pages(other_ns)[1]  # pages the misfile left alone (it may have dropped [0])
        refile_through_api(node.addr, b, a)
        clear_lmcache_memory(s)
        before = node_stats(node.addr)
        engine.go(str(Scenario.CONTROL))
        note = f"other request's page {b[1].hex()[:8]} put as prefix page {a[1].hex()[:8]}"
        record(Scenario.CONTROL, Expect.CHANGED, engine.result(str(Scenario.CONTROL)), before, note)
        engine.finish(120)
        engine.stop()
        engine = None
        s.stop()
        run.seconds[str(Scenario.CONTROL)] = time.monotonic() - t

        t = time.monotonic()
        log(f"engine #3 serves the same model in {changed_dtype}")
        s = server("dtype")
        before = node_stats(node.addr)
        got = run_engine(python, model, [warm, _req("B", req_b, max_tokens)], work / f"engine-{changed_dtype}.log",
                         connector_port=s.port, dtype=changed_dtype).results["B"]  # fmt: skip
        record(Scenario.CHANGED_DTYPE, Expect.MISS, got, before, ref=changed_dtype)
        run.seconds["changed dtype: server + engine"] = time.monotonic() - t
        s.stop()
        refs = refs_f.result(timeout=1800)  # bounded: run_engine bounds each engine's run too
    finally:
        if engine is not None:
            engine.stop()
        for srv in servers:
            srv.stop()
        node.close()
        pool.shutdown(wait=True)  # the recompute engines, if a step failed first: run_engine stops each one
        run.seconds["whole door"] = time.monotonic() - t_all
    run.results["recompute"] = refs["bfloat16"]
    run.results[f"recompute {changed_dtype}"] = refs[changed_dtype]
    short = changed_dtype.replace("float", "fp")
    for scenario, expect, ref, detail in done:
        got = run.results[str(scenario)]
        equal, diff = compare(got, refs[ref])
        name = f"{scenario} (bf16 -> {short})" if scenario is Scenario.CHANGED_DTYPE else str(scenario)
        run.rows.append(Row(run.door, name, expect, prefix_chunks, got["num_cached_tokens"] // CHUNK, equal, diff,
                            VLLM_LOGPROB_TOL, detail, got.get("ttft_ms")))  # fmt: skip
    return run


# -- kvstore's own Ray workers


WORKERS_MODEL = {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 2, "vocab": 1024, "seed": 1}


def recompute_workers(model: Path, tokens: Sequence[int], max_new_tokens: int, *, dtype: str,
                      block_size: int) -> dict[str, Any]:  # fmt: skip
    """The workers' model with no cache, in this process: the whole prompt prefilled, then greedy decode."""
    import torch

    from workers.loader import load_checkpoint
    from workers.model import CacheConfig
    from workers.serving import token_logprob

    blocks = (len(tokens) + max_new_tokens) // block_size + 2
    m = load_checkpoint(model, cache=CacheConfig(block_size=block_size, num_blocks=blocks),
                        dtype=getattr(torch, dtype)).model  # fmt: skip
    try:
        logits = m.prefill("recompute", list(tokens), start_pos=0)
        out, lps = [], []
        for i in range(max_new_tokens):
            if i:
                logits = m.decode(["recompute"], [out[-1]])[0]
            out.append(int(torch.argmax(logits)))
            lps.append(token_logprob(logits, out[-1]))
    finally:
        m.free("recompute")
    return {"tokens": out, "logprobs": lps, "num_cached_tokens": 0}


def workers_door(work: Path, *, prefix_blocks: int = 4, block_size: int = 16, max_new_tokens: int = 4,
                 log: Callable[[str], None] = _quiet) -> DoorRun:  # fmt: skip
    """The Ray workers' rows (module docstring): a LocalStack (Redis, a node, Ray with one prefill and one
    decode worker) on a small random Llama in fp32; the prefix is `prefix_blocks` blocks."""
    from kvstore.hashing import prefix_hashes
    from workers.runtime import LocalStack, StackConfig
    from workers.tiny import TinyLlamaSpec, make_tiny_llama

    run = DoorRun("kvstore Ray workers (prefill > decode)")
    work.mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()
    model = make_tiny_llama(work / "model", TinyLlamaSpec(**WORKERS_MODEL))  # type: ignore[arg-type]
    vocab = WORKERS_MODEL["vocab"]
    tokens = [(i * 7919) % (vocab - 3) + 3 for i in range(prefix_blocks * block_size + 5)]
    other = [(i * 6007 + 11) % (vocab - 3) + 3 for i in range(len(tokens))]  # another request's prompt
    cfg = StackConfig(model_dir=str(model), block_size=block_size, torch_threads=1, num_cpus=2,
                      run_dir=str(work / "stack"))  # fmt: skip
    page = LocalStack.page_bytes(cfg)
    # Pages up to twice this size (the changed block size); one DRAM slot, so the chain lives on NVMe.
    slot = slot_bytes_for(2 * page)
    cfg.max_page_bytes, cfg.dram_bytes, cfg.nvme_bytes = 2 * page, slot, 8 * (prefix_blocks + 2) * slot
    nvme = work / "stack" / "nvme"
    refs: dict[tuple[str, int], dict[str, Any]] = {}

    def ref(dtype: str, bs: int) -> dict[str, Any]:
        if (dtype, bs) not in refs:
            refs[dtype, bs] = recompute_workers(model, tokens, max_new_tokens, dtype=dtype, block_size=bs)
        return refs[dtype, bs]

    with LocalStack(cfg) as stack:
        assert stack.node is not None
        node = stack.node
        run.seconds["stack up"] = time.monotonic() - t_all
        n_req = 0

        def serve(scenario: Scenario, expect: Expect, note: str = "") -> Row:
            nonlocal n_req
            t = time.monotonic()
            before = node_stats(node.addr)
            r = stack.generate(f"conformance-{n_req}", tokens, max_new_tokens)
            n_req += 1
            got = {"tokens": r.tokens, "logprobs": r.logprobs, "cached_blocks": r.cached_blocks,
                   "cached_tiers": r.cached_tiers, "decode_fetched_blocks": r.decode_fetched_blocks,
                   "ttft_ms": r.ttft_s * 1e3}  # fmt: skip
            bs, dtype = stack.config.block_size, stack.config.dtype
            want = ref(dtype, bs)
            equal, diff = compare(got, want)
            usable = (len(tokens) - 1) // bs
            tiers = ", ".join(f"{k} {v}" for k, v in sorted(r.cached_tiers.items()))
            took = f"prefill took {tiers or 'nothing'} from the cache, decode fetched {r.decode_fetched_blocks}"
            detail = "; ".join(x for x in (note, took, node_delta(before, node_stats(node.addr))) if x)
            row = Row(run.door, str(scenario), expect, usable, r.cached_blocks, equal, diff, WORKERS_LOGPROB_TOL,
                      detail, r.ttft_s * 1e3)  # fmt: skip
            run.rows.append(row)
            run.results[str(scenario)] = got
            run.seconds[str(scenario)] = time.monotonic() - t
            log(f"{scenario}: {row.outcome} {row.cached_pages}/{row.prefix_pages}, tokens "
                f"{'=' if equal else '!='}, max |dlogprob| {diff:.2e}: {'ok' if row.passed else 'FAILED'}")  # fmt: skip
            return row

        ns = stack.namespace
        mine = [(ns, h) for h in prefix_hashes(tokens, block_size, ns)[:prefix_blocks]]
        theirs = [(ns, h) for h in prefix_hashes(other, block_size, ns)[:prefix_blocks]]
        stack.generate("other-request", other, 1)  # its pages are what gets misfiled
        serve(Scenario.COLD, Expect.MISS)
        stack.restart_workers()
        serve(Scenario.ENGINE_RESTART, Expect.HIT)
        node.restart()
        serve(Scenario.NODE_RESTART, Expect.HIT)

        node.restart(edit=lambda: damage_payload(nvme, mine[1]))
        run.facts["damaged"] = mine[1][1].hex()
        serve(Scenario.DAMAGED, Expect.RECOMPUTED, "flipped a bit of block 1")

        node.restart(edit=lambda: misfile(nvme, mine[1], theirs[1]))
        run.facts["misfiled"] = [mine[1][1].hex(), theirs[1][1].hex()]
        serve(Scenario.MISFILED, Expect.RECOMPUTED, "block 1 holds the other request's block 1 and vice versa")

        # Pages the misfile left alone: it may have dropped mine[1] and theirs[1] (a node that refuses them).
        refile_through_api(node.addr, theirs[2], mine[2])
        serve(Scenario.CONTROL, Expect.CHANGED, "the other request's block 2 put as block 2")

        stack.restart_workers(dtype="bfloat16")
        serve(Scenario.CHANGED_DTYPE, Expect.MISS).scenario = f"{Scenario.CHANGED_DTYPE} (fp32 -> bf16)"
        stack.restart_workers(dtype="float32", block_size=2 * block_size)
        serve(
            Scenario.CHANGED_BLOCK, Expect.MISS
        ).scenario = f"{Scenario.CHANGED_BLOCK} ({block_size} -> {2 * block_size})"
    run.results["recompute"] = ref("float32", block_size)
    run.seconds["whole door"] = time.monotonic() - t_all
    return run
