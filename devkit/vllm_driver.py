"""One vLLM engine (CPU build) serving a list of requests, run inside the engine venv (.engines/vllm).

    python devkit/vllm_driver.py CONFIG.json

CONFIG: {"model": DIR, "dtype": "bfloat16", "connector": null | {"host": "127.0.0.1", "port": P}, "max_model_len": 4096,
"requests": [{"name": "B", "tokens": [...], "max_tokens": 4, "logprobs": 5, "wait_file": PATH,
"cache_salt": "..."}, ...]} (`cache_salt`: vLLM's per-request salt, which LMCache keys and namespaces carry).
A request with `wait_file` starts only once that file exists (the orchestrator's "go": it damages a
page, clears LMCache's memory, ... between two requests of one engine). With a connector the
engine uses LMCache's multiprocess connector (LMCacheMPConnector) against an `lmcache server` on that
port. Prompts are token ids (the test models have no tokenizer). Prints `ENGINE_UP <seconds>` once the
engine is built, then one `RESULT <json>` line per request: its wall time (ms), time to first token (ms,
from vLLM's own request stats), output tokens, their log-probabilities and `num_cached_tokens`.

Only the standard library and vLLM are imported here: this file runs in the engine's venv, whose
packages are vLLM's, not the project's.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python devkit/vllm_driver.py", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("config", help="the run's JSON config (module docstring)")
    args = ap.parse_args(argv)
    with open(args.config) as f:
        cfg = json.load(f)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {"model": cfg["model"], "skip_tokenizer_init": True, "dtype": cfg.get("dtype", "bfloat16"),
          "max_model_len": cfg.get("max_model_len", 4096), "enable_prefix_caching": False, "enforce_eager": True,
          "max_num_batched_tokens": cfg.get("max_model_len", 4096), "max_num_seqs": 4, "disable_log_stats": False}  # fmt: skip
    conn = cfg.get("connector")
    if conn:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector", kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.host": f"tcp://{conn.get('host', '127.0.0.1')}",
                                       "lmcache.mp.port": int(conn["port"])})  # fmt: skip
    t0 = time.monotonic()
    llm = LLM(**kw)
    print(f"ENGINE_UP {time.monotonic() - t0:.2f}", flush=True)
    for req in cfg["requests"]:
        if req.get("wait_file"):  # the orchestrator changes something between two requests, then says go
            print(f"WAITING {req['name']}", flush=True)
            deadline = time.monotonic() + float(req.get("wait_s", 600))
            while not os.path.exists(req["wait_file"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nobody created {req['wait_file']} in time")
                time.sleep(0.05)
        sp = SamplingParams(max_tokens=int(req.get("max_tokens", 4)), temperature=0.0, detokenize=False,
                            logprobs=int(req.get("logprobs", 5)) or None)  # fmt: skip
        t = time.monotonic()
        salt = {"cache_salt": req["cache_salt"]} if req.get("cache_salt") else {}
        out = llm.generate([TokensPrompt(prompt_token_ids=list(req["tokens"]), **salt)], sp, use_tqdm=False)[0]
        wall = time.monotonic() - t
        comp = out.outputs[0]
        lps = [float(d[tok].logprob) for d, tok in zip(comp.logprobs or [], comp.token_ids, strict=False)]
        stats = getattr(out, "metrics", None)
        ttft = getattr(stats, "first_token_latency", 0.0) or None
        print("RESULT " + json.dumps({"name": req["name"], "wall_ms": wall * 1e3,
                                      "ttft_ms": ttft * 1e3 if ttft else None, "tokens": list(comp.token_ids),
                                      "logprobs": lps, "num_cached_tokens": out.num_cached_tokens,
                                      "prompt_tokens": len(req["tokens"])}), flush=True)  # fmt: skip
    if cfg.get("hold_s"):
        time.sleep(float(cfg["hold_s"]))  # lets LMCache's background stores reach L2 before teardown


if __name__ == "__main__":
    main()
