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
    # NOTE: the node does not ask the policy admit() yet (issue 14, phase 2: the manager's wiring),
    # so it is compared with the simulation without admission. The simulation runs on the node's own
    # keys, so once the node asks admit(), admission=True here must agree too.
    sim = replay(node_requests(requests), TieredBlockCache(capacity, policy, admission=False))
    cache = NodeReplayCache(capacity, policy)
    try:
        node = replay(requests, cache)
    finally:
        cache.close()
    assert sim.blocks == node.blocks and sim.prefix_hits > 0
    assert (node.prefix_hits, node.block_hits) == (sim.prefix_hits, sim.block_hits)
