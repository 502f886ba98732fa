"""The conformance table, asserted row by row (devkit/conformance.py; benchmarks/conformance.py prints it).

Two doors, each against its recompute (the same model and settings with no cache):
- vLLM (CPU build) -> LMCache's multiprocess server -> kvstore's L2 adapter -> a node: the session's
  `vllm_conformance` flow (tests/engines/conftest.py), 4 prefix pages (LMCache chunks), 4 greedy tokens;
- kvstore's Ray workers (prefill -> decode through the router, `kvstore generate`'s path) on a LocalStack:
  4 prefix pages (blocks), 4 greedy tokens. Needs no engine venv, so it runs with the other tests.

A row passes when its scenario shows what it must (devkit/conformance.py, `Row.passed`): a hit with the
recompute's greedy tokens and log-probabilities within the door's tolerance after an engine or a node
restart; a miss (from the bad page on) with the recompute's outputs for a damaged page, a misfiled page
(another request's page under this one's key, headers re-sealed) and a changed dtype or block size; and
changed outputs for the control (a wrong page with a valid checksum, served), which shows the model would
reveal a wrong KV cache at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from devkit.conformance import DoorRun, Row, Scenario, workers_door

# The vLLM flow (five engine starts) runs inside the first test that asks for it.
pytestmark = pytest.mark.timeout(2400)
VLLM_SCENARIOS = [Scenario.ENGINE_RESTART, Scenario.NODE_RESTART, Scenario.DAMAGED, Scenario.MISFILED,
                  Scenario.CONTROL, Scenario.CHANGED_DTYPE]  # fmt: skip
WORKERS_SCENARIOS = [Scenario.COLD, *VLLM_SCENARIOS, Scenario.CHANGED_BLOCK]


def explain(row: Row, run: DoorRun) -> str:
    ref = run.results["recompute"]
    got = next(v for k, v in run.results.items() if row.scenario.startswith(k))
    return (f"{row.door} / {row.scenario}: expected {row.expect}; got {row.outcome} {row.cached_pages}/{row.prefix_pages} "
            f"pages from the cache, tokens {got['tokens']} vs recompute {ref['tokens']}, max |dlogprob| "
            f"{row.max_logprob_diff:.3g} (tolerance {row.tolerance:g}); {row.detail}")  # fmt: skip


@pytest.fixture(scope="module")
def workers_run(tmp_path_factory: pytest.TempPathFactory) -> DoorRun:
    return workers_door(tmp_path_factory.mktemp("conformance-workers"), prefix_blocks=4, max_new_tokens=4)


def test_every_scenario_has_a_row(workers_run: DoorRun) -> None:
    assert [r.scenario.split(" (")[0] for r in workers_run.rows] == [s.split(" (")[0] for s in WORKERS_SCENARIOS]


@pytest.mark.parametrize("scenario", WORKERS_SCENARIOS, ids=lambda s: s.name.lower())
def test_ray_workers(workers_run: DoorRun, scenario: Scenario) -> None:
    row = workers_run.row(scenario)
    assert row.passed, explain(row, workers_run)


def test_ray_workers_damaged_page_is_counted_and_recomputed_from_it(workers_run: DoorRun) -> None:
    """The damaged block (block 1) is where the prefix ends: block 0 came from the cache, the node counted the
    failure."""
    row = workers_run.row(Scenario.DAMAGED)
    assert row.cached_pages == 1, explain(row, workers_run)
    assert "checksum failures 1" in row.detail, row.detail


def test_ray_workers_misfiled_page_ends_the_prefix(workers_run: DoorRun) -> None:
    """Block 1 holds another request's block 1 (and that one block 1's): a miss from block 1 on, not later."""
    row = workers_run.row(Scenario.MISFILED)
    assert row.cached_pages == 1, explain(row, workers_run)


def test_ray_workers_node_restart_serves_from_nvme(workers_run: DoorRun) -> None:
    row = workers_run.row(Scenario.NODE_RESTART)
    assert "prefill took nvme 4 from the cache" in row.detail, row.detail


@pytest.mark.parametrize("scenario", VLLM_SCENARIOS, ids=lambda s: s.name.lower())
def test_vllm_through_lmcache_l2(vllm_conformance: DoorRun, scenario: Scenario) -> None:
    row = vllm_conformance.row(scenario)
    assert row.passed, explain(row, vllm_conformance)


def test_vllm_changed_dtype_reads_nothing_from_the_node(vllm_conformance: DoorRun) -> None:
    """fp16 pages are not bf16 pages: the node serves none of the stored prefix to the fp16 engine."""
    row = vllm_conformance.row(Scenario.CHANGED_DTYPE)
    assert "node served 0 pages" in row.detail, row.detail


def test_the_benchmark_writes_the_table(workers_run: DoorRun, tmp_path: Path) -> None:
    """benchmarks/conformance.py's table and JSON from a run (the rows asserted above)."""
    import argparse
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import conformance as bench  # benchmarks/conformance.py
    finally:
        sys.path.pop(0)
    args = argparse.Namespace(doors=["workers"], prefix_chunks=4, prefix_blocks=4, max_tokens=4)
    text = bench.markdown([workers_run], {}, 1.0, args)
    assert text.count("\n| kvstore Ray workers") == len(WORKERS_SCENARIOS)
    doc = json.loads(json.dumps(workers_run.as_dict()))
    assert {r["scenario"].split(" (")[0] for r in doc["rows"]} == {s.split(" (")[0] for s in WORKERS_SCENARIOS}
