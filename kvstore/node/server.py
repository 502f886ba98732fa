"""The cache node: its manager, its gRPC server and data planes, its index link, and its lifecycle.

`Node.start()` recovers the persistent tier, serves kvstore.v1.KVStore (kvstore/node/servicer.py) beside
grpc health and reflection, starts the data planes its config turns on (kvstore/node/planes/), joins
the Redis index and starts its services (`NodeService`: what layers above the node attach, e.g. replication,
kvstore/replication). SIGTERM/SIGINT (`serve`): health goes NOT_SERVING, each service hands off what it must
(bounded by `handoff_seconds`: replication hands hot pages to other nodes) while the node still serves, in-flight
RPCs get `grace_seconds`, then the manager spills DRAM pages to NVMe (bounded) and closes, so a restart on the
same --nvme-path is warm.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.addresses import host_id
from kvstore.config import NodeConfig
from kvstore.index.publisher import IndexPublisher
from kvstore.manager import TierManager
from kvstore.memtune import HeapTrimmer, bound_arenas, freeze_startup_objects, tune_malloc_for_bulk_io
from kvstore.node.callers import Callers
from kvstore.node.fds import fit_caps, raise_soft_limit, reserve_for
from kvstore.node.interceptor import SERVICE_NAME, ErrorInterceptor
from kvstore.node.kv_events import KvEventPublisher
from kvstore.node.kv_events import start_for_node as start_kv_events
from kvstore.node.limits import MAX_RECEIVE_BYTES
from kvstore.node.metrics import NodeMetrics
from kvstore.node.planes.base import NodeServices, PlaneServer
from kvstore.node.planes.shm import ShmPlaneServer
from kvstore.node.planes.tcp import TcpPlaneServer
from kvstore.node.planes.tcp_limits import handshake_limit
from kvstore.node.servicer import KVStoreServicer
from kvstore.node.tenancy import TenantBinder, load_tenants_file, share_bytes
from kvstore.security import TokenAuthenticator, redact_url, server_credentials
from kvstore.stats import PlaneInfo, ReplicationStatus, planes_to_json
from kvstore.wire import MAX_MESSAGE_BYTES
from kvstore.wire.shm import shm_available
from kvstore.wire.ucx import ucxx_installed

log = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),  # the largest request a method accepts
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # NOTE: gRPC binds with SO_REUSEPORT by default, so a second node on a served port would start and
    # share its connections with the first (DESIGN.md §12: one node per port); without it the bind fails and we say so.
    ("grpc.so_reuseport", 0),
]


class NodeService(Protocol):
    """Something a layer above the node runs with it (kvstore/replication): started once the node serves and
    is in the index, asked to hand off on SIGTERM while the node still serves, stopped before it closes."""

    async def start(self, node: Node) -> None: ...

    async def handoff(self, deadline: float) -> None:
        """SIGTERM: move what must not be lost to other nodes by `deadline` (monotonic); never raises."""

    async def stop(self) -> None: ...


class Node:
    """A running cache node: manager + gRPC server. `start()`, then `wait()` or `stop()`."""

    def __init__(self, config: NodeConfig, services: Sequence[NodeService] = ()) -> None:
        self.config = config
        self.services = list(services)
        self._served_at = (time.monotonic(), 0)  # (when, served bytes) at the last record: the load's base
        self.load_bps = 0.0  # payload bytes per second served to clients between the last two records
        tenants = load_tenants_file(config.tenants_file) if config.tenants_file else {}
        self.manager = TierManager(config, shares=share_bytes(tenants))
        auth = None
        if config.auth_tokens_file or config.auth_read_tokens_file or config.auth_peer_tokens_file:
            auth = TokenAuthenticator(
                config.auth_tokens_file, config.auth_read_tokens_file, config.auth_peer_tokens_file
            )
        binder = TenantBinder(tenants) if any(t.mtls_subjects for t in tenants.values()) else None
        self.callers = Callers(self.manager, auth, binder)
        self.interceptor = ErrorInterceptor(self.callers)
        self.server = grpc.aio.server(interceptors=[self.interceptor], options=GRPC_OPTIONS)
        self.metrics: NodeMetrics | None = None
        self.metrics_port: int | None = None  # bound /metrics port once started
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.index: IndexPublisher | None = None
        self.kv_events: KvEventPublisher | None = None  # the KV-event feed for routers, when configured
        self.planes: list[PlaneInfo] = []  # what Stats and the index advertise, filled as planes start
        self.plane_servers: list[PlaneServer] = build_plane_servers(config)
        self._started_planes: list[PlaneServer] = []
        self.heap_trimmer = HeapTrimmer()  # bounds the free memory malloc keeps (kvstore/memtune.py)
        self._trimming: asyncio.Task[None] | None = None
        self.servicer = KVStoreServicer(config.max_pages_per_request, self.planes)
        self.servicer.replication = self._served  # what Stats says without replication (a Replicator replaces it)
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        # The port first: a node that cannot have its port (another node serves it) touches nothing.
        cfg = self.config
        bind = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert_file and cfg.tls_key_file:
                creds = server_credentials(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)
                self.port = self.server.add_secure_port(bind, creds)
            else:
                self.port = self.server.add_insecure_port(bind)
        except RuntimeError:  # gRPC's "Failed to bind": in use (by another node?), or not an address here
            self.port = 0
        if self.port == 0:
            raise OSError(
                f"cannot serve on {bind}: the port is in use (another kvstore node, or another program, "
                "is serving it) or the address is not this host's; choose another --port or stop the other one"
            )
        try:
            await self._start_serving()
        except BaseException:
            # NOTE: a refusal past the port (a plane's port in use, the event feed's endpoint, ...) stops what
            # started, the gRPC server included: left running, grpc.aio's Server.__del__ would schedule its
            # shutdown on the closed loop and print "Exception ignored" under the refusal.
            await self._abandon()
            raise
        return self.port

    async def _start_serving(self) -> None:
        cfg = self.config
        self._trimming = asyncio.get_running_loop().create_task(self.heap_trimmer.run())
        await self.manager.start()
        if self.config.kv_events_endpoint:  # before serving: the first snapshot holds the recovered pages
            self.kv_events = start_kv_events(self.manager, self.config, asyncio.get_running_loop())
        self.server.add_generic_rpc_handlers((self.servicer.handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.callers.auth is None:  # reflection has no auth hook: served only on an open node
            reflection.enable_server_reflection(
                [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
                self.server,
            )
        if self.config.metrics_port is not None:
            self.metrics = NodeMetrics(self.config.node_id, self.manager.stats, asyncio.get_running_loop())
            self.metrics_port = self.metrics.start(
                self.config.metrics_host or self.config.host, self.config.metrics_port
            )
            self.interceptor.observe = self.metrics.observe_rpc
        await self.server.start()
        planes_cfg = fit_descriptors(cfg, raise_soft_limit())
        services = NodeServices(self.callers, planes_cfg, self.advertise_addr.rsplit(":", 1)[0], self.port)
        for plane in self.plane_servers:
            self._started_planes.append(plane)  # stopped by _abandon even if its start fails half-way
            self.planes.append(await plane.start(services))
        if self.config.redis_url:
            self.index = IndexPublisher(
                self.config.redis_url,
                self.config.node_id,
                self.advertise_addr,
                self.manager.holdings,
                self._index_info,
                ttl_seconds=self.config.index_ttl_seconds,
                max_pending=self.config.index_max_pending,
            )
            self.manager.listen(self.index.note)
            self.manager.index_status = self.index.status
            await self.index.start()
            wait = self.config.index_register_wait_seconds
            if not await self.index.wait_registered(wait):
                log.warning(
                    "index at %s not reachable within %.1fs: serving local pages only until it is",
                    redact_url(self.config.redis_url),
                    wait,
                )
        for service in self.services:
            await service.start(self)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "kvstore node %s serving on %s:%d (recovered %d NVMe page(s)); metrics: %s",
            self.config.node_id,
            self.config.host,
            self.port,
            self.manager.recovered_pages,
            f"http://{self.config.metrics_host or self.config.host}:{self.metrics_port}/metrics"
            if self.metrics_port is not None
            else "off",
        )

    async def _abandon(self) -> None:
        """Stop what a failed start started (each step bounded and on its own: one failing does not keep
        the others from running), so the process exits with only the refusal to show."""
        steps: list[Callable[[], Awaitable[object]]] = [lambda: self.server.stop(0), self._stop_trimming]
        steps += [service.stop for service in self.services]
        steps += [plane.stop for plane in reversed(self._started_planes)]
        if self.index is not None:
            index = self.index
            steps.append(lambda: index.close(deregister=True))
        if self.kv_events is not None:
            events = self.kv_events
            steps.append(lambda: asyncio.to_thread(events.close))
        steps.append(self.manager.close)
        if self.metrics is not None:
            metrics = self.metrics
            steps.append(lambda: asyncio.to_thread(metrics.close))
        for step in steps:
            try:
                await asyncio.wait_for(step(), timeout=10.0)
            except Exception:  # the start's own error is the one to report
                log.debug("cleanup after a failed start", exc_info=True)

    async def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        log.info("shutting down: draining for up to %.1fs", self.config.grace_seconds)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.services and self.config.handoff_seconds > 0:
            # NOTE: before the drain: the node still serves the other nodes that pull what it hands off.
            deadline = time.monotonic() + self.config.handoff_seconds
            log.info("handing off for up to %.1fs", self.config.handoff_seconds)
            for service in self.services:
                try:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic()) + 1.0):
                        await service.handoff(deadline)
                except Exception:  # a hand-off that fails must not keep the node from stopping
                    log.exception("hand-off failed")
        for service in self.services:
            try:
                async with asyncio.timeout(10.0):
                    await service.stop()
            except Exception:
                log.exception("a node service failed to stop")
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
        if self.metrics is not None:
            # The scrape thread asks this loop for snapshots: stop it from a worker thread.
            await asyncio.to_thread(self.metrics.close)
        await self._stop_trimming()
        log.info("stopped")

    async def _stop_trimming(self) -> None:
        if self._trimming is not None:
            self._trimming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._trimming
            self._trimming = None

    async def wait(self) -> None:
        await self._stopped.wait()

    def _served(self) -> ReplicationStatus:
        reads = self.callers.reads
        return ReplicationStatus(
            served_bytes=reads.served_bytes,
            served_pages=reads.served_pages,
            copies_out=reads.copies_out,
            copy_bytes_out=reads.copy_bytes_out,
        )

    def _index_info(self) -> dict[str, int | str]:
        """The node's record in the index: occupancy, and the planes it serves (as Stats has them)."""
        now, served = time.monotonic(), self.callers.reads.served_bytes
        then, before = self._served_at
        if now - then > 0.1:
            self.load_bps = (served - before) / (now - then)
            self._served_at = (now, served)
        info: dict[str, int | str] = {
            **self.manager.occupancy(),
            "host_id": host_id(),
            "planes": planes_to_json(self.planes),
            "load_bps": int(self.load_bps),  # what readers and placement weigh (kvstore/index/choose.py)
        }
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


async def serve(config: NodeConfig, ready_file: str | None = None, services: Sequence[NodeService] = ()) -> None:
    """Run a node (with `services`) until SIGTERM/SIGINT. Writes {"port", "pid"} to ready_file once serving."""
    tune_malloc_for_bulk_io()
    bound_arenas()  # before gRPC's threads allocate: what they keep is bounded (kvstore/memtune.py)
    node = Node(config, services)
    await node.start()
    freeze_startup_objects()  # what lives as long as the node is never walked by the collector (memtune.py)
    loop = asyncio.get_running_loop()
    stop_task: list[asyncio.Task[None]] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop_task.append(loop.create_task(node.stop())))
    if ready_file:
        tmp = Path(f"{ready_file}.tmp")
        tmp.write_text(
            json.dumps({"port": node.port, "pid": os.getpid(), "host": config.host, "metrics_port": node.metrics_port})
        )
        os.replace(tmp, ready_file)
    await node.wait()
    await asyncio.gather(*stop_task)


def fit_descriptors(config: NodeConfig, limit: int) -> NodeConfig:
    """`config` with the data planes' connection caps (connections and handshakes of the TCP and same-host
    planes it serves) fitted under the descriptor `limit` less the node's reserve (kvstore/node/fds.py);
    `config` itself when they fit."""
    caps: dict[str, int] = {}
    for plane, on in (("tcp", config.tcp_enabled), ("shm", config.shm_enabled and shm_available())):
        if on:
            cap = getattr(config, f"{plane}_max_connections")
            caps[f"{plane}_max_connections"] = cap
            caps[f"{plane}_max_handshakes"] = handshake_limit(cap, getattr(config, f"{plane}_max_handshakes"))
    fitted = fit_caps(limit, caps)
    if fitted == caps:
        return config
    log.warning(
        "the descriptor limit (%d, RLIMIT_NOFILE) cannot hold the data planes' connection caps with %d kept for "
        "gRPC, files and Redis: lowered to %s (raise the limit, e.g. LimitNOFILE= or ulimit -n, to keep them)",
        limit,
        reserve_for(limit),
        ", ".join(f"{k}={v}" for k, v in fitted.items()),
    )
    return dataclasses.replace(config, **fitted)


def build_plane_servers(config: NodeConfig) -> list[PlaneServer]:
    """The plane servers this node's config turns on (gRPC streams are always served, by the servicer)."""
    servers: list[PlaneServer] = []
    if config.shm_enabled and shm_available():
        servers.append(ShmPlaneServer(config.local_socket))
    if config.tcp_enabled:
        servers.append(TcpPlaneServer())
    if config.ucx_enabled:
        if not ucxx_installed():
            raise ValueError("ucx_enabled: the UCX data plane needs ucxx (pip install 'kvstore[ucx]')")
        from kvstore.node.planes.ucx import UcxPlaneServer  # imports ucxx lazily, in start()

        servers.append(UcxPlaneServer(config.ucx_port, config.ucx_io_timeout_seconds))
    return servers
