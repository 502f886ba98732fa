"""A real node over gRPC: round trip, lookup, tiers, restart recovery, corruption, concurrency, CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.cli.launch import NodeProcess
from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.hashing import prefix_hashes
from kvstore.layout import DType, PageLayout
from kvstore.names import TierKind
from kvstore.pageformat import HEADER_BYTES
from tests.integration.conftest import LAYOUT, NS, PAGE, key, page, start_node


def test_round_trip_lookup_and_shared_prefixes(kv: KVStoreClient) -> None:
    system = list(range(64))
    a = prefix_hashes(system + [7] * 48, LAYOUT.block_size, NS)
    b = prefix_hashes(system + [9] * 32, LAYOUT.block_size, NS)
    assert kv.lookup(NS, a) == 0
    r = kv.put(NS, LAYOUT, a, [page(h) for h in a])
    assert (r.stored, r.already_present) == (7, 0)
    assert kv.lookup(NS, b) == 4  # the shared system prompt
    r = kv.put(NS, LAYOUT, b, [page(h) for h in b])
    assert (r.stored, r.already_present) == (2, 4)
    got = kv.get(NS, b)
    assert [bytes(p) for p in got] == [page(h) for h in b]
    detail = kv.lookup_detail(NS, [*a, key(999)])
    assert detail.matched == 7 and detail.namespace_known and len(detail.tiers) == 7


def test_get_stops_at_first_missing_page(kv: KVStoreClient) -> None:
    hs = [key(i) for i in range(4)]
    kv.put(NS, LAYOUT, [hs[0], hs[1], hs[3]], [page(hs[0]), page(hs[1]), page(hs[3])])
    got = kv.get(NS, hs)
    assert [bytes(p) for p in got] == [page(hs[0]), page(hs[1])]


def test_demotion_to_nvme_and_promotion_back(kv: KVStoreClient) -> None:
    hs = [key(i) for i in range(20)]  # DRAM holds 8
    kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
    tiers = kv.lookup_detail(NS, hs).tiers
    assert tiers.count(TierKind.NVME) == 12 and tiers.count(TierKind.DRAM) == 8
    pages = kv.get_pages(NS, hs[:3])
    assert [p.tier for p in pages] == [TierKind.NVME] * 3
    assert [bytes(p.data) for p in pages] == [page(h) for h in hs[:3]]
    assert kv.lookup_detail(NS, hs[:3]).tiers == [TierKind.DRAM] * 3  # promoted on hit
    s = {t.tier: t for t in kv.stats().tiers}
    assert s[TierKind.NVME].counters.hits == 3 and s[TierKind.DRAM].counters.promotions == 3
    assert s[TierKind.NVME].counters.demotions >= 12
    assert s[TierKind.DRAM].hit_rate == 0.0 and s[TierKind.NVME].hit_rate == 1.0


def test_restart_recovers_nvme_pages(tmp_path: Path) -> None:
    n = start_node(tmp_path)
    try:
        hs = [key(i, "r") for i in range(20)]
        with KVStoreClient(n.addr) as kv:
            kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
        assert n.stop() == 0  # graceful: DRAM pages are spilled to NVMe too
        n.start()
        with KVStoreClient(n.addr) as kv:
            assert kv.lookup(NS, hs) == 20
            assert [bytes(p) for p in kv.get(NS, hs)] == [page(h) for h in hs]
        n.kill()  # a crash: only what was durable on NVMe survives
        n.start()
        with KVStoreClient(n.addr) as kv:
            st = kv.stats()
            recovered = sum(t.pages for t in st.tiers)
            assert 12 <= recovered <= 20
            got = kv.get(NS, hs)
            assert all(bytes(p) == page(h) for p, h in zip(got, hs, strict=False))
    finally:
        n.close()


def test_a_node_for_2mib_pages_keeps_64kib_pages_at_their_own_size(tmp_path: Path) -> None:
    """The outside report's case: a node started with --max-page-bytes 2MiB receives a 64-page store of
    64 KiB regions beside 2 MiB pages. Each page takes its own size (64 KiB pages 30 to a chunk), nothing is
    evicted, every page comes back, and a restart recovers them all from NVMe (DESIGN.md §5.3)."""
    small = PageLayout(DType.BFLOAT16, 1, 8, 128, 16)  # 64 KiB: one layer of a 16-token page
    big = PageLayout(DType.BFLOAT16, 32, 8, 128, 16)  # 2 MiB: all 32 layers
    chunk = HEADER_BYTES + big.page_bytes
    n = NodeProcess(dram_bytes=8 * chunk, nvme_path=tmp_path / "nvme", nvme_bytes=16 * chunk,
                    max_page_bytes="2MiB", node_id="sizes").start()  # fmt: skip
    hs_small, hs_big = [key(i, "small") for i in range(64)], [key(i, "big") for i in range(4)]
    try:
        with KVStoreClient(n.addr, timeout=60) as kv:
            assert kv.put("it/small", small, hs_small, [page(h, small.page_bytes) for h in hs_small]).stored == 64
            assert kv.put("it/big", big, hs_big, [page(h, big.page_bytes) for h in hs_big]).stored == 4
            dram = {t.tier: t for t in kv.stats().tiers}[TierKind.DRAM]
            assert (dram.pages, dram.slots_used, dram.counters.evictions) == (68, 68, 0)
            assert dram.used_bytes == 64 * small.page_bytes + 4 * big.page_bytes
            assert [bytes(p) for p in kv.get("it/small", hs_small)] == [page(h, small.page_bytes) for h in hs_small]
            assert [bytes(p) for p in kv.get("it/big", hs_big)] == [page(h, big.page_bytes) for h in hs_big]
        assert n.stop() == 0  # graceful: spilled to NVMe, into chunks of each size
        n.start()
        with KVStoreClient(n.addr, timeout=60) as kv:
            assert kv.lookup("it/small", hs_small) == 64 and kv.lookup("it/big", hs_big) == 4
            assert [bytes(p) for p in kv.get("it/small", hs_small)] == [page(h, small.page_bytes) for h in hs_small]
            assert [bytes(p) for p in kv.get("it/big", hs_big)] == [page(h, big.page_bytes) for h in hs_big]
    finally:
        n.close()


def test_corrupted_nvme_slot_is_detected(tmp_path: Path) -> None:
    n = start_node(tmp_path)
    try:
        hs = [key(i, "c") for i in range(12)]
        with KVStoreClient(n.addr) as kv:
            kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
            on_nvme = [h for h, t in zip(hs, kv.lookup_detail(NS, hs).tiers, strict=True) if t is TierKind.NVME]
            assert len(on_nvme) >= 3  # which pages went down is the policy's choice
            bad, ok = on_nvme[0], on_nvme[1:3]
            seg = sorted((tmp_path / "nvme-n0").glob("seg-*.kvs"))[0]
            raw = seg.read_bytes()
            from kvstore.pageformat import PageHeader

            slot_bytes = HEADER_BYTES + PAGE
            victim = next(i for i in range(len(raw) // slot_bytes)
                          if raw[i * slot_bytes : i * slot_bytes + 4] == b"KVPG"
                          and PageHeader.unpack(raw[i * slot_bytes : i * slot_bytes + HEADER_BYTES]).hash == bad)  # fmt: skip
            with open(seg, "r+b") as f:
                f.seek(victim * slot_bytes + HEADER_BYTES + 1234)
                f.write(b"\xff\x00\xff")
                f.flush()
            assert kv.get(NS, [bad, *ok]) == []  # never returned
            nvme = {t.tier: t for t in kv.stats().tiers}[TierKind.NVME]
            assert nvme.counters.checksum_failures == 1
            assert kv.lookup(NS, [bad]) == 0
            assert [bytes(p) for p in kv.get(NS, ok)] == [page(h) for h in ok]
    finally:
        n.close()


def test_delete_pin_unpin_prefetch(kv: KVStoreClient) -> None:
    hs = [key(i, "d") for i in range(12)]
    kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
    assert kv.pin(NS, [*hs[:2], key(12345)]).done == 2
    r = kv.delete(NS, [*hs[:3], key(777)])
    assert (r.deleted, r.not_found, r.busy) == (1, 1, 2)
    assert kv.unpin(NS, hs[:2]).done == 2
    assert kv.delete(NS, hs[:2]).deleted == 2
    nvme_pages = [h for h, t in zip(hs[3:], kv.lookup_detail(NS, hs[3:]).tiers, strict=True) if t is TierKind.NVME]
    r2 = kv.prefetch(NS, nvme_pages)
    assert r2.scheduled == len(nvme_pages) > 0
    assert kv.stats().prefetch_issued == len(nvme_pages)


@pytest.mark.parametrize("transport", ["grpc", "shm", "tcp"])
def test_concurrent_clients_threads_and_asyncio(node: NodeProcess, transport: str) -> None:
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            with KVStoreClient(node.addr, transport=transport) as kv:
                hs = [key(i, f"t{w}") for i in range(6)]
                kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
                got = kv.get(NS, hs)
                assert len(got) >= 1
                assert all(bytes(p) == page(h) for p, h in zip(got, hs, strict=False))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors

    async def main() -> None:
        async with AsyncKVStoreClient(node.addr, transport=transport) as kv:

            async def one(w: int) -> None:
                hs = [key(i, f"a{w}") for i in range(3)]
                await kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
                got = await kv.get(NS, hs)
                assert all(bytes(p) == page(h) for p, h in zip(got, hs, strict=False))
                assert await kv.lookup(NS, hs) >= 1

            await asyncio.gather(*(one(w) for w in range(4)))
            st = await kv.stats()
            assert sum(t.pages for t in st.tiers) >= 12

    asyncio.run(asyncio.wait_for(main(), 60))


def test_batched_streams_bigger_than_dram(kv: KVStoreClient) -> None:
    hs = [key(i, "b") for i in range(40)]  # DRAM 8 + NVMe 64 slots: the stream commits in groups
    r = kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
    assert r.stored == 40
    assert [bytes(p) for p in kv.get(NS, hs)] == [page(h) for h in hs]


def test_health_and_reflection(node: NodeProcess) -> None:
    with grpc.insecure_channel(node.addr) as ch:
        h = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"), timeout=10
        )
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                   timeout=10)))  # fmt: skip
        names = {s.name for s in resp.list_services_response.service}
        assert {"kvstore.v1.KVStore", "grpc.health.v1.Health"} <= names


def test_kvctl_stats_json_and_table(node: NodeProcess, kv: KVStoreClient) -> None:
    hs = [key(i, "k") for i in range(10)]
    kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
    kv.get(NS, hs)
    out = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "stats", "--addr", node.addr, "--json"],
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    data = json.loads(out.stdout)
    assert data["tiers"]["hbm"]["available"] is False and data["tiers"]["hbm"]["capacity_bytes"] == 0
    assert data["tiers"]["dram"]["hits"] + data["tiers"]["nvme"]["hits"] == 10
    assert data["tiers"]["nvme"]["hit_rate"] is not None
    assert {"evictions", "promotions", "demotions", "bytes_in", "bytes_out", "checksum_failures"} <= set(
        data["tiers"]["dram"]
    )
    table = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "stats", "--addr", node.addr],
                           capture_output=True, text=True, timeout=60, check=True, env={"COLUMNS": "120", "PATH": ""})  # fmt: skip
    assert "hit rate" in table.stdout and "NVME" in table.stdout


def test_kvctl_unreachable_node_is_a_one_line_error() -> None:
    out = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "stats", "--addr", "127.0.0.1:1", "--timeout", "2"],
                         check=False, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 1 and "error" in out.stderr and "Traceback" not in out.stderr
