"""`KVStoreClient` (blocking) and `AsyncKVStoreClient` (asyncio, kvstore/client/aio.py): two drivers of one
ClientCore, on one `BaseClient`.

Each public method runs one of the core's exchanges (kvstore/client/core.py); the classes differ only in
how an operation is performed: on the caller's thread, or awaited on its event loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.client.bundles import Parts
from kvstore.client.core import (
    DEFAULT_PAGES_PER_CALL,
    ClientCore,
    ClientSettings,
    PinResult,
    PutResult,
    ReplicateResult,
    put_open,
)
from kvstore.client.exchange import Blocking, ClientStream, Exchange, Op, Outcome, ServerStream, Unary, advance
from kvstore.client.grpc_channel import bind_methods, open_channel, rpc_error
from kvstore.client.planes.pool import ReceivePool
from kvstore.client.planes.segments import SharedBuffer
from kvstore.errors import Unavailable
from kvstore.layout import PageLayout
from kvstore.names import Buffer, RetainMode, RetainOp, TierKind
from kvstore.security import ClientSecurity
from kvstore.stats import LookupResult, NodeStats, RetainResult
from kvstore.wire.streams import FetchedPage, PageRef

T = TypeVar("T")


class BaseClient:
    """What both clients hold: the target, credentials, a channel, its method table and the core. A subclass
    says which channel it drives (`_AIO`) and how it runs an exchange (`_run`)."""

    _AIO: ClassVar[bool]  # which channel the subclass drives: grpc.aio (awaited) or blocking

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 60.0,
        pages_per_call: int = DEFAULT_PAGES_PER_CALL,
        verify: bool = True,
        security: ClientSecurity | None = None,
        transport: str | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.security = ClientSecurity.from_env() if security is None else security
        self.security.check_target(target)  # never a token where nothing proves who answers (SECURITY.md)
        self._md = self.security.metadata()
        self._channel = open_channel(target, self.security, aio=self._AIO)
        self._methods = bind_methods(self._channel)
        settings = ClientSettings(target, pages_per_call, verify, self.security, timeout)
        if self.security.acting_for is not None or self.security.copies:
            # NOTE: a node acting for a tenant (or pulling copies) says so in gRPC metadata, which the other
            # planes' handshakes do not carry: on them it would be the default tenant.
            if transport not in (None, "grpc"):
                raise ValueError(f"transport={transport!r}: a peer acting for a tenant or pulling copies uses grpc")
            transport = "grpc"
        self._core = ClientCore(settings, transport)

    @property
    def transport(self) -> str:
        """The transport asked for: "auto", or one plane's name."""
        return self._core.transport

    @property
    def plane(self) -> str | None:
        """The data plane page bytes travel on now; None until the first bulk call negotiated it."""
        return self._core.plane

    @property
    def call_pages(self) -> int | None:
        """Pages one call names on the plane in use: `pages_per_call`, capped at the node's max_pages_per_request
        as its Stats advertise it (DESIGN.md §8), which the first bulk call reads; None until a plane is chosen."""
        active = self._core.active
        return None if active is None else active.call_pages

    @property
    def corrupt_pages(self) -> int:
        """Pages that failed their checksum on arrival so far (each a miss, reported to the node)."""
        return self._core.corrupt_pages

    def _call(self, op: Unary | ClientStream | ServerStream) -> Any:
        """Start the RPC `op` names: its response (awaitable on the asyncio channel), or for a server stream
        its messages (an async iterator there)."""
        method = self._methods[op.method]
        request = iter(op.requests) if isinstance(op, ClientStream) else op.request
        return method(request, timeout=self.timeout, metadata=self._md)

    @property
    def receive_pool(self) -> ReceivePool:
        """The pooled memory plain gets land in (kvstore/client/planes/pool.py): `free_bytes` and
        `mapped_bytes` say how much of it is mapped and how much is neither out nor lent to a node."""
        return self._core.settings.received

    def shared_buffer(self, nbytes: int) -> SharedBuffer:
        """Staging memory registered with this client (a /dev/shm segment), for zero-copy `get_into` and
        `put_from`: on the node's host the node writes pages straight into it and reads them straight out.
        Cut it with `.pages(page_bytes)`; free it with `.close()` (closing the client closes it too)."""
        return self._core.shared_buffer(nbytes)


class KVStoreClient(BaseClient):
    """Blocking client. Thread-safe (one channel, many concurrent calls).

        with KVStoreClient("127.0.0.1:50051") as kv:
            hashes = prefix_hashes(tokens, layout.block_size, ns)
            kv.put(ns, layout, hashes, pages)          # pages: bytes-like, layout.page_bytes each
            n = kv.lookup(ns, hashes)                   # blocks of the longest stored prefix
            pages = kv.get(ns, hashes[:n])              # list of memoryview, checksum-verified

    Batching: `put` sends up to `pages_per_call` pages per call (each call is atomic); `get` fetches any
    number of pages in calls of the same size, stopping at the first missing page. A call is never cut larger
    than the node accepts: the node's Stats advertise its `max_pages_per_request`, and every plane's calls are
    capped at it (DESIGN.md §8). Errors are the server's exception classes (kvstore/errors.py).
    """

    _AIO = False

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()
        self._core.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel connects; Unavailable (a KVStoreError, like every error of this client)
        when it has not within `timeout` seconds."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"{self.target}: no connection within {timeout:g} s") from None

    def _run(self, exchange: Exchange[T]) -> T:
        """Perform each operation the exchange yields; errors are thrown back into it at the yield."""
        with contextlib.closing(exchange):
            op, value = advance(exchange)
            while op is not None:
                op, value = advance(exchange, *self._perform(op))
            return value  # type: ignore[return-value]

    def _perform(self, op: Op) -> Outcome:
        try:
            if isinstance(op, Blocking):
                return op.fn(), None
            if not isinstance(op, ServerStream):
                return self._call(op), None
            for msg in self._call(op):
                op.sink(msg)
            return None, None
        except Exception as exc:
            return failed(exc)

    def put(
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
        """Store pages under their hashes. Each call of up to pages_per_call pages (at most the node's
        max_pages_per_request) is atomic.

        chain: the hashes are consecutive blocks of one chain (as prefix_hashes gives them), `parent`
        the block before hashes[0] (None: hashes[0] starts the chain). Pass chain=False for unrelated
        pages. Only eviction quality depends on it.

        replicas: copies the cluster should keep of these pages on distinct nodes (0..16; 0 or 1: as many as
        their reads ask for): for prefixes that must survive a node's loss. A node in a cluster with replication
        on copies them to other nodes (and again when a holder is lost); a standalone node ignores it.
        """
        op = put_open(namespace, layout, target_tier=target_tier, parent=parent, chain=chain, replicas=replicas)
        return self._run(self._core.put(op, hashes, pages))

    def lookup_detail(self, namespace: str, hashes: Sequence[bytes], *, prefetch: bool = False) -> LookupResult:
        return self._run(self._core.lookup_detail(namespace, hashes, prefetch))

    def lookup(self, namespace: str, hashes: Sequence[bytes], *, prefetch: bool = False) -> int:
        """Number of leading blocks of the chain stored on the node."""
        return self._run(self._core.lookup(namespace, hashes, prefetch))

    def get_pages(self, namespace: str, hashes: Sequence[bytes], *, promote: bool = True) -> list[FetchedPage]:
        """Pages of the longest stored prefix of `hashes`, with the tier each came from."""
        return self._run(self._core.get_pages(namespace, hashes, promote))

    def get(self, namespace: str, hashes: Sequence[bytes], *, promote: bool = True) -> list[memoryview]:
        """Payloads of the longest stored prefix of `hashes`, in order (checksum-verified)."""
        return self._run(self._core.get(namespace, hashes, promote))

    def get_into(
        self, namespace: str, hashes: Sequence[bytes], buffers: Sequence[Buffer], *, promote: bool = True
    ) -> list[PageRef]:
        """Write the pages of the longest stored prefix of `hashes` into `buffers` (page i into buffers[i]);
        returns what landed, in order (buffers past it are untouched or undefined).

        buffers: one per hash, writable, C-contiguous, not overlapping, each at least a page. On the node's
        host (the shm plane) they must lie in a `shared_buffer` of this client: the node copies each page
        once, from its tier into your memory, verified by the one checksum of that tier read. Elsewhere
        any writable buffers do, and the pages are copied in once on arrival, verified. Bad buffers raise
        ValueError naming `buffers[i]` before anything is written.
        """
        return self._run(self._core.get_into(namespace, hashes, buffers, promote))

    def put_from(
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
        """`put` of pages lying in `buffers` (one per hash, each exactly layout.page_bytes). On the node's host
        they must lie in a `shared_buffer` of this client: the node copies each page once, into its slot,
        and checksums it there; the client touches no byte. Elsewhere it is `put`."""
        op = put_open(namespace, layout, target_tier=target_tier, parent=parent, chain=chain, replicas=replicas)
        return self._run(self._core.put_from(op, hashes, buffers))

    def put_bundle(
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
        """Store multi-part pages (DESIGN.md §4.3): `layout` a bundle (PageLayout.bundle), pages[i] a mapping of
        every part name to its buffer (or list of regions, in order). Each page, all of its parts, is stored or
        not at all; the node checks the parts against the namespace's (LayoutMismatch naming the part) and
        counts the page once. Bad parts raise ValueError naming `pages[i][part]` before anything is sent. `replicas`:
        as for put."""
        op = put_open(namespace, layout, target_tier=target_tier, parent=parent, chain=chain, replicas=replicas)
        return self._run(self._core.put_bundle(op, hashes, pages))

    def get_bundle(
        self, namespace: str, layout: PageLayout, hashes: Sequence[bytes], *, promote: bool = True
    ) -> list[dict[str, memoryview]]:
        """Multi-part pages of the longest stored prefix of `hashes`, each as {part name: view of its bytes}
        (verified; no copy). A namespace holding another bundle is LayoutMismatch naming the part."""
        return self._run(self._core.get_bundle(namespace, layout, hashes, promote))

    def get_bundle_into(
        self,
        namespace: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        pages: Sequence[Parts],
        *,
        promote: bool = True,
    ) -> list[PageRef]:
        """Multi-part pages of the longest stored prefix of `hashes`, each part written into pages[i][part] (a
        writable buffer or list of regions); returns what landed, in order. All parts of a page land, or the
        page is not in the result."""
        return self._run(self._core.get_bundle_into(namespace, layout, hashes, pages, promote))

    def delete(self, namespace: str, hashes: Sequence[bytes]) -> pb.DeleteResponse:
        return self._run(self._core.delete(namespace, hashes))

    def pin(self, namespace: str, hashes: Sequence[bytes], *, ttl_seconds: float = 0.0) -> PinResult:
        return self._run(self._core.pin(namespace, hashes, ttl_seconds))

    def unpin(self, namespace: str, hashes: Sequence[bytes]) -> PinResult:
        return self._run(self._core.unpin(namespace, hashes))

    def prefetch(
        self, namespace: str, hashes: Sequence[bytes], *, target_tier: TierKind = TierKind.DRAM
    ) -> pb.PrefetchResponse:
        return self._run(self._core.prefetch(namespace, hashes, target_tier))

    def stats(self) -> NodeStats:
        return self._run(self._core.stats())

    # -- retention (DESIGN.md §6.5): a session's pages kept through its pauses; see RetainRequest in the proto

    def retain(
        self,
        session: str,
        namespace: str,
        hashes: Sequence[bytes],
        *,
        ttl_seconds: float | None = None,
        priority: int | None = None,
        mode: RetainMode | None = None,
    ) -> RetainResult:
        """Retain the pages `hashes` of `namespace` for `session` (created when new: `ttl_seconds` required; a
        session id is yours to choose, scoped to your tenant). Pages not stored yet are retained once put.
        `priority` 0..100 (default 50): at your tenant's cap lower priorities give way; `mode` HOLD (default: kept
        where they are) or DEMOTE (demote, don't drop). ResourceExhausted names the cap when no lower-priority
        session can make room (nothing changed)."""
        return self._run(
            self._core.retain(
                session, RetainOp.RETAIN, namespace, hashes, ttl_seconds=ttl_seconds, priority=priority, mode=mode
            )
        )

    def update_session(
        self,
        session: str,
        *,
        ttl_seconds: float | None = None,
        priority: int | None = None,
        mode: RetainMode | None = None,
    ) -> RetainResult:
        """Raise or lower a session's priority, renew or shorten its lease, change its mode (what is None stays);
        SessionNotFound when your tenant has no such session here."""
        return self._run(
            self._core.retain(session, RetainOp.UPDATE, "", (), ttl_seconds=ttl_seconds, priority=priority, mode=mode)
        )

    def release_pages(self, session: str, namespace: str, hashes: Sequence[bytes]) -> RetainResult:
        """Stop retaining these pages for `session` (held still where another session retains them)."""
        return self._run(self._core.retain(session, RetainOp.RELEASE, namespace, hashes))

    def end_session(self, session: str) -> RetainResult:
        """The session ended: every page it retained is released (evictable as any other)."""
        return self._run(self._core.retain(session, RetainOp.END))

    def resume_session(
        self,
        session: str,
        *,
        ttl_seconds: float | None = None,
        priority: int | None = None,
        mode: RetainMode | None = None,
    ) -> RetainResult:
        """The session's next turn arrives: its pages are promoted back toward DRAM in the background (after the
        given lease, priority or mode apply); `prefetching` says how many promotions started."""
        return self._run(
            self._core.retain(session, RetainOp.RESUME, "", (), ttl_seconds=ttl_seconds, priority=priority, mode=mode)
        )

    def replicate(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        source: str,
        *,
        layout: PageLayout | None = None,
        replicas: int = 0,
    ) -> ReplicateResult:
        """Have this node take copies of pages node `source` holds (it pulls them, verifies and stores them; a
        copy never evicts: pages past its free room are refused). Your own tenant's pages only."""
        return self._run(self._core.replicate(namespace, hashes, source, layout, replicas))


def failed(exc: Exception) -> Outcome:
    """An operation's error as the exchange sees it, under KVStoreError (kvstore/errors.py): a failed RPC
    becomes the server's exception class, a failed socket or file operation Unavailable."""
    if isinstance(exc, grpc.RpcError):
        return None, rpc_error(exc)
    if isinstance(exc, OSError):
        return None, Unavailable(f"{type(exc).__name__}: {exc}")
    return None, exc
