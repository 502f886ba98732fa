"""A second node where one already serves (SECURITY.md, round 3, finding 7a): gRPC binds with SO_REUSEPORT by default, so a
second `kvstore serve` on a served port used to start, log "serving" and share the port's connections
with the first. Now it refuses, saying why, before it touches anything; and a second node on a served
NVMe directory refuses too (two nodes writing one directory's segment files would overwrite each
other's pages). The first node keeps serving, its pages intact."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.cli.waits import free_port
from kvstore.client import KVStoreClient
from tests.integration.conftest import LAYOUT, NS, SLOT, key, page, start_node


def test_a_second_node_on_a_served_port_or_directory_refuses_and_the_first_serves_on(tmp_path: Path) -> None:
    port = free_port()
    first = start_node(tmp_path, name="first", extra_args=["--port", str(port)])
    try:
        assert first.port == port
        chain = [key(i, "served") for i in range(3)]
        with KVStoreClient(first.addr, timeout=30) as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
        # The same port, another NVMe directory: refused, naming the address.
        second = NodeProcess(dram_bytes=8 * SLOT, nvme_path=tmp_path / "nvme-second", nvme_bytes=64 * SLOT,
                             max_page_bytes=LAYOUT.page_bytes, node_id="second", extra_args=["--port", str(port)])  # fmt: skip
        with pytest.raises(RuntimeError, match="node exited with 1") as refused:
            second.start()
        second.close()
        assert f"cannot serve on 127.0.0.1:{port}: the port is in use" in " ".join(str(refused.value).split())
        # Another port, the first node's NVMe directory: refused, naming the directory.
        third = NodeProcess(dram_bytes=8 * SLOT, nvme_path=tmp_path / "nvme-first", nvme_bytes=64 * SLOT,
                            max_page_bytes=LAYOUT.page_bytes, node_id="third")  # fmt: skip
        with pytest.raises(RuntimeError) as refused:
            third.start()
        assert "is in use by another kvstore node" in " ".join(str(refused.value).split())
        third.close()
        with KVStoreClient(first.addr, timeout=30) as kv:  # the first node was not disturbed
            assert [bytes(p) for p in kv.get(NS, chain)] == [page(h) for h in chain]
            assert kv.stats().node_id == "first"
    finally:
        first.close()


def test_a_served_tcp_plane_port_is_refused_by_name_with_nothing_else_printed(tmp_path: Path) -> None:
    """Another program serves the port given as --tcp-port: the node refuses, naming the plane, the address
    and the flag, and prints nothing past that one line (it used to say only "[Errno 98] Address already in
    use", then "Exception ignored in Server.__del__" with a traceback: the gRPC server it had started was
    never stopped)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    node = NodeProcess(dram_bytes=8 * SLOT, max_page_bytes=LAYOUT.page_bytes, node_id="plane-port",
                       extra_args=["--tcp-port", str(port), "--no-shm"])  # fmt: skip
    try:
        with pytest.raises(RuntimeError, match="node exited with 1"):
            node.start()
        said = node.log_path.read_text(errors="replace")
    finally:
        node.close()
        taken.close()
    flat = " ".join(said.split())
    assert f"cannot serve the TCP data plane on 127.0.0.1:{port}: the port is in use" in flat, said
    assert "choose another --tcp-port" in flat, said
    for stray in ("Errno", "Exception ignored", "Traceback", "RuntimeWarning", "never awaited"):
        assert stray not in said, f"{stray!r} in the node's output:\n{said}"
