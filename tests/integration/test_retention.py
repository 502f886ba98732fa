"""Retention hints (DESIGN.md §6.5) and the fetch-time estimate (§6.6) through both clients against real nodes:
every hint (retain, raise and lower, mode, release, resume, end, the lease running out), what it does to placement
under pressure, its bad input over the wire, a read-only caller and another tenant, Stats, /metrics and kvctl."""

from __future__ import annotations

import asyncio
import io
import math
from pathlib import Path

import grpc
import pytest
from rich.console import Console

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.cli.stats import render_stats
from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.errors import InvalidArgument, PermissionDenied, ResourceExhausted, SessionNotFound
from kvstore.names import RetainMode, TierKind
from kvstore.security import ClientSecurity
from tests.integration.conftest import LAYOUT, NS, key, page, start_node
from tests.integration.test_metrics import scrape, value
from tests.security.conftest import private_file, wait_for

HOLD, DEMOTE = RetainMode.HOLD, RetainMode.DEMOTE


def put_chain(kv: KVStoreClient, salt: str, n: int) -> list[bytes]:
    hs = [key(i, salt) for i in range(n)]
    kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
    return hs


def noise(kv: KVStoreClient, salt: str, n: int) -> list[bytes]:
    """Pages of no chain (so no prefix-aware policy keeps their heads): pressure on every tier."""
    hs = [key(i, salt) for i in range(n)]
    for i in range(0, n, 8):
        kv.put(NS, LAYOUT, hs[i : i + 8], [page(h) for h in hs[i : i + 8]], chain=False)
    return hs


def tiers(kv: KVStoreClient, hs: list[bytes]) -> list[TierKind | None]:
    """Where each page is (None: not on the node), whatever pages before it are missing."""
    return [(d.tiers[0] if (d := kv.lookup_detail(NS, [h])).matched else None) for h in hs]


def test_every_hint_through_the_blocking_client(tmp_path: Path) -> None:
    node = start_node(tmp_path, dram_pages=8, nvme_pages=32, name="ret", extra_args=["--metrics-port", "0"])
    try:
        with KVStoreClient(node.addr, timeout=30) as kv:
            conv = put_chain(kv, "conv", 4)
            res = kv.retain("conv-1", NS, conv, ttl_seconds=120, priority=30, mode=DEMOTE)
            assert (res.retained, res.pending) == (4, 0) and res.state is not None
            assert (res.state.name, res.state.priority, res.state.mode, res.state.pages) == ("conv-1", 30, DEMOTE, 4)
            later = [key(i, "later") for i in range(2)]  # named before its writer puts them
            assert kv.retain("conv-1", NS, later).pending == 2
            kv.put(NS, LAYOUT, later, [page(h) for h in later])
            state = kv.update_session("conv-1", priority=80).state  # raise
            assert state is not None and (state.priority, state.pages, state.pending) == (80, 6, 0)
            state = kv.update_session("conv-1", priority=5, ttl_seconds=300).state  # lower, and renew the lease
            assert state is not None and state.priority == 5 and 299 < state.ttl_seconds <= 300
            first = noise(kv, "noise", 60)  # DRAM (8) and NVMe (32) overflow: unretained pages are dropped
            assert tiers(kv, conv + later) == [TierKind.NVME] * 6  # demoted, never dropped
            assert None in tiers(kv, first)
            res = kv.resume_session("conv-1", priority=90)  # the next turn: back to DRAM
            assert res.prefetching == 6
            wait_for(lambda: tiers(kv, conv + later) == [TierKind.DRAM] * 6, what="resumed pages in DRAM")
            with pytest.raises(ResourceExhausted, match="may hold 4 pages in dram"):
                kv.update_session("conv-1", mode=HOLD)  # 6 in DRAM: over the hold cap, nothing changed
            assert kv.release_pages("conv-1", NS, later).released == 2
            assert kv.update_session("conv-1", mode=HOLD).state.mode is HOLD  # type: ignore[union-attr]
            noise(kv, "noise2", 40)
            assert tiers(kv, conv) == [TierKind.DRAM] * 4  # held where they are
            assert kv.release_pages("conv-1", NS, conv[:2]).released == 2
            stats = kv.stats()
            r = stats.retention
            assert (r.sessions, r.retained_pages, r.resumed, r.refused) == (1, 2, 6, 1)
            row = next(t for t in stats.tenants if t.tenant == "default").retention
            assert row.cap_pages == 16 and {t.tier: t.hold_cap_pages for t in row.tiers}[TierKind.DRAM] == 4
            out = io.StringIO()
            render_stats(stats, Console(file=out, width=200))
            assert "retention: 1 session(s), 2 pages retained (dram 2 (held 2)" in out.getvalue()
            assert node.metrics_port
            samples = scrape(node.metrics_port)
            assert value(samples, "kvstore_retention_sessions", node="ret") == 1
            assert value(samples, "kvstore_retention_pages", node="ret", tier="dram") == 2
            assert value(samples, "kvstore_retention_calls_total", node="ret") == r.calls
            assert value(samples, "kvstore_tenant_retention_cap_pages", tenant="default") == 16
            assert kv.end_session("conv-1").released == 2
            with pytest.raises(SessionNotFound, match="conv-1"):
                kv.update_session("conv-1", priority=50)
            kv.retain("short", NS, conv[2:], ttl_seconds=0.5)
            wait_for(lambda: kv.stats().retention.expired == 1, what="the lease to run out (swept each second)")
            assert kv.stats().retention.retained_pages == 0
    finally:
        node.close()


def test_every_hint_through_the_asyncio_client(tmp_path: Path) -> None:
    node = start_node(tmp_path, dram_pages=8, nvme_pages=32, name="aret")

    async def main() -> None:
        async with AsyncKVStoreClient(node.addr, timeout=30) as kv:
            hs = [key(i, "async") for i in range(3)]
            await kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
            assert (await kv.retain("a", NS, hs, ttl_seconds=60)).retained == 3
            assert (await kv.update_session("a", priority=70)).state.priority == 70  # type: ignore[union-attr]
            assert (await kv.release_pages("a", NS, hs[:1])).released == 1
            assert (await kv.resume_session("a")).prefetching == 0  # already in DRAM
            assert (await kv.end_session("a")).released == 2
            with pytest.raises(SessionNotFound):
                await kv.resume_session("a")

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        node.close()


def test_bad_hints_over_the_wire_name_the_field_and_change_nothing(tmp_path: Path) -> None:
    node = start_node(tmp_path, dram_pages=8, nvme_pages=32, name="bad")
    try:
        with KVStoreClient(node.addr, timeout=30) as kv:
            hs = put_chain(kv, "bad", 2)
            kv.retain("s", NS, hs, ttl_seconds=60, priority=40)
            before = kv.stats().retention
            for kw, field in [
                ({"ttl_seconds": 0.0}, "ttl_seconds"),
                ({"ttl_seconds": -5.0}, "ttl_seconds"),
                ({"ttl_seconds": math.nan}, "ttl_seconds"),
                ({"priority": -1}, "priority"),
                ({"priority": 101}, "priority"),
                ({"priority": 2**40}, "priority"),
            ]:
                with pytest.raises(InvalidArgument) as info:
                    kv.update_session("s", **kw)  # type: ignore[arg-type]
                assert info.value.field == field
            with pytest.raises(InvalidArgument) as info:
                kv.retain("new", NS, hs, ttl_seconds=0)
            assert info.value.field == "ttl_seconds"
            with pytest.raises(InvalidArgument) as info:
                kv.retain("x" * 200, NS, hs, ttl_seconds=1)
            assert info.value.field == "session"
            with pytest.raises(InvalidArgument) as info:
                kv.retain("s", NS, [hs[0], b"short"], ttl_seconds=1)
            assert info.value.field == "hashes[1]"
            with pytest.raises(SessionNotFound, match=r"^session: 'nobody'"):
                kv.end_session("nobody")
            stub = pb_grpc.KVStoreStub(grpc.insecure_channel(node.addr))
            for req, field in [
                (pb.RetainRequest(session="s", op=99), "op"),
                (pb.RetainRequest(session="s", op=pb.RETAIN_OP_UPDATE, mode=7), "mode"),
                (pb.RetainRequest(session="s", hashes=[hs[0]], ttl_seconds=1), "namespace"),
            ]:
                with pytest.raises(grpc.RpcError) as err:
                    stub.Retain(req, timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith(f"{field}: "), err.value.details()
            after = kv.stats().retention
            assert (after.sessions, after.retained_pages) == (before.sessions, before.retained_pages)
            state = kv.update_session("s").state
            assert state is not None and (state.priority, state.pages) == (40, 2)
    finally:
        node.close()


def test_the_cap_displaces_lower_priority_sessions_over_the_wire(tmp_path: Path) -> None:
    node = start_node(tmp_path, dram_pages=8, nvme_pages=32, name="cap")  # DRAM hold cap: 4 pages
    try:
        with KVStoreClient(node.addr, timeout=30) as kv:
            hs = put_chain(kv, "cap", 6)
            kv.retain("bg", NS, hs[:4], ttl_seconds=60, priority=10)
            with pytest.raises(ResourceExhausted, match=r"retention cap: tenant 'default' may hold 4 pages in dram"):
                kv.retain("peer", NS, hs[4:], ttl_seconds=60, priority=10)
            res = kv.retain("fg", NS, hs[4:], ttl_seconds=60, priority=90)
            assert res.displaced == ["bg"] and res.retained == 2
            r = kv.stats().retention
            assert (r.displaced, r.refused, r.sessions) == (1, 1, 1)
    finally:
        node.close()


READ_TOKEN = "ret-read-" + "r" * 24
TOKEN_A = "ret-a----" + "a" * 24
TOKEN_B = "ret-b----" + "b" * 24


def test_a_read_only_caller_and_another_tenant_change_nothing(tmp_path: Path) -> None:
    w = private_file(tmp_path / "rw.tokens", f"{TOKEN_A} tenant-a\n{TOKEN_B} tenant-b\n")
    r = private_file(tmp_path / "ro.tokens", f"{READ_TOKEN} tenant-a\n")
    node = start_node(tmp_path, name="tn", extra_args=["--auth-tokens-file", str(w), "--auth-read-tokens-file", str(r)])
    try:

        def client(token: str) -> KVStoreClient:
            return KVStoreClient(node.addr, timeout=30, security=ClientSecurity(token=token))

        with client(TOKEN_A) as a, client(TOKEN_B) as b, client(READ_TOKEN) as ro:
            hs = [key(i, "ten") for i in range(3)]
            a.put(NS, LAYOUT, hs, [page(h) for h in hs])
            a.retain("conv", NS, hs, ttl_seconds=60, priority=50)
            with pytest.raises(PermissionDenied, match="Retain needs a read-write token"):
                ro.retain("conv", NS, hs, ttl_seconds=60)
            with pytest.raises(PermissionDenied):
                ro.end_session("conv")
            with pytest.raises(SessionNotFound):  # tenant-a's session is not tenant-b's to change
                b.end_session("conv")
            res = b.retain("conv", NS, hs, ttl_seconds=60)  # tenant-b's own session of that name
            assert (res.retained, res.pending) == (0, 3)  # its view: pages it has not stored (a cold miss)
            mine = a.update_session("conv").state
            assert mine is not None and (mine.pages, mine.priority) == (3, 50)
            rows = {t.tenant: t.retention for t in b.stats().tenants}
            assert set(rows) == {"tenant-b"} and rows["tenant-b"].retained_pages == 0
            assert b.stats().retention.sessions == 0  # the node's sum is the operator's
    finally:
        node.close()


def test_lookup_returns_a_fetch_estimate_from_the_nodes_own_reads(tmp_path: Path) -> None:
    node = start_node(tmp_path, dram_pages=8, nvme_pages=32, name="est")
    try:
        with KVStoreClient(node.addr, timeout=30, transport="grpc") as kv:
            hs = put_chain(kv, "est", 16)  # 8 in DRAM, 8 on NVMe
            d = kv.lookup_detail(NS, hs)
            assert {f.tier: f.pages for f in d.fetch} == {TierKind.DRAM: 8, TierKind.NVME: 8}
            assert not any(f.measured for f in d.fetch)
            assert all(f.bytes == f.pages * LAYOUT.page_bytes for f in d.fetch)
            for _ in range(3):
                kv.get_pages(NS, hs[:8], promote=False)
                kv.get_pages(NS, hs[8:], promote=False)
            d = kv.lookup_detail(NS, hs)
            assert all(f.measured and f.rate_bytes_per_second > 0 for f in d.fetch)
            assert d.fetch_ms == pytest.approx(sum(f.expected_ms for f in d.fetch)) and d.fetch_ms > 0
    finally:
        node.close()
