"""The same-host shared-memory data plane on real nodes: round trips, fallback, and every bad request."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.client.planes import shm as shm_client
from kvstore.client.planes.segments import SharedBuffer, SharedBuffers
from kvstore.errors import ShmNotAvailable
from kvstore.layout import DType, PageLayout
from kvstore.names import TierKind
from kvstore.pageformat import align_up, payload_checksum
from kvstore.security import WRITE_METHODS
from kvstore.stats import PlaneInfo
from kvstore.wire import shm
from kvstore.wire.streams import layout_to_pb
from tests.integration.conftest import LAYOUT, NS, PAGE, key, page, start_node

pytestmark = pytest.mark.skipif(not shm.shm_available(), reason="needs a writable /dev/shm")


@pytest.fixture(scope="module")
def shm_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    n = start_node(tmp_path_factory.mktemp("shm"), dram_pages=8, nvme_pages=64, name="shm0")
    try:
        yield n
    finally:
        n.close()


@pytest.fixture
def stub(shm_node: NodeProcess) -> Iterator[pb_grpc.KVStoreStub]:
    with grpc.insecure_channel(shm_node.addr) as ch:
        yield pb_grpc.KVStoreStub(ch)


@pytest.fixture
def seg() -> Iterator[shm_client.ClientSegment]:
    s = shm_client.ClientSegment(shm.HEADER_BYTES + 4 * align_up(PAGE))
    try:
        yield s
    finally:
        s.close()


def test_round_trip_through_dram_and_nvme_matches_grpc(shm_node: NodeProcess) -> None:
    chain = [key(i, "rt") for i in range(20)]  # 8 DRAM slots: most of the chain is demoted to NVMe
    with KVStoreClient(shm_node.addr, transport="shm") as fast, KVStoreClient(shm_node.addr, transport="grpc") as slow:
        assert fast.put(NS, LAYOUT, chain, [page(h) for h in chain]).stored == 20
        assert fast.lookup_detail(NS, chain).tiers.count(TierKind.NVME) > 0
        via_shm = fast.get_pages(NS, [*chain, key(999, "absent")], promote=False)
        via_grpc = slow.get_pages(NS, chain, promote=False)
        assert [bytes(p.data) for p in via_shm] == [bytes(p.data) for p in via_grpc] == [page(h) for h in chain]
        assert [p.tier for p in via_shm] == [p.tier for p in via_grpc]
        assert {p.tier for p in via_shm} == {TierKind.DRAM, TierKind.NVME}
        other = [key(i, "rt-grpc") for i in range(3)]
        slow.put(NS, LAYOUT, other, [page(h) for h in other])  # written by gRPC, read by shm
        assert [bytes(p) for p in fast.get(NS, other)] == [page(h) for h in other]
        assert fast.put(NS, LAYOUT, other, [page(h) for h in other]).already_present == 3


def test_windows_grow_to_fit_pages_bigger_than_the_first_guess(tmp_path: Path) -> None:
    big = PageLayout(DType.FLOAT16, num_layers=64, num_kv_heads=2, head_dim=64, block_size=16)  # 512 KiB pages
    node = NodeProcess(dram_bytes=8 * align_up(big.page_bytes + 4096), max_page_bytes=big.page_bytes,
                       node_id="big").start()  # fmt: skip
    try:
        chain = [key(i, "big") for i in range(6)]
        pages = [os.urandom(big.page_bytes) for _ in chain]
        with KVStoreClient(node.addr, transport="shm", pages_per_stream=4) as kv:
            kv.put("ns/big", big, chain, pages)
        with KVStoreClient(node.addr, transport="shm", pages_per_stream=4) as kv:  # no segment yet
            assert kv._core.active.page_hint < big.page_bytes  # its first window holds 2 of the 4 pages it asks for
            assert [bytes(p) for p in kv.get("ns/big", chain)] == pages
            assert kv._core.active.page_hint >= big.page_bytes
    finally:
        node.close()


def test_a_node_without_shm_falls_back_or_refuses_as_asked(tmp_path: Path) -> None:
    node = start_node(tmp_path, name="noshm", extra_args=["--no-shm", "--no-tcp"])
    try:
        chain = [key(i, "fb") for i in range(3)]
        with KVStoreClient(node.addr, transport="auto") as kv:
            assert "shm" not in [p.name for p in kv.stats().planes] and kv.plane is None  # none chosen yet
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
            assert kv.plane == "grpc"  # the node does not offer shm: gRPC streams
            assert [bytes(p) for p in kv.get(NS, chain)] == [page(h) for h in chain]
        with KVStoreClient(node.addr, transport="shm") as kv, pytest.raises(ShmNotAvailable, match="without"):
            kv.get(NS, chain)
    finally:
        node.close()


def test_a_same_host_client_negotiates_shm(shm_node: NodeProcess) -> None:
    with KVStoreClient(shm_node.addr) as kv:
        assert kv.stats().planes[0] == PlaneInfo("shm")  # then the TCP plane (and UCX where turned on)
        h = key(0, "nego")
        kv.put(NS, LAYOUT, [h], [page(h)])
        assert kv.plane == "shm"


def test_concurrent_threads_share_one_client(shm_node: NodeProcess) -> None:
    errors: list[BaseException] = []
    with KVStoreClient(shm_node.addr, transport="shm") as kv:

        def worker(w: int) -> None:
            try:
                for r in range(5):
                    hs = [key(i, f"cc{w}-{r}") for i in range(3)]
                    kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
                    got = kv.get(NS, hs)
                    assert all(bytes(p) == page(h) for p, h in zip(got, hs, strict=False)) and got
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        segs = list(shm.SHM_DIR.glob(f"kvstore-{os.getpid()}-*"))
        assert 1 <= len(segs) <= 4  # one per concurrent call at most, reused
    assert not errors, errors
    assert not list(shm.SHM_DIR.glob(f"kvstore-{os.getpid()}-*"))  # close() unlinked them


def test_orphaned_segments_of_dead_clients_are_swept(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = "from kvstore.client.planes.shm import ClientSegment; s = ClientSegment(1 << 16); print(s.name)"
    proc = subprocess.run([sys.executable, "-c", f"{code}; import os; os._exit(0)"], capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    name = proc.stdout.strip()
    assert (shm.SHM_DIR / name).exists()  # the process died without unlinking
    assert shm_client.sweep_stale() >= 1
    assert not (shm.SHM_DIR / name).exists()


# -- bad requests: a clear INVALID_ARGUMENT naming the field, and nothing stored ------------------------


def put_req(seg: shm_client.ClientSegment, h: bytes, **slice_fields: int) -> pb.PutShmRequest:
    data = page(h)
    seg.view[shm.HEADER_BYTES : shm.HEADER_BYTES + len(data)] = data
    fields = {"offset": shm.HEADER_BYTES, "payload_bytes": len(data), "checksum": payload_checksum(data)}
    fields.update(slice_fields)
    return pb.PutShmRequest(open=pb.PutOpen(namespace=NS, layout=layout_to_pb(LAYOUT)),
                            region=pb.ShmRegion(name=seg.name, nonce=seg.nonce),
                            pages=[pb.ShmSlice(hash=h, **fields)])  # fmt: skip


def stored(stub: pb_grpc.KVStoreStub, h: bytes) -> int:
    return stub.Lookup(pb.LookupRequest(namespace=NS, hashes=[h]), timeout=30).matched_blocks


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: r.region.__setattr__("name", "../etc/passwd"), "region.name"),
        (lambda r: r.region.__setattr__("name", "kvstore-x"), "region.name"),
        (lambda r: r.region.__setattr__("nonce", b"short"), "region.nonce"),
        (lambda r: r.pages[0].__setattr__("offset", 8), "pages[0]"),
        (lambda r: r.pages[0].__setattr__("offset", 10 << 20), "pages[0]"),
        (lambda r: r.pages[0].__setattr__("payload_bytes", PAGE - 2), "payload"),
        (lambda r: r.pages[0].__setattr__("checksum", 12345), "checksum"),
        (lambda r: r.ClearField("open"), "open"),
        (lambda r: r.pages[0].__setattr__("hash", b"x" * 5), "hash"),
    ],
)
def test_bad_put_shm_is_refused_and_stores_nothing(stub: pb_grpc.KVStoreStub, seg: shm_client.ClientSegment,
                                                   mutate: object, field: str) -> None:  # fmt: skip
    h = key(0, f"bad-shm-{field}")
    req = put_req(seg, h)
    mutate(req)  # type: ignore[operator]
    with pytest.raises(grpc.RpcError) as info:
        stub.PutShm(req, timeout=30)
    assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS), info.value.details()
    assert field in info.value.details()
    assert stored(stub, h) == 0


def test_a_segment_the_node_cannot_see_is_unimplemented(stub: pb_grpc.KVStoreStub, seg: shm_client.ClientSegment) -> None:
    req = put_req(seg, key(1, "gone"))
    req.region.name = "kvstore-0-doesnotexist0000"
    with pytest.raises(grpc.RpcError) as info:
        stub.PutShm(req, timeout=30)
    assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED and "visible" in info.value.details()


def test_get_shm_reports_a_page_that_does_not_fit(stub: pb_grpc.KVStoreStub, seg: shm_client.ClientSegment) -> None:
    hs = [key(i, "fit") for i in range(2)]
    for h in hs:
        stub.PutShm(put_req(seg, h), timeout=30)
    region = pb.ShmRegion(name=seg.name, nonce=seg.nonce)
    one = align_up(PAGE)
    reply = stub.GetShm(pb.GetShmRequest(namespace=NS, hashes=hs, region=region, offset=shm.HEADER_BYTES,
                                         size=one + 10), timeout=30)  # fmt: skip
    assert [p.hash for p in reply.pages] == hs[:1] and reply.next_page_bytes == PAGE
    with pytest.raises(grpc.RpcError) as info:
        stub.GetShm(pb.GetShmRequest(namespace=NS, hashes=hs, region=region, offset=shm.HEADER_BYTES,
                                     size=seg.size), timeout=30)  # fmt: skip
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "size" in info.value.details()


def test_put_shm_is_a_write_for_the_token_roles() -> None:
    assert "PutShm" in WRITE_METHODS and "GetShm" not in WRITE_METHODS


def test_a_segment_shrunk_by_its_client_is_refused_and_the_node_lives_on(
    shm_node: NodeProcess, stub: pb_grpc.KVStoreStub, seg: shm_client.ClientSegment
) -> None:
    h = key(1, "shrunk")
    req = put_req(seg, h)
    os.truncate(seg.path, shm.HEADER_BYTES + 100)  # after the request was built, before the node reads
    with pytest.raises(grpc.RpcError) as info:
        stub.PutShm(req, timeout=30)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "runs past" in info.value.details()
    region = pb.ShmRegion(name=seg.name, nonce=seg.nonce)
    with pytest.raises(grpc.RpcError):
        stub.GetShm(pb.GetShmRequest(namespace=NS, hashes=[h], region=region, offset=shm.HEADER_BYTES,
                                     size=align_up(PAGE)), timeout=30)  # fmt: skip
    assert stored(stub, h) == 0 and shm_node.proc is not None and shm_node.proc.poll() is None  # alive


# -- GetShm with targets (zero-copy get_into): every target checked before any page is read ---------------


@pytest.mark.parametrize(
    ("targets", "field"),
    [
        (lambda one: [(shm.HEADER_BYTES, one)], "targets"),  # one target for two hashes
        (lambda one: [(8, one), (shm.HEADER_BYTES + one, one)], "targets[0]"),  # overlaps the header
        (lambda one: [(shm.HEADER_BYTES, one), (shm.HEADER_BYTES + 4 * one, one)], "targets[1]"),  # runs past the end
        (lambda one: [(shm.HEADER_BYTES, one), (shm.HEADER_BYTES + one, PAGE - 1)], "targets[1]"),  # too small
        (lambda one: [(shm.HEADER_BYTES + 100, one), (shm.HEADER_BYTES, one)], "targets[1]"),  # overlapping pages
    ],
)
def test_bad_get_shm_targets_are_refused_and_write_nothing(stub: pb_grpc.KVStoreStub, seg: shm_client.ClientSegment,
                                                           targets: object, field: str) -> None:  # fmt: skip
    hs = [key(i, "targets") for i in range(2)]
    for h in hs:
        stub.PutShm(put_req(seg, h), timeout=30)
    seg.view[shm.HEADER_BYTES :] = b"\x5a" * (seg.size - shm.HEADER_BYTES)
    one = align_up(PAGE)
    req = pb.GetShmRequest(namespace=NS, hashes=hs, region=pb.ShmRegion(name=seg.name, nonce=seg.nonce),
                           targets=[pb.ShmTarget(offset=o, size=s) for o, s in targets(one)])  # type: ignore[operator]  # fmt: skip
    with pytest.raises(grpc.RpcError) as info:
        stub.GetShm(req, timeout=30)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(field)
    assert bytes(seg.view[shm.HEADER_BYTES :]) == b"\x5a" * (seg.size - shm.HEADER_BYTES)  # nothing written


def test_get_shm_targets_scatter_pages_in_any_order(stub: pb_grpc.KVStoreStub, seg: shm_client.ClientSegment) -> None:
    hs = [key(i, "scatter") for i in range(3)]
    for h in hs:
        stub.PutShm(put_req(seg, h), timeout=30)
    one = align_up(PAGE)
    offsets = [shm.HEADER_BYTES + 2 * one + 8, shm.HEADER_BYTES, shm.HEADER_BYTES + one + 8]  # unaligned is fine
    req = pb.GetShmRequest(namespace=NS, hashes=[*hs, key(9, "scatter-missing")],
                           region=pb.ShmRegion(name=seg.name, nonce=seg.nonce),
                           targets=[*(pb.ShmTarget(offset=o, size=PAGE) for o in offsets),
                                    pb.ShmTarget(offset=shm.HEADER_BYTES + 3 * one + 8, size=PAGE)])  # fmt: skip
    reply = stub.GetShm(req, timeout=30)
    assert [p.hash for p in reply.pages] == hs and [p.offset for p in reply.pages] == offsets
    for h, o in zip(hs, offsets, strict=True):
        assert bytes(seg.view[o : o + PAGE]) == page(h)


# -- registered buffers (sealed memfds the node maps) ------------------------------------------------------


def region_of(buf: SharedBuffer, **overrides: object) -> pb.ShmRegion:
    fields: dict[str, object] = {"name": buf.name, "nonce": buf.nonce, "pid": buf.pid, "fd": buf.fd}
    fields.update(overrides)
    return pb.ShmRegion(**fields)  # type: ignore[arg-type]


def test_bad_registered_regions_are_refused(stub: pb_grpc.KVStoreStub, seg: shm_client.ClientSegment) -> None:
    h = key(0, "memfd-bad")
    stub.PutShm(put_req(seg, h), timeout=30)
    buffers = SharedBuffers()
    buf = buffers.allocate(2 * PAGE)
    unsealed = os.memfd_create("kvstore-unsealed")
    try:
        os.ftruncate(unsealed, 4096 + PAGE)

        def get(region: pb.ShmRegion) -> grpc.RpcError:
            req = pb.GetShmRequest(namespace=NS, hashes=[h], region=region,
                                   targets=[pb.ShmTarget(offset=buf.data_offset, size=PAGE)])  # fmt: skip
            with pytest.raises(grpc.RpcError) as info:
                stub.GetShm(req, timeout=30)
            return info.value

        err = get(region_of(buf, nonce=b"\x01" * 16))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("region.nonce")
        err = get(region_of(buf, fd=unsealed))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "sealed" in err.details()
        err = get(region_of(buf, fd=9999))  # no such descriptor in this process
        assert err.code() is grpc.StatusCode.UNIMPLEMENTED and "cannot open" in err.details()
        assert bytes(buf.view[:PAGE]) == bytes(PAGE)  # nothing written
        reply = stub.GetShm(pb.GetShmRequest(namespace=NS, hashes=[h], region=region_of(buf),
                                             targets=[pb.ShmTarget(offset=buf.data_offset, size=PAGE)]), timeout=30)  # fmt: skip
        assert len(reply.pages) == 1 and bytes(buf.view[:PAGE]) == page(h)
    finally:
        os.close(unsealed)
        buffers.close()
