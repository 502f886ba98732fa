"""benchmarks/lmcache_bench.py still runs end to end (a smoke run: no figures are asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="LMCache is an optional extra: ./dev test installs it")

ROOT = Path(__file__).resolve().parents[2]


def test_lmcache_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lmcache_bench.py"), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "lmcache_bench.json").read_text())["rows"]
    assert {(r["op"], r["peer"]) for r in rows} == {(op, p) for op in ("put", "get") for p in ("kvstore", "kvstore-tcp", "kvstore-grpc", "lm")}
    assert all(r["gbs"] > 0 for r in rows)
    assert "LMCache lm://" in (tmp_path / "lmcache_bench.md").read_text()
