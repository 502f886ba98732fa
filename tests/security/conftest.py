"""Helpers of the security suite (SECURITY.md): real nodes, a real redis-server, a fake node that records
what it is sent, and RSS readings. Every process or server a test starts is stopped by that test."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from devkit.pki import DevPki, make_dev_pki
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.cli.launch import NodeProcess
from tests.integration.conftest import start_node

WRITE = "w-" + "a" * 30
READ = "r-" + "b" * 30
SERVICE = "/kvstore.v1.KVStore/"


def private_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def token_args(tmp_path: Path) -> list[str]:
    """Flags of a node with one read-write and one read-only token, in private files."""
    w = private_file(tmp_path / "write.tokens", WRITE + "\n")
    r = private_file(tmp_path / "read.tokens", READ + "\n")
    return ["--auth-tokens-file", str(w), "--auth-read-tokens-file", str(r)]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def wait_for(cond: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def cleanup() -> Iterator[contextlib.ExitStack]:
    """Register what a test starts (`cleanup.callback(x.close)`) right after starting it: all of it is
    stopped at teardown even when the test fails half-way."""
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture
def secured_node(tmp_path: Path) -> Iterator[NodeProcess]:
    """A real node with a read-write and a read-only token (WRITE, READ)."""
    node = start_node(tmp_path, name="sec", extra_args=token_args(tmp_path))
    try:
        yield node
    finally:
        node.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return make_dev_pki(tmp_path_factory.mktemp("pki"), node_ids=("n0", "n1", "evil"))


class FakeNode(grpc.GenericRpcHandler):
    """A gRPC server on loopback posing as a cache node. It records each call's method and metadata
    (so a test can see whether a token reached it) and misbehaves as `mode` says:
    "unimplemented" (every call), "garbage" (undecodable replies), "wrong-hash" (Stats answers, Get
    streams a page under a hash nobody asked for)."""

    def __init__(self, mode: str, credentials: grpc.ServerCredentials | None = None) -> None:
        self.mode = mode
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.server = grpc.server(ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((self,))
        bind = "127.0.0.1:0"
        self.port = (
            self.server.add_secure_port(bind, credentials) if credentials else self.server.add_insecure_port(bind)
        )
        self.server.start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def tokens_seen(self) -> list[str]:
        return [md["authorization"] for _, md in self.calls if "authorization" in md]

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        md = {k: v if isinstance(v, str) else v.decode() for k, v in details.invocation_metadata}
        self.calls.append((details.method, md))
        method = details.method.removeprefix(SERVICE)

        def answer(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
            next(iter(requests), None)
            if self.mode == "unimplemented":
                context.abort(grpc.StatusCode.UNIMPLEMENTED, "no such method here")
            if self.mode == "garbage":
                yield b"\xff\xff\xff\xff garbage"
                return
            if method == "Stats":
                yield pb.StatsResponse(node_id="evil").SerializeToString()
                return
            page = b"\x07" * 4096
            yield pb.GetResponse(
                page=pb.GetPage(hash=b"\x01" * 32, payload_bytes=len(page), tier=2)
            ).SerializeToString()
            yield pb.GetResponse(chunk=page).SerializeToString()

        return grpc.stream_stream_rpc_method_handler(answer, None, None)

    def stop(self) -> None:
        self.server.stop(grace=None).wait(10)
