"""The node's gRPC API (kvstore.v1.KVStore): each method turns its request into a call on the caller's
tenant view, and its result into a response.

Handlers just raise: the interceptor (kvstore/node/interceptor.py) authenticates every call before its
request is read, hands the handler its caller (kvstore/node/callers.py) and maps every exception to its
status code. Values are validated by the manager; Put and Get run the node's one put and get drivers
(kvstore/node/drivers.py), like every other data plane.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.addresses import host_id, target_host
from kvstore.errors import InvalidArgument, PermissionDenied, ReplicationOff
from kvstore.layout import PageLayout
from kvstore.manager.state import check_hashes
from kvstore.names import RetainMode, RetainOp, TierKind
from kvstore.node.callers import Caller, current
from kvstore.node.drivers import drive_put, open_get
from kvstore.node.interceptor import SERVICE_NAME
from kvstore.node.limits import bounded
from kvstore.node.planes.streams import PutStream
from kvstore.node.report_budget import ReportBudget
from kvstore.pageformat import in_form
from kvstore.scoping import DEFAULT_TENANT
from kvstore.stats import PlaneInfo, ReplicationStatus
from kvstore.wire import MAX_HASHES, check_replicas, pack_held
from kvstore.wire.answers import lookup_to_pb, retain_result_to_pb, stats_to_pb
from kvstore.wire.streams import checksum_form_from_pb, enum_from_pb, get_responses, layout_from_pb, tier_from_pb


@dataclass(slots=True)
class Copied:
    """What a Replicate did (its response)."""

    copied: int = 0
    already_present: int = 0
    refused: int = 0
    failed: int = 0


class ReplicateHandler(Protocol):
    """What a Replicate does: (caller, namespace, hashes; the source node's id, the layout or None, replicas)
    -> what was copied. The last three are keyword-only."""

    def __call__(
        self,
        caller: Caller,
        namespace: str,
        hashes: list[bytes],
        *,
        source: str,
        layout: PageLayout | None,
        replicas: int,
    ) -> Awaitable[Copied]: ...


class KVStoreServicer:
    """kvstore.v1.KVStore on one node. `planes` is what Stats advertises (filled as planes start)."""

    def __init__(self, max_pages: int, planes: list[PlaneInfo]) -> None:
        self.max_pages = max_pages  # pages one Put or Get may name (max_pages_per_request; advertised in Stats)
        self.planes = planes
        self.report_budget = ReportBudget()  # pages each caller may have verified by its reports
        # Replication (kvstore/replication), where a layer above the node attached it: what a Replicate does,
        # and what Stats says of it. None: this node makes and takes no copies.
        self.replicate: ReplicateHandler | None = None
        self.replication: Callable[[], ReplicationStatus] | None = None

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        caller = current()
        if request.prefetch and not caller.may_move:
            raise PermissionDenied("Lookup with prefetch moves pages between tiers: it needs a read-write token")
        hashes = bounded(request.hashes, MAX_HASHES, "hashes")
        return lookup_to_pb(caller.view.lookup(request.namespace, hashes, prefetch=request.prefetch))

    async def Put(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> pb.PutResponse:
        """Requests arrive serialized (see `handlers`): chunks are copied once, into their slot."""
        caller = current()
        stream = PutStream(request_iterator)
        op = await stream.open()
        done = await drive_put(lambda: (caller, op), stream.heads(), stream, drain=False)
        return pb.PutResponse(stored=done.stored, already_present=done.present, held=pack_held(done.held))

    async def Get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Responses leave serialized (see `handlers`): each chunk is copied once, from its slot."""
        hashes = bounded(request.hashes, self.max_pages, "hashes")
        form = checksum_form_from_pb(request.checksum_form, "checksum_form")
        caller = current()
        expect = layout_from_pb(request.layout, "layout") if request.HasField("layout") else None
        async with open_get(
            caller, request.namespace, hashes, not request.no_promote, receiver_verifies=True, expect=expect
        ) as leases:
            async for lease in leases:
                checksum = in_form(lease.checksum, form, request.namespace, lease.hash)
                for msg in get_responses(lease.hash, lease.tier, checksum, lease.payload):
                    yield msg

    async def Delete(self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext) -> pb.DeleteResponse:
        hashes = bounded(request.hashes, MAX_HASHES, "hashes")
        deleted, not_found, busy = await current().view.delete(request.namespace, hashes)
        return pb.DeleteResponse(deleted=deleted, not_found=not_found, busy=busy)

    async def Pin(self, request: pb.PinRequest, context: grpc.aio.ServicerContext) -> pb.PinResponse:
        hashes = bounded(request.hashes, MAX_HASHES, "hashes")
        pinned, not_found = current().view.pin(request.namespace, hashes, request.ttl_seconds)
        return pb.PinResponse(pinned=pinned, not_found=not_found)

    async def Unpin(self, request: pb.UnpinRequest, context: grpc.aio.ServicerContext) -> pb.UnpinResponse:
        unpinned, not_pinned = current().view.unpin(request.namespace, bounded(request.hashes, MAX_HASHES, "hashes"))
        return pb.UnpinResponse(unpinned=unpinned, not_pinned=not_pinned)

    async def Prefetch(self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext) -> pb.PrefetchResponse:
        target = tier_from_pb(request.target_tier)
        if target is TierKind.NVME:
            raise InvalidArgument("target_tier", "prefetch promotes toward DRAM or HBM, not NVMe")
        hashes = bounded(request.hashes, MAX_HASHES, "hashes")
        scheduled, resident, missing = current().view.prefetch(request.namespace, hashes, target)
        return pb.PrefetchResponse(scheduled=scheduled, already_resident=resident, missing=missing)

    async def Report(self, request: pb.ReportRequest, context: grpc.aio.ServicerContext) -> pb.ReportResponse:
        hashes = bounded(request.hashes, MAX_HASHES, "hashes")
        caller = current()
        # NOTE: a token's subject, else the peer's host (its port changes with every connection).
        who = caller.principal.subject if caller.principal is not None else f"peer:{target_host(context.peer())}"
        res = await caller.view.report_corrupt(
            request.namespace, hashes, lambda n: self.report_budget.take(who, n, time.monotonic())
        )
        return pb.ReportResponse(dropped=res.dropped, intact=res.intact, unchecked=res.unchecked)

    async def Retain(self, request: pb.RetainRequest, context: grpc.aio.ServicerContext) -> pb.RetainResponse:
        """Retention hints of a session (DESIGN.md §6.5). A read-only caller never gets here (Retain is a write
        method: kvstore/security.py); the values are checked by the manager, each error naming its field."""
        hashes = bounded(request.hashes, MAX_HASHES, "hashes")
        res = current().view.retain(
            request.session,
            enum_from_pb(RetainOp, request.op, "op"),
            request.namespace,
            hashes,
            ttl_seconds=request.ttl_seconds if request.HasField("ttl_seconds") else None,
            priority=request.priority if request.HasField("priority") else None,
            mode=None if request.mode == pb.RETAIN_MODE_UNSPECIFIED else enum_from_pb(RetainMode, request.mode, "mode"),
        )
        return retain_result_to_pb(res)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        caller = current()
        stats = caller.view.stats()
        stats.planes = list(self.planes)
        stats.host_id = host_id()
        stats.max_pages_per_request = self.max_pages  # NOTE: clients cut their calls to fit (DESIGN.md §8)
        if self.replication is not None and caller.view.tenant == DEFAULT_TENANT:  # node-wide: the operator's
            stats.replication = self.replication()
        return stats_to_pb(stats)

    async def Replicate(self, request: pb.ReplicateRequest, context: grpc.aio.ServicerContext) -> pb.ReplicateResponse:
        """Take copies from another node (DESIGN.md §7.3), for the caller's tenant (a peer's: the one it names)."""
        hashes = bounded(request.hashes, self.max_pages, "hashes")
        if self.replicate is None:
            raise ReplicationOff("this node takes no copies (replication is off, or it has no index)")
        if not request.source:
            raise InvalidArgument("source", "the node to copy from is required")
        check_hashes(hashes, "hashes", self.max_pages)
        layout = layout_from_pb(request.layout, "layout") if request.HasField("layout") else None
        replicas = check_replicas(request.replicas, "replicas")
        res = await self.replicate(
            current(), request.namespace, hashes, source=request.source, layout=layout, replicas=replicas
        )
        return pb.ReplicateResponse(
            copied=res.copied, already_present=res.already_present, refused=res.refused, failed=res.failed
        )

    def handlers(self) -> grpc.GenericRpcHandler:
        """The service's method handlers. Same wire format as the generated ones, except that Put
        requests reach the servicer still serialized and Get responses leave already serialized, so
        bulk bytes skip protobuf's extra copy (kvstore.wire.streams.frame_chunk / parse_put_request)."""
        unary = {
            "Lookup": (self.Lookup, pb.LookupRequest, pb.LookupResponse),
            "Delete": (self.Delete, pb.DeleteRequest, pb.DeleteResponse),
            "Pin": (self.Pin, pb.PinRequest, pb.PinResponse),
            "Unpin": (self.Unpin, pb.UnpinRequest, pb.UnpinResponse),
            "Prefetch": (self.Prefetch, pb.PrefetchRequest, pb.PrefetchResponse),
            "Stats": (self.Stats, pb.StatsRequest, pb.StatsResponse),
            "Report": (self.Report, pb.ReportRequest, pb.ReportResponse),
            "Retain": (self.Retain, pb.RetainRequest, pb.RetainResponse),
            "Replicate": (self.Replicate, pb.ReplicateRequest, pb.ReplicateResponse),
        }
        # NOTE: the deserializers are not run by gRPC: the interceptor takes each request as raw bytes and
        # parses it after the token check and the method's size limit (kvstore/node/limits.py), so
        # undecodable bytes are INVALID_ARGUMENT naming the request (gRPC itself would answer UNKNOWN).
        methods = {
            name: grpc.unary_unary_rpc_method_handler(fn, req.FromString, resp.SerializeToString)
            for name, (fn, req, resp) in unary.items()
        }
        methods["Put"] = grpc.stream_unary_rpc_method_handler(self.Put, None, pb.PutResponse.SerializeToString)
        methods["Get"] = grpc.unary_stream_rpc_method_handler(self.Get, pb.GetRequest.FromString, None)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)
