"""The per-page store outcome every engine door reports (kvstore/integrations/outcome.py): pure, no node."""

from __future__ import annotations

import itertools

import pytest

from kvstore.integrations.outcome import MAX_RESOLVE_LOOKUPS, Stored, held_pages, pages_held


def node_holding(held: list[bool]) -> tuple[list[int], object]:
    """held_from of a node holding exactly `held`; also the start index of every Lookup asked."""
    asked: list[int] = []

    def held_from(i: int) -> int:
        asked.append(i)
        run = 0
        while i + run < len(held) and held[i + run]:
            run += 1
        return run

    return asked, held_from


def test_fast_path_asks_nothing() -> None:
    asked, held_from = node_holding([True] * 5)
    assert held_pages(5, 5, held_from) == [True] * 5 and asked == []
    assert held_pages(0, 0, held_from) == [] and asked == []


def test_nothing_held_asks_nothing() -> None:
    asked, held_from = node_holding([False] * 4)
    assert held_pages(4, 0, held_from) == [False] * 4 and asked == []


@pytest.mark.parametrize("truth", [list(t) for t in itertools.product([True, False], repeat=6) if 0 < sum(t) < 6])
def test_every_refusal_pattern_is_found_exactly(truth: list[bool]) -> None:
    asked, held_from = node_holding(truth)
    assert held_pages(len(truth), sum(truth), held_from) == truth
    assert len(asked) <= truth.count(False) + 1


def test_never_reports_a_page_the_node_does_not_hold_past_the_lookup_budget() -> None:
    truth = [i % 2 == 0 for i in range(64)]  # every other page refused: one Lookup per refusal
    asked, held_from = node_holding(truth)
    got = held_pages(64, 32, held_from)
    assert len(asked) == MAX_RESOLVE_LOOKUPS
    assert all(t or not g for g, t in zip(got, truth, strict=True))  # no page reported held that is not
    assert got[: 2 * MAX_RESOLVE_LOOKUPS] == truth[: 2 * MAX_RESOLVE_LOOKUPS] and not any(
        got[2 * MAX_RESOLVE_LOOKUPS :]
    )


def test_a_page_evicted_after_the_put_reads_as_failed() -> None:
    # The node counted 3 held; by the time of the Lookups page 1 was evicted by other traffic.
    _, held_from = node_holding([True, False, True, False])
    assert held_pages(4, 3, held_from) == [True, False, True, False]


def test_a_node_that_stops_answering_leaves_the_rest_failed() -> None:
    calls: list[int] = []

    def held_from(i: int) -> int | None:
        calls.append(i)
        return 2 if i == 0 else None

    assert held_pages(6, 4, held_from) == [True, True, False, False, False, False]
    assert calls == [0, 3]


def test_stored_sums_and_pages_of_regions() -> None:
    s = Stored((True, False), 1) + Stored.failed(2)
    assert s.held == (True, False, False, False) and s.new == 1 and s.count == 1 and not s.ok and len(s) == 4
    assert Stored(()).ok and Stored((True,), 1).ok
    assert pages_held([True, True, True, False, False, True], 2) == [True, False, False]
