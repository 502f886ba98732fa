"""The UCX plane's pure parts: tags, control frames, HELLO, advertised addresses, the device-send rule."""

from __future__ import annotations

import pytest

from kvstore.manager.reads import DeviceBytes, ReadLease
from kvstore.names import TierKind
from kvstore.node.planes.ucx_device import send_from_device
from kvstore.wire.ucx import (
    HELLO_CID,
    HELLO_TAG,
    Hello,
    Kind,
    ProtocolError,
    TagKind,
    UcxAddress,
    format_address,
    frame,
    parse_address,
    tag,
    unframe,
)


def test_tags_separate_connections_kinds_requests_and_pages() -> None:
    seen = {tag(c, k, s, i) for c in (1, 2) for k in TagKind for s in (0, 1, 256) for i in (0, 1, 0xFFFF)}
    assert len(seen) == 2 * len(TagKind) * 2 * 3  # seq is mod 256: 0 and 256 share a tag, nothing else does
    assert tag(7, TagKind.DATA_TO_NODE, 3, 5) >> 32 == 7
    assert HELLO_TAG >> 32 == HELLO_CID
    with pytest.raises(ValueError, match="does not fit"):
        tag(1, TagKind.DATA_TO_NODE, 0, 0x10000)


def test_frames_round_trip_in_a_bigger_buffer_and_reject_garbage() -> None:
    msg = frame(Kind.PUT, 42, b"body")
    buf = bytearray(100)
    buf[: len(msg)] = msg
    kind, flags, seq, body = unframe(buf)
    assert (kind, flags, seq, bytes(body)) == (Kind.PUT, 0, 42, b"body")
    with pytest.raises(ProtocolError, match="shorter"):
        unframe(msg[:5])
    with pytest.raises(ProtocolError, match="magic"):
        unframe(b"XXXX" + msg[4:])
    with pytest.raises(ProtocolError, match="runs past"):
        unframe(msg[:-1])
    with pytest.raises(ProtocolError, match="kind"):
        unframe(msg[:5] + bytes([99]) + msg[6:])


def test_hello_round_trip_and_bad_lengths() -> None:
    h = Hello(5, "token-0123456789abcdef", b"\x01\x02addr", True)
    assert Hello.parse(memoryview(h.pack())) == h
    assert Hello.parse(memoryview(Hello(6, None, b"", False).pack())) == Hello(6, None, b"", False)
    with pytest.raises(ProtocolError, match="lengths"):
        Hello.parse(memoryview(h.pack() + b"x"))
    with pytest.raises(ProtocolError, match="reserved"):
        Hello.parse(memoryview(Hello(HELLO_CID, None, b"", True).pack()))


def test_address_round_trip_and_errors() -> None:
    a = UcxAddress("10.0.0.7", 13337, bytes(range(200)))
    assert parse_address(format_address(a)) == a
    assert parse_address("node-1:80") == UcxAddress("node-1", 80)
    for bad in ("node-1", ":80", "node:0", "node:x", "node:80#***"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_only_pages_held_in_device_memory_go_from_it() -> None:
    """The lease says where its bytes are (its medium supplied it); UCX sends from there only if it can."""
    on_device = ReadLease(b"h" * 32, TierKind.HBM, 1, memoryview(b""), device=DeviceBytes(0x7000, 4096))
    in_host = ReadLease(b"h" * 32, TierKind.DRAM, 1, memoryview(b""))
    assert send_from_device(True, on_device)
    assert not send_from_device(False, on_device)  # no CUDA-capable UCX
    assert not send_from_device(True, in_host)
