"""The per-caller budget of reported pages to verify (kvstore/node/report_budget.py): pure, clock given."""

from __future__ import annotations

import pytest

from kvstore.node.report_budget import ReportBudget


def test_a_caller_gets_its_burst_then_its_rate_and_others_are_untouched() -> None:
    b = ReportBudget(rate=10, burst=100)
    assert b.take("reader", 64, now=0.0) == 64
    assert b.take("reader", 64, now=0.0) == 36  # the burst is spent
    assert b.take("reader", 64, now=0.0) == 0
    assert b.take("reader", 64, now=2.0) == 20  # 10 a second since
    assert b.available("reader", now=100.0) == 100  # refills up to the burst, no further
    assert b.take("writer", 5, now=2.0) == 5  # another caller's bucket is its own


def test_over_time_no_caller_gets_more_than_burst_plus_rate() -> None:
    b = ReportBudget(rate=32, burst=256)
    granted = sum(b.take("r", 65536, now=t / 10) for t in range(100))  # 10 s of asking, 10 times a second
    assert granted <= 256 + 32 * 10


def test_buckets_are_bounded_and_forgetting_a_full_one_changes_nothing() -> None:
    b = ReportBudget(rate=1, burst=4, max_callers=3)
    for c in "abc":
        b.take(c, 4, now=0.0)
    assert b.take("d", 1, now=10.0) == 1  # a, b, c refilled: forgotten
    assert len(b._buckets) <= 3
    assert b.take("a", 4, now=10.0) == 4


@pytest.mark.parametrize(("rate", "burst", "callers"), [(0, 1, 1), (1, 0, 1), (1, 1, 0)])
def test_bad_settings_are_refused(rate: float, burst: int, callers: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        ReportBudget(rate, burst, callers)
