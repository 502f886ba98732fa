"""The fault suite at smoke size (devkit/faults.py; `benchmarks/faults.py` runs the full sizes): real node
processes, a real redis-server, a real tmpfs. Each asserts the scenario's promise; the figures are
printed (pytest -s) and, at full size, kept in benchmarks/RESULTS.md."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devkit import faults

KILL_ROUNDS = int(os.environ.get("KVSTORE_KILL_ROUNDS", "20"))


def _show(res: faults.FaultResult) -> None:
    print(f"\n{res.row()}\n  {res.notes}")


@pytest.mark.timeout(900)
def test_kill9_loses_no_durable_page_and_serves_nothing_corrupt(tmp_path: Path) -> None:
    res = faults.kill9(tmp_path, rounds=KILL_ROUNDS, seed=1)
    _show(res)
    assert res.rounds == KILL_ROUNDS
    assert len(res.recovery_seconds) == KILL_ROUNDS + 1  # every restart came up
    assert res.corrupt_served == 0
    assert res.durable_lost == 0
    assert res.notes["durable_pages_at_end"] > 0  # pages did reach NVMe: the check had something to check
    assert res.notes["checksum_failures_at_restarts"] == 0  # a crash tears no header


def test_bit_rot_is_refused_and_every_refusal_counted(tmp_path: Path) -> None:
    res = faults.bitrot(tmp_path, rounds=3, flips_per_round=100, seed=2)
    _show(res)
    assert res.corrupt_served == 0
    assert res.errors == 0  # every restart and SIGTERM clean
    assert res.notes["refused"] > 0
    assert res.notes["refused"] == res.notes["checksum_failures_stats"] == res.notes["checksum_failures_metrics"]
    assert res.notes["metadata_rebuilt"]  # the flipped metadata byte was rebuilt from the segments


def test_disk_full_keeps_serving_and_exits_cleanly(tmp_path: Path) -> None:
    why = faults.can_mount_tmpfs(tmp_path / "probe")
    if why is not None:
        pytest.skip(why)
    res = faults.disk_full(tmp_path, seconds=4.0)
    _show(res)
    refusal = " ".join(res.notes["start_refusal"])  # type: ignore[arg-type]
    assert "does not fit" in refusal and "too-big" in refusal, refusal
    assert res.errors == 0, res.notes.get("put_errors")  # no Put failed while the disk was full
    assert "No space left on device" in str(res.notes["nvme_detail"])  # the failure shows in Stats
    assert res.notes["sigterm_exit_code"] == 0
    assert res.corrupt_served == 0
    assert res.notes["recovered_after_full"] > 0


def test_redis_restart_under_load(tmp_path: Path) -> None:
    res = faults.redis_outage(tmp_path, outages=1, down_seconds=2.0)
    _show(res)
    assert res.errors == 0  # local hits kept being served while Redis was down
    assert res.notes["index_unavailable_answers"] > 0  # and index lookups said so with a kvstore error
    assert res.recovery_seconds and res.recovery_max < 30  # target 5 s: a figure in RESULTS.md, not asserted


def test_stalled_consumers_do_not_hurt_others(tmp_path: Path) -> None:
    # NOTE: 8 streams of 2,048 pages ask for 256 MiB in all: a node that buffered what its stalled streams
    # asked for would grow by that; one that holds only their read-ahead grows by a few MiB (3 MiB measured).
    # A quarter of the whole ask is a bound noise cannot reach and buffering cannot pass.
    res = faults.slow_consumers(tmp_path, stalled=8, silent=8, seconds=3.0, stream_pages=2048)
    _show(res)
    assert res.errors == 0 and res.corrupt_served == 0
    assert res.notes["requests_after_release"] > 0
    ask, grown = res.notes["whole_ask_bytes"], res.notes["rss_growth_bytes"]
    assert ask >= 256 << 20 and grown < ask // 4, f"the node grew by {grown >> 20} MiB (the streams asked {ask >> 20})"
