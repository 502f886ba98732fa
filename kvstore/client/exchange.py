"""Exchanges: client-side protocol logic written once, driven by a blocking or an asyncio caller.

An exchange is a generator. It yields operations (a gRPC call, or a blocking function such as a socket
transfer), receives each one's result at the yield (or has its error thrown in there), and returns its
own result. It does no I/O of its own beyond memory copies, so the same code serves `KVStoreClient`,
which performs each operation on the caller's thread, and `AsyncKVStoreClient`, which awaits it
(blocking functions run in a worker thread). A data plane (kvstore/client/planes/) is written once, as exchanges.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Unary:
    """A unary KVStore RPC by method name; the result is the response message."""

    method: str
    request: Any


@dataclass(frozen=True, slots=True)
class ClientStream:
    """A client-streaming RPC whose requests are already serialized; the result is the response."""

    method: str
    requests: Iterable[bytes]


@dataclass(frozen=True, slots=True)
class ServerStream:
    """A server-streaming RPC; every serialized response is handed to `sink`; the result is None."""

    method: str
    request: Any
    sink: Callable[[bytes], None]


@dataclass(frozen=True, slots=True)
class Blocking:
    """A blocking function (socket transfers, say): called on the caller's thread by the blocking
    client, in a worker thread by the asyncio client; the result is its return value."""

    fn: Callable[[], Any]


Op = Unary | ClientStream | ServerStream | Blocking
Exchange = Generator[Op, Any, T]
Outcome = tuple[Any, Exception | None]  # an operation's (result, error): one of them is None


def advance(exchange: Exchange[T], result: Any = None, error: Exception | None = None) -> tuple[Op | None, T | None]:
    """One step of a driver: send the last operation's result into the exchange (or throw its error in
    at the yield). Returns (next operation, None), or (None, the exchange's result) once it returned.
    The first call (no result) starts the exchange."""
    try:
        op = exchange.throw(error) if error is not None else exchange.send(result)
    except StopIteration as done:
        return None, done.value
    return op, None
