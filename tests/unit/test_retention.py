"""Retention (DESIGN.md §6.5) through the TierManager on real media: an mmap DRAM slab and NVMe segment files.

Every scenario ends by checking the bookkeeping's invariants against the page table (`check_invariants`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from kvstore.config import NodeConfig
from kvstore.errors import InvalidArgument, ResourceExhausted, SessionNotFound
from kvstore.manager import TierManager
from kvstore.manager.fetchrates import DEFAULT_RATES, FetchRates
from kvstore.manager.retention import RetainCall
from kvstore.manager.state import UNRETAINED
from kvstore.names import RetainMode, RetainOp, TierKind
from kvstore.policy import POLICIES
from tests.unit.test_manager import NS, PAGE, SLOT, config, key, put, read, tiers_of

HOLD, DEMOTE = RetainMode.HOLD, RetainMode.DEMOTE


def run(fn: Callable[[TierManager], Awaitable[None]], cfg: NodeConfig) -> None:
    async def main() -> None:
        mgr = TierManager(cfg)
        await mgr.start()
        try:
            await fn(mgr)
            check_invariants(mgr)
        finally:
            await mgr.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def retain(
    mgr: TierManager,
    session: str,
    ids: list[int] = (),  # type: ignore[assignment]
    op: RetainOp = RetainOp.RETAIN,
    tenant: str = "default",
    **kw: object,
):  # type: ignore[no-untyped-def]
    if op is RetainOp.RETAIN and "ttl_seconds" not in kw:
        kw["ttl_seconds"] = 60.0
    res = mgr.retain(tenant, RetainCall(session, op, [(NS, key(i)) for i in ids], **kw))  # type: ignore[arg-type]
    check_invariants(mgr)
    return res


def check_invariants(mgr: TierManager) -> None:
    """The retention module's invariants against the page table (its docstring), through its own check."""
    mgr.retention.check()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_held_pages_stay_in_dram_under_every_policy(tmp_path: Path, policy: str) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, [0, 1])
        res = retain(mgr, "s", [0, 1])
        assert (res.retained, res.pending) == (2, 0) and res.state is not None and res.state.pages == 2
        for i in range(2, 40):  # DRAM holds 4: everything else cycles through it
            await put(mgr, [i])
            await read(mgr, [i, i])  # a reused page: the kind every policy would rather keep
        assert tiers_of(mgr, [0, 1]) == [TierKind.DRAM, TierKind.DRAM]
        retain(mgr, "s", op=RetainOp.END)
        assert all(mgr.entry(NS, key(i)).evictable for i in (0, 1))  # released: a page like any other

    run(body, config(tmp_path, policy=policy))


@pytest.mark.parametrize("policy", ["lru", "adaptive", "s3fifo"])
def test_demote_dont_drop_keeps_pages_on_nvme_while_others_drop(tmp_path: Path, policy: str) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, [0, 1, 2, 3])
        retain(mgr, "s", [0, 1, 2], mode=DEMOTE)
        for i in range(4, 60):  # through DRAM (4) and NVMe (16) several times over
            await put(mgr, [i])
        assert tiers_of(mgr, [0, 1, 2]) == [TierKind.NVME] * 3  # demoted, never dropped
        assert tiers_of(mgr, [3]) == [None]  # the unretained neighbour was dropped
        assert [t for _, t in await read(mgr, [0, 1, 2])] == [TierKind.NVME] * 3

    run(body, config(tmp_path, policy=policy))


def test_named_before_put_is_retained_when_its_writer_puts_it(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        res = retain(mgr, "s", [0, 1, 2], mode=HOLD)
        assert (res.retained, res.pending) == (0, 3)
        await put(mgr, [0, 1])
        st = retain(mgr, "s", op=RetainOp.UPDATE).state
        assert st is not None and (st.pages, st.pending) == (2, 1)
        for i in range(3, 20):
            await put(mgr, [i])
        assert tiers_of(mgr, [0, 1]) == [TierKind.DRAM] * 2

    run(body, config(tmp_path))


def test_cap_displaces_lower_priority_sessions_and_refuses_otherwise(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        caps = mgr.retain_caps("default")
        assert caps.hold == {TierKind.DRAM: 4} and caps.total == 8  # 0.5 of 8 DRAM slots, of 16 NVMe slots
        await put(mgr, list(range(8)))
        assert retain(mgr, "low", [0, 1], priority=10).retained == 2
        assert retain(mgr, "mid", [2, 3], priority=50).retained == 2
        with pytest.raises(ResourceExhausted, match=r"retention cap.*hold 4 pages in dram"):
            retain(mgr, "same", [4], priority=10)  # nothing below 10 gives way
        assert "same" not in mgr.retention.tenants["default"].sessions  # nothing changed
        res = retain(mgr, "high", [4, 5], priority=90)
        assert res.displaced == ["low"] and res.retained == 2  # the lowest gave way, only it
        assert sorted(mgr.retention.tenants["default"].sessions) == ["high", "mid"]
        with pytest.raises(SessionNotFound):
            retain(mgr, "low", op=RetainOp.UPDATE, priority=99)
        # DEMOTE pages are capped by the slowest tier's share instead: room for 8 there.
        assert retain(mgr, "cold", [0, 1, 6, 7], mode=DEMOTE, priority=1).retained == 4
        st = mgr.stats()
        assert st.retention.displaced == 1 and st.retention.refused == 1 and st.retention.retained_pages == 8
        row = next(t for t in st.tenants if t.tenant == "default").retention
        assert row.cap_pages == 8 and {t.tier: t.hold_cap_pages for t in row.tiers}[TierKind.DRAM] == 4

    run(body, config(tmp_path, dram_pages=8, nvme_pages=16))


def test_caps_follow_a_tenants_byte_shares(tmp_path: Path) -> None:
    """Shares are bytes (DESIGN.md §10); the caps are retain_fraction of them in pages of the largest slot, so a
    tenant never retains more than that fraction of its bytes."""
    shares = {"acme": {TierKind.DRAM: 4 * SLOT + SLOT // 2, TierKind.NVME: 8 * SLOT}}

    async def main() -> None:
        mgr = TierManager(config(tmp_path, dram_pages=8, nvme_pages=16), shares=shares)
        await mgr.start()
        try:
            assert mgr.config.slot_bytes == SLOT
            acme, other = mgr.retain_caps("acme"), mgr.retain_caps("default")
            assert (acme.total, acme.hold) == (4, {TierKind.DRAM: 2})  # 0.5 x 8 slots; 0.5 x 4.5 slots, rounded down
            assert (other.total, other.hold) == (8, {TierKind.DRAM: 4})  # no share: the tiers' own bytes
        finally:
            await mgr.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_put_at_the_cap_is_stored_unheld_and_retained_later(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, [0, 1])
        retain(mgr, "a", [0, 1])  # the DRAM hold cap (2 of 4 slots)
        res = retain(mgr, "b", [2])  # not stored yet: pending, nothing to make room for
        assert res.pending == 1
        await put(mgr, [2])
        st = retain(mgr, "b", op=RetainOp.UPDATE).state
        assert st is not None and (st.pages, st.unheld) == (0, 1)
        assert mgr.stats().retention.unheld == 1
        retain(mgr, "a", op=RetainOp.END)
        assert retain(mgr, "b", [2]).retained == 1  # named again: retained now there is room

    run(body, config(tmp_path))


def test_updates_release_end_and_expiry(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, [0, 1, 2])
        retain(mgr, "s", [0, 1, 2], ttl_seconds=5.0, priority=20)
        st = retain(mgr, "s", op=RetainOp.UPDATE, priority=80, ttl_seconds=100.0).state
        assert st is not None and st.priority == 80 and 99 < st.ttl_seconds <= 100
        st = retain(mgr, "s", op=RetainOp.UPDATE, mode=DEMOTE).state
        assert st is not None and st.mode is DEMOTE and mgr.entry(NS, key(0)).hold_from == int(TierKind.NVME)
        assert retain(mgr, "s", [1], op=RetainOp.RELEASE).released == 1
        assert mgr.entry(NS, key(1)).hold_from == UNRETAINED
        retain(mgr, "t", [2], ttl_seconds=1.0)  # shares page 2
        assert retain(mgr, "s", op=RetainOp.END).released == 1  # page 0; page 2 still t's
        assert mgr.entry(NS, key(2)).retained and not mgr.entry(NS, key(0)).retained
        assert mgr.retention.expire(time.monotonic() + 2) == 1  # t's lease ran out
        assert not mgr.entry(NS, key(2)).retained and mgr.retention.tenants["default"].sessions == {}
        st2 = mgr.stats().retention
        assert (st2.ended, st2.expired, st2.sessions) == (1, 1, 0)

    run(body, config(tmp_path, dram_pages=8))


def test_bad_input_names_the_field_and_changes_nothing(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, [0])
        retain(mgr, "s", [0], priority=40)
        before = mgr.retention.view(mgr.retention.tenants["default"].sessions["s"], 0.0)
        cases: list[tuple[dict[str, object], str]] = [
            ({"session": "new", "ttl_seconds": 0.0}, "ttl_seconds"),
            ({"session": "new", "ttl_seconds": -1.0}, "ttl_seconds"),
            ({"session": "new", "ttl_seconds": math.nan}, "ttl_seconds"),
            ({"session": "new", "ttl_seconds": math.inf}, "ttl_seconds"),
            ({"session": "new"}, "ttl_seconds"),  # a new session needs a lease
            ({"session": "s", "ttl_seconds": 1.0, "priority": -1}, "priority"),
            ({"session": "s", "ttl_seconds": 1.0, "priority": 101}, "priority"),
            ({"session": "", "ttl_seconds": 1.0}, "session"),
            ({"session": "x" * 129, "ttl_seconds": 1.0}, "session"),
            ({"session": "a\nb", "ttl_seconds": 1.0}, "session"),
            ({"session": "s", "op": RetainOp.END, "ids": [0]}, "hashes"),
        ]
        for kw, field in cases:
            ids = kw.pop("ids", [0])
            session = kw.pop("session")
            op = kw.pop("op", RetainOp.RETAIN)
            with pytest.raises(InvalidArgument) as info:
                mgr.retain("default", RetainCall(session, op, [(NS, key(i)) for i in ids], **kw))  # type: ignore[arg-type]
            assert info.value.field == field, (kw, info.value)
        with pytest.raises(InvalidArgument, match="hashes\\[1\\]"):
            mgr.retain("default", RetainCall("s", RetainOp.RETAIN, [(NS, key(1)), (NS, b"short")], 1.0))
        for op in (RetainOp.UPDATE, RetainOp.RELEASE, RetainOp.END, RetainOp.RESUME):
            with pytest.raises(SessionNotFound, match=r"^session: 'nobody'"):
                mgr.retain("default", RetainCall("nobody", op, [], 1.0))
        with pytest.raises(SessionNotFound):  # another tenant's session of the same name is not this one's
            mgr.retain("other", RetainCall("s", RetainOp.UPDATE, [], 1.0, 99))
        after = mgr.retention.view(mgr.retention.tenants["default"].sessions["s"], 0.0)
        assert after == before and set(mgr.retention.tenants["default"].sessions) == {"s"}
        assert mgr.entry(NS, key(0)).hold_from == 0

    run(body, config(tmp_path))


def test_another_tenants_hashes_are_pending_for_the_caller(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, [0])  # the default tenant's page
        res = mgr.retain("t1", RetainCall("s", RetainOp.RETAIN, [("\x1ft1\x1f" + NS, key(0))], 60.0))
        assert (res.retained, res.pending) == (0, 1)  # t1's page of that name is not stored: a cold miss
        assert not mgr.entry(NS, key(0)).retained

    run(body, config(tmp_path))


def test_held_pages_are_busy_for_delete_and_capped_on_promotion(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(8)))  # 4 in DRAM, 4 demoted to NVMe
        on_nvme = [i for i, t in zip(range(8), tiers_of(mgr, list(range(8))), strict=True) if t is TierKind.NVME]
        retain(mgr, "s", on_nvme, mode=HOLD)  # held on NVMe: DRAM hold cap is 2
        assert await mgr.delete(NS, [key(on_nvme[0])]) == (0, 0, 1)
        await read(mgr, on_nvme)  # reads promote, up to the hold cap
        tiers = tiers_of(mgr, on_nvme)
        assert tiers.count(TierKind.DRAM) == 2 and tiers.count(TierKind.NVME) == 2
        res = retain(mgr, "s", op=RetainOp.RESUME)
        assert res.prefetching == 2  # started, and refused by the cap as they go: they stay where they are
        await asyncio.sleep(0.2)
        assert tiers_of(mgr, on_nvme) == tiers
        retain(mgr, "s", op=RetainOp.UPDATE, mode=DEMOTE)
        res = retain(mgr, "s", op=RetainOp.RESUME)
        assert res.prefetching == 2
        for _ in range(200):
            if tiers_of(mgr, on_nvme) == [TierKind.DRAM] * 4:
                break
            await asyncio.sleep(0.01)
        assert tiers_of(mgr, on_nvme) == [TierKind.DRAM] * 4
        assert mgr.stats().retention.resumed == 4

    run(body, config(tmp_path))


def test_lookup_carries_a_fetch_estimate_from_the_nodes_own_gets(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, list(range(8)))
        res = mgr.lookup(NS, [key(i) for i in range(8)])
        assert {f.tier: f.pages for f in res.fetch} == {TierKind.DRAM: 4, TierKind.NVME: 4}
        assert not any(f.measured for f in res.fetch) and res.fetch_ms > 0
        assert res.fetch_ms == pytest.approx(sum(f.expected_ms for f in res.fetch))
        await read(mgr, [4, 5, 6, 7], promote=False)
        await read(mgr, [0, 1, 2, 3], promote=False)
        res = mgr.lookup(NS, [key(i) for i in range(8)])
        assert all(f.measured for f in res.fetch)
        assert all(f.bytes == f.pages * PAGE for f in res.fetch)

    run(body, config(tmp_path))


def test_fetch_rates_average_each_tiers_gets() -> None:
    r = FetchRates()
    e = r.estimate(TierKind.NVME, 10, 10 << 20)
    assert not e.measured and e.rate_bytes_per_second == DEFAULT_RATES[TierKind.NVME]
    r.observe(TierKind.NVME, 0.002, {TierKind.NVME: 100_000_000}, 1.0)  # 0.1 GB/s after a 2 ms first page
    e = r.estimate(TierKind.NVME, 1, 100_000_000)
    assert e.measured and e.expected_ms == pytest.approx(1002.0)
    r.observe(TierKind.NVME, 0.002, {TierKind.NVME: 100_000_000}, 0.5)  # 0.2 GB/s: weight 0.2
    assert r.estimate(TierKind.NVME, 1, 1).rate_bytes_per_second == pytest.approx(0.12e9)
    # A Get over two tiers shares its time by what each tier's bytes cost at the current rates.
    r.observe(TierKind.DRAM, 0.0, {TierKind.DRAM: 10**9, TierKind.NVME: 0}, 0.25)
    assert r.estimate(TierKind.DRAM, 1, 1).rate_bytes_per_second == pytest.approx(4e9)
    r.observe(TierKind.DRAM, 0.0, {TierKind.DRAM: 10**6}, 0.0)  # no time measured: no rate sample
    assert r.estimate(TierKind.DRAM, 1, 1).rate_bytes_per_second == pytest.approx(4e9)


def test_the_self_check_names_a_broken_invariant(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await put(mgr, [0, 1])
        retain(mgr, "s", [0, 1])
        tr = next(iter(mgr.retention.tenants.values()))
        tr.total += 1  # as a bookkeeping bug would leave it
        with pytest.raises(AssertionError, match="counts"):
            mgr.retention.check()
        tr.total -= 1
        session = next(iter(tr.sessions.values()))
        session.held -= 1
        with pytest.raises(AssertionError, match="held"):
            mgr.retention.check()
        session.held += 1
        mgr.retention.check()

    run(body, config(tmp_path))
