"""kvstore/pointers.py: the one rule for a buffer's address, on every kind of buffer the planes and the read path
hand it, and the export it takes is gone when it returns."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvstore.pointers import buffer_address


def _numpy_address(obj: object) -> int:
    return int(np.frombuffer(obj, dtype=np.uint8).__array_interface__["data"][0])  # type: ignore[call-overload]


def test_every_kind_of_buffer_gives_its_first_bytes_address() -> None:
    m = mmap.mmap(-1, 8192)
    view = memoryview(m)
    try:
        assert buffer_address(view) == _numpy_address(view)
        assert buffer_address(view[100:200]) == buffer_address(view) + 100  # a slice starts where it starts
        assert buffer_address(view.toreadonly()[7:9]) == buffer_address(view) + 7  # read-only: numpy's way
        arr = np.zeros(64, dtype=np.float32)
        assert buffer_address(arr) == arr.__array_interface__["data"][0]
        data = b"abc"
        assert buffer_address(data) == _numpy_address(data)
        assert isinstance(buffer_address(bytearray()), int)  # empty: no crash, an address nobody reads
    finally:
        view.release()
    m.close()  # no export left behind by any call above: the mapping closes
    with pytest.raises(TypeError):
        buffer_address(5)
