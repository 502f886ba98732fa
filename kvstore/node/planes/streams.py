"""The node side of the gRPC streams plane: a Put stream read as pages for the put driver, a Get's leases
written as a response stream (framing, both directions: kvstore/wire/streams.py).

Put requests reach the servicer still serialized and Get responses leave already serialized, so page
bytes skip protobuf's extra copy: each chunk is copied once, into its slot (Put) or from it (Get).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from kvstore.errors import InvalidArgument
from kvstore.node.drivers import PageHead
from kvstore.wire import PutOpen
from kvstore.wire.streams import PutChunk, PutPageHeader, PutParser, put_open_from_pb


class PutStream:
    """One Put stream as the put driver reads it: `open()` first, then `heads()`, whose pages' bytes the
    driver takes with `read_into` / `discard` before asking for the next head. Framing breaches (a chunk
    before its header, too many bytes, a truncated page) raise InvalidArgument naming the field."""

    def __init__(self, requests: AsyncIterator[bytes]) -> None:
        self._requests = aiter(requests)
        self._parser = PutParser()

    async def _next(self) -> object | None:
        raw = await anext(self._requests, None)
        return None if raw is None else self._parser.feed(raw)

    async def open(self) -> PutOpen:
        msg = await self._next()
        if msg is None:
            self._parser.finish()  # raises: an empty stream
        return put_open_from_pb(msg)  # type: ignore[arg-type]

    async def heads(self) -> AsyncIterator[PageHead]:
        while (msg := await self._next()) is not None:
            assert isinstance(msg, PutPageHeader)  # the parser refuses a chunk past its page's announced size
            yield PageHead(msg.hash, msg.payload_bytes, msg.checksum)
        self._parser.finish()

    async def _chunks(self, nbytes: int) -> AsyncIterator[PutChunk]:
        got = 0
        while got < nbytes:
            msg = await self._next()
            if msg is None:
                self._parser.finish()  # raises: the stream ended inside a page
            if not isinstance(msg, PutChunk):
                raise InvalidArgument("chunk", "a page's chunks must follow its header")
            got += len(msg.data)
            yield msg

    async def read_into(self, index: int, view: memoryview) -> None:
        async for chunk in self._chunks(len(view)):
            view[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data

    async def discard(self, index: int, nbytes: int) -> None:
        async for _ in self._chunks(nbytes):
            pass
