"""The one rule by which a client cuts its calls (kvstore/client/planes/base.py `capped_pages`, DESIGN.md §8): the
client's pages_per_call, capped at the node's advertised max_pages_per_request; unchanged where the node says none."""

from __future__ import annotations

import pytest

from kvstore.client.planes.base import batches, capped_pages


@pytest.mark.parametrize(
    ("asked", "limit", "cut"),
    [(256, 64, 64), (256, 4096, 256), (10, 64, 10), (64, 64, 64), (256, None, 256), (256, 0, 256), (1, 1, 1)],
)
def test_capped_pages(asked: int, limit: int | None, cut: int) -> None:
    assert capped_pages(asked, limit) == cut


def test_the_first_batch_is_the_largest() -> None:
    # NOTE: the client retries a call the node refused for its page count only because the refusal comes from
    # its first batch, before anything was stored or returned (ClientCore._on_plane).
    for n in (1, 63, 64, 65, 300):
        sizes = [b - a for a, b in batches(n, 64)]
        assert sizes[0] == max(sizes) and sum(sizes) == n
