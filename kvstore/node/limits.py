"""Request limits: what a KVStore call must pass before its request is read: credentials, then size, then count.

Order, and why (DESIGN.md §8.5): an unauthenticated caller must not make the node allocate anything sized by
its request. So
1. the token is checked from the call's metadata (`ErrorInterceptor.intercept_service` sees it before
   gRPC reads a single request message); a refused call gets a handler that never reads its request:
   whatever the method, it is answered as a request *stream* that is never iterated, so the request
   bytes are neither deserialised nor even buffered beyond the HTTP/2 flow-control window;
2. no message larger than any method accepts is received at all (MAX_RECEIVE_BYTES, the server's
   gRPC limit), and an admitted unary call's request arrives as raw bytes and is parsed only when it
   is no larger than its own method's limit (`REQUEST_LIMITS`);
3. repeated fields are counted (`bounded`) before they are turned into Python lists;
4. the handler runs with its resolved caller (kvstore/node/callers.py), which holds a read-only
   principal to reading and reaches only its tenant's namespaces.

Pure bookkeeping plus gRPC handler plumbing; no I/O.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sized
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.hashing import HASH_BYTES, MAX_NAMESPACE_BYTES
from kvstore.wire import CHUNK_BYTES, MAX_HASHES

T = TypeVar("T")

_HASH_FIELD = HASH_BYTES + 2  # tag + length byte + 32 bytes, per repeated hash
_HEAD = MAX_NAMESPACE_BYTES + 256  # namespace, flags, layout, a shm region, target tier: with room

# Largest serialized request each unary method accepts. A larger one is refused (INVALID_ARGUMENT)
# before it is parsed; streams (Put) are framed and checked chunk by chunk in kvstore.wire.streams.PutParser.
REQUEST_LIMITS: dict[str, int] = {
    "Stats": 1024,
    **{
        m: _HEAD + MAX_HASHES * _HASH_FIELD
        for m in ("Lookup", "Delete", "Pin", "Unpin", "Prefetch", "Get", "Report", "Retain")
    },
    "Replicate": _HEAD + MAX_NAMESPACE_BYTES + MAX_HASHES * _HASH_FIELD,  # + the source's node id
}
# The node's gRPC receive limit: the largest request any method accepts, a Put chunk included. gRPC
# refuses a larger message (RESOURCE_EXHAUSTED) from its length prefix, before buffering it.
MAX_RECEIVE_BYTES = max(*REQUEST_LIMITS.values(), CHUNK_BYTES + 4096)


def check_count(items: Sized, limit: int, field: str) -> None:
    """InvalidArgument naming the field unless `len(items)` <= limit (a protobuf repeated field counts
    its elements without creating them)."""
    if len(items) > limit:
        raise InvalidArgument(field, f"{len(items)} entries in one request; the limit is {limit}")


def bounded(items: Sized, limit: int, field: str) -> list[Any]:
    """`list(items)`, once their count is known to be <= limit (see check_count)."""
    check_count(items, limit, field)
    return list(items)  # type: ignore[call-overload]


def parse_request(raw: bytes, method: str, parse: Callable[[bytes], T]) -> T:
    """The request of `method` from its raw bytes, refusing one over the method's limit unparsed."""
    limit = REQUEST_LIMITS.get(method)
    if limit is not None and len(raw) > limit:
        raise InvalidArgument(
            "request",
            f"{len(raw)} bytes is over the {limit}-byte limit of {method} (at most {MAX_HASHES} hashes per call)",
        )
    try:
        return parse(raw)
    except DecodeError as exc:
        raise InvalidArgument(
            "request", f"{len(raw)} bytes do not parse as a {method} request (or a string in it is not UTF-8): {exc}"
        ) from None


def refusal_handler(exc: KVStoreError) -> grpc.RpcMethodHandler:
    """A handler that answers `exc`'s status without reading the request: registered as a stream-stream
    handler whatever the method, so the server never waits for, buffers or deserialises a request
    message (clients cannot tell: on the wire a unary call is a stream of one message)."""
    code = getattr(grpc.StatusCode, exc.status_name)
    message = str(exc)

    async def refuse(_requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        await context.abort(code, message)
        yield b""  # pragma: no cover - abort raises; this only makes the function a generator

    return grpc.stream_stream_rpc_method_handler(refuse, None, None)


def raw_unary(
    fn: Callable[[Any, grpc.aio.ServicerContext], T], method: str, parse: Callable[[bytes], Any] | None
) -> Callable[[bytes, grpc.aio.ServicerContext], T]:
    """Wrap a handler whose request now arrives as raw bytes: size-check and parse, then call it."""
    if parse is None:
        return fn  # the handler takes bytes already (Put, Get's responses)

    def call(raw: bytes, context: grpc.aio.ServicerContext) -> T:
        return fn(parse_request(raw, method, parse), context)

    return call
