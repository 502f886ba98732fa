"""The same-host plane on real nodes: round trips, fallback, pooled receive memory, and every bad request a
local process can send to the node's Unix socket (kvstore/wire/shm.py), by hand."""

from __future__ import annotations

import array
import dataclasses
import fcntl
import gc
import mmap
import os
import pty
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.client.planes import shm as client_shm
from kvstore.errors import DataLoss, PlaneUnavailable
from kvstore.names import TierKind
from kvstore.pageformat import ChecksumForm, wire_checksum
from kvstore.security import ClientSecurity
from kvstore.wire import PutOpen, shm
from kvstore.wire.shm import Kind
from kvstore.wire.streams import layout_to_pb, put_open_to_pb
from tests.integration.conftest import LAYOUT, NS, PAGE, key, page, start_node
from tests.security.conftest import READ, WRITE, token_args

pytestmark = pytest.mark.skipif(not shm.shm_available(), reason="needs memfd_create and Unix sockets")


@pytest.fixture(scope="module")
def shm_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    tmp = tmp_path_factory.mktemp("shm")
    n = start_node(tmp, dram_pages=8, nvme_pages=64, name="shm0", extra_args=token_args(tmp))
    try:
        yield n
    finally:
        n.close()


def socket_of(node: NodeProcess) -> str:
    with KVStoreClient(node.addr, security=ClientSecurity(token=WRITE)) as kv:
        return next(p.address for p in kv.stats().planes if p.name == "shm")


class Raw:
    """A hand-driven client of the node's socket: it sends whatever a test wants."""

    def __init__(self, path: str, token: str | None = WRITE) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.seq = 0
        if token is not None:
            kind, body = self.call(Kind.HELLO, token.encode())
            assert kind is Kind.WELCOME, shm.parse_error(body)

    def call(self, kind: Kind, body: bytes = b"", fds: list[int] | None = None) -> tuple[Kind, bytes]:
        self.send(kind, body, fds)
        return self.reply()

    def send(self, kind: Kind, body: bytes = b"", fds: list[int] | None = None, seq: int | None = None) -> None:
        """One message; a new request's seq unless `seq` names one (a SUMS names its PUT_SUMS's)."""
        if seq is None:
            self.seq += 1
        msg = shm.frame(kind, self.seq if seq is None else seq, body)
        if fds:
            self.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            self.sock.send(msg)

    def reply(self) -> tuple[Kind, bytes]:
        reply = self.sock.recv(shm.MAX_MESSAGE_BYTES)
        if not reply:
            return Kind.ERROR, b""
        got, _, payload = shm.unframe(reply)
        return got, bytes(payload)

    def error(self, kind: Kind, body: bytes = b"", fds: list[int] | None = None) -> tuple[str, str]:
        got, payload = self.call(kind, body, fds)
        assert got is Kind.ERROR, f"expected an ERROR, got {got.name}"
        return shm.parse_error(payload) if payload else ("CLOSED", "")

    def close(self) -> None:
        self.sock.close()


def memfd(size: int, seals: int = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) -> int:
    fd = os.memfd_create("test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_round_trip_through_dram_and_nvme_matches_grpc(shm_node: NodeProcess) -> None:
    chain = [key(i, "rt") for i in range(20)]  # 8 DRAM slots: most of the chain is demoted to NVMe
    sec = ClientSecurity(token=WRITE)
    with (
        KVStoreClient(shm_node.addr, transport="shm", security=sec) as fast,
        KVStoreClient(shm_node.addr, transport="grpc", security=sec) as slow,
    ):
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
        with pytest.raises(Exception, match="not known"):  # an unknown namespace, as on every plane
            fast.get("never/stored", chain[:1])


def test_a_plain_get_lands_in_pooled_memory_that_is_recycled_only_when_dropped(shm_node: NodeProcess) -> None:
    """The lifetime rule (kvstore/client/planes/pool.py): a page get returned stays as it is while anything
    refers to it, however many calls come after; its block is reused only once nothing does."""
    hs = [key(i, "pool") for i in range(4)]
    with KVStoreClient(shm_node.addr, transport="shm", security=ClientSecurity(token=WRITE)) as kv:
        kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
        pool = kv.receive_pool
        kept = kv.get(NS, hs[:2])
        kept_slice = kept[1][100:200]  # a view of a view keeps the page too
        del kept[1]
        for _ in range(20):  # many calls later, the kept pages are unchanged
            others = kv.get(NS, hs[2:])
            assert [bytes(p) for p in others] == [page(h) for h in hs[2:]]
            del others
        assert bytes(kept[0]) == page(hs[0]) and bytes(kept_slice) == page(hs[1])[100:200]
        mapped = pool.mapped_bytes
        del kept, kept_slice
        gc.collect()
        for _ in range(20):
            kv.get(NS, hs)
        assert pool.mapped_bytes == mapped  # blocks were reused, not mapped anew


def test_a_node_without_shm_falls_back_or_refuses_as_asked(tmp_path: Path) -> None:
    node = start_node(tmp_path, name="noshm", extra_args=["--no-shm", "--no-tcp"])
    try:
        chain = [key(i, "fb") for i in range(3)]
        with KVStoreClient(node.addr, transport="auto") as kv:
            assert "shm" not in [p.name for p in kv.stats().planes] and kv.plane is None  # none chosen yet
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
            assert kv.plane == "grpc"  # the node does not offer shm: gRPC streams
            assert [bytes(p) for p in kv.get(NS, chain)] == [page(h) for h in chain]
        with KVStoreClient(node.addr, transport="shm") as kv, pytest.raises(PlaneUnavailable, match="shm"):
            kv.get(NS, chain)
    finally:
        node.close()


def test_a_socket_that_is_gone_falls_back_to_the_next_plane(tmp_path: Path) -> None:
    node = start_node(tmp_path, name="gone")
    try:
        os.unlink(socket_of(node))  # the node advertises a socket nobody can reach any more
        with KVStoreClient(node.addr) as kv:
            h = key(0, "gone")
            kv.put(NS, LAYOUT, [h], [page(h)])
            assert kv.plane == "tcp" and bytes(kv.get(NS, [h])[0]) == page(h)
    finally:
        node.close()


def test_a_same_host_client_negotiates_shm(shm_node: NodeProcess) -> None:
    with KVStoreClient(shm_node.addr, security=ClientSecurity(token=WRITE)) as kv:
        planes = kv.stats().planes
        assert planes[0].name == "shm" and planes[0].address.endswith(".sock")  # then TCP (and UCX where on)
        h = key(0, "nego")
        kv.put(NS, LAYOUT, [h], [page(h)])
        assert kv.plane == "shm"


def test_concurrent_threads_share_one_client(shm_node: NodeProcess) -> None:
    errors: list[BaseException] = []
    with KVStoreClient(shm_node.addr, transport="shm", security=ClientSecurity(token=WRITE)) as kv:

        def worker(w: int) -> None:
            try:
                for r in range(5):
                    hs = [key(i, f"cc{w}-{r}") for i in range(3)]
                    kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
                    got = kv.get(NS, hs)
                    assert got and all(bytes(p) == page(h) for p, h in zip(got, hs, strict=False))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors


def test_a_second_node_on_a_served_socket_is_refused_and_a_stale_one_replaced(tmp_path: Path) -> None:
    path = str(tmp_path / "node.sock")
    first = start_node(tmp_path, name="first", extra_args=["--local-socket", path])
    try:
        with pytest.raises(Exception, match=r"did not become ready|exited"):
            start_node(tmp_path, name="second", extra_args=["--local-socket", path])
    finally:
        first.close()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(tmp_path / "stale.sock"))
    stale.close()  # a socket file nobody serves (a node killed -9 leaves one)
    again = start_node(tmp_path, name="again", extra_args=["--local-socket", str(tmp_path / "stale.sock")])
    try:
        with KVStoreClient(again.addr, transport="shm") as kv:
            h = key(0, "stale")
            kv.put(NS, LAYOUT, [h], [page(h)])
            assert bytes(kv.get(NS, [h])[0]) == page(h)
    finally:
        again.close()


# -- bad requests, by hand ----------------------------------------------------------------------------


def test_nothing_is_served_before_hello_or_with_a_bad_token(shm_node: NodeProcess) -> None:
    path = socket_of(shm_node)
    raw = Raw(path, token=None)
    try:
        assert raw.error(Kind.LAYOUT, bytes(32) + NS.encode())[0] == "INVALID_ARGUMENT"  # a request before HELLO
    finally:
        raw.close()
    raw = Raw(path, token=None)
    try:
        assert raw.error(Kind.HELLO, b"not-a-token")[0] == "UNAUTHENTICATED"
    finally:
        raw.close()


def test_every_unusable_descriptor_gets_one_answer_and_maps_nothing(shm_node: NodeProcess) -> None:
    """The node never opens a path; of what a client hands it, it maps only a memfd sealed against shrinking and
    growing and not against writes. A pty, a pipe, a socket, a regular file, an unsealed memfd and memfds
    sealed otherwise all get the very same reply (so the answer tells nothing), and the node lives on."""
    path = socket_of(shm_node)
    master, slave = pty.openpty()
    r, w = os.pipe()
    s1, s2 = socket.socketpair()
    plain = os.open(__file__, os.O_RDONLY)
    fds = {
        "pty": slave,
        "pipe": r,
        "socket": s1.fileno(),
        "file": plain,
        "unsealed memfd": memfd(PAGE, 0),
        "shrinkable memfd": memfd(PAGE, fcntl.F_SEAL_GROW),
        "write-sealed memfd": memfd(PAGE, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE),
        "future-write-sealed memfd": memfd(PAGE, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | 0x0010),
    }
    raw = Raw(path)
    try:
        answers = {
            name: raw.error(Kind.REGISTER, shm.REGISTER.pack(i + 1), [fd]) for i, (name, fd) in enumerate(fds.items())
        }
        assert len(set(answers.values())) == 1, answers
        assert next(iter(answers.values()))[0] == "INVALID_ARGUMENT"
        good = memfd(PAGE)
        assert raw.call(Kind.REGISTER, shm.REGISTER.pack(100), [good])[0] is Kind.OK  # the connection goes on
        assert raw.error(Kind.REGISTER, shm.REGISTER.pack(100), [good])[0] == "INVALID_ARGUMENT"  # id in use
        assert raw.error(Kind.REGISTER, shm.REGISTER.pack(101))[0] == "INVALID_ARGUMENT"  # no descriptor
        assert raw.error(Kind.REGISTER, shm.REGISTER.pack(102), [good, good])[0] == "INVALID_ARGUMENT"  # two
        os.close(good)
    finally:
        raw.close()
        for fd in (master, slave, r, w, plain, *[fds[k] for k in fds if "memfd" in k]):
            os.close(fd)
        s1.close()
        s2.close()
    with KVStoreClient(shm_node.addr, transport="shm", security=ClientSecurity(token=WRITE)) as kv:
        h = key(0, "alive")
        kv.put(NS, LAYOUT, [h], [page(h)])
        assert bytes(kv.get(NS, [h])[0]) == page(h)  # and the node never took a terminal nor died


def test_what_the_node_maps_is_bounded_and_given_back_with_the_connection(shm_node: NodeProcess) -> None:
    """SECURITY.md, round 3, finding 6: a read-only token once had ~128 TiB of sealed memfds mapped into the node, then ENOMEM
    as INTERNAL. Now the node maps at most `shm_max_mapped_bytes` (1 TiB by default) of client memory in all, and
    one caller at most half of it (round 4, finding 5): a memfd that does not fit is refused as
    RESOURCE_EXHAUSTED before it is mapped, the connection goes on, a client that finds no room falls back to the
    next plane while another caller still has room, and a closed connection's mappings are given back."""
    path = socket_of(shm_node)
    huge = 128 << 30  # virtual: a memfd costs nothing until written
    raw = Raw(path, READ)
    fds: list[int] = []
    try:
        refused = None
        for i in range(1, 20):  # 1 TiB / 128 GiB = 8 fit at most (fewer if other connections hold some)
            fds.append(memfd(huge))
            kind, body = raw.call(Kind.REGISTER, shm.REGISTER.pack(i), [fds[-1]])
            if kind is Kind.ERROR:
                refused = (i, shm.parse_error(body))
                break
        assert refused is not None and refused[0] <= 9, refused
        code, message = refused[1]
        assert code == "RESOURCE_EXHAUSTED" and "shm_max_mapped_bytes" in message
        size, buf_id = huge // 2, 100
        while size >= mmap.PAGESIZE:  # fill what room is left, to the page
            fds.append(memfd(size))
            buf_id += 1
            if raw.call(Kind.REGISTER, shm.REGISTER.pack(buf_id), [fds[-1]])[0] is not Kind.OK:
                size //= 2
        # A client that finds no room for its memory carries on over the next plane (auto mode); another caller
        # still has room of its own.
        h = key(0, "no-room")
        with KVStoreClient(shm_node.addr, transport="auto", security=ClientSecurity(token=WRITE)) as kv:
            kv.put(NS, LAYOUT, [h], [page(h)])
            assert kv.plane == "shm"
        with KVStoreClient(shm_node.addr, transport="auto", security=ClientSecurity(token=READ)) as kv:
            assert bytes(kv.get(NS, [h])[0]) == page(h)
            assert kv.plane != "shm"
    finally:
        raw.close()
    again = Raw(path, READ)  # the first connection's mappings went with it
    try:
        assert again.call(Kind.REGISTER, shm.REGISTER.pack(1), [fds[0]])[0] is Kind.OK
    finally:
        again.close()
        for fd in fds:
            os.close(fd)


def test_bad_targets_and_slices_are_refused_and_change_nothing(shm_node: NodeProcess) -> None:
    path = socket_of(shm_node)
    hs = [key(i, "raw-bad") for i in range(2)]
    with KVStoreClient(shm_node.addr, transport="grpc", security=ClientSecurity(token=WRITE)) as kv:
        kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
    raw = Raw(path)
    fd = memfd(4 * PAGE)
    view = mmap.mmap(fd, 4 * PAGE)
    try:
        assert raw.call(Kind.REGISTER, shm.REGISTER.pack(1), [fd])[0] is Kind.OK
        view[:] = b"\xa5" * (4 * PAGE)

        def get(*targets: tuple[int, int, int]) -> tuple[str, str]:
            req = pb.BulkGetRequest(namespace=NS, hashes=hs[: len(targets)] if len(targets) <= 2 else hs)
            for buf, off, size in targets:
                req.targets.add(buffer=buf, offset=off, size=size)
            return raw.error(Kind.GET, req.SerializeToString())

        cases = {
            "unregistered": get((7, 0, PAGE)),
            "past the end": get((1, 3 * PAGE + 1, PAGE)),
            "too small": get((1, 0, PAGE - 1)),
            "overlapping": get((1, 0, PAGE), (1, PAGE // 2, PAGE)),
        }
        assert all(status == "INVALID_ARGUMENT" for status, _ in cases.values()), cases
        assert "targets[0].buffer" in cases["unregistered"][1] and "targets[1]" in cases["overlapping"][1]
        assert bytes(view) == b"\xa5" * (4 * PAGE)  # nothing written anywhere
        fresh = [key(i, "raw-put") for i in range(2)]
        put = pb.BulkPutRequest(open=pb.PutOpen(namespace=NS, layout=layout_to_pb(LAYOUT)))
        put.pages.add(hash=fresh[0], offset=0, payload_bytes=PAGE, buffer=1)
        put.pages.add(hash=fresh[1], offset=3 * PAGE + 8, payload_bytes=PAGE, buffer=1)  # runs past the end
        status, message = raw.error(Kind.PUT, put.SerializeToString())
        assert status == "INVALID_ARGUMENT" and "pages[1]" in message
        assert raw.error(Kind.PUT, b"\xff\xff")[0] == "INVALID_ARGUMENT"  # not a BulkPutRequest
    finally:
        raw.close()
        view.close()
        os.close(fd)
    with KVStoreClient(shm_node.addr, transport="grpc", security=ClientSecurity(token=WRITE)) as kv:
        assert kv.lookup(NS, fresh) == 0  # not even the good first page


def test_a_read_only_token_reads_and_registers_but_never_writes(shm_node: NodeProcess) -> None:
    hs = [key(0, "ro")]
    with KVStoreClient(shm_node.addr, transport="shm", security=ClientSecurity(token=READ)) as kv:
        with pytest.raises(Exception, match="read-write token"):
            kv.put(NS, LAYOUT, hs, [page(hs[0])])
        views = kv.shared_buffer(PAGE).pages(PAGE, 1)
        assert kv.get_into(NS, hs, views) == []  # registered and asked: a miss, not an error


def test_a_put_whose_sums_follow_stores_nothing_before_they_come_and_match(shm_node: NodeProcess) -> None:
    """PUT_SUMS (kvstore/wire/shm.py): the node copies the pages, then waits for their SUMS with none of them
    visible; a SUMS that declares other bytes than the node copied (the caller changed a page while the node
    copied it, or the node copied from the wrong place) stores nothing; a SUMS for a PUT_SUMS refused before it
    came is dropped; anything else in its place ends the connection, nothing stored."""
    path = socket_of(shm_node)
    fd = memfd(2 * PAGE)
    view = mmap.mmap(fd, 2 * PAGE)
    raw = Raw(path)
    reader = KVStoreClient(shm_node.addr, transport="grpc", security=ClientSecurity(token=WRITE))
    try:
        assert raw.call(Kind.REGISTER, shm.REGISTER.pack(1), [fd])[0] is Kind.OK

        def put_sums(hs: list[bytes], checksum: int = 0) -> bytes:
            req = pb.BulkPutRequest(open=put_open_to_pb(PutOpen(NS, LAYOUT, checksums=ChecksumForm.KEYED)))
            for i, h in enumerate(hs):
                req.pages.add(hash=h, offset=i * PAGE, payload_bytes=PAGE, buffer=1, checksum=checksum)
            return req.SerializeToString()

        hs = [key(i, "sums-after") for i in range(2)]
        view[:] = page(hs[0]) + page(hs[1])
        raw.send(Kind.PUT_SUMS, put_sums(hs))
        time.sleep(0.5)  # the node copies and hashes both pages meanwhile, then waits for their SUMS
        assert select.select([raw.sock], [], [], 0)[0] == []  # no answer before the SUMS
        assert reader.lookup(NS, hs) == 0  # and nothing visible
        changed = [wire_checksum(NS, hs[0], page(hs[0])), wire_checksum(NS, hs[1], page(hs[0]))]
        raw.send(Kind.SUMS, shm.sums_body(changed), seq=raw.seq)
        kind, body = raw.reply()
        assert kind is Kind.ERROR and shm.parse_error(body)[0] == "DATA_LOSS", shm.parse_error(body)
        assert reader.lookup(NS, hs) == 0  # not even the page whose checksum matched

        # Refused before its SUMS came (a PUT_SUMS carries no checksums itself): the SUMS is dropped when it comes.
        status, message = raw.error(Kind.PUT_SUMS, put_sums(hs, checksum=5))
        assert status == "INVALID_ARGUMENT" and "pages[0].checksum" in message
        raw.send(Kind.SUMS, shm.sums_body([1, 2]), seq=raw.seq)
        sums = [wire_checksum(NS, h, page(h)) for h in hs]
        raw.send(Kind.PUT_SUMS, put_sums(hs))
        raw.send(Kind.SUMS, shm.sums_body(sums), seq=raw.seq)
        kind, body = raw.reply()
        assert kind is Kind.OK, shm.parse_error(body)
        assert pb.PutResponse.FromString(body).stored == 2
        assert [bytes(p) for p in reader.get(NS, hs)] == [page(h) for h in hs]

        fresh = [key(i, "sums-out-of-step") for i in range(2)]
        for wrong in (Kind.LAYOUT, Kind.SUMS):  # another request, or a SUMS of the wrong size, in the SUMS's place
            out = Raw(path)
            try:
                assert out.call(Kind.REGISTER, shm.REGISTER.pack(1), [fd])[0] is Kind.OK
                out.send(Kind.PUT_SUMS, put_sums(fresh))
                out.send(wrong, b"\0" * 8, seq=out.seq)
                kind, body = out.reply()
                assert kind is Kind.ERROR and shm.parse_error(body)[0] == "INVALID_ARGUMENT"
                assert out.sock.recv(shm.MAX_MESSAGE_BYTES) == b""  # closed
            finally:
                out.close()
        assert reader.lookup(NS, fresh) == 0
    finally:
        reader.close()
        raw.close()
        view.close()
        os.close(fd)


@pytest.mark.parametrize("node_takes", ["PUT_SUMS", "PUT only"])
def test_put_from_declares_every_pages_checksum_and_a_wrong_one_stores_nothing(
    shm_node: NodeProcess, node_takes: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """put_from's checksums, hashed while the node copies (PUT_SUMS) or before (a node that takes only PUT):
    pages stored as put; a wrong one (a page that changed after the writer hashed it) fails the call and
    stores none of its pages."""
    if node_takes == "PUT only":  # as an older node answers: no SUMS_AFTER in its WELCOME
        welcome = shm.parse_welcome
        monkeypatch.setattr(shm, "parse_welcome", lambda body: dataclasses.replace(welcome(body), sums_after=False))
    hs = [key(i, f"put-from-{node_takes}") for i in range(3)]
    with KVStoreClient(shm_node.addr, transport="shm", security=ClientSecurity(token=WRITE)) as kv:
        views = kv.shared_buffer(3 * PAGE).pages(PAGE, 3)
        for v, h in zip(views, hs, strict=True):
            v[:] = page(h)
        honest = client_shm.declared_checksums
        monkeypatch.setattr(client_shm, "declared_checksums", lambda *a, **k: [*honest(*a, **k)[:2], 7])
        with pytest.raises(DataLoss):
            kv.put_from(NS, LAYOUT, hs, views)
        assert kv.lookup(NS, hs) == 0
        monkeypatch.setattr(client_shm, "declared_checksums", honest)
        assert kv.put_from(NS, LAYOUT, hs, views).stored == 3  # the same connections, in step
        assert [bytes(p) for p in kv.get(NS, hs)] == [page(h) for h in hs]


def test_a_page_changed_while_the_node_copies_it_is_refused_or_stored_as_hashed(shm_node: NodeProcess) -> None:
    """A caller's thread rewrites its pages while put_from stores them again and again: each put either fails
    (DataLoss: what the node copied is not what the writer hashed) and stores none of its pages, or stores
    what its writer hashed; a reader never gets a torn page."""
    stop = threading.Event()
    n = 4
    fills = [bytes([b]) * PAGE for b in (0x11, 0x22)]
    refused = stored = 0
    with KVStoreClient(shm_node.addr, transport="shm", security=ClientSecurity(token=WRITE)) as kv:
        buf = kv.shared_buffer(n * PAGE)
        views = buf.pages(PAGE, n)

        def rewrite() -> None:
            for k in range(10_000_000):  # bounded; stopped by the test long before
                if stop.is_set():
                    return
                views[k % n][:] = fills[k // n % 2]

        writer = threading.Thread(target=rewrite, daemon=True)
        writer.start()
        try:
            deadline = time.monotonic() + 10
            for i in range(200):  # bounded in count and time
                if time.monotonic() > deadline or (refused > 2 and stored > 2):
                    break
                hs = [key(j, f"torn-{i}") for j in range(n)]
                try:
                    kv.put_from(NS, LAYOUT, hs, views)
                except DataLoss:
                    refused += 1
                    assert kv.lookup(NS, hs) == 0
                else:
                    stored += 1
                    got = [bytes(p) for p in kv.get(NS, hs)]
                    assert all(p in fills for p in got), "a reader got a page its writer never hashed whole"
                    kv.delete(NS, hs)
        finally:
            stop.set()
            writer.join(10)
    assert refused + stored > 0
