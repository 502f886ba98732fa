"""The cache node's gRPC server (grpc.aio): request validation, stream framing, status codes.

One interceptor (`ErrorInterceptor`, kvstore/interceptor.py) authenticates every call before its
request is read and turns every kvstore exception into its gRPC status code, so handlers just raise. Health (grpc.health.v1) and reflection are served beside kvstore.v1.KVStore.
SIGTERM/SIGINT: health goes NOT_SERVING, in-flight RPCs get `grace_seconds`, then the manager spills
DRAM pages to NVMe (bounded) and closes, so a restart on the same --nvme-path is warm.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.admission import (
    MAX_RECEIVE_BYTES,
    bounded,
    check_count,
    may_move_pages,
    tenant_of_caller,
)
from kvstore.config import NodeConfig
from kvstore.errors import InvalidArgument, PermissionDenied, ShmNotAvailable
from kvstore.index.publisher import IndexPublisher
from kvstore.interceptor import SERVICE_NAME, ErrorInterceptor
from kvstore.kv_events import KvEventPublisher
from kvstore.kv_events import start_for_node as start_kv_events
from kvstore.manager import TierManager
from kvstore.manager.core import MAX_HASHES
from kvstore.manager.tenants import TenantView
from kvstore.memtune import tune_malloc_for_bulk_io
from kvstore.metrics import NodeMetrics
from kvstore.names import TierKind
from kvstore.pageformat import align_up
from kvstore.security import TokenAuthenticator, redact_url, server_credentials
from kvstore.stats import PlaneInfo, planes_to_json
from kvstore.tenancy import TenantBinder, load_tenants_file, share_slots
from kvstore.transport.planes import host_id
from kvstore.transport.serving import NodeServices, PlaneServer, build_plane_servers
from kvstore.transport.shm import shm_available
from kvstore.transport.shm.node import MappedSegment, NodeSegment, SegmentAttachments
from kvstore.wire import (
    MAX_MESSAGE_BYTES,
    PutChunk,
    PutPageHeader,
    PutParser,
    get_responses,
    layout_from_pb,
    stats_to_pb,
    tier_from_pb,
)

log = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),  # the largest request a method accepts
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


class KVStoreServicer(pb_grpc.KVStoreServicer):
    """Translates messages to TierManager calls. Validation of values lives in the manager; framing of
    the Put stream (order, sizes, truncation) lives here."""

    def __init__(self, manager: TierManager, shm: SegmentAttachments | None = None,
                 planes: list[PlaneInfo] | None = None) -> None:  # fmt: skip
        self.manager = manager
        self.shm = shm  # None: the shared-memory data plane is off on this node
        self.planes = planes if planes is not None else []  # advertised in Stats (filled as planes start)
        self.max_pages = manager.config.max_pages_per_request

    @property
    def mgr(self) -> TenantView:
        """The manager in the calling tenant's scope: every namespace of a request goes through it."""
        return self.manager.scoped(tenant_of_caller())

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        if request.prefetch and not may_move_pages():
            raise PermissionDenied("Lookup with prefetch moves pages between tiers: it needs a read-write token")
        res = self.mgr.lookup(request.namespace, bounded(request.hashes, MAX_HASHES, "hashes"), prefetch=request.prefetch)
        return pb.LookupResponse(
            matched_blocks=res.matched, tiers=[int(t) for t in res.tiers], namespace_known=res.namespace_known
        )

    async def Put(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> pb.PutResponse:
        """Requests arrive serialized (see `handlers`): chunks are copied once, into their slot."""
        parser = PutParser()
        txn = None
        view: memoryview | None = None
        try:
            async for raw in request_iterator:
                msg = parser.feed(raw)
                if isinstance(msg, PutChunk):
                    if view is not None:  # None: the page is stored already, its bytes are dropped
                        view[msg.offset : msg.offset + len(msg.data)] = msg.data
                elif isinstance(msg, PutPageHeader):
                    if view is not None:
                        view.release()
                    view = await txn.add_page(msg.hash, msg.payload_bytes, msg.checksum)  # type: ignore[union-attr]
                else:
                    txn = self.mgr.begin_put(msg.namespace, layout_from_pb(msg.layout),
                                             tier_from_pb(msg.target_tier, field="open.target_tier"),
                                             msg.parent_hash or None, msg.chain)  # fmt: skip
            parser.finish()
            assert txn is not None
            stored, present = await txn.commit()
            return pb.PutResponse(stored=stored, already_present=present)
        finally:
            if view is not None:
                view.release()
            if txn is not None and not txn.done:
                txn.abort()

    async def Get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Responses leave serialized (see `handlers`): each chunk is copied once, from its slot."""
        leases = self.mgr.get(request.namespace, bounded(request.hashes, self.max_pages, "hashes"),
                              promote=not request.no_promote and may_move_pages())  # fmt: skip
        try:
            async for lease in leases:
                for msg in get_responses(lease.hash, lease.tier, lease.checksum, lease.payload):
                    yield msg
        finally:
            await leases.aclose()

    def _segment(self, region: pb.ShmRegion) -> NodeSegment:
        if self.shm is None:
            raise ShmNotAvailable("this node runs without the shared-memory data plane; use Put/Get")
        if region.pid:
            return self.shm.acquire_memfd(region.pid, region.fd, region.nonce, region.name)
        return self.shm.acquire(region.name, region.nonce)

    async def PutShm(self, request: pb.PutShmRequest, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        """Put whose page bytes lie in the caller's segment: one copy per page, segment -> slot; the
        checksum is the one the transaction takes of the slot (checked against a declared one, if any)."""
        if not request.HasField("open"):
            raise InvalidArgument("open", "PutShm needs `open` (namespace and layout)")
        if not request.pages:
            raise InvalidArgument("pages", "PutShm with no pages")
        check_count(request.pages, self.max_pages, "pages")
        seg = self._segment(request.region)
        txn = None
        try:
            for i, p in enumerate(request.pages):  # bounds first: a bad slice must leave the node unchanged
                seg.check(p.offset, p.payload_bytes, f"pages[{i}]")
            op = request.open
            txn = self.mgr.begin_put(op.namespace, layout_from_pb(op.layout),
                                     tier_from_pb(op.target_tier, field="open.target_tier"),
                                     op.parent_hash or None, op.chain)  # fmt: skip
            for i, p in enumerate(request.pages):
                dst = await txn.add_page(p.hash, p.payload_bytes, p.checksum)
                if dst is not None:
                    try:
                        seg.read_into(p.offset, dst, f"pages[{i}]")
                    finally:
                        dst.release()
            stored, present = await txn.commit()
            return pb.PutResponse(stored=stored, already_present=present)
        finally:
            seg.release()
            if txn is not None and not txn.done:
                txn.abort()

    async def GetShm(self, request: pb.GetShmRequest, context: grpc.aio.ServicerContext) -> pb.GetShmResponse:
        """Get into the caller's segment: one copy per page, from its slot (or tier read) to the segment.
        Pages go back to back into the window [offset, offset + size), or, with `targets` (zero-copy
        get_into), page i into targets[i], all checked before the first page is read. Into a registered
        (mapped) buffer the reader copies each page itself, verifying it in the same pass."""
        seg = self._segment(request.region)
        windows: list[memoryview] = []
        try:
            places: list[int] | None = None
            if request.targets:
                page_bytes = self.mgr.layout_of(request.namespace).page_bytes
                places = seg.targets(request.targets, len(request.hashes), page_bytes)
                if isinstance(seg, MappedSegment):
                    windows = [seg.window(o, page_bytes) for o in places]
            else:
                seg.check(request.offset, request.size, "size")
            out = pb.GetShmResponse()
            pos, end = request.offset, request.offset + request.size
            leases = self.mgr.get(request.namespace, bounded(request.hashes, self.max_pages, "hashes"),
                                  promote=not request.no_promote and may_move_pages(), into=windows or None)  # fmt: skip
            try:
                async for lease in leases:
                    n = len(lease.payload)
                    if places is not None:
                        pos = places[len(out.pages)]
                    elif pos + n > end:
                        out.next_page_bytes = n
                        break
                    if not windows:  # else the reader has copied it there already
                        seg.write(pos, lease.payload)
                    out.pages.add(hash=lease.hash, offset=pos, payload_bytes=n, checksum=lease.checksum,
                                  tier=int(lease.tier))  # fmt: skip
                    pos = align_up(pos + n)
            finally:
                await leases.aclose()
            return out
        finally:
            for w in windows:
                w.release()
            seg.release()

    def handlers(self) -> grpc.GenericRpcHandler:
        """The service's method handlers. Same wire format as the generated ones, except that Put
        requests reach the servicer still serialized and Get responses leave already serialized, so
        bulk bytes skip protobuf's extra copy (kvstore.wire.frame_chunk / parse_put_request)."""
        unary = {
            "Lookup": (self.Lookup, pb.LookupRequest, pb.LookupResponse),
            "Delete": (self.Delete, pb.DeleteRequest, pb.DeleteResponse),
            "Pin": (self.Pin, pb.PinRequest, pb.PinResponse),
            "Unpin": (self.Unpin, pb.UnpinRequest, pb.UnpinResponse),
            "Prefetch": (self.Prefetch, pb.PrefetchRequest, pb.PrefetchResponse),
            "Stats": (self.Stats, pb.StatsRequest, pb.StatsResponse),
            "PutShm": (self.PutShm, pb.PutShmRequest, pb.PutResponse),
            "GetShm": (self.GetShm, pb.GetShmRequest, pb.GetShmResponse),
        }
        # NOTE: the deserializers are not run by gRPC: the interceptor takes each request as raw bytes and
        # parses it after the token check and the method's size limit (kvstore/admission.py), so undecodable
        # bytes are INVALID_ARGUMENT naming the request (gRPC itself would answer UNKNOWN).
        methods = {
            name: grpc.unary_unary_rpc_method_handler(fn, req.FromString, resp.SerializeToString)
            for name, (fn, req, resp) in unary.items()
        }
        methods["Put"] = grpc.stream_unary_rpc_method_handler(self.Put, None, pb.PutResponse.SerializeToString)
        methods["Get"] = grpc.unary_stream_rpc_method_handler(self.Get, pb.GetRequest.FromString, None)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)

    async def Delete(self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext) -> pb.DeleteResponse:
        deleted, not_found, busy = await self.mgr.delete(request.namespace, bounded(request.hashes, MAX_HASHES, "hashes"))
        return pb.DeleteResponse(deleted=deleted, not_found=not_found, busy=busy)

    async def Pin(self, request: pb.PinRequest, context: grpc.aio.ServicerContext) -> pb.PinResponse:
        pinned, not_found = self.mgr.pin(request.namespace, bounded(request.hashes, MAX_HASHES, "hashes"), request.ttl_seconds)
        return pb.PinResponse(pinned=pinned, not_found=not_found)

    async def Unpin(self, request: pb.UnpinRequest, context: grpc.aio.ServicerContext) -> pb.UnpinResponse:
        unpinned, not_pinned = self.mgr.unpin(request.namespace, bounded(request.hashes, MAX_HASHES, "hashes"))
        return pb.UnpinResponse(unpinned=unpinned, not_pinned=not_pinned)

    async def Prefetch(self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext) -> pb.PrefetchResponse:
        target = tier_from_pb(request.target_tier)
        if target is TierKind.NVME:
            raise InvalidArgument("target_tier", "prefetch promotes toward DRAM or HBM, not NVMe")
        scheduled, resident, missing = self.mgr.prefetch(request.namespace, bounded(request.hashes, MAX_HASHES, "hashes"), target)
        return pb.PrefetchResponse(scheduled=scheduled, already_resident=resident, missing=missing)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        stats = self.mgr.stats()
        stats.planes = list(self.planes)
        stats.host_id = host_id()
        return stats_to_pb(stats)


class Node:
    """A running cache node: manager + gRPC server. `start()`, then `wait()` or `stop()`."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        tenants = load_tenants_file(config.tenants_file) if config.tenants_file else {}
        self.manager = TierManager(config, shares=share_slots(tenants, config.slot_bytes))
        auth = None
        if config.auth_tokens_file or config.auth_read_tokens_file:
            auth = TokenAuthenticator(config.auth_tokens_file, config.auth_read_tokens_file)
        binder = TenantBinder(tenants) if any(t.mtls_subjects for t in tenants.values()) else None
        self.interceptor = ErrorInterceptor(auth=auth, binder=binder)
        self.server = grpc.aio.server(interceptors=[self.interceptor], options=GRPC_OPTIONS)
        self.metrics: NodeMetrics | None = None
        self.metrics_port: int | None = None  # bound /metrics port once started
        self.shm = SegmentAttachments() if config.shm_enabled and shm_available() else None
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.index: IndexPublisher | None = None
        self.kv_events: KvEventPublisher | None = None  # the KV-event feed for routers, when configured
        self.planes: list[PlaneInfo] = [PlaneInfo("shm")] if self.shm is not None else []
        self.plane_servers: list[PlaneServer] = build_plane_servers(config)
        self._auth = auth
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        await self.manager.start()
        if self.config.kv_events_endpoint:  # before serving: the first snapshot holds the recovered pages
            self.kv_events = start_kv_events(self.manager, self.config, asyncio.get_running_loop())
        self.server.add_generic_rpc_handlers((KVStoreServicer(self.manager, self.shm, self.planes).handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.interceptor.auth is None:  # reflection has no auth hook: served only on an open node
            reflection.enable_server_reflection(
                [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
                self.server,
            )
        bind = f"{self.config.host}:{self.config.port}"
        cfg = self.config
        if cfg.tls_cert_file and cfg.tls_key_file:
            creds = server_credentials(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)
            self.port = self.server.add_secure_port(bind, creds)
        else:
            self.port = self.server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"could not bind {self.config.host}:{self.config.port}")
        if self.config.metrics_port is not None:
            self.metrics = NodeMetrics(self.config.node_id, self.manager.stats, asyncio.get_running_loop())
            self.metrics_port = self.metrics.start(self.config.metrics_host or self.config.host,
                                                   self.config.metrics_port)  # fmt: skip
            self.interceptor.observe = self.metrics.observe_rpc
        await self.server.start()
        services = NodeServices(self.manager, cfg, self._auth, self.advertise_addr.rsplit(":", 1)[0],
                                self.interceptor.binder)  # fmt: skip
        for plane in self.plane_servers:
            self.planes.append(await plane.start(services))
        if self.config.redis_url:
            self.index = IndexPublisher(
                self.config.redis_url, self.config.node_id, self.advertise_addr, self.manager.holdings,
                self._index_info, ttl_seconds=self.config.index_ttl_seconds,
                max_pending=self.config.index_max_pending,
            )  # fmt: skip
            self.manager.listen(self.index.note)
            self.manager.index_status = self.index.status
            await self.index.start()
            wait = self.config.index_register_wait_seconds
            if not await self.index.wait_registered(wait):
                log.warning("index at %s not reachable within %.1fs: serving local pages only until it is",
                            redact_url(self.config.redis_url), wait)  # fmt: skip
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "kvstore node %s serving on %s:%d (recovered %d NVMe page(s)); metrics: %s",
            self.config.node_id, self.config.host, self.port, self.manager.recovered_pages,
            f"http://{self.config.metrics_host or self.config.host}:{self.metrics_port}/metrics"
            if self.metrics_port is not None else "off",
        )  # fmt: skip
        return self.port

    async def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        log.info("shutting down: draining for up to %.1fs", self.config.grace_seconds)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(self.config.grace_seconds)
        for plane in self.plane_servers:
            await plane.stop()
        if self.index is not None:
            self.manager.unlisten(self.index.note)
            await self.index.close(deregister=True)
        if self.kv_events is not None:
            self.manager.unlisten(self.kv_events.note)
            await asyncio.to_thread(self.kv_events.close)  # sends the final clears (bounded)
        await self.manager.close()
        if self.shm is not None:
            self.shm.close()
        if self.metrics is not None:
            # The scrape thread asks this loop for snapshots: stop it from a worker thread.
            await asyncio.to_thread(self.metrics.close)
        log.info("stopped")

    async def wait(self) -> None:
        await self._stopped.wait()

    def _index_info(self) -> dict[str, int | str]:
        """The node's record in the index: occupancy, and the planes it serves (as Stats has them)."""
        info: dict[str, int | str] = {**self.manager.occupancy(), "host_id": host_id(),
                                      "planes": planes_to_json(self.planes)}  # fmt: skip
        if self.metrics_port is not None:  # where kvctl top finds this node's /metrics
            info["metrics_addr"] = f"{self.advertise_addr.rsplit(':', 1)[0]}:{self.metrics_port}"
        return info

    @property
    def advertise_addr(self) -> str:
        """host:port other machines use to reach this node."""
        if self.config.advertise_addr:
            return self.config.advertise_addr
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()
        return f"{host}:{self.port}"


async def serve(config: NodeConfig, ready_file: str | None = None) -> None:
    """Run a node until SIGTERM/SIGINT. Writes {"port", "pid"} to ready_file once serving."""
    tune_malloc_for_bulk_io()
    node = Node(config)
    await node.start()
    loop = asyncio.get_running_loop()
    stop_task: list[asyncio.Task[None]] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop_task.append(loop.create_task(node.stop())))
    if ready_file:
        tmp = Path(f"{ready_file}.tmp")
        tmp.write_text(json.dumps({"port": node.port, "pid": os.getpid(), "host": config.host,
                                   "metrics_port": node.metrics_port}))  # fmt: skip
        os.replace(tmp, ready_file)
    await node.wait()
    await asyncio.gather(*stop_task)
