"""The prefix-hash contract v1 (DESIGN.md §3): fixed vectors pin it for every implementation."""

import hashlib
import struct

import pytest

from kvstore.hashing import HashContractError, from_hex, prefix_hashes, root_hash, to_hex

# Fixed vectors. If one of these changes, every deployed cache's keys change: bump the contract
# version instead of editing a vector.
VECTORS = [
    (
        list(range(40)), 16, "llama-3-8b/fp16",
        ["b6c22b0bac154624ac2449ba32cf948a34e6d546fc27211c2eb2a60486297ead",
         "b2a07d829002a7823afef435eaea7ddb67beeba0ed9ffb0c11bb78b8b1885db9"],
    ),
    (
        [0, 1, 2, 3, 4294967295, 7, 7, 7], 4, "tenant-a/model-x",
        ["7cda2b22ac593897fbe8993c494a0a118704bd6592b5ef2bddefec03f193fc74",
         "a74566bde170433e8f19f998e13ebd152232a995e2bfabc1fdb1e82505d97a93"],
    ),
    (
        [5, 5, 5], 1, "ns/é",
        ["cbc0e68de7136140e0c80ea56fa761e5cccedf046a7a6ee3be9625bdc41e1f48",
         "54f28ed7f32120f656b4f310d2a06bbf90f027990617876a33fbb5625e36f654",
         "507aa00fdfa89f2170c42e5d5bc15c06d9e36da7550d651d230cbbcf60de782c"],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("tokens", "block", "ns", "expected"), VECTORS)
def test_fixed_vectors(tokens: list[int], block: int, ns: str, expected: list[str]) -> None:
    assert [to_hex(h) for h in prefix_hashes(tokens, block, ns)] == expected


def test_root_vector() -> None:
    assert root_hash(16, "llama-3-8b/fp16").hex() == "bd617c2ef93ebc83623c2c9a7484373f045dc930952e8d3bc013752b5ba644f6"


def test_matches_the_written_formula() -> None:
    """An independent spelling of the contract, straight from its text."""
    tokens, block, ns = [9, 8, 7, 6, 5, 4, 3], 3, "m"
    h = hashlib.sha256(b"kvstore/v1\x00" + struct.pack("<I", block) + ns.encode()).digest()
    expected = []
    for i in range(len(tokens) // block):
        h = hashlib.sha256(h + b"".join(struct.pack("<I", t) for t in tokens[i * block : (i + 1) * block])).digest()
        expected.append(h)
    assert prefix_hashes(tokens, block, ns) == expected


def test_partial_block_never_hashed() -> None:
    assert prefix_hashes(list(range(15)), 16, "ns") == []
    assert prefix_hashes(list(range(47)), 16, "ns") == prefix_hashes(list(range(32)), 16, "ns")


def test_shared_prefix_shares_keys_until_divergence() -> None:
    a = prefix_hashes([1] * 32 + [2] * 16, 16, "ns")
    b = prefix_hashes([1] * 32 + [3] * 16, 16, "ns")
    assert a[:2] == b[:2] and a[2] != b[2]


def test_namespace_and_block_size_separate_keys() -> None:
    toks = list(range(64))
    assert prefix_hashes(toks, 16, "a")[0] != prefix_hashes(toks, 16, "b")[0]
    assert prefix_hashes(toks, 16, "a")[0] != prefix_hashes(toks, 32, "a")[0]


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "3"])
def test_token_out_of_range(bad: object) -> None:
    with pytest.raises(HashContractError, match="token ids"):
        prefix_hashes([1, 2, bad, 4], 2, "ns")  # type: ignore[list-item]


@pytest.mark.parametrize(("ns", "msg"), [("", "empty"), ("a\nb", "control"), ("x" * 257, "limit")])
def test_bad_namespace(ns: str, msg: str) -> None:
    with pytest.raises(HashContractError, match=msg):
        prefix_hashes([1, 2], 1, ns)


@pytest.mark.parametrize("block", [0, -4, 2**32])
def test_bad_block_size(block: int) -> None:
    with pytest.raises(HashContractError, match="block_size"):
        prefix_hashes([1, 2], block, "ns")


def test_hex_round_trip_and_errors() -> None:
    h = prefix_hashes([1], 1, "ns")[0]
    assert from_hex(to_hex(h)) == h and to_hex(h) == to_hex(h).lower()
    with pytest.raises(HashContractError):
        from_hex("abcd")
    with pytest.raises(HashContractError):
        from_hex("zz" * 32)
