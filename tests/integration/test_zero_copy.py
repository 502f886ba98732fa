"""Zero-copy get_into / put_from on real nodes: round trips on both clients and planes, bad buffers,
corruption, concurrent callers, registered-buffer lifetime and fallback."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import AsyncKVStoreClient, KVStoreClient, SharedBuffer
from kvstore.names import TierKind
from kvstore.pageformat import HEADER_BYTES, PageHeader
from kvstore.wire import shm
from tests.integration.conftest import LAYOUT, NS, PAGE, key, page, start_node

pytestmark = pytest.mark.skipif(not shm.shm_available(), reason="needs a writable /dev/shm")
SENTINEL = b"\xa5" * PAGE


@pytest.fixture(scope="module")
def zc_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    with contextlib.closing(start_node(tmp_path_factory.mktemp("zc"), dram_pages=8, nvme_pages=400, name="zc0")) as n:
        yield n


def fill(views: list[memoryview], hashes: list[bytes]) -> None:
    for v, h in zip(views, hashes, strict=True):
        v[:] = page(h)


def blank(views: list[memoryview]) -> None:
    for v in views:
        v[:] = SENTINEL


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_blocking_round_trip_through_dram_and_nvme(zc_node: NodeProcess, transport: str) -> None:
    chain = [key(i, f"rt-{transport}") for i in range(20)]  # 8 DRAM slots: most of the chain goes to NVMe
    with KVStoreClient(zc_node.addr, transport=transport) as kv:
        buf = kv.shared_buffer(21 * PAGE)
        views = buf.pages(PAGE)
        assert len(views) == 21
        fill(views[:20], chain)
        assert kv.put_from(NS, LAYOUT, chain, views[:20]).stored == 20
        assert kv.put_from(NS, LAYOUT, chain, views[:20]).already_present == 20
        assert TierKind.NVME in kv.lookup_detail(NS, chain).tiers
        blank(views)
        refs = kv.get_into(NS, [*chain, key(999, "absent")], views, promote=False)
        assert [r.hash for r in refs] == chain and all(r.nbytes == PAGE for r in refs)
        assert {r.tier for r in refs} == {TierKind.DRAM, TierKind.NVME}
        assert [bytes(v) for v in views[:20]] == [page(h) for h in chain]
        assert bytes(views[20]) == SENTINEL  # past the prefix: untouched
        assert [bytes(p) for p in kv.get(NS, chain[:3])] == [page(h) for h in chain[:3]]  # same pages via get


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_async_round_trip_through_dram_and_nvme(zc_node: NodeProcess, transport: str) -> None:
    chain = [key(i, f"art-{transport}") for i in range(14)]

    async def main() -> None:
        async with AsyncKVStoreClient(zc_node.addr, transport=transport) as kv:
            buf = kv.shared_buffer(14 * PAGE)
            views = buf.pages(PAGE, 14)
            fill(views, chain)
            assert (await kv.put_from(NS, LAYOUT, chain, views)).stored == 14
            blank(views)
            refs = await kv.get_into(NS, chain, views, promote=False)
            assert len(refs) == 14 and TierKind.NVME in {r.tier for r in refs}
            assert [bytes(v) for v in views] == [page(h) for h in chain]

    asyncio.run(asyncio.wait_for(main(), 120))


def test_get_into_promotes_nvme_pages_when_asked(zc_node: NodeProcess) -> None:
    chain = [key(i, "promo") for i in range(12)]
    with KVStoreClient(zc_node.addr, transport="shm") as kv:
        views = kv.shared_buffer(12 * PAGE).pages(PAGE, 12)
        fill(views, chain)
        kv.put_from(NS, LAYOUT, chain, views)
        first_nvme = next(
            h for h, t in zip(chain, kv.lookup_detail(NS, chain).tiers, strict=True) if t is TierKind.NVME
        )
        blank(views[:1])
        refs = kv.get_into(NS, [first_nvme], views[:1])  # promote=True (default)
        assert refs[0].tier is TierKind.NVME and bytes(views[0]) == page(first_nvme)
        assert kv.lookup_detail(NS, [first_nvme]).tiers == [TierKind.DRAM]


# -- bad buffers: a ValueError naming the argument, and nothing changed ---------------------------------


def bad_get_cases(views: list[memoryview]) -> list[tuple[str, list[Any], str]]:
    """(case, buffers for 2 hashes, what the error names)."""
    return [
        ("wrong count", views[:3], "buffers: 3 buffers for 2 hashes"),
        ("one buffer, not a list", views[0], "buffers: pass a sequence"),
        ("too small", [views[0], views[1][:100]], "buffers[1]"),
        ("read-only", [views[0].toreadonly(), views[1]], "buffers[0]: the buffer is read-only"),
        ("overlapping", [views[0], views[0]], "buffers[1]: overlaps buffers[0]"),
        ("not contiguous", [views[0], views[1][::2]], "buffers[1]: the buffer is not C-contiguous"),
        ("not a buffer", [views[0], 12345], "buffers[1]: a int is not a buffer"),
        ("empty", [views[0], views[1][:0]], "buffers[1]"),
    ]


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_bad_get_into_buffers_are_refused_and_change_nothing(zc_node: NodeProcess, transport: str) -> None:
    hs = [key(i, f"badget-{transport}") for i in range(2)]
    with KVStoreClient(zc_node.addr, transport=transport) as kv:
        views = kv.shared_buffer(4 * PAGE).pages(PAGE, 4)
        fill(views[:2], hs)
        kv.put_from(NS, LAYOUT, hs, views[:2])
        cases = bad_get_cases(views)
        for case, buffers, names in cases:
            blank(views)
            with pytest.raises(ValueError) as info:
                kv.get_into(NS, hs, buffers)
            assert names in str(info.value), (case, str(info.value))
            assert all(bytes(v) == SENTINEL for v in views), case  # nothing written anywhere


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_bad_put_from_buffers_are_refused_and_store_nothing(zc_node: NodeProcess, transport: str) -> None:
    with KVStoreClient(zc_node.addr, transport=transport) as kv:
        views = kv.shared_buffer(3 * PAGE).pages(PAGE, 3)
        big = kv.shared_buffer(2 * PAGE)
        cases: list[tuple[list[Any], str]] = [
            (views[:1], "buffers: 1 buffers for 2 hashes"),
            ([views[0], views[1][:100]], f"buffers[1]: 100 bytes, but a page of this layout is {PAGE} bytes"),
            ([views[0], big.view], f"buffers[1]: {2 * PAGE} bytes"),
            ([views[0], "text"], "buffers[1]: a str is not a buffer"),
        ]
        for i, (buffers, names) in enumerate(cases):
            hs = [key(j, f"badput-{transport}-{i}") for j in range(2)]
            with pytest.raises(ValueError) as info:
                kv.put_from(NS, LAYOUT, hs, buffers)
            assert names in str(info.value)
            assert kv.lookup(NS, hs) == 0  # nothing stored, not even the good first page


def test_read_only_buffers_are_fine_for_put_from(zc_node: NodeProcess) -> None:
    hs = [key(0, "ro-put")]
    with KVStoreClient(zc_node.addr, transport="shm") as kv:
        views = kv.shared_buffer(PAGE).pages(PAGE, 1)
        fill(views, hs)
        assert kv.put_from(NS, LAYOUT, hs, [views[0].toreadonly()]).stored == 1
        assert bytes(kv.get(NS, hs)[0]) == page(hs[0])


def test_memory_the_node_cannot_reach_costs_one_copy_more_never_an_error(zc_node: NodeProcess) -> None:
    """Buffers that are not this client's registered memory (plain bytearrays, another client's buffer, a
    closed buffer's stale views) still get their pages on the same-host plane: through the receive pool."""
    hs = [key(i, "foreign") for i in range(2)]
    with KVStoreClient(zc_node.addr, transport="shm") as kv, KVStoreClient(zc_node.addr, transport="shm") as other:
        mine = kv.shared_buffer(2 * PAGE)
        fill(mine.pages(PAGE, 2), hs)
        kv.put_from(NS, LAYOUT, hs, mine.pages(PAGE, 2))
        theirs = other.shared_buffer(2 * PAGE).pages(PAGE, 2)
        plain = [bytearray(PAGE), bytearray(PAGE)]
        stale = mine.pages(PAGE, 2)
        mine.close()
        assert mine.closed
        for buffers in (theirs, plain, stale):
            blank(buffers)
            assert len(kv.get_into(NS, hs, buffers)) == 2
            assert [bytes(b) for b in buffers] == [page(h) for h in hs]
        hs2 = [key(i, "foreign-put") for i in range(2)]
        fill(plain, hs2)
        assert kv.put_from(NS, LAYOUT, hs2, plain).stored == 2  # copied into registered memory first
        assert [bytes(p) for p in kv.get(NS, hs2)] == [page(h) for h in hs2]
        assert kv.plane == "shm"
        mine.close()  # idempotent


def test_shared_buffers_are_sealed_memfds_closed_with_the_client(zc_node: NodeProcess) -> None:
    kv = KVStoreClient(zc_node.addr, transport="shm")
    try:
        a, b = kv.shared_buffer(PAGE), kv.shared_buffer(3 * PAGE)
        for buf in (a, b):
            seals = fcntl.fcntl(buf.fd, fcntl.F_GET_SEALS)
            assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_SEAL  # the node may map it safely
            assert buf.view.nbytes == buf.nbytes and not buf.view.readonly
        with pytest.raises(ValueError, match="count"):
            b.pages(PAGE, 4)
        with pytest.raises(ValueError, match="nbytes"):
            kv.shared_buffer(0)
        registry = kv._core.settings.buffers
        with SharedBuffer(PAGE, registry) as c:  # a context manager too
            assert len(registry) == 3
        assert c.closed and len(registry) == 2
    finally:
        kv.close()
    assert a.closed and b.closed  # the client closed its buffers
    with pytest.raises(OSError):
        os.fstat(b.fd)


def test_corruption_on_nvme_is_never_handed_to_the_caller(tmp_path: Path) -> None:
    node = start_node(tmp_path, dram_pages=4, nvme_pages=32, name="zc-corrupt")
    try:
        hs = [key(i, "zc-c") for i in range(10)]
        with KVStoreClient(node.addr, transport="shm") as kv:
            views = kv.shared_buffer(10 * PAGE).pages(PAGE, 10)
            fill(views, hs)
            kv.put_from(NS, LAYOUT, hs, views)
            tiers = kv.lookup_detail(NS, hs).tiers
            on_nvme = [i for i, t in enumerate(tiers) if t is TierKind.NVME]
            assert len(on_nvme) >= 3
            bad = on_nvme[1]
            flip_payload_byte(tmp_path / "nvme-zc-corrupt", hs[bad])
            blank(views)
            refs = kv.get_into(NS, hs, views, promote=False)
            assert [r.hash for r in refs] == hs[:bad]  # stops before the corrupt page: never handed over
            assert [bytes(v) for v in views[:bad]] == [page(h) for h in hs[:bad]]
            nvme = {t.tier: t for t in kv.stats().tiers}[TierKind.NVME]
            assert nvme.counters.checksum_failures == 1 and kv.lookup(NS, [hs[bad]]) == 0
    finally:
        node.close()


def flip_payload_byte(nvme_dir: Path, h: bytes) -> None:
    """Flip one payload byte of the NVMe slot holding page `h` (found by its header)."""
    slot = HEADER_BYTES + PAGE
    for seg in sorted(nvme_dir.glob("seg-*.kvs")):
        raw = seg.read_bytes()
        for i in range(len(raw) // slot):
            block = raw[i * slot : i * slot + HEADER_BYTES]
            if block[:4] == b"KVPG" and PageHeader.unpack(block).hash == h:
                with open(seg, "r+b") as f:
                    f.seek(i * slot + HEADER_BYTES + 777)
                    f.write(bytes([raw[i * slot + HEADER_BYTES + 777] ^ 0xFF]))
                return
    raise AssertionError("page not found on NVMe")


def test_concurrent_callers_share_one_client_and_one_buffer(zc_node: NodeProcess) -> None:
    with KVStoreClient(zc_node.addr, transport="shm") as kv:
        views = kv.shared_buffer(4 * 6 * PAGE).pages(PAGE, 24)

        def worker(w: int) -> int:
            mine = views[w * 6 : (w + 1) * 6]
            for r in range(4):
                hs = [key(i, f"cc-{w}-{r}") for i in range(6)]
                fill(mine, hs)
                assert kv.put_from(NS, LAYOUT, hs, mine).stored == 6
                blank(mine)
                assert len(kv.get_into(NS, hs, mine, promote=r % 2 == 0)) == 6
                assert [bytes(v) for v in mine] == [page(h) for h in hs]
                kv.delete(NS, hs)
            return w

        with ThreadPoolExecutor(4) as pool:  # a worker's failure is raised here
            assert sorted(pool.map(worker, range(4), timeout=120)) == [0, 1, 2, 3]


def test_concurrent_async_callers(zc_node: NodeProcess) -> None:
    async def main() -> None:
        async with AsyncKVStoreClient(zc_node.addr, transport="shm") as kv:
            views = kv.shared_buffer(3 * 5 * PAGE).pages(PAGE, 15)

            async def worker(w: int) -> None:
                mine = views[w * 5 : (w + 1) * 5]
                hs = [key(i, f"acc-{w}") for i in range(5)]
                fill(mine, hs)
                await kv.put_from(NS, LAYOUT, hs, mine)
                blank(mine)
                assert len(await kv.get_into(NS, hs, mine, promote=False)) == 5
                assert [bytes(v) for v in mine] == [page(h) for h in hs]

            await asyncio.gather(*(worker(w) for w in range(3)))

    asyncio.run(asyncio.wait_for(main(), 120))


def test_without_shm_on_the_node_get_into_falls_back_to_one_copy(tmp_path: Path) -> None:
    node = start_node(tmp_path, name="zc-noshm", extra_args=["--no-shm"])
    try:
        hs = [key(i, "zc-fb") for i in range(3)]
        with KVStoreClient(node.addr) as kv:  # auto: the node offers no shm plane
            views = kv.shared_buffer(3 * PAGE).pages(PAGE, 3)
            fill(views, hs)
            assert kv.put_from(NS, LAYOUT, hs, views).stored == 3
            assert kv.plane in ("tcp", "grpc")  # a copying plane (the TCP plane when the node has it)
            blank(views)
            assert len(kv.get_into(NS, hs, views)) == 3
            assert [bytes(v) for v in views] == [page(h) for h in hs]
            plain = [bytearray(PAGE) for _ in hs]  # any writable buffers do on a copying plane
            assert len(kv.get_into(NS, hs, plain)) == 3 and bytes(plain[2]) == page(hs[2])
    finally:
        node.close()
