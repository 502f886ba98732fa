"""What both sides of the wire agree on: limits, the typed Put opening, and each plane's protocol.

    streams.py       gRPC: proto <-> kvstore types, Put and Get stream framing (both directions)
    tcp.py           the bulk TCP plane's frame format (v1)
    ucx.py           the UCX plane's control messages, tags and addresses
    ucx_progress.py  waiting on UCX requests, blocking (client) or on the node's event loop
    shm.py           the same-host shared-memory plane: segment header, names, nonce

Pure (no sockets, no files) except where a module says so. The client side of each plane lives in
kvstore/client/planes/, the node side in kvstore/node/planes/; both import from here, never each other.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvstore.errors import InvalidArgument, ProtocolError
from kvstore.hashing import HASH_BYTES
from kvstore.layout import PageLayout
from kvstore.names import TierKind
from kvstore.pageformat import ChecksumForm

MAX_HASHES = 65536  # hashes in one Lookup / Delete / Pin / Unpin / Prefetch call
CHUNK_BYTES = 1 << 20  # measured: Python gRPC messages above ~1 MiB are several times slower
MAX_MESSAGE_BYTES = 8 << 20  # a gRPC chunk + framing, with room to spare; channels and the server set this
MAX_REPLICAS = 16  # copies a Put may ask the cluster to keep (PutOpen.replicas)
PAGE_BYTES = struct.Struct("<Q")  # the answer to a page-size ask (`page_size_ask`)


@dataclass(frozen=True, slots=True)
class PutOpen:
    """What opens a Put on every plane (the typed form of the proto's PutOpen).

    `target_tier`: the tier new pages should land in (None: the node's default). With `chain`, page i's chain
    parent is page i-1 and the first page's is `parent` (prefix-aware policies evict a chain's tail before
    its head); without it pages carry no parent and `parent` is ignored. `checksums`: the form of the
    checksums its pages declare (KEYED from this build's clients; PAYLOAD from older ones).
    """

    namespace: str
    layout: PageLayout
    target_tier: TierKind | None = None
    parent: bytes | None = None
    chain: bool = False
    checksums: ChecksumForm = ChecksumForm.KEYED  # what the pages' declared checksums cover (pageformat)
    replicas: int = 0

    def batch(self, hashes: Sequence[bytes], start: int) -> PutOpen:
        """The opening of the batch of `hashes` that starts at index `start`: its first page's parent is
        the page before it in the chain (for `start` 0, this opening's own parent)."""
        if not self.chain:
            return self if self.parent is None else replace(self, parent=None)
        return self if start == 0 else replace(self, parent=hashes[start - 1])


def check_replicas(value: int, field: str) -> int:
    """`value` if a Put may ask for that many copies (0..MAX_REPLICAS); InvalidArgument naming `field`."""
    if not 0 <= value <= MAX_REPLICAS:
        raise InvalidArgument(field, f"{value} copies asked for; a Put may ask for 0 to {MAX_REPLICAS}")
    return value


def pack_held(held: Sequence[bool]) -> bytes:
    """A Put's per-page answer as a bitmap: bit i (least significant first, byte i // 8) set when page i is held."""
    out = bytearray((len(held) + 7) // 8)
    for i, h in enumerate(held):
        if h:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def unpack_held(raw: bytes | memoryview, pages: int) -> list[bool] | None:
    """The per-page answer of a Put of `pages` pages; None when the node sent none (an older node) or a bitmap
    of the wrong size (then the caller falls back to the counts)."""
    if len(raw) != (pages + 7) // 8 or pages == 0:
        return None
    return [bool(raw[i >> 3] >> (i & 7) & 1) for i in range(pages)]


# -- a namespace's page size, asked before a Get (the same-host and UCX planes: their receives are sized first)


def page_size_ask(namespace: str, first: bytes) -> bytes:
    """The body of a page-size ask: the first hash the Get that needs it will ask for (so the node answers and
    counts a namespace it does not hold as that Get's refusal would be), then the namespace (UTF-8)."""
    if len(first) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes, got {len(first)}")
    return bytes(first) + namespace.encode()


def parse_page_size_ask(body: bytes | memoryview) -> tuple[str, bytes]:
    """(namespace, first hash) of a page-size ask; InvalidArgument naming the field that is bad."""
    if len(body) < HASH_BYTES:
        raise InvalidArgument("layout", f"a page-size ask carries a {HASH_BYTES}-byte hash, then the namespace")
    try:
        namespace = bytes(body[HASH_BYTES:]).decode()
    except UnicodeDecodeError:
        raise InvalidArgument("namespace", "not valid UTF-8") from None
    return namespace, bytes(body[:HASH_BYTES])


def parse_page_size(body: bytes | memoryview, max_page_bytes: int) -> int:
    """The page size a node answered; ProtocolError unless it is 1..max_page_bytes (the largest page the node
    said it holds), so no receive is ever sized by an answer the node could not have meant."""
    if len(body) != PAGE_BYTES.size:
        raise ProtocolError(f"a page-size answer is {PAGE_BYTES.size} bytes, got {len(body)}")
    (n,) = PAGE_BYTES.unpack(body)
    if not 0 < n <= max_page_bytes:
        raise ProtocolError(f"the node answered a page size of {n} bytes (its largest page: {max_page_bytes})")
    return int(n)
