"""The gRPC streams data plane: Put as a client stream, Get as a server stream (framing: kvstore/wire/streams.py).

Always available: the fallback of every other plane, and the plane of a client on another host.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.client.exchange import ClientStream, Exchange, ServerStream
from kvstore.client.planes.base import DataPlane, PutResult
from kvstore.client.planes.pool import ReceivePool
from kvstore.layout import PageLayout
from kvstore.names import Buffer
from kvstore.wire import PutOpen, unpack_held
from kvstore.wire.streams import FetchedPage, GetAssembler, layout_to_pb, put_requests


class GrpcStreams(DataPlane):
    """Pages travel as <= 1 MiB chunks inside gRPC messages; one stream per batch of `call_pages` pages."""

    name = "grpc"

    def __init__(self, pages_per_call: int, verify: bool, received: ReceivePool | None = None) -> None:
        self.pages_per_call = pages_per_call
        self.verify = verify
        self.received = ReceivePool() if received is None else received  # where a get's pages land

    def put_batch(self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[Buffer]) -> Exchange[PutResult]:
        reply = yield ClientStream("Put", put_requests(op, hashes, pages))
        return PutResult(reply.stored, reply.already_present, unpack_held(reply.held, len(hashes)))

    def get_batch(
        self, namespace: str, hashes: Sequence[bytes], promote: bool, expect: PageLayout | None = None
    ) -> Exchange[list[FetchedPage]]:
        asm = GetAssembler(namespace, hashes, self.verify, self.received.take)
        request = pb.GetRequest(
            namespace=namespace, hashes=list(hashes), no_promote=not promote, checksum_form=pb.CHECKSUM_FORM_KEYED
        )
        if expect is not None:
            request.layout.CopyFrom(layout_to_pb(expect))
        yield ServerStream("Get", request, asm.feed)
        return asm.finish()
