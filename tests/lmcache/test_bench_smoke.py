"""benchmarks/lmcache_bench.py and l2_bench.py still run end to end (smoke runs: no figure is asserted, only
the checks each makes of the bytes it moved, and that its ratios are against the same run's peer)."""

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
    assert {(r["op"], r["peer"]) for r in rows} == {
        (op, p) for op in ("put", "get") for p in ("kvstore", "kvstore-tcp", "kvstore-grpc", "lm")
    }
    lm = {(r["size"], r["op"]): r["gbs"] for r in rows if r["peer"] == "lm"}
    for r in rows:  # each peer against LMCache's own server in the same run
        assert r["vs_lm"] == pytest.approx(r["gbs"] / lm[(r["size"], r["op"])])
    assert "LMCache lm://" in (tmp_path / "lmcache_bench.md").read_text()


def test_l2_bench_quick_run(tmp_path: Path) -> None:
    """benchmarks/l2_bench.py: our L2 adapter through LMCache's own adapter factory and task interface."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "l2_bench.py"), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "l2_bench.json").read_text())
    (row,) = doc["adapters"]["kvstore"]["results"]
    assert row["bit_exact"] and row["load_hits"] == row["batch"] and row["lookup_found"] == row["batch"]
    assert "kvstore (our L2 adapter)" in (tmp_path / "l2_bench.md").read_text()
