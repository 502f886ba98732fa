"""`./dev demo --engine vllm`: a real vLLM engine (CPU build) whose prefix comes from a kvstore node through
LMCache's multiprocess server and kvstore's L2 adapter, with the time to first token printed.

    vLLM --LMCacheMPConnector--> lmcache server --L2 adapter (kvstore.integrations.lmcache_l2)--> kvstore node

1. A kvstore node starts on loopback; a first `lmcache server` with kvstore as its L2 and a first vLLM
   engine serve request A (a 2,048-token shared prefix + its question): LMCache stores the prefix's
   chunks, and they reach the node.
2. Both stop. A fresh `lmcache server` (empty memory) and a fresh engine serve request B (the same prefix,
   another question) and request C (a prompt of the same length no one has seen): B's prefix comes from
   the node, C is computed from scratch. The table shows each request's TTFT and how many prompt tokens
   came from the cache; then the node's own counters (hits, bytes out).

The model is a random-weight 16-layer Llama written on the fly (no download); its outputs are noise, its
timings are real. Needs the engine venv (.engines/vllm, made by tools/vllm_venv.sh; `./dev demo --engine
vllm` makes it). About 2-3 minutes on 2 cores, most of it vLLM starting twice.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from devkit.engines import CHUNK, LMCacheServer, ensure_engine_venv, kvstore_l2, make_model, prompt, run_engine
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.pageformat import slot_bytes_for

LAYERS, KV_HEADS, HEAD_DIM = 16, 2, 64


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="./dev demo --engine vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="shared prefix length (a multiple of 256)")
    ap.add_argument("--workdir", type=Path, default=None, help="where logs, the model and NVMe files go")
    args = ap.parse_args(argv)
    if args.prefix_tokens < CHUNK or args.prefix_tokens % CHUNK:
        ap.error(f"--prefix-tokens: a positive multiple of LMCache's chunk size ({CHUNK}), got {args.prefix_tokens}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvstore-engine-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    say = lambda text: print(f"==> {text}", flush=True)  # noqa: E731

    say("the engine venv (.engines/vllm: vLLM CPU build, LMCache 0.5.6, this kvstore)")
    py = ensure_engine_venv(work / "engine-venv.log")
    say("a random-weight 16-layer Llama (no tokenizer: prompts are token ids)")
    model = make_model(py, work / "model", hidden=512, layers=LAYERS, intermediate=1536, init_range=0.02)
    page = CHUNK * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # one LMCache chunk of this model, bf16
    prefix = prompt(args.prefix_tokens)
    warm = {"name": "warm-up", "tokens": prompt(32, 104729), "max_tokens": 1, "logprobs": 0}
    chunks = args.prefix_tokens // CHUNK
    t_all = time.monotonic()
    slot = slot_bytes_for(page)
    with NodeProcess(dram_bytes=(2 * chunks + 8) * slot, max_page_bytes=page, node_id="demo-node",
                     log_path=work / "node.log") as node:  # fmt: skip
        say(f"kvstore node {node.addr}; lmcache server #1 with kvstore as L2; vLLM engine #1 serves request A")
        with LMCacheServer(py, work / "lmcache-server-1.log", [kvstore_l2(node.addr)], l1_size_gb=0.5) as s1:
            run_engine(py, model, [warm, {"name": "A", "tokens": [*prefix, 11, 12, 13], "max_tokens": 1,
                                          "logprobs": 0}], work / "engine-1.log", connector_port=s1.port)  # fmt: skip
            deadline = time.monotonic() + 120
            with KVStoreClient(node.addr, timeout=10, transport="grpc") as kv:
                while sum(n for _, _, n in kv.stats().namespaces) < chunks and time.monotonic() < deadline:
                    time.sleep(0.2)
                held = sum(n for _, _, n in kv.stats().namespaces)
        say(f"the node holds {held} of the prefix's {chunks} chunks; engine #1 and its LMCache server are gone")
        say("fresh lmcache server #2 (empty memory) and fresh vLLM engine #2 serve B (same prefix) and C (unseen)")
        with LMCacheServer(py, work / "lmcache-server-2.log", [kvstore_l2(node.addr)], l1_size_gb=0.5) as s2:
            reqs = [warm, {"name": "B", "tokens": [*prefix, 21, 22, 23], "max_tokens": 1, "logprobs": 0},
                    {"name": "C", "tokens": [*prompt(args.prefix_tokens, 104723), 21, 22, 23], "max_tokens": 1,
                     "logprobs": 0}]  # fmt: skip
            run = run_engine(py, model, reqs, work / "engine-2.log", connector_port=s2.port)
        with KVStoreClient(node.addr, timeout=10, transport="grpc") as kv:
            st = kv.stats()
    print()
    print(f"{'request':<40} {'prompt':>7} {'from cache':>10} {'TTFT ms':>9}")
    for name, what in (("B", "B: shared prefix (from the kvstore node)"), ("C", "C: unseen prompt (recomputed)")):
        r = run.results[name]
        print(f"{what:<40} {r['prompt_tokens']:>7} {r['num_cached_tokens']:>10} {r['ttft_ms'] or r['wall_ms']:>9.1f}")
    hits = sum(t.counters.hits for t in st.tiers)
    out = sum(t.counters.bytes_out for t in st.tiers)
    print(f"\nkvstore node: {hits} page hits, {out / 1e6:.1f} MB out, {sum(t.pages for t in st.tiers)} pages held; "
          f"whole demo {time.monotonic() - t_all:.0f} s; logs in {work}")  # fmt: skip
    b = run.results["B"]
    if b["num_cached_tokens"] < args.prefix_tokens:
        print(f"B found only {b['num_cached_tokens']} cached tokens: see {work}/lmcache-server-2.log", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
