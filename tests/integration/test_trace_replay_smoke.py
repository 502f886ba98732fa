"""benchmarks/trace_replay.py runs end to end on the workload suite in its smoke size plus a trace
given by path (no figures asserted, only what must hold for any policy), and refuses bad input; so
does benchmarks/policy_bench.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.workloads import WORKLOADS, generate
from kvstore.policy import POLICIES

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "trace_replay.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, check=False
    )


def test_smoke_suite_and_a_trace(tmp_path: Path) -> None:
    trace = tmp_path / "tiny.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(r), "output_length": 1,
                                         "hash_ids": r}) + "\n" for i, r in enumerate(generate("chat", 40))))  # fmt: skip
    out = _run("--suite", "smoke", "--trace", str(trace), "--fractions", "0.05,0.3", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "trace_replay.json").read_text())
    assert set(doc["workloads"]) == {*WORKLOADS, "tiny"} and doc["policies"][0] == "lru"
    assert set(doc["policies"]) == set(POLICIES)
    bound = {(b["source"], b["config"]): b["belady_block_hit"] for b in doc["bounds"]}
    assert len(bound) == 2 * len(doc["workloads"])
    for c in doc["cells"]:
        # any cache's prefix hits are block hits, and Belady bounds the block hits
        assert c["prefix_hit"] <= c["block_hit"] <= bound[(c["source"], c["config"])] + 1e-12
    assert len(doc["target"]) == len(bound)  # one verdict per workload and capacity
    assert "Target (DESIGN.md §6.4)" in (tmp_path / "trace_replay.md").read_text()


def test_another_seed_replays_other_requests_of_the_same_shapes(tmp_path: Path) -> None:
    """--seed N: a held-out draw of the suite (the policies' constants were measured on seed 0)."""
    docs = {}
    for seed in (0, 1):
        out = _run("--suite", "smoke", "--workloads", "chat", "--seed", str(seed), "--fractions", "0.3",
                   "--policy", "lru,adaptive", "--out", str(tmp_path / str(seed)))  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        docs[seed] = json.loads((tmp_path / str(seed) / "trace_replay.json").read_text())
        assert docs[seed]["machine"]["seed"] == seed
        assert f"suite seed {seed}" in (tmp_path / str(seed) / "trace_replay.md").read_text()
    assert docs[0]["workloads"]["chat"] != docs[1]["workloads"]["chat"]
    assert docs[0]["workloads"]["chat"]["requests"] == docs[1]["workloads"]["chat"]["requests"]


def test_tiers_bytes_and_first_reuse(tmp_path: Path) -> None:
    """--tiered-fractions: a DRAM tier over an NVMe tier per workload, the bytes each serves (the agentic
    workload's 4096-token blocks, Llama-3.1-8B's KV per token by default) against Belady's bounds (the
    top tier's at its own capacity); --reuse-split: first reuses apart from later hits; the agentic
    workload's table has the default told of sessions beside it (never a candidate of the target)."""
    out = _run("--suite", "smoke", "--workloads", "agentic", "--fractions", "0.1", "--tiered-fractions", "0.05",
               "--nvme-ratio", "3", "--reuse-split", "--policy", "lru,second-sight,adaptive", "--out", str(tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "trace_replay.json").read_text())
    assert doc["kv_bytes_per_block"] == {"agentic": 4096 * 131_072}
    tiered = [b for b in doc["bounds"] if b["top_capacity"] is not None]
    assert len(tiered) == 1 and tiered[0]["capacity"] == 4 * tiered[0]["top_capacity"]
    assert tiered[0]["belady_top_block_hit"] <= tiered[0]["belady_block_hit"]
    for c in doc["cells"]:
        if c["tiers"]:
            dram, nvme = c["tiers"]["dram"], c["tiers"]["nvme"]
            assert dram[1] <= tiered[0]["belady_top_block_hit"] + 1e-12  # no policy beats MIN in its top tier
            assert abs(dram[1] + nvme[1] - c["prefix_hit"]) < 1e-12
        assert 0 <= c["first_reuse_hit"] <= c["block_hit"]
    hinted = [c for c in doc["cells"] if c["policy"] == "adaptive+hints"]
    assert len(hinted) == 2 and all(c["counters"]["leased"] > 0 for c in hinted)  # one tier, and tiered
    assert all(v["best"] != "adaptive+hints" for v in doc["target"])  # hints are no candidate of the target
    md = (tmp_path / "trace_replay.md").read_text()
    assert "GB from dram" in md and "Belady (bound)" in md and "first reuse" in md and "adaptive with hints" in md
    bad = _run("--suite", "smoke", "--workloads", "agentic", "--hint-ttl", "nan", "--out", str(tmp_path / "x"))
    assert bad.returncode != 0 and "--hint-ttl" in bad.stderr and not (tmp_path / "x").exists()
    bad = _run("--suite", "smoke", "--workloads", "agentic", "--tiered-fractions", "1.5", "--out", str(tmp_path / "x"))
    assert bad.returncode != 0 and "--tiered-fractions" in bad.stderr and not (tmp_path / "x").exists()
    bad = _run("--suite", "smoke", "--workloads", "agentic", "--kv-bytes-per-token", "0", "--out", str(tmp_path / "x"))
    assert bad.returncode != 0 and "--kv-bytes-per-token" in bad.stderr


def test_bad_input_is_named(tmp_path: Path) -> None:
    out = _run("--suite", "none", "--trace", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path))
    assert out.returncode != 0 and "missing.jsonl" in out.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1}\n')
    out = _run("--suite", "none", "--trace", str(bad), "--out", str(tmp_path))
    assert out.returncode != 0 and "bad.jsonl:2" in out.stderr and "hash_ids" in out.stderr
    out = _run("--workloads", "chat,nope", "--out", str(tmp_path))
    assert out.returncode != 0 and "nope" in out.stderr
    out = _run("--suite", "smoke", "--fractions", "0,2", "--out", str(tmp_path))
    assert out.returncode != 0 and "--fractions" in out.stderr
    assert not (tmp_path / "trace_replay.json").exists()  # nothing was written by the refused runs


def test_policy_bench_replays_every_decision(tmp_path: Path) -> None:
    """benchmarks/policy_bench.py: the recorded calls replay to the same answers (it checks that itself
    and fails otherwise) and a figure is written per policy and cell; bad input is named."""
    script = ROOT / "benchmarks" / "policy_bench.py"
    args = ["--size", "smoke", "--workloads", "conversation,batch", "--fractions", "0.1",
            "--policy", "lru,second-sight,adaptive,prefix-arc", "--runs", "2", "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "policy_bench.json").read_text())["rows"]
    assert {(r["workload"], r["policy"]) for r in rows} == {
        (w, p) for w in ("conversation", "batch") for p in ("lru", "second-sight", "adaptive", "prefix-arc")
    }
    for r in rows:
        assert r["events"] >= r["block_refs"] > 0  # every block reference asked the policy something
        # the two units are the same seconds, over the tape's events and over the requests' block references
        assert r["us_per_event"] * r["events"] == pytest.approx(r["us_per_block"] * r["block_refs"])
    assert len({(r["workload"], r["block_refs"]) for r in rows}) == 2  # each policy replayed the same requests
    md = (tmp_path / "policy_bench.md").read_text()
    for unit in ("event", "block reference"):
        assert f"ratio to prefix-arc in the same cell, per {unit}: lru " in md
    bad = subprocess.run([sys.executable, str(script), "--policy", "nope", "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert bad.returncode != 0 and "nope" in bad.stderr and not (tmp_path / "x").exists()
