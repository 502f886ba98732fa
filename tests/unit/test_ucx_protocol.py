"""The UCX plane's pure parts: session tags, control frames, HELLO, advertised addresses, UCX defaults, the
device-send rule."""

from __future__ import annotations

import pytest

from kvstore.manager.reads import DeviceBytes, ReadLease
from kvstore.names import TierKind
from kvstore.node.planes.ucx_device import send_from_device
from kvstore.wire.ucx import (
    CHALLENGE_TAG,
    CONTEXT_DEFAULTS,
    HELLO_REPLY_TAG,
    NONCE,
    SECRET_TAG_BIT,
    Hello,
    HelloOk,
    Kind,
    Lane,
    ProtocolError,
    SessionTags,
    UcxAddress,
    context_options,
    expect,
    format_address,
    frame,
    new_nonce,
    parse_address,
    parse_nonce,
    range_base,
    unframe,
)


def test_session_tags_are_secret_per_lane_and_request_and_never_fixed_ones() -> None:
    a, b = SessionTags(b"a" * 32), SessionTags(b"b" * 32)
    tags = {(s.secret, lane, seq): s.tag(lane, seq) for s in (a, b) for lane in Lane for seq in range(1, 200)}
    assert len(set(tags.values())) == len(tags)  # no two sessions, lanes or requests share a tag
    assert all(t & SECRET_TAG_BIT for t in tags.values())
    assert not {CHALLENGE_TAG, HELLO_REPLY_TAG} & set(tags.values())
    assert SessionTags(b"a" * 32).tag(Lane.CONTROL, 7) == a.tag(Lane.CONTROL, 7)  # both sides derive the same
    base = a.tag(Lane.PUT_PAGES, 3)
    assert base & 0xFFFF == 0 and range_base(SessionTags.page(base, 0xFFFF)) == base
    with pytest.raises(ValueError, match="does not fit"):
        SessionTags.page(base, 0x10000)
    with pytest.raises(ValueError, match="32"):
        SessionTags(b"short")
    assert SessionTags.new().secret != SessionTags.new().secret


def test_nonces_and_secrets_parse_strictly() -> None:
    n = new_nonce()
    assert n & SECRET_TAG_BIT and parse_nonce(memoryview(NONCE.pack(n))) == n
    with pytest.raises(ProtocolError, match="secret-tag bit"):
        parse_nonce(memoryview(NONCE.pack(5)))
    with pytest.raises(ProtocolError, match="expected 8"):
        parse_nonce(memoryview(b"1234"))
    ok = HelloOk(b"s" * 32, 4 << 20)
    assert HelloOk.parse(memoryview(ok.pack())) == ok
    with pytest.raises(ProtocolError, match="expected 40"):
        HelloOk.parse(memoryview(ok.pack()[1:]))
    with pytest.raises(ProtocolError, match="no page size"):
        HelloOk.parse(memoryview(HelloOk(b"s" * 32, 0).pack()))


def test_frames_round_trip_in_a_bigger_buffer_and_reject_garbage() -> None:
    msg = frame(Kind.PUT, 42, b"body")
    buf = bytearray(100)
    buf[: len(msg)] = msg
    kind, flags, seq, body = unframe(buf)
    assert (kind, flags, seq, bytes(body)) == (Kind.PUT, 0, 42, b"body")
    assert bytes(expect(buf, Kind.PUT, 42)) == b"body"
    with pytest.raises(ProtocolError, match="expected GET"):
        expect(buf, Kind.GET, 42)
    with pytest.raises(ProtocolError, match="request 42, expected 41"):
        expect(buf, Kind.PUT, 41)
    with pytest.raises(ProtocolError, match="shorter"):
        unframe(msg[:5])
    with pytest.raises(ProtocolError, match="magic"):
        unframe(b"XXXX" + msg[4:])
    with pytest.raises(ProtocolError, match="version 1"):
        unframe(msg[:4] + bytes([1]) + msg[5:])  # the protocol before session tags is refused, not misread
    with pytest.raises(ProtocolError, match="runs past"):
        unframe(msg[:-1])
    with pytest.raises(ProtocolError, match="kind"):
        unframe(msg[:5] + bytes([99]) + msg[6:])


def test_hello_round_trip_and_bad_lengths() -> None:
    h = Hello("token-0123456789abcdef", b"\x01\x02addr", True)
    assert Hello.parse(memoryview(h.pack())) == h
    assert Hello.parse(memoryview(Hello(None, b"", False).pack())) == Hello(None, b"", False)
    with pytest.raises(ProtocolError, match="lengths"):
        Hello.parse(memoryview(h.pack() + b"x"))
    with pytest.raises(ProtocolError, match="shorter"):
        Hello.parse(memoryview(b"\x01"))


def test_address_round_trip_and_errors() -> None:
    a = UcxAddress("10.0.0.7", 13337, bytes(range(200)))
    assert parse_address(format_address(a)) == a
    assert parse_address("node-1:80") == UcxAddress("node-1", 80)
    for bad in ("node-1", ":80", "node:0", "node:x", "node:80#***"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_ucx_defaults_yield_to_the_environment() -> None:
    assert context_options({}) == CONTEXT_DEFAULTS
    assert "TCP_TX_SEG_SIZE" not in context_options({"UCX_TCP_TX_SEG_SIZE": "8K"})
    assert context_options({"UCX_TCP_TX_SEG_SIZE": "8K"})["TCP_RX_SEG_SIZE"] == CONTEXT_DEFAULTS["TCP_RX_SEG_SIZE"]


def test_only_pages_held_in_device_memory_go_from_it() -> None:
    """The lease says where its bytes are (its medium supplied it); UCX sends from there only if it can."""
    on_device = ReadLease(b"h" * 32, TierKind.HBM, 1, memoryview(b""), device=DeviceBytes(0x7000, 4096))
    in_host = ReadLease(b"h" * 32, TierKind.DRAM, 1, memoryview(b""))
    assert send_from_device(True, on_device)
    assert not send_from_device(False, on_device)  # no CUDA-capable UCX
    assert not send_from_device(True, in_host)


def test_a_detached_lease_is_released_once_by_its_new_owner() -> None:
    released: list[int] = []
    lease = ReadLease(b"h" * 32, TierKind.DRAM, 1, memoryview(b""), _release=lambda: released.append(1))
    release = lease.detach()
    lease.release()  # what the Get does when it moves on: nothing now
    assert released == []
    release()
    assert released == [1]
    lease.detach()()  # detached twice: the second owner gets a no-op
    assert released == [1]
