"""Calls a caller gave up on (an asyncio cancel, a client timeout) never hand anyone wrong bytes (DESIGN.md §8).

The sequences an outside probe used against the receive pool and the caller's own buffers, on every plane:
- a Put cancelled on a node with full DRAM, then the caller's next plain get: the Put's pages must never be
  stored with the get's bytes (the node copies out of the client's memory until it is done with it);
- a large NVMe Get abandoned (cancelled, or timed out), then another get: the pages that get returned must
  not change afterwards (the abandoned Get's late writes must not land in reused receive memory);
- a cancelled `get_into`: once the cancel returned, nothing writes into the caller's buffers any more.
Each is a race, so each repeats a bounded number of times; before the fix they failed within a few rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.client.planes import shm_conn
from kvstore.errors import KVStoreError
from kvstore.names import TierKind
from kvstore.wire.ucx import ucxx_installed
from tests.integration.conftest import LAYOUT, NS, PAGE, key, page, start_node

PLANES = ["grpc", "shm", "tcp", *(["ucx"] if ucxx_installed() else [])]
SETTLE_S = 1.5  # how long a test watches for late writes after a call was given up


@pytest.fixture(scope="module")
def full_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A node whose small DRAM fills at once: every later Put page is refused there and written through."""
    path = tmp_path_factory.mktemp("abandon")
    with contextlib.closing(start_node(path, dram_pages=16, nvme_pages=3000, name="ab0", extra_args=["--ucx"])) as n:
        yield n


def _chain(tag: str, n: int) -> list[bytes]:
    return [key(i, tag) for i in range(n)]


@pytest.mark.parametrize("plane", PLANES)
def test_a_cancelled_put_never_stores_someone_elses_bytes(full_node: NodeProcess, plane: str) -> None:
    readers = _chain(f"cp-read-{plane}", 64)
    with KVStoreClient(full_node.addr, transport=plane) as kv:
        kv.put(NS, LAYOUT, readers, [page(h) for h in readers], target_tier=TierKind.NVME)

    async def round_(r: int) -> list[bytes]:
        hashes = _chain(f"cp-{plane}-{r}", 256)
        async with AsyncKVStoreClient(full_node.addr, transport=plane, timeout=30) as kv:
            await kv.get(NS, readers[:2])  # negotiate the plane first: the cancel hits the Put itself
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(kv.put(NS, LAYOUT, hashes, [page(h) for h in hashes]), 0.03 + 0.02 * r)
            got = await kv.get(NS, readers)  # reuses whatever receive memory is free now
            assert [bytes(p) for p in got] == [page(h) for h in readers]
            await asyncio.sleep(SETTLE_S)  # the node finishes (or aborts) the cancelled Put meanwhile
            return hashes

    for r in range(4):
        hashes = asyncio.run(round_(r))
        with KVStoreClient(full_node.addr, transport="grpc") as kv:
            stored = kv.get(NS, hashes, promote=False)
            bad = [i for i, p in enumerate(stored) if bytes(p) != page(hashes[i])]
            assert not bad, f"round {r}: {len(bad)} of {len(stored)} stored pages hold other bytes"


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("how", ["cancel", "timeout"])
def test_pages_a_get_returned_never_change_after_an_abandoned_get(full_node: NodeProcess, plane: str, how: str) -> None:
    big = _chain(f"ag-big-{plane}", 1024)
    small = _chain(f"ag-small-{plane}", 20)
    with KVStoreClient(full_node.addr, transport="grpc", timeout=120) as kv:
        for i in range(0, len(big), 256):
            kv.put(NS, LAYOUT, big[i : i + 256], [page(h) for h in big[i : i + 256]], target_tier=TierKind.NVME)
        kv.put(NS, LAYOUT, small, [page(h) for h in small], target_tier=TierKind.NVME)
    expected = [page(h) for h in small]

    async def abandon_async() -> list[memoryview]:
        async with AsyncKVStoreClient(full_node.addr, transport=plane, timeout=30, pages_per_call=1024) as kv:
            await kv.get(NS, small[:1], promote=False)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(kv.get(NS, big, promote=False), 0.08)
            got = await kv.get(NS, small, promote=False)
            await asyncio.sleep(SETTLE_S)
            return got

    for _ in range(2):
        if how == "cancel":
            got = asyncio.run(abandon_async())
        else:
            with KVStoreClient(full_node.addr, transport=plane, timeout=0.08, pages_per_call=1024) as kv:
                with contextlib.suppress(KVStoreError):
                    kv.get(NS, small[:1], promote=False)
                with contextlib.suppress(KVStoreError):
                    kv.get(NS, big, promote=False)
                got = kv.get(NS, small, promote=False) if plane == "grpc" else _get_slowly(kv, small)
                time.sleep(SETTLE_S)
        assert len(got) == len(small)
        changed = [i for i, p in enumerate(got) if bytes(p) != expected[i]]
        assert not changed, f"{len(changed)} of {len(got)} returned pages changed after they were returned"


def _get_slowly(kv: KVStoreClient, hashes: list[bytes]) -> list[memoryview]:
    """A get on a client whose calls time out after 0.08 s: a loaded machine may need several tries to even
    connect (a UCX handshake alone can take longer); retry, bounded in time and count, until served."""
    deadline = time.monotonic() + 30.0
    for _ in range(300):
        try:
            return kv.get(NS, hashes, promote=False)
        except KVStoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    return kv.get(NS, hashes, promote=False)


@pytest.mark.parametrize("plane", PLANES)
def test_a_cancelled_get_into_writes_nothing_after_the_cancel(full_node: NodeProcess, plane: str) -> None:
    chain = _chain(f"gi-{plane}", 256)
    with KVStoreClient(full_node.addr, transport="grpc", timeout=120) as kv:
        kv.put(NS, LAYOUT, chain, [page(h) for h in chain], target_tier=TierKind.NVME)

    async def main() -> int:
        async with AsyncKVStoreClient(full_node.addr, transport=plane, timeout=30) as kv:
            buf = kv.shared_buffer(len(chain) * PAGE)
            views = buf.pages(PAGE, len(chain))
            await kv.get(NS, chain[:1], promote=False)
            late = 0
            for r in range(3):
                for v in views:
                    v[:8] = b"\0" * 8
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(kv.get_into(NS, chain, views, promote=False), 0.02 + 0.02 * r)
                for v in views:  # the cancel returned: from now on the buffers are the caller's alone
                    v[:] = b"\x5a" * PAGE
                await asyncio.sleep(SETTLE_S)
                late += sum(bytes(v) != b"\x5a" * PAGE for v in views)
            buf.close()
            return late

    assert asyncio.run(main()) == 0


def test_a_hung_node_keeps_the_memory_it_was_lent_until_it_lets_go(tmp_path: Path) -> None:
    """A same-host get whose node stops answering (SIGSTOP): the call times out, waits DRAIN_SECONDS for the
    node's close, then raises an error saying the buffers may still be written; the receive blocks stay out of
    the pool (quarantined) until the node, resumed, sees the hang-up and closes; then they come back."""
    chain = _chain("hung", 512)
    with contextlib.closing(start_node(tmp_path, dram_pages=16, nvme_pages=600, name="hung")) as n:
        with KVStoreClient(n.addr, transport="grpc", timeout=60) as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain], target_tier=TierKind.NVME)
        with KVStoreClient(n.addr, transport="shm", timeout=0.5, pages_per_call=512) as kv:
            assert len(kv.get(NS, chain[:1], promote=False)) == 1
            pool = kv.receive_pool  # its free bytes tell what is lent to the node
            free_before = pool.free_bytes
            assert n.proc is not None
            os.kill(n.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(KVStoreError, match="may still be written"):
                    kv.get(NS, chain, promote=False)
                assert pool.free_bytes < free_before  # the GET's blocks are still lent to the stopped node
            finally:
                os.kill(n.proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while pool.free_bytes < free_before and time.monotonic() < deadline:
                time.sleep(0.1)
            assert pool.free_bytes >= free_before  # the node let go: the quarantine gave them back
            assert not shm_conn.QUARANTINE.written_off
