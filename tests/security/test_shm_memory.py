"""Client memory the node maps, under attack (SECURITY.md, round 4, findings 2, 3 and 5), against real nodes.

Before: a read-only token killed the node with SIGBUS on a host with huge pages (a hugetlb memfd sealed
SHRINK|GROW, a hole punched after the node mapped it, the free huge pages taken, then a GET into the hole);
every registered buffer kept a duplicated descriptor in the node (CPython's mmap), so at a 1,024-descriptor
limit 1,000 tiny registrations on 4 connections made every new gRPC, TCP and same-host connection fail; and one
reader could register the node's whole mapping room (`shm_max_mapped_bytes`) with sparse memfds, so other
callers' same-host calls were refused. Now the node maps only memfds of the shared-memory filesystem (a hole
punched there reads back as zeros: no fault can kill the node), keeps no descriptor for a mapping, and bounds
registrations by count and bytes per connection, per caller and per tenant.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.security import ClientSecurity
from kvstore.wire import shm
from kvstore.wire.shm import Kind
from kvstore.wire.streams import layout_to_pb
from tests.integration.conftest import LAYOUT, NS, PAGE, key, page, start_node
from tests.integration.test_shm import Raw, memfd, socket_of
from tests.security.conftest import READ, WRITE, token_args

pytestmark = pytest.mark.skipif(not shm.shm_available(), reason="needs memfd_create and Unix sockets")

HUGE = 2 << 20  # the huge page size this test asks for (x86-64, arm64 with 4 KiB pages)
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
_libc = ctypes.CDLL(None, use_errno=True)


def punch_hole(fd: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, ctypes.c_long(offset), ctypes.c_long(length)):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def hugepages(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"HugePages_{field}:"):
            return int(line.split()[1])
    return 0


@contextlib.contextmanager
def huge_pages(n: int) -> Iterator[bool]:
    """`n` free 2 MiB huge pages for the block (root sets vm.nr_hugepages, and restores it); yields whether the
    host has them (False: not root, no hugetlbfs, or the kernel could not find the memory)."""
    try:
        old = NR_HUGEPAGES.read_text().strip()
        NR_HUGEPAGES.write_text(str(int(old) + n))
    except OSError:
        yield False
        return
    try:
        yield hugepages("Free") - hugepages("Rsvd") >= n
    finally:
        NR_HUGEPAGES.write_text(old)


def take_free_huge_pages() -> tuple[int, mmap.mmap] | None:
    """Fault in every free, unreserved huge page (what another process on the host can do); None if none."""
    free = hugepages("Free") - hugepages("Rsvd")
    if free <= 0:
        return None
    fd = os.memfd_create("hog", os.MFD_HUGETLB)
    os.ftruncate(fd, free * HUGE)
    m = mmap.mmap(fd, free * HUGE, flags=mmap.MAP_SHARED)
    for i in range(free):
        m[i * HUGE] = 1
    return fd, m


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    n = start_node(tmp_path, name="mem", extra_args=token_args(tmp_path))
    try:
        yield n
    finally:
        n.close()


def alive(node: NodeProcess) -> bool:
    """Whether the node still answers (Stats over gRPC) and runs."""
    try:
        with KVStoreClient(node.addr, transport="grpc", timeout=10, security=ClientSecurity(token=WRITE)) as kv:
            kv.stats()
    except Exception:
        return False
    return node.proc is not None and node.proc.poll() is None


def put_one(node: NodeProcess, tag: str) -> bytes:
    h = key(0, tag)
    with KVStoreClient(node.addr, transport="grpc", security=ClientSecurity(token=WRITE)) as kv:
        kv.put(NS, LAYOUT, [h], [page(h)])
    return h


def get_into_buffer_1(raw: Raw, h: bytes, offset: int = 0) -> tuple[Kind, bytes]:
    req = pb.BulkGetRequest(namespace=NS, hashes=[h], checksum_form=pb.CHECKSUM_FORM_KEYED)
    req.targets.add(buffer=1, offset=offset, size=PAGE)
    return raw.call(Kind.GET, req.SerializeToString())


def unusable_answer(path: str) -> tuple[str, str]:
    """The node's one answer for a descriptor it will not map (a pipe's)."""
    r, w = os.pipe()
    raw = Raw(path, READ)
    try:
        return raw.error(Kind.REGISTER, shm.REGISTER.pack(99), [r])
    finally:
        raw.close()
        os.close(r)
        os.close(w)


def test_a_hugetlb_memfd_with_a_punched_hole_cannot_kill_the_node(node: NodeProcess) -> None:
    h = put_one(node, "sigbus")
    path = socket_of(node)
    with huge_pages(2) as have:
        fd = os.memfd_create("victim", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
        hog = None
        raw = Raw(path, READ)  # a read-only token is all it takes
        try:
            os.ftruncate(fd, HUGE)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            kind, body = raw.call(Kind.REGISTER, shm.REGISTER.pack(1), [fd])
            if kind is Kind.OK:  # the node mapped it: the rest of the attack
                assert have, "no free huge pages here: the node's mapping should have failed"
                assert get_into_buffer_1(raw, h)[0] is Kind.OK  # the node's write faults a huge page in
                punch_hole(fd, 0, HUGE)  # and gives it back, with the reservation the mapping had
                hog = take_free_huge_pages()
                get_into_buffer_1(raw, h)  # the node's next write into the hole finds no huge page
            assert alive(node), f"the node died: {node.log_tail(5)}"
            assert kind is Kind.ERROR and shm.parse_error(body) == unusable_answer(path)  # the one answer
        finally:
            raw.close()
            if hog is not None:
                hog[1].close()
                os.close(hog[0])
            os.close(fd)
    with KVStoreClient(node.addr, transport="shm", security=ClientSecurity(token=WRITE)) as kv:
        assert [bytes(p) for p in kv.get(NS, [h])] == [page(h)]  # alive, and serving


def test_a_hole_punched_in_shared_memory_reads_back_as_zeros_and_harms_nothing(node: NodeProcess) -> None:
    """The node maps only memfds of the shared-memory filesystem, where a page punched out after it was mapped
    comes back as a zero page on the next touch: a GET into it lands, a PUT from it stores nothing (its
    declared checksum no longer matches), and the node lives on."""
    h = put_one(node, "hole")
    path = socket_of(node)
    fd = memfd(4 * PAGE)
    view = mmap.mmap(fd, 4 * PAGE)
    raw = Raw(path, READ)
    writer = Raw(path, WRITE)
    try:
        view[:] = b"\x5a" * (4 * PAGE)
        assert raw.call(Kind.REGISTER, shm.REGISTER.pack(1), [fd])[0] is Kind.OK
        assert writer.call(Kind.REGISTER, shm.REGISTER.pack(1), [fd])[0] is Kind.OK
        punch_hole(fd, 0, 4 * PAGE)
        assert get_into_buffer_1(raw, h)[0] is Kind.OK
        assert bytes(view[:PAGE]) == page(h)  # landed in the hole
        punch_hole(fd, PAGE, PAGE)
        fresh = key(1, "hole")
        put = pb.BulkPutRequest(open=pb.PutOpen(namespace=NS, layout=layout_to_pb(LAYOUT)))
        put.pages.add(hash=fresh, offset=PAGE, payload_bytes=PAGE, buffer=1, checksum=12345)
        kind, body = writer.call(Kind.PUT, put.SerializeToString())
        assert kind is Kind.ERROR and shm.parse_error(body)[0] == "DATA_LOSS", shm.parse_error(body)
    finally:
        raw.close()
        writer.close()
        view.close()
        os.close(fd)
    assert alive(node)
    with KVStoreClient(node.addr, transport="grpc", security=ClientSecurity(token=WRITE)) as kv:
        assert kv.lookup(NS, [fresh]) == 0


def node_fds(node: NodeProcess) -> int:
    assert node.proc is not None
    return len(os.listdir(f"/proc/{node.proc.pid}/fd"))


def test_registrations_keep_no_descriptor_and_new_connections_are_served(tmp_path: Path) -> None:
    """At a 1,024-descriptor limit, a reader's 1,020 tiny registrations on 4 connections: the node keeps no
    descriptor for any of them, and new gRPC, TCP-plane and same-host connections are all served (before, the
    registrations filled the descriptor table and every new connection failed)."""
    node = NodeProcess(dram_bytes=64 * (PAGE + 4096), max_page_bytes=PAGE, node_id="fds",
                       extra_args=token_args(tmp_path))  # fmt: skip
    node.args = ["prlimit", "--nofile=1024:1024", "--", *node.args]
    node.start()
    conns: list[Raw] = []
    fd = memfd(mmap.PAGESIZE)
    try:
        path = socket_of(node)
        before = node_fds(node)
        conns = [Raw(path, READ) for _ in range(4)]
        answers = [c.call(Kind.REGISTER, shm.REGISTER.pack(i + 1), [fd])[0] for c in conns for i in range(255)]
        assert answers.count(Kind.OK) == 1020
        assert node_fds(node) - before < 50, (before, node_fds(node))  # 4 connections, no descriptor per mapping
        for transport in ("grpc", "tcp", "shm"):
            hs = [key(i, f"fds-{transport}") for i in range(2)]
            with KVStoreClient(node.addr, transport=transport, timeout=15, security=ClientSecurity(token=WRITE)) as kv:
                kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
                assert [bytes(p) for p in kv.get(NS, hs)] == [page(h) for h in hs]
                assert kv.plane == transport
    finally:
        for c in conns:
            c.close()
        os.close(fd)
        node.close()


def test_one_caller_cannot_take_the_node_wide_room(tmp_path: Path) -> None:
    """A reader registers sparse memfds until refused: it holds at most its share of the node's mapping room
    and of its registrations, and another caller (a writer's token) still gets the same-host plane."""
    node = start_node(tmp_path, name="room", extra_args=token_args(tmp_path),
                      env={"KVSTORE_SHM_MAX_MAPPED_BYTES": str(1 << 30), "KVSTORE_SHM_MAX_REGISTRATIONS": "64"})  # fmt: skip
    fds: list[int] = []
    raws: list[Raw] = []
    try:
        path = socket_of(node)
        raws = [Raw(path, READ) for _ in range(2)]
        fds.append(memfd(128 << 20))  # virtual: a memfd costs nothing until written
        refused = None
        for i in range(1, 40):  # 1 GiB / 128 MiB = 8 would fill the whole room
            kind, body = raws[i % 2].call(Kind.REGISTER, shm.REGISTER.pack(i), [fds[0]])
            if kind is Kind.ERROR:
                refused = (i, shm.parse_error(body))
                break
        assert refused is not None and refused[0] <= 5, refused  # its share: half, 4 of 128 MiB
        assert refused[1][0] == "RESOURCE_EXHAUSTED" and "share" in refused[1][1], refused
        small = memfd(mmap.PAGESIZE)
        fds.append(small)
        counts = [raws[0].call(Kind.REGISTER, shm.REGISTER.pack(100 + i), [small])[0] for i in range(64)]
        assert counts.count(Kind.OK) < 32, counts.count(Kind.OK)  # half of 64 registrations, some taken above
        hs = [key(i, "room") for i in range(2)]
        with KVStoreClient(node.addr, security=ClientSecurity(token=WRITE)) as kv:
            kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
            assert [bytes(p) for p in kv.get(NS, hs)] == [page(h) for h in hs]
            assert kv.plane == "shm"  # another caller still has room
        with KVStoreClient(node.addr, security=ClientSecurity(token=READ)) as kv:
            assert [bytes(p) for p in kv.get(NS, hs)] == [page(h) for h in hs]
            assert kv.plane != "shm"  # the reader's own share is full: it falls back, never fails
    finally:
        for r in raws:
            r.close()
        for fd in fds:
            os.close(fd)
        node.close()
