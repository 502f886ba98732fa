"""The node's same-host GET cuts a target's window only when its page is reached
(kvstore/node/planes/shm_requests.py): a Get whose stored prefix ends early pays for no window past it, and
every window cut is released."""

from __future__ import annotations

import os

import pytest

from kvstore.node.planes.shm_memory import MappedBuffer
from kvstore.node.planes.shm_requests import _Windows
from kvstore.wire import shm

pytestmark = pytest.mark.skipif(not shm.shm_available(), reason="needs memfd_create")

PAGE = 4096


def test_windows_are_cut_on_first_use_and_released_together() -> None:
    fd = os.memfd_create("windows")
    try:
        os.ftruncate(fd, 8 * PAGE)
        buf = MappedBuffer(fd, 8 * PAGE)
    finally:
        os.close(fd)
    targets = [(1, i * PAGE, PAGE) for i in range(8)]
    windows = _Windows([buf] * 8, targets, PAGE)
    assert len(windows) == 8 and not windows._cut  # nothing cut before a page is reached
    windows[2][:3] = b"abc"
    assert windows[2] is windows[2] and set(windows._cut) == {2}
    assert bytes(buf.view[2 * PAGE : 2 * PAGE + 3]) == b"abc"  # the window is the target's bytes
    assert len(windows[7]) == PAGE
    cut = list(windows._cut.values())
    windows.release()
    assert not windows._cut
    for w in cut:
        with pytest.raises(ValueError, match="released"):
            len(w)
    buf.drop()  # no window left exported: the mapping goes
