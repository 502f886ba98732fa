"""A door's calls in flight (kvstore/integrations/lanes.py): order, the bound on calls in flight, and that nothing a
run started is still running when it returns (however it ends). Threads only, no node."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvstore.integrations.lanes import Lanes, slices


@pytest.fixture
def lanes() -> Iterator[Lanes]:
    ln = Lanes("test-lane", threads=4, depth=2)
    yield ln
    ln.close()


class Tracker:
    """Calls in flight now, the most seen at once, which started and which ended."""

    def __init__(self, delay: float = 0.02) -> None:
        self.delay = delay
        self.lock = threading.Lock()
        self.now = self.most = 0
        self.started: list[int] = []
        self.ended: list[int] = []

    def __call__(self, item: int) -> int:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.started.append(item)
        time.sleep(self.delay)
        with self.lock:
            self.now -= 1
            self.ended.append(item)
        return item * 10


def test_slices_cover_every_page_once_with_at_least_one_page_each() -> None:
    assert slices(7, 2 << 20, 8 << 20) == [(0, 4), (4, 7)]
    assert slices(3, 16 << 20, 8 << 20) == [(0, 1), (1, 2), (2, 3)]  # a page above the slice size: one per call
    assert slices(0, 1 << 20) == []
    for n, page in ((1, 1), (17, 3 << 20), (64, 4096)):
        cuts = slices(n, page)
        assert [i for a, b in cuts for i in range(a, b)] == list(range(n))


def test_results_come_in_order_with_at_most_depth_in_flight(lanes: Lanes) -> None:
    t = Tracker()
    assert list(lanes.ordered(t, range(9))) == [i * 10 for i in range(9)]
    assert t.most == 2 and sorted(t.ended) == list(range(9))


def test_a_stop_starts_nothing_more_and_returns_after_the_calls_in_flight(lanes: Lanes) -> None:
    t = Tracker(delay=0.05)
    for r in lanes.ordered(t, range(10)):
        if r == 0:
            break
    # Returned: what had started has ended (none can still touch the caller's memory), nothing else began.
    assert sorted(t.started) == sorted(t.ended)
    assert len(t.started) <= 1 + 2  # the result taken, and the depth's calls in flight when it was handed out


def test_an_error_surfaces_after_the_calls_in_flight_ended(lanes: Lanes) -> None:
    t = Tracker(delay=0.05)

    def fn(i: int) -> int:
        if i == 0:
            raise RuntimeError("boom")
        return t(i)

    with pytest.raises(RuntimeError, match="boom"):
        list(lanes.ordered(fn, range(6)))
    assert sorted(t.started) == sorted(t.ended)


def test_one_item_runs_on_the_callers_thread(lanes: Lanes) -> None:
    seen: list[str] = []
    assert list(lanes.ordered(lambda i: seen.append(threading.current_thread().name) or i, [5])) == [5]
    assert seen == [threading.current_thread().name]


def test_bad_sizes_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="threads and depth"):
        Lanes("x", threads=0)
