"""Real cache nodes in child processes on loopback; every node a test starts is stopped by it."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
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
