"""An auto-mode client comes back to the fast plane after a node restart (DESIGN.md §8.1; SECURITY.md, round 3, finding 7e). The restarted
node serves its TCP plane on a new port, so the client's plane fails (PlaneUnavailable) and its calls go
over gRPC streams; it used to stay there for good. Now it negotiates again after a bounded interval
(kvstore/client/core.py PLANE_RETRY_SECONDS) and is back on the TCP plane, with no call failing on the
way once the node answers again. An explicit transport="tcp" client follows the node too."""

from __future__ import annotations

import time
from pathlib import Path

from kvstore.cli.waits import free_port
from kvstore.client import KVStoreClient
from kvstore.client.core import PLANE_RETRY_MAX_SECONDS
from kvstore.errors import KVStoreError
from tests.integration.conftest import LAYOUT, NS, key, page, start_node


def _tcp_port(kv: KVStoreClient) -> str:
    return next(p.address for p in kv.stats().planes if p.name == "tcp")


def test_an_auto_client_returns_to_the_tcp_plane_after_a_node_restart(tmp_path: Path) -> None:
    port = free_port()
    args = ["--port", str(port), "--no-shm"]  # same gRPC port across the restart; TCP is the fast plane
    node = start_node(tmp_path, name="comeback", extra_args=args)
    chain = [key(i, "comeback") for i in range(3)]
    try:
        with KVStoreClient(node.addr, timeout=30) as auto, KVStoreClient(node.addr, timeout=30, transport="tcp") as tcp:
            auto.put(NS, LAYOUT, chain, [page(h) for h in chain])
            assert auto.plane == "tcp" and [bytes(p) for p in tcp.get(NS, chain)] == [page(h) for h in chain]
            old = _tcp_port(auto)
            assert node.stop() == 0  # SIGTERM: the pages spill to NVMe, the node comes back warm
            node.start()
            assert node.port == port and _tcp_port(auto) != old
            deadline = time.monotonic() + 10 + 2 * PLANE_RETRY_MAX_SECONDS
            planes: list[str | None] = []
            while time.monotonic() < deadline:
                try:
                    got = auto.get(NS, chain)
                except KVStoreError:  # only while the gRPC channel reconnects to the restarted node
                    assert not planes, "a call failed after the client had been served again"
                    time.sleep(0.2)
                    continue
                assert [bytes(p) for p in got] == [page(h) for h in chain]
                planes.append(auto.plane)
                if auto.plane == "tcp":
                    break
                time.sleep(0.2)
            assert planes[-1] == "tcp", planes  # back on the fast plane...
            assert "grpc" in planes  # ...after serving from gRPC streams meanwhile
            # The explicit client raised once (its plane moved), then follows the node's new address.
            for _ in range(2):
                try:
                    got = tcp.get(NS, chain)
                    break
                except KVStoreError:
                    continue
            assert [bytes(p) for p in got] == [page(h) for h in chain]
    finally:
        node.close()
