"""The gRPC streams data plane: Put as a client stream, Get as a server stream (framing in kvstore/wire.py).

Always available: the fallback of every other plane, and the plane of a client on another host.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.layout import PageLayout
from kvstore.names import Buffer, TierKind
from kvstore.transport.exchange import ClientStream, DataPlane, Exchange, ServerStream, batches, prefix_batches
from kvstore.wire import FetchedPage, GetAssembler, put_requests


class GrpcStreams(DataPlane):
    """Pages travel as <= 1 MiB chunks inside gRPC messages; one stream per `pages_per_call` pages."""

    name = "grpc"

    def __init__(self, pages_per_call: int, verify: bool) -> None:
        self.pages_per_call = pages_per_call
        self.verify = verify

    def put(self, namespace: str, layout: PageLayout, hashes: Sequence[bytes], pages: Sequence[Buffer],
            target: TierKind | None, parent: bytes | None, chain: bool) -> Exchange[tuple[int, int]]:  # fmt: skip
        stored = present = 0
        for a, b in batches(len(hashes), self.pages_per_call):
            first_parent = parent if a == 0 else hashes[a - 1]
            requests = put_requests(namespace, layout, hashes[a:b], pages[a:b], target,
                                    parent=first_parent if chain else None, chain=chain)  # fmt: skip
            reply = yield ClientStream("Put", requests)
            stored += reply.stored
            present += reply.already_present
        return stored, present

    def get(self, namespace: str, hashes: Sequence[bytes], promote: bool) -> Exchange[list[FetchedPage]]:
        def fetch(a: int, b: int) -> Exchange[list[FetchedPage]]:
            asm = GetAssembler(hashes[a:b], self.verify)
            yield ServerStream("Get", pb.GetRequest(namespace=namespace, hashes=list(hashes[a:b]),
                                                    no_promote=not promote), asm.feed)  # fmt: skip
            return asm.finish()

        return (yield from prefix_batches(len(hashes), self.pages_per_call, fetch))
