"""Clients of a cache node: `KVStoreClient` (blocking) and `AsyncKVStoreClient` (asyncio).

Both speak the same wire framing (kvstore/wire.py) and raise the server's exception classes
(kvstore/errors.py): `InvalidArgument`, `NamespaceNotFound`, `ResourceExhausted`, ...

    with KVStoreClient("127.0.0.1:50051") as kv:
        hashes = prefix_hashes(tokens, layout.block_size, ns)
        kv.put(ns, layout, hashes, pages)          # pages: bytes-like, layout.page_bytes each
        n = kv.lookup(ns, hashes)                   # blocks of the longest stored prefix
        pages = kv.get(ns, hashes[:n])              # list of memoryview, checksum-verified

Batching: `put` sends up to `pages_per_stream` pages per Put stream (each stream is atomic);
`get` fetches any number of pages in streams of the same size, stopping at the first missing page.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import KVStoreError, ShmNotAvailable, from_status
from kvstore.layout import PageLayout
from kvstore.security import ClientSecurity
from kvstore.stats import LookupResult, NodeStats
from kvstore.tiers.base import TierKind
from kvstore.transport import shm
from kvstore.wire import MAX_MESSAGE_BYTES, Buffer, FetchedPage, GetAssembler, put_requests, stats_from_pb

T = TypeVar("T")

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
DEFAULT_PAGES_PER_STREAM = 256
SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"].full_name


@dataclass(slots=True)
class PutResult:
    stored: int
    already_present: int


@dataclass(slots=True)
class PinResult:
    done: int
    skipped: int


def _raise(err: grpc.RpcError) -> KVStoreError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    return from_status(code.name, err.details() or "")


def _bulk_methods(channel: grpc.Channel | grpc.aio.Channel) -> tuple[object, object]:
    """Put and Get callables that send/receive serialized messages, so page bytes skip protobuf's
    extra copy (kvstore.wire.put_requests / GetAssembler). Same wire format as the stub's."""
    put = channel.stream_unary(f"/{SERVICE}/Put", request_serializer=None,
                               response_deserializer=pb.PutResponse.FromString)  # fmt: skip
    get = channel.unary_stream(f"/{SERVICE}/Get", request_serializer=pb.GetRequest.SerializeToString,
                               response_deserializer=None)  # fmt: skip
    return put, get


def _batches(n: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(i + size, n)) for i in range(0, n, size)]


TRANSPORTS = ("auto", "grpc", "shm")


def _choose_transport(target: str, transport: str | None) -> tuple[str, shm.SegmentPool | None]:
    """(mode, segment pool or None). "auto" (default, or KVSTORE_TRANSPORT) uses shared memory when the
    node is on this host's loopback and /dev/shm exists, and falls back to gRPC streams for good if the
    node says it cannot (ShmNotAvailable); "shm" insists (errors surface); "grpc" never uses it."""
    mode = (transport or os.environ.get("KVSTORE_TRANSPORT") or "auto").lower()
    if mode not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {mode!r}")
    if mode == "grpc" or (mode == "auto" and not (shm.shm_available() and _is_loopback(target))):
        return mode, None
    if not shm.shm_available():
        raise ValueError("transport='shm' needs a writable /dev/shm on this host")
    return mode, shm.SegmentPool()


def _is_loopback(target: str) -> bool:
    host = target.removeprefix("ipv4:").removeprefix("ipv6:").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _open_channel(target: str, security: ClientSecurity, *, aio: bool) -> grpc.Channel | grpc.aio.Channel:
    options = CHANNEL_OPTIONS + security.channel_options()
    creds = security.channel_credentials()
    if aio:
        if creds is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, creds, options=options)
    if creds is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, creds, options=options)


class KVStoreClient:
    """Blocking client. Thread-safe (one channel, many concurrent calls)."""

    def __init__(self, target: str, *, timeout: float = 60.0, pages_per_stream: int = DEFAULT_PAGES_PER_STREAM,
                 verify: bool = True, security: ClientSecurity | None = None,
                 transport: str | None = None) -> None:  # fmt: skip
        self.target = target
        self.timeout = timeout
        self.pages_per_stream = pages_per_stream
        self.verify = verify
        self.security = ClientSecurity.from_env() if security is None else security
        self._md = self.security.metadata()
        self._channel = _open_channel(target, self.security, aio=False)
        self.transport, self._shm = _choose_transport(target, transport)
        self._shm_hint = shm.DEFAULT_PAGE_HINT  # bytes per page GetShm windows are sized for
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._put, self._get = _bulk_methods(self._channel)

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()
        if self._shm is not None:
            self._shm.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel connects (raises grpc.FutureTimeoutError after timeout)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def put(self, namespace: str, layout: PageLayout, hashes: Sequence[bytes], pages: Sequence[Buffer], *,
            target_tier: TierKind | None = None, parent: bytes | None = None, chain: bool = True) -> PutResult:  # fmt: skip
        """Store pages under their hashes. Each stream of up to pages_per_stream pages is atomic.

        chain: the hashes are consecutive blocks of one chain (as prefix_hashes gives them), `parent`
        the block before hashes[0] (None: hashes[0] starts the chain). Pass chain=False for unrelated
        pages. Only eviction quality depends on it.
        """
        if len(hashes) != len(pages):
            raise ValueError(f"{len(hashes)} hashes but {len(pages)} pages")
        if self._shm is not None:
            try:
                return self._put_shm(namespace, layout, hashes, pages, target_tier, parent, chain)
            except ShmNotAvailable as exc:
                self._no_shm(exc)
        total = PutResult(0, 0)
        try:
            for a, b in _batches(len(hashes), self.pages_per_stream):
                first_parent = parent if a == 0 else hashes[a - 1]
                r = self._put(put_requests(namespace, layout, hashes[a:b], pages[a:b], target_tier,
                                           parent=first_parent if chain else None, chain=chain),
                              timeout=self.timeout, metadata=self._md)  # fmt: skip
                total.stored += r.stored
                total.already_present += r.already_present
        except grpc.RpcError as err:
            raise _raise(err) from None
        return total

    def lookup_detail(self, namespace: str, hashes: Sequence[bytes], *, prefetch: bool = False) -> LookupResult:
        try:
            r = self._stub.Lookup(pb.LookupRequest(namespace=namespace, hashes=list(hashes), prefetch=prefetch),
                                  timeout=self.timeout, metadata=self._md)  # fmt: skip
        except grpc.RpcError as err:
            raise _raise(err) from None
        return LookupResult(r.matched_blocks, [TierKind(t) for t in r.tiers], r.namespace_known)

    def lookup(self, namespace: str, hashes: Sequence[bytes], *, prefetch: bool = False) -> int:
        """Number of leading blocks of the chain stored on the node."""
        return self.lookup_detail(namespace, hashes, prefetch=prefetch).matched

    def _no_shm(self, exc: ShmNotAvailable) -> None:
        """The node cannot use our segments: gRPC streams from now on (unless shm was insisted on)."""
        if self.transport == "shm":
            raise exc
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    def _put_shm(self, namespace: str, layout: PageLayout, hashes: Sequence[bytes], pages: Sequence[Buffer],
                 target_tier: TierKind | None, parent: bytes | None, chain: bool) -> PutResult:  # fmt: skip
        assert self._shm is not None
        ex = shm.put_exchange(self._shm, namespace, layout, hashes, pages, target_tier, parent, chain,
                              self.pages_per_stream)  # fmt: skip
        return PutResult(*self._drive(ex, self._stub.PutShm))

    def _get_pages_shm(self, namespace: str, hashes: Sequence[bytes], promote: bool) -> list[FetchedPage]:
        assert self._shm is not None
        ex = shm.get_exchange(self._shm, namespace, hashes, promote, self.verify, self.pages_per_stream,
                              self._shm_hint)  # fmt: skip
        pages, self._shm_hint = self._drive(ex, self._stub.GetShm)
        return pages

    def _drive(self, exchange: Generator[Any, Any, T], method: grpc.UnaryUnaryMultiCallable) -> T:
        """Run a transport exchange: send each request it yields, feed it the reply."""
        try:
            request = next(exchange)
            while True:
                request = exchange.send(self._call(method, request))
        except StopIteration as done:
            return done.value
        finally:
            exchange.close()

    def get_pages(self, namespace: str, hashes: Sequence[bytes], *, promote: bool = True) -> list[FetchedPage]:
        """Pages of the longest stored prefix of `hashes`, with the tier each came from."""
        if self._shm is not None and hashes:
            try:
                return self._get_pages_shm(namespace, hashes, promote)
            except ShmNotAvailable as exc:
                self._no_shm(exc)
        out: list[FetchedPage] = []
        for a, b in _batches(len(hashes), self.pages_per_stream):
            asm = GetAssembler(hashes[a:b], self.verify)
            req = pb.GetRequest(namespace=namespace, hashes=list(hashes[a:b]), no_promote=not promote)
            try:
                for msg in self._get(req, timeout=self.timeout, metadata=self._md):
                    asm.feed(msg)
            except grpc.RpcError as err:
                raise _raise(err) from None
            got = asm.finish()
            out.extend(got)
            if len(got) < b - a:
                break
        return out

    def get(self, namespace: str, hashes: Sequence[bytes], *, promote: bool = True) -> list[memoryview]:
        """Payloads of the longest stored prefix of `hashes`, in order (checksum-verified)."""
        return [memoryview(p.data) for p in self.get_pages(namespace, hashes, promote=promote)]

    def delete(self, namespace: str, hashes: Sequence[bytes]) -> pb.DeleteResponse:
        return self._call(self._stub.Delete, pb.DeleteRequest(namespace=namespace, hashes=list(hashes)))

    def pin(self, namespace: str, hashes: Sequence[bytes], *, ttl_seconds: float = 0.0) -> PinResult:
        r = self._call(self._stub.Pin, pb.PinRequest(namespace=namespace, hashes=list(hashes), ttl_seconds=ttl_seconds))
        return PinResult(r.pinned, r.not_found)

    def unpin(self, namespace: str, hashes: Sequence[bytes]) -> PinResult:
        r = self._call(self._stub.Unpin, pb.UnpinRequest(namespace=namespace, hashes=list(hashes)))
        return PinResult(r.unpinned, r.not_pinned)

    def prefetch(self, namespace: str, hashes: Sequence[bytes], *, target_tier: TierKind = TierKind.DRAM) -> pb.PrefetchResponse:
        req = pb.PrefetchRequest(namespace=namespace, hashes=list(hashes), target_tier=int(target_tier))
        return self._call(self._stub.Prefetch, req)

    def stats(self) -> NodeStats:
        return stats_from_pb(self._call(self._stub.Stats, pb.StatsRequest()))

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: object) -> object:
        try:
            return method(request, timeout=self.timeout, metadata=self._md)
        except grpc.RpcError as err:
            raise _raise(err) from None


class AsyncKVStoreClient:
    """asyncio twin of KVStoreClient, same methods, awaitable. Create and use it inside one event loop."""

    def __init__(self, target: str, *, timeout: float = 60.0, pages_per_stream: int = DEFAULT_PAGES_PER_STREAM,
                 verify: bool = True, security: ClientSecurity | None = None,
                 transport: str | None = None) -> None:  # fmt: skip
        self.target = target
        self.timeout = timeout
        self.pages_per_stream = pages_per_stream
        self.verify = verify
        self.security = ClientSecurity.from_env() if security is None else security
        self._md = self.security.metadata()
        self._channel = _open_channel(target, self.security, aio=True)
        self.transport, self._shm = _choose_transport(target, transport)
        self._shm_hint = shm.DEFAULT_PAGE_HINT  # bytes per page GetShm windows are sized for
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._put, self._get = _bulk_methods(self._channel)

    async def __aenter__(self) -> AsyncKVStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()
        if self._shm is not None:
            self._shm.close()

    async def put(self, namespace: str, layout: PageLayout, hashes: Sequence[bytes], pages: Sequence[Buffer], *,
                  target_tier: TierKind | None = None, parent: bytes | None = None,
                  chain: bool = True) -> PutResult:  # fmt: skip
        if len(hashes) != len(pages):
            raise ValueError(f"{len(hashes)} hashes but {len(pages)} pages")
        if self._shm is not None:
            try:
                return await self._put_shm(namespace, layout, hashes, pages, target_tier, parent, chain)
            except ShmNotAvailable as exc:
                self._no_shm(exc)
        total = PutResult(0, 0)
        try:
            for a, b in _batches(len(hashes), self.pages_per_stream):
                first_parent = parent if a == 0 else hashes[a - 1]
                r = await self._put(put_requests(namespace, layout, hashes[a:b], pages[a:b], target_tier,
                                                 parent=first_parent if chain else None, chain=chain),
                                    timeout=self.timeout, metadata=self._md)  # fmt: skip
                total.stored += r.stored
                total.already_present += r.already_present
        except grpc.RpcError as err:
            raise _raise(err) from None
        return total

    async def lookup_detail(self, namespace: str, hashes: Sequence[bytes], *, prefetch: bool = False) -> LookupResult:
        r = await self._call(self._stub.Lookup, pb.LookupRequest(namespace=namespace, hashes=list(hashes), prefetch=prefetch))
        return LookupResult(r.matched_blocks, [TierKind(t) for t in r.tiers], r.namespace_known)

    async def lookup(self, namespace: str, hashes: Sequence[bytes], *, prefetch: bool = False) -> int:
        return (await self.lookup_detail(namespace, hashes, prefetch=prefetch)).matched

    def _no_shm(self, exc: ShmNotAvailable) -> None:
        if self.transport == "shm":
            raise exc
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    async def _put_shm(self, namespace: str, layout: PageLayout, hashes: Sequence[bytes], pages: Sequence[Buffer],
                       target_tier: TierKind | None, parent: bytes | None, chain: bool) -> PutResult:  # fmt: skip
        assert self._shm is not None
        ex = shm.put_exchange(self._shm, namespace, layout, hashes, pages, target_tier, parent, chain,
                              self.pages_per_stream)  # fmt: skip
        return PutResult(*await self._drive(ex, self._stub.PutShm))

    async def _get_pages_shm(self, namespace: str, hashes: Sequence[bytes], promote: bool) -> list[FetchedPage]:
        assert self._shm is not None
        ex = shm.get_exchange(self._shm, namespace, hashes, promote, self.verify, self.pages_per_stream,
                              self._shm_hint)  # fmt: skip
        pages, self._shm_hint = await self._drive(ex, self._stub.GetShm)
        return pages

    async def _drive(self, exchange: Generator[Any, Any, T], method: grpc.aio.UnaryUnaryMultiCallable) -> T:
        try:
            request = next(exchange)
            while True:
                request = exchange.send(await self._call(method, request))
        except StopIteration as done:
            return done.value
        finally:
            exchange.close()

    async def get_pages(self, namespace: str, hashes: Sequence[bytes], *, promote: bool = True) -> list[FetchedPage]:
        if self._shm is not None and hashes:
            try:
                return await self._get_pages_shm(namespace, hashes, promote)
            except ShmNotAvailable as exc:
                self._no_shm(exc)
        out: list[FetchedPage] = []
        for a, b in _batches(len(hashes), self.pages_per_stream):
            asm = GetAssembler(hashes[a:b], self.verify)
            req = pb.GetRequest(namespace=namespace, hashes=list(hashes[a:b]), no_promote=not promote)
            try:
                async for msg in self._get(req, timeout=self.timeout, metadata=self._md):
                    asm.feed(msg)
            except grpc.RpcError as err:
                raise _raise(err) from None
            got = asm.finish()
            out.extend(got)
            if len(got) < b - a:
                break
        return out

    async def get(self, namespace: str, hashes: Sequence[bytes], *, promote: bool = True) -> list[memoryview]:
        return [memoryview(p.data) for p in await self.get_pages(namespace, hashes, promote=promote)]

    async def delete(self, namespace: str, hashes: Sequence[bytes]) -> pb.DeleteResponse:
        return await self._call(self._stub.Delete, pb.DeleteRequest(namespace=namespace, hashes=list(hashes)))

    async def pin(self, namespace: str, hashes: Sequence[bytes], *, ttl_seconds: float = 0.0) -> PinResult:
        r = await self._call(self._stub.Pin, pb.PinRequest(namespace=namespace, hashes=list(hashes), ttl_seconds=ttl_seconds))
        return PinResult(r.pinned, r.not_found)

    async def unpin(self, namespace: str, hashes: Sequence[bytes]) -> PinResult:
        r = await self._call(self._stub.Unpin, pb.UnpinRequest(namespace=namespace, hashes=list(hashes)))
        return PinResult(r.unpinned, r.not_pinned)

    async def prefetch(self, namespace: str, hashes: Sequence[bytes], *, target_tier: TierKind = TierKind.DRAM) -> pb.PrefetchResponse:
        req = pb.PrefetchRequest(namespace=namespace, hashes=list(hashes), target_tier=int(target_tier))
        return await self._call(self._stub.Prefetch, req)

    async def stats(self) -> NodeStats:
        return stats_from_pb(await self._call(self._stub.Stats, pb.StatsRequest()))

    async def _call(self, method: grpc.aio.UnaryUnaryMultiCallable, request: object) -> object:
        try:
            return await method(request, timeout=self.timeout, metadata=self._md)
        except grpc.RpcError as err:
            raise _raise(err) from None
