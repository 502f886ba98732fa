"""`AsyncKVStoreClient`: the asyncio driver of ClientCore, the same methods as `KVStoreClient` (kvstore/client/
clients.py), awaitable. Each method's contract is the blocking one's: its docstring there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any, TypeVar

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.client.bundles import Parts
from kvstore.client.clients import BaseClient, failed
from kvstore.client.core import (
    PinResult,
    PutResult,
    ReplicateResult,
    put_open,
)
from kvstore.client.exchange import Blocking, Exchange, Op, Outcome, ServerStream, advance
from kvstore.layout import PageLayout
from kvstore.names import Buffer, RetainMode, RetainOp, TierKind
from kvstore.stats import LookupResult, NodeStats, RetainResult
from kvstore.wire.streams import FetchedPage, PageRef

T = TypeVar("T")


class AsyncKVStoreClient(BaseClient):
    """asyncio twin of KVStoreClient, same methods, awaitable. Create and use it inside one event loop."""

    _AIO = True

    async def __aenter__(self) -> AsyncKVStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()
        self._core.close()

    async def _run(self, exchange: Exchange[T]) -> T:
        """Await each operation the exchange yields; errors are thrown back into it at the yield."""
        with contextlib.closing(exchange):
            op, value = advance(exchange)
            while op is not None:
                op, value = advance(exchange, *await self._perform(op))
            return value  # type: ignore[return-value]

    async def _perform(self, op: Op) -> Outcome:
        try:
            if isinstance(op, Blocking):
                return await _blocking(op), None
            if not isinstance(op, ServerStream):
                return await self._call(op), None
            async for msg in self._call(op):
                op.sink(msg)
            return None, None
        except Exception as exc:
            return failed(exc)

    async def put(
        self,
        namespace: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        pages: Sequence[Buffer],
        *,
        target_tier: TierKind | None = None,
        parent: bytes | None = None,
        chain: bool = True,
        replicas: int = 0,
    ) -> PutResult:
        op = put_open(namespace, layout, target_tier=target_tier, parent=parent, chain=chain, replicas=replicas)
        return await self._run(self._core.put(op, hashes, pages))

    async def lookup_detail(self, namespace: str, hashes: Sequence[bytes], *, prefetch: bool = False) -> LookupResult:
        return await self._run(self._core.lookup_detail(namespace, hashes, prefetch))

    async def lookup(self, namespace: str, hashes: Sequence[bytes], *, prefetch: bool = False) -> int:
        return await self._run(self._core.lookup(namespace, hashes, prefetch))

    async def get_pages(self, namespace: str, hashes: Sequence[bytes], *, promote: bool = True) -> list[FetchedPage]:
        return await self._run(self._core.get_pages(namespace, hashes, promote))

    async def get(self, namespace: str, hashes: Sequence[bytes], *, promote: bool = True) -> list[memoryview]:
        return await self._run(self._core.get(namespace, hashes, promote))

    async def get_into(
        self, namespace: str, hashes: Sequence[bytes], buffers: Sequence[Buffer], *, promote: bool = True
    ) -> list[PageRef]:
        """See KVStoreClient.get_into."""
        return await self._run(self._core.get_into(namespace, hashes, buffers, promote))

    async def put_from(
        self,
        namespace: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        buffers: Sequence[Buffer],
        *,
        target_tier: TierKind | None = None,
        parent: bytes | None = None,
        chain: bool = True,
        replicas: int = 0,
    ) -> PutResult:
        """See KVStoreClient.put_from."""
        op = put_open(namespace, layout, target_tier=target_tier, parent=parent, chain=chain, replicas=replicas)
        return await self._run(self._core.put_from(op, hashes, buffers))

    async def put_bundle(
        self,
        namespace: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        pages: Sequence[Parts],
        *,
        target_tier: TierKind | None = None,
        parent: bytes | None = None,
        chain: bool = True,
        replicas: int = 0,
    ) -> PutResult:
        """See KVStoreClient.put_bundle."""
        op = put_open(namespace, layout, target_tier=target_tier, parent=parent, chain=chain, replicas=replicas)
        return await self._run(self._core.put_bundle(op, hashes, pages))

    async def get_bundle(
        self, namespace: str, layout: PageLayout, hashes: Sequence[bytes], *, promote: bool = True
    ) -> list[dict[str, memoryview]]:
        """See KVStoreClient.get_bundle."""
        return await self._run(self._core.get_bundle(namespace, layout, hashes, promote))

    async def get_bundle_into(
        self,
        namespace: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        pages: Sequence[Parts],
        *,
        promote: bool = True,
    ) -> list[PageRef]:
        """See KVStoreClient.get_bundle_into."""
        return await self._run(self._core.get_bundle_into(namespace, layout, hashes, pages, promote))

    async def delete(self, namespace: str, hashes: Sequence[bytes]) -> pb.DeleteResponse:
        return await self._run(self._core.delete(namespace, hashes))

    async def pin(self, namespace: str, hashes: Sequence[bytes], *, ttl_seconds: float = 0.0) -> PinResult:
        return await self._run(self._core.pin(namespace, hashes, ttl_seconds))

    async def unpin(self, namespace: str, hashes: Sequence[bytes]) -> PinResult:
        return await self._run(self._core.unpin(namespace, hashes))

    async def prefetch(
        self, namespace: str, hashes: Sequence[bytes], *, target_tier: TierKind = TierKind.DRAM
    ) -> pb.PrefetchResponse:
        return await self._run(self._core.prefetch(namespace, hashes, target_tier))

    async def stats(self) -> NodeStats:
        return await self._run(self._core.stats())

    # -- retention (DESIGN.md §6.5): a session's pages kept through its pauses; see RetainRequest in the proto

    async def retain(
        self,
        session: str,
        namespace: str,
        hashes: Sequence[bytes],
        *,
        ttl_seconds: float | None = None,
        priority: int | None = None,
        mode: RetainMode | None = None,
    ) -> RetainResult:
        """See KVStoreClient.retain."""
        return await self._run(
            self._core.retain(
                session, RetainOp.RETAIN, namespace, hashes, ttl_seconds=ttl_seconds, priority=priority, mode=mode
            )
        )

    async def update_session(
        self,
        session: str,
        *,
        ttl_seconds: float | None = None,
        priority: int | None = None,
        mode: RetainMode | None = None,
    ) -> RetainResult:
        """See KVStoreClient.update_session."""
        return await self._run(
            self._core.retain(session, RetainOp.UPDATE, "", (), ttl_seconds=ttl_seconds, priority=priority, mode=mode)
        )

    async def release_pages(self, session: str, namespace: str, hashes: Sequence[bytes]) -> RetainResult:
        """See KVStoreClient.release_pages."""
        return await self._run(self._core.retain(session, RetainOp.RELEASE, namespace, hashes))

    async def end_session(self, session: str) -> RetainResult:
        """See KVStoreClient.end_session."""
        return await self._run(self._core.retain(session, RetainOp.END))

    async def resume_session(
        self,
        session: str,
        *,
        ttl_seconds: float | None = None,
        priority: int | None = None,
        mode: RetainMode | None = None,
    ) -> RetainResult:
        """See KVStoreClient.resume_session."""
        return await self._run(
            self._core.retain(session, RetainOp.RESUME, "", (), ttl_seconds=ttl_seconds, priority=priority, mode=mode)
        )

    async def replicate(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        source: str,
        *,
        layout: PageLayout | None = None,
        replicas: int = 0,
    ) -> ReplicateResult:
        """See KVStoreClient.replicate."""
        return await self._run(self._core.replicate(namespace, hashes, source, layout, replicas))


async def _blocking(op: Blocking) -> Any:
    """Run `op.fn` in a worker thread. When the caller is cancelled meanwhile, fire `op.abort` and wait for
    the thread to return before the cancellation goes on (Blocking's invariant): until then the call's
    memory (a receive block, the caller's buffer) may still be written, by the thread or by the node."""
    fut = asyncio.ensure_future(asyncio.to_thread(op.fn))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        op.abort.fire()
        for _ in range(_MAX_CANCEL_DEFERRALS):  # a caller cancelling again does not cut the wait short
            if fut.done():
                break
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([fut])
        if fut.done() and not fut.cancelled():
            fut.exception()  # retrieved: the thread's own error after an abort is expected, not news
        raise


_MAX_CANCEL_DEFERRALS = 10_000  # repeated cancels while waiting out an aborted thread (bounded loop)
