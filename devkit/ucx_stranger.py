"""A UCX peer that never says HELLO: what an attacker on the fabric can open toward a node's UCX plane
(tests/security/test_ucx_plane.py, benchmarks/ucx_flood_bench.py)."""

from __future__ import annotations

import time
from typing import Any

from kvstore.wire.ucx import load_ucxx, parse_address


def stranger(address: str, path: str, extra_features: tuple[str, ...] = ()) -> tuple[Any, Any, Any]:
    """(ucx, worker, endpoint): a fresh worker (blocking progress) with an endpoint to the node whose UCX
    plane is advertised as `address`, by its worker address (`path` "worker") or its listener ("listener"),
    in peer-failure mode. `extra_features`: ucx.Feature names beyond TAG and WAKEUP (e.g. "STREAM", "AM")."""
    ucx = load_ucxx()
    addr = parse_address(address)
    features = (ucx.Feature.TAG, ucx.Feature.WAKEUP, *(getattr(ucx.Feature, f) for f in extra_features))
    worker = ucx.UCXWorker(ucx.UCXContext({}, feature_flags=features))
    worker.init_blocking_progress_mode()
    if path == "worker":
        ep = ucx.UCXEndpoint.create_from_worker_address(worker, ucx.UCXAddress.create_from_buffer(addr.worker), True)
    elif path == "listener":
        ep = ucx.UCXEndpoint.create(worker, addr.host, addr.port, True)
    else:
        raise ValueError(f"path must be 'worker' or 'listener', got {path!r}")
    return ucx, worker, ep


def settle(worker: Any, reqs: list[Any], seconds: float) -> int:
    """Progress until `reqs` completed or `seconds` passed (an attacker does not care which); how many did."""
    deadline = time.monotonic() + seconds
    while not all(r.completed for r in reqs) and time.monotonic() < deadline:
        worker.progress_worker_event(20)
    return sum(r.completed for r in reqs)
