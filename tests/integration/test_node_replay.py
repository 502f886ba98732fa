"""A real node over gRPC runs the policy it claims: the same hit counts as the pure simulation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from devkit.sim import TieredBlockCache, replay
from devkit.workloads import generate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from node_replay import NodeReplayCache, node_requests


@pytest.mark.parametrize("policy", ["lru", "prefix-arc", "tinylfu", "adaptive"])
def test_node_replay_agrees_with_simulation(policy: str) -> None:
    requests = generate("tenants", 60, seed=3)
    capacity = 48  # small enough that eviction decisions matter on every request
    # The simulation runs on the node's own keys and asks admit() where the node's manager does (a
    # full DRAM tier taking a new page; with no NVMe, a refused page is not stored), so the decisions agree.
    sim = replay(node_requests(requests), TieredBlockCache(capacity, policy, admission=True))
    cache = NodeReplayCache(capacity, policy)
    try:
        node = replay(requests, cache)
    finally:
        cache.close()
    assert sim.blocks == node.blocks and sim.prefix_hits > 0
    assert (node.prefix_hits, node.block_hits) == (sim.prefix_hits, sim.block_hits)
