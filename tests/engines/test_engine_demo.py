"""`./dev demo --engine vllm`, as the README gives it, and the modules that only import beside an engine.

`./dev demo --engine vllm` is `./dev setup` (what `./dev test` runs before any test), tools/vllm_venv.sh (the
engine venv these tests run on) and then `python -m devkit.engine_demo`: that last step is run here, with a
shorter prefix than its default (2 LMCache chunks instead of 8) to keep the engine tests' time down.

tests/unit/test_entry_points.py imports every module in the project's venv; the few that need vLLM (or
LMCache, where it is not installed there) are imported here, in the engine venv.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.engines import REPO, engine_env

pytestmark = pytest.mark.timeout(1200)
ENGINE_PACKAGES = ("vllm", "lmcache")


def _env(**extra: str) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO), **extra}


def test_engine_demo_runs_and_serves_the_prefix_from_the_node(vllm_python: Path, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "devkit.engine_demo", "--prefix-tokens", "512", "--workdir",
                        str(tmp_path)], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=1100,
                       check=False)  # fmt: skip
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(tmp_path.glob("*.log")))
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{logs}"
    # The table: request, prompt tokens, tokens from the cache, TTFT.
    b = re.search(r"^B: shared prefix \(from the kvstore node\)\s+(\d+)\s+(\d+)\s+([\d.]+)$", r.stdout, re.M)
    c = re.search(r"^C: unseen prompt \(recomputed\)\s+(\d+)\s+(\d+)\s+([\d.]+)$", r.stdout, re.M)
    assert b and c, r.stdout
    assert (int(b[1]), int(b[2])) == (515, 512) and (int(c[1]), int(c[2])) == (515, 0), r.stdout
    assert re.search(r"kvstore node: [1-9]\d* page hits", r.stdout), r.stdout


def test_engine_demo_refuses_a_prefix_that_is_not_whole_chunks() -> None:
    r = subprocess.run([sys.executable, "-m", "devkit.engine_demo", "--prefix-tokens", "300"], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert (
        r.returncode == 2 and "--prefix-tokens: a positive multiple of LMCache's chunk size (256), got 300" in r.stderr
    )


def test_engine_side_modules_import_in_the_engine_venv(vllm_python: Path) -> None:
    """What the project's venv cannot import for want of an engine's package imports beside the engine."""
    ours = subprocess.run([sys.executable, "-m", "devkit.entry_points"], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=600, check=True)  # fmt: skip
    failed = json.loads(ours.stdout.strip().splitlines()[-1])
    engine_side = sorted(m for m, e in failed.items() if any(f"No module named '{p}'" in e for p in ENGINE_PACKAGES))
    assert "kvstore.integrations.vllm_offload" in engine_side  # vLLM is never in the project's venv
    theirs = subprocess.run([str(vllm_python), "-m", "devkit.entry_points", *engine_side], cwd=REPO,
                            env=engine_env(), capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    assert json.loads(theirs.stdout.strip().splitlines()[-1]) == {}, theirs.stdout
