"""The same-host plane's messages that carry more than one field (kvstore/wire/shm.py): WELCOME's role byte and
its SUMS_AFTER bit, and the SUMS that follows a PUT_SUMS."""

from __future__ import annotations

import pytest

from kvstore.errors import ProtocolError
from kvstore.security import Role
from kvstore.wire import shm


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("sums_after", [True, False])
def test_a_welcome_says_the_role_and_whether_the_node_takes_put_sums(role: Role, sums_after: bool) -> None:
    got = shm.parse_welcome(shm.welcome_body(1 << 20, 512, role, sums_after))
    assert got == shm.Welcome(1 << 20, 512, role, sums_after)


def test_an_older_nodes_welcome_takes_no_put_sums_and_a_short_one_is_refused() -> None:
    assert shm.parse_welcome(shm.WELCOME.pack(4096, 8, Role.WRITE)).sums_after is False  # as older nodes sent it
    with pytest.raises(ProtocolError, match="WELCOME"):
        shm.parse_welcome(shm.WELCOME.pack(4096, 8, Role.WRITE)[:-1])


def test_sums_round_trip_and_a_sums_of_another_size_is_refused() -> None:
    sums = [0, 1, (1 << 64) - 1]
    assert shm.parse_sums(shm.sums_body(sums), 3) == sums
    with pytest.raises(ProtocolError, match="SUMS for 4 pages"):
        shm.parse_sums(shm.sums_body(sums), 4)
