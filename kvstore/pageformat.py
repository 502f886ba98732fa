"""On-media page format: a fixed 4 KiB header block followed by the payload (pure, no I/O).

Slot layout, identical in every tier so a demotion is one copy of the used bytes:

    [0, 4096)                header block (below), zero padded
    [4096, 4096 + payload)   payload, the page bytes exactly as the client sent them

Header block (little endian):
    magic "KVPG" | format u16 | flags u16 | generation u64 | payload_len u64 | checksum u64 |
    layout (20 B, PageLayout.pack) | hash (32 B) | namespace_len u16 | namespace (UTF-8) | header_checksum u64

Format versions (a reader takes every version up to FORMAT_VERSION; a writer writes FORMAT_VERSION):
    1  layout = dtype u32 | layers | kv heads | head dim | block size (5 x u32): raw pages only;
       `checksum` is XXH3-64 of the payload alone.
    2  the layout's first word is dtype u16 | encoding u16 (PageEncoding): pages of any encoding;
       `checksum` as in 1.
    3  as 2, but `checksum` binds the page's identity (below): a page whose header names another
       namespace, tenant, key or layout than the one its bytes were stored under fails its check.
An NVMe file of an older build recovers after an upgrade: its pages are verified the old way (the payload
against its header's checksum; `PageHeader.bound_checksum` derives the bound form from the header's own
fields, so the binding is only as good as that header) until rewritten in format 3, which every move
(promotion, demotion, the graceful-shutdown spill) does. An older build meets a format 3 page as "page
format 3 is not supported", never as a misread layout or a wrong checksum.

The identity binding (DESIGN.md §8). A page's stored checksum is

    XXH3-64(payload) ^ key_digest(namespace, key) ^ scope_digest(tenant) ^ layout_digest(layout)

where `namespace` is the client's (unscoped) namespace, `tenant` the scope the node stores it under
(kvstore/scoping.py) and each digest an XXH3-64 of a domain-separated encoding of its fields. XOR of
independent 64-bit digests: no second pass over the payload, and each side checks the part it knows. A
client computes and verifies the *wire* form, XXH3-64(payload) ^ key_digest(namespace, key): it needs
neither its tenant nor the layout. The node converts between the two with scope and layout digests of
what it believes the request is (the caller's tenant, the namespace's layout), never of what a header or
entry claims, so a page served under another key, namespace, tenant or layout fails at whichever party
verifies it. A wire checksum of the older *payload* form (ChecksumForm.PAYLOAD: clients that predate the
binding) is the payload's XXH3-64 alone; the node converts it too, by one more XOR.

`header_checksum` is XXH3-64 of every header byte before it, so a torn or stale header is recognised on
NVMe recovery. `generation` grows monotonically per node; when recovery finds one key in two slots, the
higher generation wins.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from kvstore.hashing import HASH_BYTES
from kvstore.layout import PageEncoding, PageLayout
from kvstore.pointers import buffer_address
from kvstore.scoping import MAX_SCOPED_NAMESPACE_BYTES, split  # a tenant's scoped namespace

MAGIC = b"KVPG"
FORMAT_VERSION = 3  # the newest this build reads, and the one it writes (module docstring)
_FORMAT_RAW_ONLY = 1  # the version before encodings: its layouts are raw
_FORMAT_BOUND = 3  # the first version whose checksum binds the page's identity
HEADER_BYTES = 4096
ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffers aligned to the logical block size
_FIXED = struct.Struct("<4sHHQQQ20s32sH")


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def slot_bytes_for(max_page_bytes: int) -> int:
    """Slot size that holds a header and a payload of up to max_page_bytes, O_DIRECT aligned."""
    return HEADER_BYTES + align_up(max_page_bytes)


def payload_checksum(payload: memoryview | bytes) -> int:
    """XXH3-64 of a page payload alone (the identity digests below bind it to its page)."""
    return xxhash.xxh3_64_intdigest(payload)


class ChecksumForm(enum.IntEnum):
    """What a checksum on the wire covers; values equal the proto's `kvstore.v1.ChecksumForm` numbers."""

    PAYLOAD = 0  # the payload's XXH3-64 alone: clients that predate the identity binding
    KEYED = 1  # the payload's XXH3-64 ^ key_digest(namespace, key): the wire form (module docstring)


def key_digest(namespace: str, key: bytes) -> int:
    """The digest of a page's client namespace (unscoped) and key, as both client and node compute it."""
    return xxhash.xxh3_64_intdigest(b"kvstore/page-key/v1\0" + namespace.encode() + b"\0" + key)


@functools.lru_cache(maxsize=1024)
def scope_digest(tenant: str) -> int:
    """The digest of the tenant a page is stored for (the node's side of the binding)."""
    return xxhash.xxh3_64_intdigest(b"kvstore/page-tenant/v1\0" + tenant.encode())


@functools.lru_cache(maxsize=1024)
def layout_digest(layout: PageLayout) -> int:
    """The digest of a page's layout, its encoding included."""
    return xxhash.xxh3_64_intdigest(b"kvstore/page-layout/v1\0" + layout.pack())


def identity_digest(scoped_namespace: str, key: bytes, layout: PageLayout) -> int:
    """All of a stored page's identity: its stored checksum is its payload's XXH3-64 XOR this."""
    tenant, namespace = split(scoped_namespace)
    return key_digest(namespace, key) ^ scope_digest(tenant) ^ layout_digest(layout)


def node_side_digest(scoped_namespace: str, layout: PageLayout) -> int:
    """What the node XORs in to turn a wire (KEYED) checksum into the stored one, and back: the tenant's and
    the layout's part of the identity, which the client does not know."""
    return scope_digest(split(scoped_namespace)[0]) ^ layout_digest(layout)


def in_form(keyed: int, form: ChecksumForm, namespace: str, key: bytes) -> int:
    """A KEYED wire checksum in the form a request asked for (PAYLOAD: the key digest taken out again)."""
    return keyed if form is ChecksumForm.KEYED else keyed ^ key_digest(namespace, key)


def wire_checksum(namespace: str, key: bytes, payload: memoryview | bytes) -> int:
    """The checksum a client declares for a page it puts (ChecksumForm.KEYED), `namespace` as it names it."""
    return payload_checksum(payload) ^ key_digest(namespace, key)


def payload_hasher() -> xxhash.xxh3_64:
    """payload_checksum over bytes fed in pieces: `update(piece)` in order, then `intdigest()`."""
    return xxhash.xxh3_64()


# A page moved and hashed in steps of this many bytes is hashed while its bytes are still in the core's L2
# cache (512 KiB per core here). NOTE: measured on a 2-vCPU EPYC VM: XXH3-64 runs 27-36 GB/s over bytes in
# cache and 9-10 GB/s over bytes it must fetch from RAM; hashing a whole 4 MiB page after receiving or copying
# it costs a second pass over RAM.
HOT_CHUNK = 256 << 10


def checksum_in_steps(n: int, step: Callable[[int, int], memoryview | bytes]) -> int:
    """The payload checksum (XXH3-64, equal to payload_checksum's) of `n` bytes that `step(off, k)` makes ready
    HOT_CHUNK at a time (receives or copies bytes [off, off + k) and returns them), each hashed right after."""
    h = payload_hasher()
    for off in range(0, n, HOT_CHUNK):
        h.update(step(off, min(HOT_CHUNK, n - off)))
    return h.intdigest()


def checksum_into(payload: memoryview, dest: memoryview | None) -> int:
    """XXH3-64 of `payload` (its payload checksum), copying it into `dest` in the same pass when given.

    NOTE: one pass over memory instead of two: each chunk is copied, then hashed from cache
    (checksum_in_steps), rather than hashing the whole page and copying it again from RAM. The hash is of the
    source, so it verifies what was read; the copy is a memcpy of hashed bytes. Used wherever a page is copied
    and hashed: the node's reads into a caller's memory, a same-host put's copy into registered memory.
    """
    if dest is None:
        return payload_checksum(payload)
    n = len(payload)
    if len(dest) < n:
        raise ValueError(f"destination of {len(dest)} bytes cannot hold a {n}-byte page")
    # NOTE: memmove through ctypes releases the GIL (a memoryview slice assignment holds it), as XXH3 does,
    # so copies of several pages run in parallel on the I/O pool's threads.
    src, dst = buffer_address(payload), buffer_address(dest)

    def copy(off: int, k: int) -> memoryview:
        ctypes.memmove(dst + off, src + off, k)
        return payload[off : off + k]

    return checksum_in_steps(n, copy)


def copy_checksum_dest(src: memoryview, dest: memoryview) -> int:
    """Copy `src` into `dest` and return the XXH3-64 of what landed in `dest` (its payload checksum), in one
    pass: each chunk copied, then hashed from cache out of `dest` (checksum_in_steps). The hash is of the
    destination, so it says what `dest` holds even if `src` changed meanwhile (a put's slot: DESIGN.md §8.3,
    the node's checksum is of the bytes in its slot). `dest` must be exactly as long as `src`."""
    n = len(src)
    if len(dest) != n:
        raise ValueError(f"destination of {len(dest)} bytes for a {n}-byte page")
    s, d = buffer_address(src), buffer_address(dest)

    def copy(off: int, k: int) -> memoryview:
        ctypes.memmove(d + off, s + off, k)
        return dest[off : off + k]

    return checksum_in_steps(n, copy)


class HeaderError(ValueError):
    """A header block is not a valid page header (blank, torn, foreign or corrupt)."""


@dataclass(frozen=True, slots=True)
class PageHeader:
    """A slot's header block as written. `checksum` is in the form of its `version` (module docstring): use
    `bound_checksum` for the identity-bound form every check of this build compares with."""

    namespace: str
    hash: bytes
    layout: PageLayout
    payload_len: int
    checksum: int
    generation: int
    version: int = FORMAT_VERSION

    def bound_checksum(self) -> int:
        """The stored checksum in the identity-bound form; for an older format derived from this header's own
        fields (its payload is verified the old way: module docstring)."""
        if self.version >= _FORMAT_BOUND:
            return self.checksum
        return self.checksum ^ identity_digest(self.namespace, self.hash, self.layout)

    def pack(self) -> bytes:
        """The header block: exactly HEADER_BYTES bytes, in format `version` (FORMAT_VERSION unless a test or
        a repair rewrites an older header as it was)."""
        ns = self.namespace.encode()
        if len(ns) > MAX_SCOPED_NAMESPACE_BYTES or len(self.hash) != HASH_BYTES:
            raise ValueError("namespace or hash out of range for a page header")
        if not _FORMAT_RAW_ONLY <= self.version <= FORMAT_VERSION or (
            self.version == _FORMAT_RAW_ONLY and self.layout.encoding is not PageEncoding.RAW
        ):
            raise ValueError(f"page format {self.version} cannot express a {self.layout.encoding.label} page")
        body = (
            _FIXED.pack(
                MAGIC,
                self.version,
                0,
                self.generation,
                self.payload_len,
                self.checksum,
                self.layout.pack(),
                self.hash,
                len(ns),
            )
            + ns
        )
        body += struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
        return body + bytes(HEADER_BYTES - len(body))

    @classmethod
    def unpack(cls, block: bytes | memoryview) -> PageHeader:
        """Parse and verify a header block; raise HeaderError if it is not a valid header."""
        if len(block) < _FIXED.size:
            raise HeaderError("header block too short")
        magic, version, _flags, gen, plen, csum, layout_raw, h, ns_len = _FIXED.unpack_from(block)
        if magic != MAGIC:
            raise HeaderError("no page header (blank or foreign slot)")
        if not _FORMAT_RAW_ONLY <= version <= FORMAT_VERSION:
            raise HeaderError(
                f"page format {version} is not supported (this build reads {_FORMAT_RAW_ONLY} to {FORMAT_VERSION})"
            )
        if ns_len > MAX_SCOPED_NAMESPACE_BYTES:
            raise HeaderError("namespace length out of range")
        end = _FIXED.size + ns_len
        (stored,) = struct.unpack_from("<Q", block, end)
        if xxhash.xxh3_64_intdigest(bytes(block[:end])) != stored:
            raise HeaderError("header checksum mismatch (torn or corrupt header)")
        try:
            layout = PageLayout.unpack(layout_raw)
            namespace = bytes(block[_FIXED.size : end]).decode()
        except (ValueError, UnicodeDecodeError) as exc:
            raise HeaderError(f"header fields invalid: {exc}") from None
        if version == _FORMAT_RAW_ONLY and layout.encoding is not PageEncoding.RAW:
            # In version 1 the whole first word was the dtype: a non-zero upper half is no encoding.
            raise HeaderError(f"header fields invalid: a format {version} page has no encoding")
        return cls(namespace, h, layout, plen, csum, gen, version)
