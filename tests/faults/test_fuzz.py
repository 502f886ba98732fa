"""Fuzzing the wire API of a real node (devkit/fuzz.py): Hypothesis strategies over the proto messages
and raw frames, on every data plane the node serves (gRPC unary, Put streams, shared memory, the TCP
plane's own frames: devkit/fuzz_tcp.py).

Invariants, after every request: the node answers, the status code is the one expected (exact for a
message with one broken field; INVALID_ARGUMENT for bytes that do not parse; never INTERNAL or UNKNOWN),
and Stats is unchanged after every request that may not change state. At least 10,000 requests in CI
(KVSTORE_FUZZ_REQUESTS raises it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from devkit.fuzz import FuzzTarget, default_planes, run_fuzz, setup_target
from devkit.fuzz_shm import ShmPlane
from devkit.fuzz_tcp import TcpPlane
from kvstore.cli.launch import NodeProcess

REQUESTS = int(os.environ.get("KVSTORE_FUZZ_REQUESTS", "10000"))


@pytest.fixture(scope="module")
def fuzz_node() -> Iterator[NodeProcess]:
    # DRAM only and never full: no background promotion, demotion or eviction changes Stats between reads.
    node = NodeProcess(dram_bytes="96MiB", max_page_bytes=4096, node_id="fuzz").start()
    try:
        yield node
    finally:
        node.close()


@pytest.fixture(scope="module")
def target(fuzz_node: NodeProcess) -> Iterator[FuzzTarget]:
    t = setup_target(fuzz_node.addr)
    try:
        yield t
    finally:
        t.close()


@pytest.mark.timeout(900)
def test_fuzzed_requests_keep_the_node_up_and_answer_the_right_code(fuzz_node: NodeProcess, target: FuzzTarget) -> None:
    planes = [*default_planes(), TcpPlane(), ShmPlane()]
    log = run_fuzz(target, REQUESTS, planes)
    assert fuzz_node.proc is not None and fuzz_node.proc.poll() is None, "the node died"
    assert target.state()["node_id"] == "fuzz"  # still answering
    assert log.requests >= REQUESTS, log.requests
    planes_seen = {label.split(" | ")[0] for label in log.by_label}
    assert planes_seen == {p.name for p in planes}, planes_seen
    if os.environ.get("KVSTORE_FUZZ_VERBOSE"):
        print("\n".join(f"{n:6d}  {k}" for k, n in sorted(log.by_label.items())))
    print(f"\nfuzzed {log.requests} requests ({target.sent} RPCs) over {len(log.by_label)} (case, code) kinds")
