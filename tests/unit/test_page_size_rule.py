"""The one page-size rule of the planes that size their receives first (`client/planes/base.page_size`) and the
page-size ask's wire form (`kvstore.wire`): asked once per namespace, remembered within a bound, answers
checked before any receive is sized by them. Pure: the ask is a plain function here."""

from __future__ import annotations

import pytest

from kvstore.client.planes.base import MAX_KNOWN_PAGE_SIZES, page_size
from kvstore.errors import InvalidArgument, ProtocolError
from kvstore.wire import PAGE_BYTES, page_size_ask, parse_page_size, parse_page_size_ask

FIRST = bytes(range(32))


def test_asked_once_per_namespace_and_remembered_within_a_bound() -> None:
    asks: list[bytes] = []

    def ask(body: bytes) -> int:
        asks.append(body)
        return 4096 + len(asks)

    known: dict[str, int] = {}
    assert page_size(known, "a", FIRST, ask) == 4097
    assert page_size(known, "a", FIRST, ask) == 4097  # remembered: no second ask
    assert asks == [page_size_ask("a", FIRST)]
    for i in range(MAX_KNOWN_PAGE_SIZES):
        page_size(known, f"ns{i}", FIRST, ask)
    assert len(known) == MAX_KNOWN_PAGE_SIZES and "a" not in known  # the oldest forgotten first
    page_size(known, "a", FIRST, ask)
    assert len(asks) == MAX_KNOWN_PAGE_SIZES + 2  # forgotten, so asked again


def test_a_refused_ask_remembers_nothing() -> None:
    def refuse(body: bytes) -> int:
        raise InvalidArgument("namespace", "no")

    known: dict[str, int] = {}
    with pytest.raises(InvalidArgument):
        page_size(known, "a", FIRST, refuse)
    assert known == {}


def test_the_ask_round_trips_and_bad_asks_name_their_field() -> None:
    assert parse_page_size_ask(page_size_ask("llama/fp16", FIRST)) == ("llama/fp16", FIRST)
    with pytest.raises(InvalidArgument, match="layout"):
        parse_page_size_ask(FIRST[:31])
    with pytest.raises(InvalidArgument, match="namespace"):
        parse_page_size_ask(FIRST + b"\xff")
    with pytest.raises(ValueError, match="32 bytes"):
        page_size_ask("a", b"short")


@pytest.mark.parametrize("body", [b"", bytes(7), PAGE_BYTES.pack(0), PAGE_BYTES.pack((1 << 20) + 1)])
def test_an_answer_no_receive_may_be_sized_by_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_page_size(body, 1 << 20)
    assert parse_page_size(PAGE_BYTES.pack(1 << 20), 1 << 20) == 1 << 20
