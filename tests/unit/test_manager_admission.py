"""Admission in the TierManager (DESIGN.md §6.2): what a full DRAM tier's policy refuses goes where the
contract says (written through to NVMe, or not stored without NVMe), promotions on read ask too,
an explicit Prefetch does not, and policies without admit() behave as before."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvstore.errors import DataLoss
from kvstore.manager import TierManager
from kvstore.names import TierKind
from kvstore.policy import AdaptivePolicy
from kvstore.policy.adaptive import SECOND
from tests.unit.test_manager import LAYOUT, NS, PutOpen, config, key, payload, put, read, run, tiers_of


def dram(mgr: TierManager):  # type: ignore[no-untyped-def]
    return next(t for t in mgr.stats().tiers if t.tier == TierKind.DRAM)


async def fill_and_heat(mgr: TierManager, ids: list[int], reads: int) -> None:
    """Put `ids` (filling DRAM) and read each `reads` times, so the sketch counts them as hot."""
    assert await put(mgr, ids) == (len(ids), 0)
    for _ in range(reads):
        assert [p for p, _ in await read(mgr, ids)] == [payload(key(i)) for i in ids]


def test_refused_put_is_written_through_to_nvme_and_reads_back(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await fill_and_heat(mgr, [0, 1, 2, 3], reads=3)
        assert await put(mgr, [4]) == (1, 0)  # stored: through to NVMe, DRAM left as it is
        assert tiers_of(mgr, [0, 1, 2, 3, 4]) == [TierKind.DRAM] * 4 + [TierKind.NVME]
        assert dram(mgr).counters.not_admitted == 1 and dram(mgr).counters.evictions == 0
        got = await read(mgr, [4], promote=False)
        assert got == [(payload(key(4)), TierKind.NVME)]  # the written-through page verifies on read

    run(body, config(tmp_path, dram_pages=4, nvme_pages=16, policy="tinylfu"))


def test_refused_put_without_nvme_is_not_stored_and_changes_nothing(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await fill_and_heat(mgr, [0, 1, 2, 3], reads=2)
        before = dram(mgr)
        assert await put(mgr, [4]) == (0, 0)  # neither stored nor already present
        after = dram(mgr)
        assert tiers_of(mgr, [0, 1, 2, 3, 4]) == [TierKind.DRAM] * 4 + [None]
        assert after.counters.not_admitted == 1
        assert (after.pages, after.slots_used, after.counters.evictions) == (
            before.pages, before.slots_used, before.counters.evictions)  # fmt: skip
        assert mgr.stats().put_rejected == 0  # a refusal is not a failed transaction

    run(body, config(tmp_path, dram_pages=4, nvme_pages=0, policy="tinylfu"))


def test_page_referenced_often_enough_is_admitted_on_a_later_put(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await fill_and_heat(mgr, [0, 1, 2, 3], reads=0)  # each referenced once (its insert)
        for _ in range(4):  # each refused Put is a reference: the page gains on the residents
            if await put(mgr, [4]) == (1, 0):
                break
        assert tiers_of(mgr, [4]) == [TierKind.DRAM]
        assert sum(t is None for t in tiers_of(mgr, [0, 1, 2, 3])) == 1  # exactly one victim, dropped
        assert dram(mgr).counters.not_admitted >= 1

    run(body, config(tmp_path, dram_pages=4, nvme_pages=0, policy="tinylfu"))


def test_promotion_on_read_asks_admission_and_prefetch_does_not(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await fill_and_heat(mgr, [0, 1, 2, 3], reads=4)
        assert await put(mgr, [4, 5]) == (2, 0)
        assert tiers_of(mgr, [4, 5]) == [TierKind.NVME, TierKind.NVME]
        refused = dram(mgr).counters.not_admitted
        got = await read(mgr, [4])  # promote=True, but DRAM's residents are hotter
        assert got == [(payload(key(4)), TierKind.NVME)]
        assert tiers_of(mgr, [4]) == [TierKind.NVME] and dram(mgr).counters.not_admitted == refused + 1
        # An explicit Prefetch is the engine saying it reads the page next: always admitted.
        assert mgr.prefetch(NS, [key(5)]) == (1, 0, 0)
        for _ in range(200):
            if tiers_of(mgr, [5]) == [TierKind.DRAM]:
                break
            await asyncio.sleep(0.01)
        assert tiers_of(mgr, [5]) == [TierKind.DRAM]
        assert dram(mgr).counters.not_admitted == refused + 1

    run(body, config(tmp_path, dram_pages=4, nvme_pages=16, policy="tinylfu"))


def test_policy_without_admission_evicts_as_before(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await fill_and_heat(mgr, [0, 1, 2, 3], reads=3)
        assert await put(mgr, [4]) == (1, 0)
        assert tiers_of(mgr, [4]) == [TierKind.DRAM]
        assert dram(mgr).counters.not_admitted == 0 and dram(mgr).counters.evictions == 1

    run(body, config(tmp_path, dram_pages=4, nvme_pages=16, policy="prefix-arc"))


def test_write_through_when_nvme_is_full_of_pinned_pages_is_not_stored(tmp_path: Path) -> None:
    async def body(mgr: TierManager) -> None:
        await fill_and_heat(mgr, [0, 1, 2, 3], reads=3)
        assert await put(mgr, [10, 11]) == (2, 0)  # refused by DRAM: both written through to NVMe
        assert tiers_of(mgr, [10, 11]) == [TierKind.NVME] * 2
        for i in (10, 11):
            mgr.pin(NS, [key(i)], ttl_seconds=60)
        assert await put(mgr, [12]) == (0, 0)  # NVMe (2 slots) holds only pinned pages: not stored
        assert tiers_of(mgr, [12]) == [None]
        assert mgr.stats().put_rejected == 0

    run(body, config(tmp_path, dram_pages=4, nvme_pages=2, policy="tinylfu"))


def test_a_refusal_whatever_the_victim_chooses_no_victim(tmp_path: Path) -> None:
    # The default at second sight refuses an unseen page before any victim is chosen: the page is
    # written through to NVMe, DRAM is untouched, and its victim query never runs.
    async def body(mgr: TierManager) -> None:
        await fill_and_heat(mgr, [0, 1, 2, 3], reads=1)
        policy = mgr.table.tiers[TierKind.DRAM].policy
        assert isinstance(policy, AdaptivePolicy)
        assert await put(mgr, [4]) == (1, 0)  # the first question: the tier is full, at ALL
        policy.rule.level = SECOND
        asked: list[object] = []
        query = policy.first_candidate
        policy.first_candidate = lambda usable: asked.append(usable) or query(usable)  # type: ignore[method-assign]
        refused = dram(mgr).counters.not_admitted
        assert await put(mgr, [5]) == (1, 0)
        assert tiers_of(mgr, [5]) == [TierKind.NVME] and dram(mgr).counters.not_admitted == refused + 1
        assert asked == []  # no victim was chosen for the refusal

    run(body, config(tmp_path, dram_pages=4, nvme_pages=16, policy="adaptive"))


def test_refused_put_without_nvme_is_still_verified(tmp_path: Path) -> None:
    # A page the full DRAM tier refuses, with no NVMe to write it through to, is not stored; its bytes
    # are still checked, so a wrong declared checksum fails the Put (DataLoss) instead of answering OK.
    async def body(mgr: TierManager) -> None:
        await fill_and_heat(mgr, [0, 1, 2, 3], reads=2)
        txn = mgr.begin_put(PutOpen(NS, LAYOUT))
        try:
            view = await txn.add_page(key(4), LAYOUT.page_bytes, 12345)
            assert view is not None  # refused, but received to be verified
            view[:] = payload(key(4))[: LAYOUT.page_bytes]
            with pytest.raises(DataLoss, match="checksum"):
                await txn.commit()
        finally:
            txn.abort()
        assert tiers_of(mgr, [0, 1, 2, 3, 4]) == [TierKind.DRAM] * 4 + [None]

    run(body, config(tmp_path, dram_pages=4, nvme_pages=0, policy="tinylfu"))
