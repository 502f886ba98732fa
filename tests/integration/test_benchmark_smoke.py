"""The benchmark scripts still run end to end (smoke runs: no figure is asserted, only what must hold of any
run: the checks each script makes of the bytes it moved, and that each ratio it reports is against the peer or
limit measured in the same run)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_store_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "store_bench.py"), "--quick", "--sizes", "256KiB", "--batch", "4",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "store_bench.json").read_text())
    assert {r["op"] for r in data["rows"]} == {"put", "get_dram", "get_nvme", "get_nvme_zc"}
    table = (tmp_path / "store_bench.md").read_text()
    assert "get NVMe" in table and "CHECK FAILED" not in table and "CELL FAILED" not in table


def test_index_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "index_bench.py"), "--quick", "--no-v1", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "index_bench.json").read_text())
    assert [r["masters"] for r in data["runs"]] == [1, 3]  # one Redis, then a Redis Cluster of 3
    for run in data["runs"]:
        # The index's contract: one round trip per lookup (a little over: who is alive is re-read every 0.5 s).
        assert all(1.0 <= c["round_trips"] < 1.2 for c in run["cells"]), run["cells"]
        assert {c["chain"] for c in run["cells"]} == {16, 64, 280} and run["memory"]["bytes_per_page"] > 0
        assert run["updates"]["flushed"] == run["updates"]["pages"]


def test_prefetch_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "prefetch_bench.py"), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "prefetch_bench.json").read_text())["rows"]
    assert rows[0]["prefetch_lead_ms"] is None and rows[0]["pages_found_in_dram"] == 0
    assert rows[-1]["prefetch_used"] > 0  # prefetched pages were read by the Gets


def test_ttft_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ttft_bench.py"), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "ttft_bench.json").read_text())["rows"]
    full = [r for r in rows if r["cached_share"] == 1]
    assert full and all(r["cached_tokens"] > 0 for r in full)  # the warm-up's pages were found


def test_secure_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "secure_bench.py"), "--quick", "--page-kib", "64",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "secure_bench.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["plain", "metrics", "tokens", "tls+tokens"]
    plain = rows[0]
    for r in rows:  # each mode against the plain node of the same run
        assert r["put_vs_plain"] == pytest.approx(r["put_gbs"] / plain["put_gbs"])
        assert r["get_vs_plain"] == pytest.approx(r["get_gbs"] / plain["get_gbs"])


def test_shm_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "shm_bench.py"), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "shm_bench.json").read_text())["rows"]
    assert [r["op"] for r in rows] == ["put", "get"]
    for r in rows:  # each plane against the memcpy of the same runs (its limit)
        for plane in ("shm", "zc"):
            assert r[f"{plane}_vs_memcpy"] == pytest.approx(r[f"{plane}_gbs"] / r["memcpy_gbs"])


def test_nvme_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "nvme_bench.py"), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "nvme_bench.json").read_text())["rows"]
    (row,) = rows
    assert row["page_kib"] == 256 and row["slot_runs"] >= 1  # the disk baseline read the pages' own slots
    # the get against the disk's own 16-deep rate in the same run
    assert row["get_into_vs_disk_deep"] == pytest.approx(row["get_into_gbs"] / row["disk_deep_gbs"])


def test_auth_memory_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "auth_memory_bench.py"), "--quick", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "auth_memory_bench.json").read_text())["rows"]
    assert [list(r["codes"]) for r in rows] == [["UNAUTHENTICATED"], ["INVALID_ARGUMENT"], ["OK"], ["UNAUTHENTICATED"]]
    assert rows[-1]["calls"] == 4 and rows[-1]["rss_settled"] > 0  # the flood: 2 rounds of 2, then settled


def test_kv_events_abuse_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_events_abuse_bench.py"), "--quick", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads((tmp_path / "kv_events_abuse_bench.json").read_text())["rows"][0]
    assert (row["pages"], row["subscribers"]) == (2048, 3)  # the quick sizes
    assert row["snapshots"] >= 1 and row["idle"]["n"] == 400 and row["loaded"]["n"] > 0
    for phase in (row["idle"], row["loaded"]):  # each phase's percentiles of its own samples
        assert 0 < phase["p50"] <= phase["p99"] <= phase["max"], phase


def test_tenancy_bench_quick_run(tmp_path: Path) -> None:
    """The tenancy benchmark runs end to end: every mode, both planes, the in-process figures."""
    argv = [sys.executable, str(ROOT / "benchmarks" / "tenancy_bench.py"), "--quick", "--page-kib", "64", "--out",
            str(tmp_path)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((tmp_path / "tenancy_bench.json").read_text())
    assert [r["mode"] for r in doc["rows"]] == ["no-tenancy", "tenant", "tenant+share"] == list(doc["micro"])
    base = doc["rows"][0]
    for r in doc["rows"]:  # each mode against the node without tenancy in the same run
        for p in ("grpc", "shm"):
            for op in ("put", "get"):
                assert r[f"{p}_{op}_ratio"] == pytest.approx(r[f"{p}_{op}_gbs"] / base[f"{p}_{op}_gbs"])
    assert all(set(f) >= {"lookup_hit_us", "lookup_miss_us", "get_us", "put_evict_us"} for f in doc["micro"].values())


def test_tree_ab_compares_two_checkouts(tmp_path: Path) -> None:
    """tree_ab runs each tree's code in its own child (this checkout twice here) and pairs the rounds; a path
    that is not a checkout is refused by name."""
    argv = [sys.executable, str(ROOT / "benchmarks" / "tree_ab.py"), "--tree", str(ROOT), "--tree", str(ROOT),
            "--rounds", "1", "--sizes", "1", "--modes", "shm:put_from,tcp:get", "--phases", "1", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((tmp_path / "tree_ab.json").read_text())
    assert [r["tree"] for r in doc["rows"]] == [str(ROOT), str(ROOT)]
    assert all(set(r["gbs"]) == {"1MiB shm:put_from", "1MiB tcp:get"} for r in doc["rows"])
    bad = subprocess.run([*argv[:2], "--tree", str(tmp_path)], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "--tree" in bad.stderr


def test_doors_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "doors_bench.py"), "--runs", "1", "--iters", "2", "--batch", "4",
         "--sgl-batch", "2", "--page-tokens", "4", "--acct-batch", "4", "--tier-rows", "65536", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "doors_bench.json").read_text())
    assert set(data["events"]["rates"]) == {"off", "on", "stuck"} and set(data["sglang"]) >= {"tcp", "shm"}
    acct = data["accounting"]
    assert acct["outcome_us"] > 0 and set(acct["fast_ms"]) == set(acct["slow_ms"]) == {"door", "bare"}
    assert set(acct["refused"]) == {2}  # every other page of 4 refused, and the door found each
    tier = data["vllm"]  # the vLLM tier's rows, or why not (no engine venv: an empty payload and a skipped row)
    assert not tier or all(r["bit_exact"] and r["store_gbs"] > 0 for r in tier["results"]), tier


def test_fp8_quality_quick_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_quality.py"), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "fp8_quality.json").read_text())["rows"]
    assert rows and all(r["encoded_tokens"] > 0 and r["max_abs_logit_delta"] > 0 for r in rows)


def test_fp8_economics_quick_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_economics.py"), "--quick", "--parts",
                          "bytes,hits", "--out", str(tmp_path)], capture_output=True, text=True, timeout=240,
                         check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "fp8_economics.json").read_text())
    assert all(r["fp8_page"] < r["raw_page"] for r in data["bytes"])
    fp8 = [r for r in data["hits"] if r["encoding"] == "fp8-e4m3"]
    raw = [r for r in data["hits"] if r["encoding"] == "raw"]
    assert all(f["dram_pages"] >= 2 * r["dram_pages"] - 1 for f, r in zip(fp8, raw, strict=True))  # equal bytes


def test_mixed_sizes_bench_small_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mixed_sizes_bench.py"), "--dram-bytes", str(16 << 20),
                          "--workloads", "sglang,hybrid", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "mixed_sizes_bench.json").read_text())["rows"]
    assert [r["workload"] for r in rows] == ["sglang", "hybrid"]
    for r in rows:  # what any run must show: no more held than budgeted, nothing stored that was not offered
        assert 0 < r["held_bytes"] <= r["capacity_bytes"] <= 16 << 20
        assert r["pages_held"] <= r["pages_stored"] <= r["pages_offered"]


def test_cluster_bench_quick_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cluster_bench.py"), "--quick", "--out-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=180, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    [r] = json.loads((tmp_path / "cluster_bench.json").read_text())["results"]
    served = r["served_bytes"]
    assert r["mode"] == "repl" and sorted(served) == ["n0", "n1", "n2"] and r["killed"] in served
    assert r["steady_gets"] > 0 and r["after_gets"] > 0 and sum(served.values()) > 0
    # each ratio is of figures of the same run
    mean = sum(served.values()) / len(served)
    assert r["max_over_mean"] == pytest.approx(max(served.values()) / mean)
    assert r["copy_share"] >= 0.0 and 0.0 <= r["after_prefix_hit"] <= 1.0
    assert r["prefix_hits_lost"] == pytest.approx(1.0 - r["after_prefix_hit"] / r["steady_prefix_hit"])
    assert "| repl |" in (tmp_path / "cluster_bench.md").read_text()
