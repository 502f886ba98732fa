"""Clients of a cache node: `KVStoreClient` (blocking) and `AsyncKVStoreClient` (asyncio), two drivers of
one core (core.py: every operation written once, as exchanges), plus the gRPC plumbing (calls.py).

    with KVStoreClient("127.0.0.1:50051") as kv:
        kv.put(ns, layout, hashes, pages)
        pages = kv.get(ns, hashes[: kv.lookup(ns, hashes)])
"""

from kvstore.client.clients import AsyncKVStoreClient, KVStoreClient
from kvstore.client.core import DEFAULT_PAGES_PER_STREAM, PinResult, PutResult
from kvstore.transport.planes import TRANSPORTS

__all__ = ["DEFAULT_PAGES_PER_STREAM", "TRANSPORTS", "AsyncKVStoreClient", "KVStoreClient", "PinResult", "PutResult"]
