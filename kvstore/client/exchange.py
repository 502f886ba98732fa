"""Exchanges: client-side protocol logic written once, driven by a blocking or an asyncio caller.

An exchange is a generator. It yields operations (a gRPC call, or a blocking function such as a socket
transfer), receives each one's result at the yield (or has its error thrown in there), and returns its
own result. It does no I/O of its own beyond memory copies, so the same code serves `KVStoreClient`,
which performs each operation on the caller's thread, and `AsyncKVStoreClient`, which awaits it
(blocking functions run in a worker thread). A data plane (kvstore/client/planes/) is written once, as exchanges.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
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


class Abort:
    """How a `Blocking` function is asked to stop early: thread-safe, fired at most once.

    The function registers what makes it return soon (`on_abort`: a socket shutdown, a flag its waits
    check) for as long as it runs; `fire()` (the asyncio client, when its caller is cancelled) calls those
    hooks. Firing does not end the function: the caller still waits for it to return, because until it
    has returned it (or the node it talks to) may still use the call's memory (DESIGN.md §8).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fired = False
        self._hooks: list[Callable[[], None]] = []

    @property
    def fired(self) -> bool:
        return self._fired

    def on_abort(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Run `hook` when fired (at once if fired already); returns the function that unregisters it."""
        with self._lock:
            fired = self._fired
            if not fired:
                self._hooks.append(hook)
        if fired:
            hook()

        def forget() -> None:
            with self._lock:
                if hook in self._hooks:
                    self._hooks.remove(hook)

        return forget

    def fire(self) -> None:
        with self._lock:
            if self._fired:
                return
            self._fired = True
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()


@dataclass(frozen=True, slots=True)
class Blocking:
    """A blocking function (socket transfers, say): called on the caller's thread by the blocking
    client, in a worker thread by the asyncio client; the result is its return value.

    Invariant: the exchange resumes only after `fn` returned or raised, also when the asyncio caller was
    cancelled meanwhile (then `abort` is fired first, to make `fn` return soon, and the cancellation is
    raised once it has): memory `fn` or its peer may still write is never handed back while it can."""

    fn: Callable[[], Any]
    abort: Abort = field(default_factory=Abort)


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
