"""The UCX data plane against a real node on loopback: both ways of connecting, auth, concurrency, and
bad input from a hand-driven UCX peer (truncated page, wrong checksum, silence, a peer that vanishes
mid-transfer). The core round trips run on UCX through the `kv` fixture (conftest)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.cli.launch import NodeProcess
from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.client.planes.ucx import UcxConnection
from kvstore.errors import DataLoss, InvalidArgument, PermissionDenied, Unauthenticated
from kvstore.pageformat import payload_checksum
from kvstore.security import ClientSecurity
from kvstore.wire.streams import layout_to_pb
from kvstore.wire.ucx import Kind, Lane, load_ucxx, parse_address, ucxx_installed
from kvstore.wire.ucx_progress import wait_blocking

from .conftest import LAYOUT, NS, PAGE, key, page, start_node

pytestmark = pytest.mark.skipif(not ucxx_installed(), reason="ucxx is not installed (pip install 'kvstore[ucx]')")
IO_TIMEOUT = 2.0  # the node's ucx_io_timeout_seconds in these tests


@pytest.fixture
def ucx_node(tmp_path: Path) -> Iterator[NodeProcess]:
    n = start_node(tmp_path, extra_args=["--ucx"], env={"KVSTORE_UCX_IO_TIMEOUT_SECONDS": str(IO_TIMEOUT)})
    try:
        yield n
    finally:
        n.close()


def ucx_address(node: NodeProcess) -> str:
    with KVStoreClient(node.addr, transport="grpc") as c:
        return next(p.address for p in c.stats().planes if p.name == "ucx")


def footprint(node: NodeProcess) -> list[tuple[int, int]]:
    """(pages, used bytes) per tier: what a failed Put must leave unchanged."""
    with KVStoreClient(node.addr, transport="grpc") as c:
        return [(t.pages, t.used_bytes) for t in c.stats().tiers]


class RawPeer:
    """A hand-driven UCX client: speaks the protocol through UcxConnection, but sends what a test says."""

    def __init__(self, node: NodeProcess, token: str | None = None) -> None:
        ucx = load_ucxx()
        self.ucx = ucx
        self.ctx = ucx.UCXContext({}, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        self.conn = UcxConnection(ucx, self.ctx, parse_address(ucx_address(node)), token, time.monotonic() + 10)

    def put(self, pages: list[bytes], sent: list[bytes], checksums: list[int] | None = None) -> pb.PutResponse:
        """A PUT announcing `pages` (sizes and, unless given, checksums) whose data messages carry `sent`."""
        c = self.conn
        req = pb.BulkPutRequest(open=pb.PutOpen(namespace=NS, layout=layout_to_pb(LAYOUT)))
        for i, p in enumerate(pages):
            req.pages.add(hash=key(i, "raw"), payload_bytes=len(p),
                          checksum=checksums[i] if checksums else payload_checksum(p))  # fmt: skip
        seq, reply, keep = c._request(Kind.PUT, req.SerializeToString())
        base = c.tags.tag(Lane.PUT_PAGES, seq)
        for i, data in enumerate(sent):
            arr = c.Array(bytearray(data))
            keep.append(arr)
            keep.append(c.ep.tag_send(arr, self.ucx.UCXXTag(base | i)))
        wait_blocking(c.worker, [reply], time.monotonic() + 10, None, "reply")
        return pb.PutResponse.FromString(bytes(c._reply_body(Kind.OK, seq)))


@pytest.mark.parametrize("connect", ["worker", "listener"])
def test_round_trip_by_worker_address_and_by_listener(ucx_node: NodeProcess, connect: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("KVSTORE_UCX_CONNECT", connect)
    hs = [key(i, connect) for i in range(6)]
    with KVStoreClient(ucx_node.addr, transport="ucx", timeout=30) as kv:
        assert kv.put(NS, LAYOUT, hs, [page(h) for h in hs]).stored == 6
        assert [bytes(p) for p in kv.get(NS, hs)] == [page(h) for h in hs]
        assert kv.plane == "ucx"
        bufs = [memoryview(bytearray(PAGE + 100)) for _ in hs]
        refs = kv.get_into(NS, hs, bufs)
        assert [r.nbytes for r in refs] == [PAGE] * 6
        assert all(bytes(b[:PAGE]) == page(h) for b, h in zip(bufs, hs, strict=True))


def test_concurrent_threads_and_asyncio_clients(ucx_node: NodeProcess) -> None:
    def worker(t: int) -> None:
        hs = [key(i, f"t{t}") for i in range(5)]
        with KVStoreClient(ucx_node.addr, transport="ucx") as kv:
            kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
            assert [bytes(p) for p in kv.get(NS, hs)] == [page(h) for h in hs]

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(worker, range(4)))

    async def main() -> None:
        async with AsyncKVStoreClient(ucx_node.addr, transport="ucx") as kv:

            async def one(t: int) -> None:
                hs = [key(i, f"a{t}") for i in range(3)]
                await kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
                assert [bytes(p) for p in await kv.get(NS, hs)] == [page(h) for h in hs]

            await asyncio.gather(*(one(t) for t in range(4)))

    asyncio.run(main())


def test_auth_unknown_token_and_read_token_on_put(tmp_path: Path) -> None:
    rw, ro = tmp_path / "rw", tmp_path / "ro"
    rw.write_text("write-token-0123456789\n")
    ro.write_text("read-token-0123456789\n")
    rw.chmod(0o600)
    ro.chmod(0o600)  # token files must be private (DESIGN.md §12)
    n = start_node(tmp_path, extra_args=["--ucx", "--auth-tokens-file", str(rw), "--auth-read-tokens-file", str(ro)])
    try:
        hs = [key(i, "auth") for i in range(3)]
        with KVStoreClient(n.addr, transport="ucx", security=ClientSecurity(token="write-token-0123456789")) as kv:
            kv.put(NS, LAYOUT, hs[:1], [page(hs[0])])
            before = [(t.pages, t.used_bytes) for t in kv.stats().tiers]
        with (
            pytest.raises(Unauthenticated),
            KVStoreClient(n.addr, transport="ucx", security=ClientSecurity(token="no-such-token-0123456")) as kv,
        ):
            kv.put(NS, LAYOUT, hs, [page(h) for h in hs])  # fmt: skip
        with KVStoreClient(n.addr, transport="ucx", security=ClientSecurity(token="read-token-0123456789")) as kv:
            with pytest.raises(PermissionDenied):
                kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
            assert [bytes(p) for p in kv.get(NS, hs)] == [page(hs[0])]  # reads work, nothing new stored
            assert [(t.pages, t.used_bytes) for t in kv.stats().tiers] == before
    finally:
        n.close()


def test_truncated_page_wrong_checksum_and_wrong_size_store_nothing(ucx_node: NodeProcess) -> None:
    before = footprint(ucx_node)
    good = page(key(0, "raw"))
    with pytest.raises(DataLoss):  # half the bytes arrive: the declared checksum cannot match
        RawPeer(ucx_node).put([good], [good[: PAGE // 2]])
    with pytest.raises(DataLoss):
        RawPeer(ucx_node).put([good], [good], checksums=[payload_checksum(good) ^ 1])
    with pytest.raises(InvalidArgument, match="payload_bytes"):
        RawPeer(ucx_node).put([good + b"x"], [good + b"x"])
    with pytest.raises(DataLoss):  # more bytes than announced: UCX truncates, the node refuses the page
        RawPeer(ucx_node).put([good], [good + b"extra"])
    assert footprint(ucx_node) == before
    peer = RawPeer(ucx_node)  # the node still serves well-formed requests
    assert peer.put([good], [good]).stored == 1


def test_silent_client_is_closed_and_others_unaffected(ucx_node: NodeProcess) -> None:
    ucx = load_ucxx()
    ctx = ucx.UCXContext({}, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
    worker = ucx.UCXWorker(ctx)
    worker.init_blocking_progress_mode()
    addr = parse_address(ucx_address(ucx_node))
    ep = ucx.UCXEndpoint.create(worker, addr.host, addr.port, True)  # connects, never says HELLO
    hs = [key(i, "quiet") for i in range(3)]
    with KVStoreClient(ucx_node.addr, transport="ucx") as kv:  # served while the silent one waits
        kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
        assert len(kv.get(NS, hs)) == 3
    deadline = time.monotonic() + IO_TIMEOUT + 10
    while ep.alive and time.monotonic() < deadline:
        worker.progress_worker_event(100)
    assert not ep.alive, "the node should close a connection that sends no HELLO"


def _vanish_mid_put(address: str, q: mp.Queue) -> None:  # type: ignore[type-arg]
    """Child process: announce a 2-page PUT, send the first page, then die before the second leaves.
    (A second page merely started may still arrive whole: over shared memory the node pulls its bytes.)"""
    ucx = load_ucxx()
    ctx = ucx.UCXContext({}, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
    c = UcxConnection(ucx, ctx, parse_address(address), None, time.monotonic() + 10)
    pages = [page(key(i, "vanish")) for i in range(2)]
    req = pb.BulkPutRequest(open=pb.PutOpen(namespace=NS, layout=layout_to_pb(LAYOUT)))
    for i, p in enumerate(pages):
        req.pages.add(hash=key(i, "vanish"), payload_bytes=len(p), checksum=payload_checksum(p))
    seq, _, _keep = c._request(Kind.PUT, req.SerializeToString())
    arrs = [c.Array(bytearray(p)) for p in pages]
    base = c.tags.tag(Lane.PUT_PAGES, seq)
    first = c.ep.tag_send(arrs[0], ucx.UCXXTag(base))
    wait_blocking(c.worker, [first], time.monotonic() + 10, None, "first page")
    q.put("sent")
    q.close()
    q.join_thread()  # the queue's feeder thread must flush before the hard exit
    os._exit(0)  # no close: the node learns from UCX (or its timeout) that the peer is gone


def test_client_vanishing_mid_put_stores_nothing(ucx_node: NodeProcess) -> None:
    before = footprint(ucx_node)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_vanish_mid_put, args=(ucx_address(ucx_node), q))
    proc.start()
    try:
        assert q.get(timeout=60) == "sent"
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    time.sleep(IO_TIMEOUT + 1)  # the node aborts the PUT within its I/O timeout at the latest
    assert footprint(ucx_node) == before
    with KVStoreClient(ucx_node.addr, transport="ucx") as kv:
        assert kv.lookup(NS, [key(0, "vanish")]) == 0
        hs = [key(i, "after") for i in range(2)]
        assert kv.put(NS, LAYOUT, hs, [page(h) for h in hs]).stored == 2


def _abandon_get(address: str, hashes: list[bytes], q: mp.Queue) -> None:  # type: ignore[type-arg]
    """Child process (default settings): ask for pages, post no receive for them, then get killed."""
    ucx = load_ucxx()
    ctx = ucx.UCXContext({}, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
    c = UcxConnection(ucx, ctx, parse_address(address), None, time.monotonic() + 10)
    req = pb.BulkGetRequest(namespace=NS, hashes=hashes)
    req.targets.extend(pb.BulkTarget(size=PAGE) for _ in hashes)
    _keep = c._request(Kind.GET, req.SerializeToString())
    c.worker.progress()
    q.put("asked")
    time.sleep(60)  # killed long before


def test_a_client_killed_mid_get_leaves_no_page_pinned(ucx_node: NodeProcess) -> None:
    """The node's sends of an abandoned GET are cancelled when the client's endpoints go, so the leases
    they held are released: the pages can be deleted (a pinned page could not, and would hold its slot)."""
    hs = [key(i, "abandoned") for i in range(16)]
    with KVStoreClient(ucx_node.addr, transport="grpc") as kv:
        kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_abandon_get, args=(ucx_address(ucx_node), hs, q))
    proc.start()
    try:
        assert q.get(timeout=60) == "asked"
        time.sleep(0.5)  # the node has posted its sends
    finally:
        proc.kill()
        proc.join(10)
    deadline = time.monotonic() + IO_TIMEOUT + 10
    with KVStoreClient(ucx_node.addr, transport="grpc") as kv:
        while time.monotonic() < deadline:
            kv.delete(NS, hs)
            if kv.lookup(NS, hs) == 0:
                break
            time.sleep(0.5)
        assert kv.lookup(NS, hs) == 0, "pages of an abandoned GET stay pinned"
    assert "did not finish after close" not in ucx_node.log_tail()


def test_node_without_ucx_is_refused_or_skipped(tmp_path: Path) -> None:
    n = start_node(tmp_path, extra_args=["--no-ucx"])
    try:
        with KVStoreClient(n.addr, transport="grpc") as c:
            assert "ucx" not in [p.name for p in c.stats().planes]
        with KVStoreClient(n.addr, transport="ucx") as c, pytest.raises(Exception, match="does not serve the ucx"):
            c.get(NS, [key(0)])
    finally:
        n.close()
