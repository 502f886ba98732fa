"""Bad input over real gRPC: a clear status naming the field, and nothing stored.

Uses the raw stub so the requests can be malformed in ways the client never produces.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.errors import LayoutMismatch, NamespaceNotFound, ResourceExhausted
from kvstore.layout import DType, PageLayout
from kvstore.pageformat import payload_checksum
from kvstore.wire.streams import layout_to_pb
from tests.integration.conftest import LAYOUT, NS, PAGE, key, page, start_node

MiB = 1 << 20


@pytest.fixture(scope="module")
def shared_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    n = start_node(tmp_path_factory.mktemp("bad"), dram_pages=4, nvme_pages=0)
    try:
        yield n
    finally:
        n.close()


@pytest.fixture(scope="module")
def stub(shared_node: NodeProcess) -> Iterator[pb_grpc.KVStoreStub]:
    with grpc.insecure_channel(shared_node.addr) as ch:
        yield pb_grpc.KVStoreStub(ch)


def opened(ns: str = NS, layout: PageLayout = LAYOUT) -> pb.PutRequest:
    return pb.PutRequest(open=pb.PutOpen(namespace=ns, layout=layout_to_pb(layout)))


def header(h: bytes, n: int = PAGE, checksum: int = 0) -> pb.PutRequest:
    return pb.PutRequest(page=pb.PutPage(hash=h, payload_bytes=n, checksum=checksum))


def chunk(b: bytes) -> pb.PutRequest:
    return pb.PutRequest(chunk=b)


def whole(h: bytes) -> list[pb.PutRequest]:
    return [header(h), chunk(page(h))]


def expect(stub: pb_grpc.KVStoreStub, msgs: list[pb.PutRequest], code: grpc.StatusCode, field: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Put(iter(msgs), timeout=30)
    assert info.value.code() == code, info.value.details()
    assert field in info.value.details(), info.value.details()


def stored(stub: pb_grpc.KVStoreStub, *hashes: bytes, ns: str = NS) -> int:
    try:
        return stub.Lookup(pb.LookupRequest(namespace=ns, hashes=list(hashes)), timeout=10).matched_blocks
    except grpc.RpcError:
        return 0


INVALID = grpc.StatusCode.INVALID_ARGUMENT
CASES = {
    "no open first": ([header(key(1)), chunk(page(key(1)))], INVALID, "open"),
    "empty stream": ([], INVALID, "open"),
    "open twice": ([opened(), opened()], INVALID, "open"),
    "chunk before header": ([opened(), chunk(b"x" * 10)], INVALID, "chunk"),
    "hash not 32 bytes": ([opened(), header(b"\x01" * 31), chunk(b"x" * PAGE)], INVALID, "page.hash"),
    "page size not the layout's": ([opened(), header(key(1), PAGE - 2), chunk(b"x" * (PAGE - 2))], INVALID, "page.payload_bytes"),
    "page longer than announced": ([opened(), header(key(1)), chunk(page(key(1))), chunk(b"x")], INVALID, "chunk"),
    "truncated stream": ([opened(), *whole(key(2)), header(key(1)), chunk(page(key(1))[:1000])], INVALID, "truncated"),
    "out of order: header mid page": ([opened(), header(key(1)), chunk(page(key(1))[:100]), *whole(key(2))], INVALID, "page"),
    "oversize chunk": ([opened(), header(key(1)), chunk(b"x" * (MiB + 1))], INVALID, "chunk"),
    "empty namespace": ([opened(ns=""), *whole(key(1))], INVALID, "namespace"),
    "control char namespace": ([opened(ns="a\x00b"), *whole(key(1))], INVALID, "namespace"),
    "dtype unspecified": ([pb.PutRequest(open=pb.PutOpen(namespace=NS, layout=pb.PageLayout(num_layers=1)))], INVALID, "dtype"),
    "zero-sized layout": ([pb.PutRequest(open=pb.PutOpen(namespace=NS, layout=pb.PageLayout(dtype=1)))], INVALID, "open.layout"),
    "page bigger than slots": ([opened(layout=PageLayout(DType.FLOAT32, 64, 8, 128, 16))], INVALID, "max_page_bytes"),
    "declared checksum wrong": ([opened(), header(key(1), checksum=payload_checksum(page(key(1))) ^ 1), chunk(page(key(1)))],
                                grpc.StatusCode.DATA_LOSS, "checksum"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_put_stores_nothing(stub: pb_grpc.KVStoreStub, case: str) -> None:
    msgs, code, field = CASES[case]
    expect(stub, msgs, code, field)
    assert stored(stub, key(1)) == 0 and stored(stub, key(2)) == 0


def test_good_put_still_works_after_bad_ones(stub: pb_grpc.KVStoreStub) -> None:
    r = stub.Put(iter([opened(ns="after"), *whole(key(5))]), timeout=30)
    assert r.stored == 1 and stored(stub, key(5), ns="after") == 1


@pytest.mark.parametrize(
    ("rpc", "req"),
    [
        ("Lookup", pb.LookupRequest(namespace=NS, hashes=[b"\x00" * 33])),
        ("Lookup", pb.LookupRequest(namespace="", hashes=[key(1)])),
        ("Lookup", pb.LookupRequest(namespace=NS, hashes=[key(1)] * 65537)),
        ("Delete", pb.DeleteRequest(namespace=NS, hashes=[b"short"])),
        ("Pin", pb.PinRequest(namespace=NS, hashes=[key(1)], ttl_seconds=-1)),
        ("Prefetch", pb.PrefetchRequest(namespace=NS, hashes=[key(1)], target_tier=pb.TIER_NVME)),
    ],
)
def test_unary_bad_input(stub: pb_grpc.KVStoreStub, rpc: str, req: object) -> None:
    stub.Put(iter([opened(), *whole(key(9))]), timeout=30)  # make NS known so only the bad field fails
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, rpc)(req, timeout=30)
    assert info.value.code() == INVALID, info.value.details()


def test_get_bad_hash_and_unknown_namespace(stub: pb_grpc.KVStoreStub) -> None:
    stub.Put(iter([opened(), *whole(key(9))]), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Get(pb.GetRequest(namespace=NS, hashes=[key(9), b"x"]), timeout=30))
    assert info.value.code() == INVALID and "hashes[1]" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Get(pb.GetRequest(namespace="never-seen", hashes=[key(9)]), timeout=30))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "never-seen" in info.value.details()


def test_client_raises_typed_errors(shared_node: NodeProcess) -> None:
    with KVStoreClient(shared_node.addr) as kv:
        kv.put(NS, LAYOUT, [key(9)], [page(key(9))])
        with pytest.raises(NamespaceNotFound):
            kv.get("nobody-home", [key(9)])
        with pytest.raises(LayoutMismatch):
            kv.put(NS, PageLayout(DType.FLOAT16, 1, 2, 64, 16), [key(10)], [b"\x00" * 8192])
        assert kv.lookup(NS, [key(10)]) == 0


def test_full_with_everything_pinned_is_resource_exhausted(tmp_path: Path) -> None:
    n = start_node(tmp_path, dram_pages=2, nvme_pages=0, name="full")
    try:
        with KVStoreClient(n.addr) as kv:
            hs = [key(i, "f") for i in range(3)]
            kv.put(NS, LAYOUT, hs[:2], [page(h) for h in hs[:2]])
            kv.pin(NS, hs[:2])
            with pytest.raises(ResourceExhausted, match="pinned"):
                kv.put(NS, LAYOUT, hs[2:], [page(hs[2])])
            assert kv.lookup(NS, hs) == 2 and kv.stats().put_rejected == 1
    finally:
        n.close()


def test_cancelled_put_stream_stores_nothing(stub: pb_grpc.KVStoreStub) -> None:
    def gen() -> Iterator[pb.PutRequest]:
        yield opened()
        yield header(key(42))
        yield chunk(page(key(42))[:4096])
        raise RuntimeError("client died mid-stream")

    with pytest.raises(grpc.RpcError) as info:
        stub.Put(gen(), timeout=30)
    assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, INVALID)
    assert stored(stub, key(42)) == 0


def test_rejected_streams_leak_no_slots(stub: pb_grpc.KVStoreStub) -> None:
    """Runs after the cases above on the same node: every staged slot was given back."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the server may finish aborting a cancelled stream just after
        dram = stub.Stats(pb.StatsRequest(), timeout=10).tiers[1]
        if dram.slots_used == dram.pages:
            break
        time.sleep(0.05)
    assert dram.slots_used == dram.pages
