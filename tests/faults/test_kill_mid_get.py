"""A node killed (SIGKILL) while it streams a Get, on every plane: the caller gets an error or a miss (a correct
prefix), never wrong bytes, and never hangs past its timeout (DESIGN.md §8.4)."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.layout import DType, PageLayout
from kvstore.pageformat import slot_bytes_for
from kvstore.wire.ucx import ucxx_installed

LAYOUT = PageLayout(DType.FLOAT16, num_layers=32, num_kv_heads=2, head_dim=64, block_size=16)  # 256 KiB pages
PAGES = 64
NS = "faults/kill-mid-get"
PLANES = ["grpc", "shm", "tcp", *(["ucx"] if ucxx_installed() else [])]


def page(h: bytes) -> bytes:
    return hashlib.shake_256(h).digest(LAYOUT.page_bytes)


@pytest.mark.parametrize("plane", PLANES)
def test_a_node_killed_mid_get_gives_an_error_or_a_correct_prefix(tmp_path: Path, plane: str) -> None:
    node = NodeProcess(
        dram_bytes=(PAGES + 8) * slot_bytes_for(LAYOUT.page_bytes),
        max_page_bytes=LAYOUT.page_bytes,
        node_id="victim",
        extra_args=["--ucx"] if plane == "ucx" else [],
        env={"UCX_NET_DEVICES": "lo", "KVSTORE_UCX_IO_TIMEOUT_SECONDS": "3"},
    ).start()
    hs = [hashlib.sha256(f"kill-{plane}-{i}".encode()).digest() for i in range(PAGES)]
    wrong: list[str] = []
    outcomes: dict[str, int] = {"complete": 0, "prefix": 0, "error": 0}
    stop = threading.Event()
    try:
        with KVStoreClient(node.addr, transport=plane, timeout=10) as kv:
            kv.put(NS, LAYOUT, hs, [page(h) for h in hs])

            def reader() -> None:
                deadline = time.monotonic() + 30
                while not stop.is_set() and time.monotonic() < deadline:
                    try:
                        got = kv.get_pages(NS, hs)
                    except KVStoreError:
                        outcomes["error"] += 1
                        if node.proc is None or node.proc.poll() is not None:
                            return  # the node is gone: errors from here on
                        continue
                    for p in got:
                        if bytes(p.data) != page(p.hash):
                            wrong.append(p.hash.hex())
                    outcomes["complete" if len(got) == PAGES else "prefix"] += 1

            t = threading.Thread(target=reader)
            t.start()
            time.sleep(1.0)  # some gets done, one in flight
            assert node.proc is not None
            os.kill(node.proc.pid, signal.SIGKILL)
            t.join(40)
            stop.set()
            assert not t.is_alive(), "a get outlived its timeout after the node died"
    finally:
        stop.set()
        node.close()
    assert not wrong, f"wrong bytes handed out for {len(wrong)} page(s)"
    assert outcomes["complete"] >= 1 and outcomes["error"] >= 1, outcomes
