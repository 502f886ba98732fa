"""The node's one gRPC interceptor: authentication before a request is read, then every kvstore
exception mapped to its status code, and every KVStore call timed for metrics.

Invariants: a call refused for its credentials never has its request read (kvstore/node/limits.py); a
handler's KVStoreError becomes exactly its `status_name`; anything else is INTERNAL, logged with its
traceback; `observe(method, code, seconds)` sees each call once, when it ends; the handler runs with
its caller (bound to its mTLS tenant where the tenants file says so) in `admission.CALLER`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.addresses import peer_host
from kvstore.errors import KVStoreError
from kvstore.node.callers import CALLER, Callers
from kvstore.node.limits import raw_unary, refusal_handler
from kvstore.node.tenancy import grpc_cert_names
from kvstore.security import Principal, marks_copy

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name


def status_of(exc: KVStoreError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.status_name)


RpcObserver = Callable[[str, str, float], None]  # (method, status code name, seconds)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps KVStoreError subclasses to their status codes and anything unexpected to INTERNAL (logged
    with its traceback). The only place exceptions become status codes, and so also where every
    KVStore RPC is timed: `observe(method, code, seconds)` (metrics) sees each call once it ends."""

    def __init__(self, callers: Callers, observe: RpcObserver | None = None) -> None:
        self.callers = callers
        self.observe = observe

    def bind(self, who: Principal | None, context: grpc.aio.ServicerContext) -> Principal | None:
        """The call's principal, bound to its mTLS certificate's tenant where the tenants file says so."""
        if self.callers.binder is None:
            return who
        return self.callers.bind(who, grpc_cert_names(context.auth_context()))

    def authorize(self, method: str, metadata: Any) -> tuple[grpc.RpcMethodHandler | None, Principal | None]:
        """(None, the caller) when the call's token allows `method`; else a handler refusing it that
        never reads the request (kvstore/node/limits.py: authentication before any allocation sized by
        the caller). The caller is None on a node without tokens."""
        try:
            return None, self.callers.check(method.rsplit("/", 1)[-1], metadata)
        except KVStoreError as exc:
            self.done(method, time.perf_counter(), exc)
            return refusal_handler(exc), None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        method = details.method
        refusal, caller = self.authorize(method, details.invocation_metadata)
        if refusal is not None:
            return refusal
        # Requests reach the wrappers as raw bytes and are parsed there, after a per-method size check.
        name, parse = method.rsplit("/", 1)[-1], handler.request_deserializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(raw_unary(handler.unary_unary, name, parse), method, self, caller),
                None,
                handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, method, self, caller),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(raw_unary(handler.unary_stream, name, parse), method, self, caller),
                None,
                handler.response_serializer,
            )
        return handler

    def done(self, method: str, started: float, exc: BaseException | None) -> None:
        if self.observe is None:
            return
        if exc is None:
            code = "OK"
        elif isinstance(exc, asyncio.CancelledError):
            code = "CANCELLED"
        elif isinstance(exc, KVStoreError):
            code = status_of(exc).name
        elif isinstance(exc, grpc.aio.AbortError):
            code = "UNKNOWN"  # a handler aborted by itself (none does today: errors go through _abort)
        else:
            code = "INTERNAL"
        self.observe(method, code, time.perf_counter() - started)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    if isinstance(exc, KVStoreError):
        log.debug("%s -> %s: %s", method, exc.status_name, exc)
        await context.abort(status_of(exc), str(exc))
    log.exception("%s failed unexpectedly", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


@contextlib.asynccontextmanager
async def _handled(
    method: str, icpt: ErrorInterceptor, caller: Principal | None, context: grpc.aio.ServicerContext
) -> AsyncIterator[None]:
    """One KVStore call as its handler runs: the caller in CALLER (this call's own task context, seen
    by the handler only), the outcome timed and any exception mapped to its status (an abort)."""
    started = time.perf_counter()
    CALLER.set(None)
    try:
        # may refuse (another tenant's certificate)
        copies = marks_copy(context.invocation_metadata())
        CALLER.set(icpt.callers.caller(icpt.bind(caller, context), peer_host(context.peer()), copies))
        yield
    except (asyncio.CancelledError, grpc.aio.AbortError) as exc:
        icpt.done(method, started, exc)
        raise
    except Exception as exc:
        icpt.done(method, started, exc)
        await _abort(context, exc, method)
    else:
        icpt.done(method, started, None)


def _wrap_unary(
    fn: Callable[..., Awaitable[Any]], method: str, icpt: ErrorInterceptor, caller: Principal | None
) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _handled(method, icpt, caller, context):
            return await fn(request, context)

    return wrapper


def _wrap_stream(
    fn: Callable[..., AsyncIterator[Any]], method: str, icpt: ErrorInterceptor, caller: Principal | None
) -> Callable[..., AsyncIterator[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async with _handled(method, icpt, caller, context):
            async for item in fn(request, context):
                yield item

    return wrapper
