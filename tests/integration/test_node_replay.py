"""A real node over gRPC runs the policy it claims: the same hit counts as the pure simulation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvstore.sim import replay, replay_policy, synthetic_workload

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from node_replay import NodeReplayCache


@pytest.mark.parametrize("policy", ["lru", "prefix-arc"])
def test_node_replay_agrees_with_simulation(policy: str) -> None:
    requests = synthetic_workload("mixed", 60, seed=3)
    capacity = 48  # small enough that eviction decisions matter on every request
    sim, _ = replay_policy(requests, capacity, policy)
    cache = NodeReplayCache(capacity, policy)
    try:
        node = replay(requests, cache)
    finally:
        cache.close()
    assert sim.blocks == node.blocks and sim.prefix_hits > 0
    assert (node.prefix_hits, node.block_hits) == (sim.prefix_hits, sim.block_hits)
