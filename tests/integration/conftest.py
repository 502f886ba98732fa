"""Real cache nodes in child processes on loopback (and one in this process: InProcessNode); every node a test
starts is stopped by it."""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.config import NodeConfig
from kvstore.layout import DType, PageLayout
from kvstore.node.server import Node
from kvstore.pageformat import HEADER_BYTES
from kvstore.wire.ucx import ucxx_installed

LAYOUT = PageLayout(DType.FLOAT16, num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)  # 16 KiB
PAGE = LAYOUT.page_bytes
SLOT = HEADER_BYTES + PAGE
NS = "it/llama-tiny/fp16"


def key(i: int, salt: str = "") -> bytes:
    return hashlib.sha256(f"{salt}{i}".encode()).digest()


def page(h: bytes, size: int = PAGE) -> bytes:
    return random.Random(h).randbytes(size)


def start_node(
    tmp_path: Path, dram_pages: int = 8, nvme_pages: int = 64, name: str = "n0", **kw: object
) -> NodeProcess:
    return NodeProcess(dram_bytes=dram_pages * SLOT, nvme_path=tmp_path / f"nvme-{name}", nvme_bytes=nvme_pages * SLOT,
                       max_page_bytes=PAGE, node_id=name, **kw).start()  # type: ignore[arg-type]  # fmt: skip


@pytest.fixture
def node(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[NodeProcess]:
    """A node; it serves the UCX plane (off by default) when the test's `kv` client is to use it."""
    callspec = getattr(request.node, "callspec", None)
    ucx = callspec is not None and callspec.params.get("kv") == "ucx"
    n = start_node(tmp_path, extra_args=["--ucx"] if ucx else [])
    try:
        yield n
    finally:
        n.close()


@pytest.fixture(params=["grpc", "shm", "tcp", *(["ucx"] if ucxx_installed() else [])])
def kv(node: NodeProcess, request: pytest.FixtureRequest) -> Iterator[KVStoreClient]:
    """A client of `node` over each data plane: gRPC streams, the same-host shared-memory plane, UCX."""
    with KVStoreClient(node.addr, timeout=30, transport=request.param) as c:
        yield c


def as_older_node(kv: KVStoreClient) -> KVStoreClient:
    """`kv`, reading the real node's Stats as a node that predates advertising max_pages_per_request sends them
    (the field absent): the client then cuts its calls by its own pages_per_call alone, as clients did before."""
    stats = kv._methods["Stats"]

    def older(request: object, **kw: object) -> object:
        reply = stats(request, **kw)
        reply.ClearField("max_pages_per_request")
        return reply

    kv._methods["Stats"] = older
    return kv


class InProcessNode:
    """A node on its own event loop in a thread of this process, so a test can reach its page table (and corrupt
    it as a mapping bug would). Its DRAM holds `dram_slots` slots of `page_bytes` (PAGE by default); every plane but UCX (where
    installed: UCX too); the same-host plane's socket under `tmp`."""

    def __init__(self, tmp: Path, dram_slots: int = 32, page_bytes: int = PAGE) -> None:
        cfg = NodeConfig(
            host="127.0.0.1",
            port=0,
            dram_bytes=dram_slots * (HEADER_BYTES + page_bytes),
            max_page_bytes=page_bytes,
            node_id="inproc",
            ucx_enabled=ucxx_installed(),
            local_socket=str(tmp / "inproc.sock"),
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="inproc-node", daemon=True)
        self.thread.start()

        async def make() -> Node:  # grpc.aio objects belong to the loop they are made in
            return Node(cfg)

        self.node = self.run(make())
        self.port = self.run(self.node.start())

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def call(self, fn: Any) -> Any:
        async def wrap() -> Any:
            return fn()

        return self.run(wrap())

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        try:
            self.run(self.node.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()


@pytest.fixture
def inproc(tmp_path: Path) -> Iterator[InProcessNode]:
    n = InProcessNode(tmp_path)
    try:
        yield n
    finally:
        n.close()
