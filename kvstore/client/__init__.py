"""Clients of a cache node: `KVStoreClient` (blocking) and `AsyncKVStoreClient` (asyncio), two drivers of
one core (core.py: every operation written once, as exchanges), plus the gRPC plumbing (grpc_channel.py).

    with KVStoreClient("127.0.0.1:50051") as kv:
        kv.put(ns, layout, hashes, pages)
        pages = kv.get(ns, hashes[: kv.lookup(ns, hashes)])

        staging = kv.shared_buffer(16 * layout.page_bytes)     # zero-copy on the node's host
        refs = kv.get_into(ns, hashes[:16], staging.pages(layout.page_bytes, 16))

        kv.retain("conv-42", ns, hashes, ttl_seconds=300, mode=RetainMode.DEMOTE)   # a session's pages kept
        kv.resume_session("conv-42")                             # its next turn: back to DRAM
"""

from kvstore.client.aio import AsyncKVStoreClient
from kvstore.client.clients import KVStoreClient
from kvstore.client.core import DEFAULT_PAGES_PER_CALL, PinResult, PutResult, ReplicateResult
from kvstore.client.planes.choice import TRANSPORTS
from kvstore.client.planes.segments import SharedBuffer
from kvstore.names import RetainMode
from kvstore.stats import RetainResult, SessionState
from kvstore.wire.streams import PageRef

__all__ = [
    "DEFAULT_PAGES_PER_CALL",
    "TRANSPORTS",
    "AsyncKVStoreClient",
    "KVStoreClient",
    "PageRef",
    "PinResult",
    "PutResult",
    "ReplicateResult",
    "RetainMode",
    "RetainResult",
    "SessionState",
    "SharedBuffer",
]
