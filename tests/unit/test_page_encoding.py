"""Page encodings in the layout and the page header (kvstore/layout.py, kvstore/pageformat.py).

The compatibility promises pinned here: a raw layout packs to the bytes of the build before encodings
(dtype u32 first), and a header block written by that build (a fixed vector) parses today, so NVMe files
survive the upgrade; every page is now written in format 3, whose checksum binds the page's identity (the
digests are pinned as test vectors: the wire contract, like the prefix-hash contract).
"""

from __future__ import annotations

import struct

import pytest
import xxhash

from kvstore.layout import DType, PageEncoding, PageLayout
from kvstore.pageformat import (
    FORMAT_VERSION,
    HEADER_BYTES,
    ChecksumForm,
    HeaderError,
    PageHeader,
    identity_digest,
    in_form,
    key_digest,
    layout_digest,
    node_side_digest,
    payload_checksum,
    scope_digest,
    wire_checksum,
)
from kvstore.scoping import scope

RAW = PageLayout(DType.BFLOAT16, 4, 2, 64, 16)
FP8 = RAW.with_encoding(PageEncoding.FP8_E4M3)

# PageHeader("model@abc/bfloat16/tp1", bytes(range(32)), RAW, 32768, 0x0123456789ABCDEF, 7).pack() as the
# build before encodings (commit 95d7e5c) wrote it; zero padding to 4 KiB follows.
V1_HEADER = bytes.fromhex(
    "4b5650470100000007000000000000000080000000000000efcdab89674523010200000004000000020000004000000010000000"
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f16006d6f64656c406162632f62666c6f617431"
    "362f7470311f3bff9b680dee71"
).ljust(HEADER_BYTES, b"\0")


def test_raw_layout_packs_as_before_encodings() -> None:
    assert RAW.encoding is PageEncoding.RAW
    assert RAW.pack() == struct.pack("<IIIII", int(DType.BFLOAT16), 4, 2, 64, 16)
    assert RAW.page_bytes == RAW.raw_page_bytes == 4 * 2 * 16 * 2 * 64 * 2
    assert RAW.values_offset == 0 and RAW.scales_bytes == 0
    assert "fp8" not in RAW.describe()


def test_fp8_layout_sizes_and_offsets() -> None:
    assert FP8.scales_bytes == 4 * 2 * 2 * 4  # one fp32 per (layer, K/V, kv head)
    assert FP8.values_offset == 64  # 64 is already 16-aligned
    assert FP8.page_bytes == 64 + 4 * 2 * 16 * 2 * 64  # one byte a value
    assert FP8.raw_page_bytes == RAW.page_bytes
    assert FP8.page_bytes * 2 < RAW.page_bytes + 2 * 64 + 1  # half the bytes, plus the scales
    assert "as fp8-e4m3" in FP8.describe()
    # Odd shapes: scales and the page padded to 16-byte boundaries.
    odd = PageLayout(DType.FLOAT16, 3, 1, 5, 3, PageEncoding.FP8_E4M3)
    assert odd.scales_bytes == 24 and odd.values_offset == 32
    assert odd.page_bytes == 32 + 96  # 90 values -> 96
    assert odd.page_bytes % 16 == 0


def test_layout_pack_round_trip_and_validation() -> None:
    assert PageLayout.unpack(FP8.pack()) == FP8 and PageLayout.unpack(RAW.pack()) == RAW
    assert PageEncoding.parse("fp8") is PageEncoding.FP8_E4M3
    assert PageEncoding.parse("FP8_E4M3") is PageEncoding.FP8_E4M3
    assert PageEncoding.parse("raw") is PageEncoding.RAW
    assert PageLayout(DType.FLOAT32, 1, 1, 8, 1, "fp8-e4m3").encoding is PageEncoding.FP8_E4M3  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown page encoding 'int4'"):
        PageEncoding.parse("int4")
    with pytest.raises(ValueError, match="unknown page encoding 7"):
        PageLayout.unpack(struct.pack("<HHIIII", int(DType.FLOAT16), 7, 1, 1, 8, 1))
    for dtype in (DType.FLOAT8_E4M3, DType.UINT8):  # nothing to quantize
        with pytest.raises(ValueError, match=r"layout\.encoding fp8-e4m3 encodes float16, bfloat16, float32"):
            PageLayout(dtype, 1, 1, 8, 1, PageEncoding.FP8_E4M3)
    # An engine that already holds fp8 KV stores it raw: its bytes untouched.
    assert PageLayout(DType.FLOAT8_E4M3, 2, 2, 64, 16).page_bytes == 2 * 2 * 16 * 2 * 64


def test_header_written_before_encodings_still_reads() -> None:
    h = PageHeader.unpack(V1_HEADER)
    assert h == PageHeader("model@abc/bfloat16/tp1", bytes(range(32)), RAW, 32768, 0x0123456789ABCDEF, 7, version=1)
    assert h.pack() == V1_HEADER  # a repair can write it back exactly as it was
    # Its checksum covers the payload alone: the bound form is derived from the header's own fields.
    assert h.bound_checksum() == 0x0123456789ABCDEF ^ identity_digest(h.namespace, h.hash, RAW)


def test_every_page_is_written_in_format_3_and_round_trips() -> None:
    for layout, ns in ((FP8, "model@abc/bfloat16+fp8-e4m3/tp1"), (RAW, "model@abc/bfloat16/tp1")):
        h = PageHeader(ns, bytes(range(32)), layout, layout.page_bytes, 99, 8)
        block = h.pack()
        assert struct.unpack_from("<H", block, 4)[0] == FORMAT_VERSION == 3
        assert PageHeader.unpack(block) == h and h.bound_checksum() == 99  # format 3 stores the bound form


# The identity binding (pageformat module docstring; the proto's "Checksums"), pinned: any client of any
# language computes the same wire checksums.
VECTOR_NS = "model@abc/bfloat16/tp1"
VECTOR_KEY = bytes(range(32))
VECTOR_PAYLOAD = bytes(range(256))


def test_identity_digests_are_pinned() -> None:
    assert key_digest(VECTOR_NS, VECTOR_KEY) == 0x4C2E82B90FA41F56
    assert scope_digest("default") == 0x959DA93337D5FC2C and scope_digest("acme") == 0x5A8C5B0403918911
    assert layout_digest(RAW) == 0x36EC76FCA6BA735D
    assert identity_digest(VECTOR_NS, VECTOR_KEY, RAW) == 0xEF5F5D769ECB9027
    assert payload_checksum(VECTOR_PAYLOAD) == 0x9408A4433B952D71
    assert (
        wire_checksum(VECTOR_NS, VECTOR_KEY, VECTOR_PAYLOAD)
        == 0xD82626FA34313227
        == 0x9408A4433B952D71 ^ 0x4C2E82B90FA41F56
    )


def test_the_binding_tells_every_part_of_the_identity_apart() -> None:
    """A stored checksum read as any other namespace, key, tenant or layout does not verify."""
    stored = payload_checksum(VECTOR_PAYLOAD) ^ identity_digest(VECTOR_NS, VECTOR_KEY, RAW)
    same = stored ^ identity_digest(VECTOR_NS, VECTOR_KEY, RAW)
    assert same == payload_checksum(VECTOR_PAYLOAD)
    others = [
        identity_digest(VECTOR_NS + "x", VECTOR_KEY, RAW),  # another namespace
        identity_digest(VECTOR_NS, bytes(32), RAW),  # another key
        identity_digest(scope(VECTOR_NS, "acme"), VECTOR_KEY, RAW),  # another tenant
        identity_digest(VECTOR_NS, VECTOR_KEY, FP8),  # another encoding
        identity_digest(VECTOR_NS, VECTOR_KEY, PageLayout(DType.BFLOAT16, 4, 2, 64, 32)),  # another block size
        identity_digest(VECTOR_NS, VECTOR_KEY, PageLayout(DType.FLOAT16, 4, 2, 64, 16)),  # another dtype
    ]
    assert all(stored ^ other != payload_checksum(VECTOR_PAYLOAD) for other in others)
    # The node's half and the client's half make the whole: wire form + node side = stored form.
    wire = wire_checksum(VECTOR_NS, VECTOR_KEY, VECTOR_PAYLOAD)
    assert wire ^ node_side_digest(VECTOR_NS, RAW) == stored
    assert in_form(wire, ChecksumForm.PAYLOAD, VECTOR_NS, VECTOR_KEY) == payload_checksum(VECTOR_PAYLOAD)
    assert in_form(wire, ChecksumForm.KEYED, VECTOR_NS, VECTOR_KEY) == wire


def test_a_header_naming_another_page_fails_the_bound_check() -> None:
    """Two headers whose keys were swapped (each re-sealed, as a metadata bug would write them): each slot's
    checksum no longer matches the identity its header claims."""
    a, b = bytes(32), bytes([1]) * 32
    pa, pb = b"A" * 64, b"B" * 64
    sa = payload_checksum(pa) ^ identity_digest(VECTOR_NS, a, RAW)
    swapped = PageHeader.unpack(PageHeader(VECTOR_NS, b, RAW, 64, sa, 1).pack())  # slot of A claims key B
    assert swapped.bound_checksum() ^ identity_digest(VECTOR_NS, b, RAW) != payload_checksum(pa)
    assert swapped.bound_checksum() ^ identity_digest(VECTOR_NS, b, RAW) != payload_checksum(pb)


def test_header_versions_outside_the_range_are_refused() -> None:
    for version in (0, 4):
        block = bytearray(V1_HEADER)
        struct.pack_into("<H", block, 4, version)
        with pytest.raises(HeaderError, match=f"page format {version} is not supported"):
            PageHeader.unpack(bytes(block))


def test_format_1_header_with_encoding_bits_is_invalid() -> None:
    """Format 1 had no encoding: an fp8 layout under format 1 is a damaged header, never read as fp8."""
    h = PageHeader("ns", bytes(32), FP8, FP8.page_bytes, 1, 1, version=2)
    block = bytearray(h.pack())
    struct.pack_into("<H", block, 4, 1)
    # Re-seal the header checksum so only the version rule can refuse it.
    end = struct.calcsize("<4sHHQQQ20s32sH") + len(b"ns")
    struct.pack_into("<Q", block, end, xxhash.xxh3_64_intdigest(bytes(block[:end])))
    with pytest.raises(HeaderError, match="a format 1 page has no encoding"):
        PageHeader.unpack(bytes(block))
