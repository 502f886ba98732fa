"""The prefix-hash contract, version 1 (DESIGN.md §3; also written in the proto's header comment).

    root = SHA-256(b"kvstore/v1\\x00" || u32le(block_size) || utf8(namespace))
    h_i  = SHA-256(h_{i-1} || u32le(t[i*B]) || ... || u32le(t[i*B+B-1])),  h_{-1} = root

Invariants: only full blocks are hashed (a trailing partial block never is); token ids lie in
[0, 2^32); keys are 32-byte digests, text forms are lowercase hex. Changing anything here changes every
key in every deployed cache: bump the version string instead and keep v1 computable.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kvstore.errors import HashContractError

CONTRACT_VERSION = "kvstore/v1"
HASH_BYTES = 32
MAX_NAMESPACE_BYTES = 256
_ROOT_TAG = CONTRACT_VERSION.encode() + b"\x00"
_U32_MAX = 0xFFFFFFFF


def validate_namespace(namespace: str) -> bytes:
    """Return the UTF-8 bytes of a valid namespace or raise HashContractError saying why."""
    if not isinstance(namespace, str):
        raise HashContractError("namespace", f"must be a str, got {type(namespace).__name__}")
    if not namespace:
        raise HashContractError("namespace", "must not be empty")
    raw = namespace.encode("utf-8", errors="strict")
    if len(raw) > MAX_NAMESPACE_BYTES:
        raise HashContractError("namespace", f"{len(raw)} bytes UTF-8; the limit is {MAX_NAMESPACE_BYTES}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in namespace):
        raise HashContractError("namespace", "must not contain control characters")
    return raw


def root_hash(block_size: int, namespace: str) -> bytes:
    """h_{-1}: the chain's root for one (block_size, namespace)."""
    if not isinstance(block_size, int) or not 1 <= block_size <= _U32_MAX:
        raise HashContractError("block_size", f"must be an int in [1, 2^32), got {block_size!r}")
    ns = validate_namespace(namespace)
    return hashlib.sha256(_ROOT_TAG + struct.pack("<I", block_size) + ns).digest()


def prefix_hashes(tokens: Sequence[int], block_size: int, namespace: str) -> list[bytes]:
    """Chained SHA-256 keys of every full block of `tokens`, in order.

    `len(result) == len(tokens) // block_size`; result[i] depends on every token of blocks 0..i, the
    block size and the namespace, so two prompts share key i exactly when they share blocks 0..i.
    """
    prev = root_hash(block_size, namespace)
    n_blocks = len(tokens) // block_size
    if n_blocks == 0:
        return []
    body = list(tokens[: n_blocks * block_size])
    try:
        packed = struct.pack(f"<{len(body)}I", *body)
    except struct.error:
        bad = next((t for t in body if not isinstance(t, int) or not 0 <= t <= _U32_MAX), None)
        raise HashContractError("token_ids", f"token ids must be ints in [0, 2^32); got {bad!r}") from None
    step = 4 * block_size
    out: list[bytes] = []
    for i in range(n_blocks):
        prev = hashlib.sha256(prev + packed[i * step : (i + 1) * step]).digest()
        out.append(prev)
    return out


def to_hex(h: bytes) -> str:
    """Canonical text form of a key: lowercase hex."""
    return h.hex()


def from_hex(text: str) -> bytes:
    """Parse a key's text form; raises HashContractError unless it is 64 hex digits."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise HashContractError("key", f"not a hex key: {text!r}") from None
    if len(raw) != HASH_BYTES:
        raise HashContractError("key", f"a key is {HASH_BYTES} bytes ({2 * HASH_BYTES} hex digits), got {len(raw)}")
    return raw
