"""A client's calls fit the node's page-count limit (DESIGN.md §8). A node configured with
max_pages_per_request 64 (KVSTORE_MAX_PAGES_PER_REQUEST) refuses any request naming more pages, on every
plane; a default client (256 pages per call) learns the limit from the node's Stats and cuts every bulk call to fit: put, put_from, get, get_into
and lookup of 300 pages round-trip bit-exact on each plane (gRPC streams, shm, TCP, UCX where installed). A
caller's pages_per_call above the limit is capped, one below it kept. A node that does not advertise the limit
(an older one: its Stats read with the field absent) gets the client's own size, as before, and refuses it. A
node restarted with a smaller limit is learned again: no call fails on it once the node answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.client.core import DEFAULT_PAGES_PER_CALL
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.wire.ucx import ucxx_installed
from tests.integration.conftest import LAYOUT, NS, PAGE, as_older_node, key, page, start_node

PLANES = ["grpc", "shm", "tcp", *(["ucx"] if ucxx_installed() else [])]
LIMIT_ENV = "KVSTORE_MAX_PAGES_PER_REQUEST"  # the node's config from its environment (`kvstore serve` has no flag)
LIMIT = 64  # the node's max_pages_per_request, below the client's default 256
PAGES = 300  # pages of each call: several of the node's requests, and more than one default call


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    tmp = tmp_path_factory.mktemp("callsize")
    ucx = ["--ucx"] if "ucx" in PLANES else []
    n = start_node(tmp, dram_pages=4096, nvme_pages=0, extra_args=ucx,
                   env={"UCX_NET_DEVICES": "lo", LIMIT_ENV: str(LIMIT)})  # fmt: skip
    try:
        yield n
    finally:
        n.close()


def chain(tag: str, n: int = PAGES) -> list[bytes]:
    return [key(i, f"callsize-{tag}") for i in range(n)]


def test_the_node_advertises_its_limit(node: NodeProcess) -> None:
    with KVStoreClient(node.addr, timeout=30, transport="grpc") as kv:
        assert kv.stats().max_pages_per_request == LIMIT


@pytest.mark.parametrize("plane", PLANES)
def test_a_default_client_moves_300_pages_through_a_node_that_takes_64(node: NodeProcess, plane: str) -> None:
    hashes, more = chain(f"{plane}-put"), chain(f"{plane}-put-from")
    pages = [page(h) for h in hashes]
    with KVStoreClient(node.addr, timeout=30, transport=plane) as kv:
        r = kv.put(NS, LAYOUT, hashes, pages)
        assert kv.plane == plane and kv.call_pages == LIMIT
        assert (r.stored, r.already_present, r.held) == (PAGES, 0, [True] * PAGES)
        assert kv.lookup(NS, hashes) == PAGES
        assert [bytes(p) for p in kv.get(NS, hashes)] == pages
        out = [bytearray(PAGE) for _ in hashes]
        refs = kv.get_into(NS, hashes, out)
        assert len(refs) == PAGES and [bytes(b) for b in out] == pages
        src = [bytearray(page(h)) for h in more]
        r = kv.put_from(NS, LAYOUT, more, src)
        assert (r.stored, r.already_present) == (PAGES, 0)
        assert [bytes(p) for p in kv.get(NS, more)] == [bytes(b) for b in src]
        assert kv.corrupt_pages == 0


@pytest.mark.parametrize(("asked", "sent"), [(1000, LIMIT), (LIMIT, LIMIT), (10, 10)])
def test_an_explicit_pages_per_call_is_capped_above_the_limit_and_kept_below(
    node: NodeProcess, asked: int, sent: int
) -> None:
    hashes = chain(f"asked-{asked}", 150)
    pages = [page(h) for h in hashes]
    with KVStoreClient(node.addr, timeout=30, transport="tcp", pages_per_call=asked) as kv:
        assert kv.put(NS, LAYOUT, hashes, pages).stored == len(hashes)
        assert kv.call_pages == sent
        assert [bytes(p) for p in kv.get(NS, hashes)] == pages


def test_the_asyncio_client_cuts_its_calls_alike(node: NodeProcess) -> None:
    hashes = chain("aio")
    pages = [page(h) for h in hashes]

    async def run() -> list[bytes]:
        async with AsyncKVStoreClient(node.addr, timeout=30, transport="grpc") as kv:
            assert (await kv.put(NS, LAYOUT, hashes, pages)).stored == PAGES
            assert kv.call_pages == LIMIT
            return [bytes(p) for p in await kv.get(NS, hashes)]

    assert asyncio.run(run()) == pages


@pytest.mark.parametrize("plane", ["grpc", "tcp"])
def test_a_node_that_does_not_advertise_gets_the_clients_own_size(node: NodeProcess, plane: str) -> None:
    hashes = chain(f"older-{plane}")
    pages = [page(h) for h in hashes]
    with as_older_node(KVStoreClient(node.addr, timeout=30, transport=plane)) as kv:
        with pytest.raises(InvalidArgument, match="pages"):  # today's behaviour: the node refuses 256 pages
            kv.put(NS, LAYOUT, hashes, pages)
        assert kv.call_pages == DEFAULT_PAGES_PER_CALL
    with KVStoreClient(node.addr, timeout=30, transport="grpc") as kv:
        assert kv.lookup(NS, hashes) == 0  # the refused call stored nothing
    with as_older_node(KVStoreClient(node.addr, timeout=30, transport=plane, pages_per_call=LIMIT)) as kv:
        assert kv.put(NS, LAYOUT, hashes, pages).stored == PAGES  # a caller who sizes its calls is served
        assert [bytes(p) for p in kv.get(NS, hashes)] == pages


def test_pages_per_call_below_one_is_refused_naming_it(node: NodeProcess) -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match="pages_per_call"):
            KVStoreClient(node.addr, pages_per_call=bad)


@pytest.mark.parametrize("plane", ["grpc", "tcp"])
def test_a_node_restarted_with_a_smaller_limit_is_learned_again(tmp_path: Path, plane: str) -> None:
    node = start_node(tmp_path, dram_pages=1024, nvme_pages=0, name=f"restart-{plane}", env={LIMIT_ENV: "128"})
    hashes, later = chain(f"restart-{plane}"), chain(f"restart-{plane}-later")
    try:
        with KVStoreClient(node.addr, timeout=30, transport=plane) as kv:
            assert kv.put(NS, LAYOUT, hashes, [page(h) for h in hashes]).stored == PAGES
            assert kv.call_pages == 128

            def smaller() -> None:
                node.env[LIMIT_ENV] = "32"

            node.restart(edit=smaller)
            deadline, served = time.monotonic() + 30, False
            while time.monotonic() < deadline and not served:
                try:
                    r = kv.put(NS, LAYOUT, later, [page(h) for h in later])
                    served = True
                except KVStoreError as exc:  # only while the client reconnects to the restarted node
                    assert not isinstance(exc, InvalidArgument), exc  # never a call cut to the old limit
                    time.sleep(0.2)
            assert served and r.stored == PAGES and kv.call_pages == 32
            assert [bytes(p) for p in kv.get(NS, later)] == [page(h) for h in later]
    finally:
        node.close()
