"""The payload checksum computed in steps (while receiving or copying a page) equals the one-shot checksum,
for every size around the step boundaries; a step sees every byte once, in order."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.pageformat import HOT_CHUNK, checksum_in_steps, checksum_into, payload_checksum

SIZES = [0, 1, HOT_CHUNK - 1, HOT_CHUNK, HOT_CHUNK + 1, 3 * HOT_CHUNK + 17, (4 << 20) + 3]


@pytest.mark.parametrize("n", SIZES)
def test_in_steps_equals_one_shot_and_visits_each_byte_once(n: int) -> None:
    data = memoryview(os.urandom(n))
    seen: list[tuple[int, int]] = []

    def step(off: int, k: int) -> memoryview:
        seen.append((off, k))
        return data[off : off + k]

    assert checksum_in_steps(n, step) == payload_checksum(data)
    assert [off for off, _ in seen] == list(range(0, n, HOT_CHUNK))
    assert sum(k for _, k in seen) == n and all(0 < k <= HOT_CHUNK for _, k in seen)


@pytest.mark.parametrize("n", SIZES[1:])
def test_checksum_into_copies_exactly_and_hashes_the_source(n: int) -> None:
    src = memoryview(bytearray(os.urandom(n)))
    dst = memoryview(bytearray(n + 8))
    assert checksum_into(src, dst) == payload_checksum(src)
    assert bytes(dst[:n]) == bytes(src) and bytes(dst[n:]) == bytes(8)
    with pytest.raises(ValueError, match="cannot hold"):
        checksum_into(src, memoryview(np.zeros(n - 1, dtype=np.uint8)))
