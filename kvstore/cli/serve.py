"""`kvstore serve`: run one cache node until SIGTERM."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.cli.common import friendly_errors, setup_logging
from kvstore.config import NodeConfig, parse_size
from kvstore.security import WRITE_METHODS

SizeOpt = Annotated[str | None, typer.Option(help="bytes, or with a unit: 64MiB, 2G", show_default=False)]
# What a read-only token may call: every RPC but the node's write methods (the rule lives in security.py).
READ_ONLY_METHODS = ", ".join(
    m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods if m.name not in WRITE_METHODS
)


@friendly_errors
# one parameter per CLI option (typer)
def serve(  # noqa: PLR0913, PLR0917
    host: Annotated[str | None, typer.Option(help="address to bind (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port to bind; 0 picks a free one (default 50051)")] = None,
    dram_bytes: SizeOpt = None,
    nvme_path: Annotated[Path | None, typer.Option(help="directory for NVMe segment files")] = None,
    nvme_bytes: SizeOpt = None,
    hbm_bytes: SizeOpt = None,
    max_page_bytes: Annotated[
        str | None,
        typer.Option(
            help="the largest page accepted, e.g. 2MiB (default); smaller pages take slots of their own size",
            show_default=False,
        ),
    ] = None,
    node_id: Annotated[str | None, typer.Option(help="node name in stats (default: hostname)")] = None,
    policy: Annotated[str | None, typer.Option(help="eviction and admission policy (default adaptive)")] = None,
    redis_url: Annotated[str | None, typer.Option(help="join a cluster: publish to this Redis index")] = None,
    advertise_addr: Annotated[str | None, typer.Option(help="host:port other machines reach this node at")] = None,
    index_ttl: Annotated[float | None, typer.Option(help="index heartbeat TTL in seconds (default 10)")] = None,
    index_register_wait: Annotated[
        float | None, typer.Option(help="seconds to wait for the first index publish before serving (default 5)")
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="serve Prometheus /metrics on this port (0: a free one; default off)")
    ] = None,
    metrics_host: Annotated[str | None, typer.Option(help="address for /metrics (default: --host)")] = None,
    shm: Annotated[
        bool | None, typer.Option("--shm/--no-shm", help="same-host shared-memory data plane (default on)")
    ] = None,
    scrub_bytes_per_second: Annotated[
        str | None,
        typer.Option(help="rate the DRAM scrubber re-verifies resident pages at, e.g. 64MiB (default); 0: off"),
    ] = None,
    retain_fraction: Annotated[
        float | None,
        typer.Option(help="share of each tenant's bytes its sessions' retention hints may keep, 0..1 (default 0.5)"),
    ] = None,
    local_socket: Annotated[
        str | None,
        typer.Option(
            help="the same-host plane's Unix socket (default: kvstore-UID/node-PORT.sock in $XDG_RUNTIME_DIR or "
            "/tmp, a directory only the node's user may write); in Kubernetes a hostPath the workers' pods mount too"
        ),
    ] = None,
    tcp: Annotated[
        bool | None, typer.Option("--tcp/--no-tcp", help="bulk TCP data plane for remote clients (default on)")
    ] = None,
    tcp_port: Annotated[
        int | None, typer.Option(help="TCP data plane port; 0 picks a free one, advertised to clients (default 0)")
    ] = None,
    ucx: Annotated[
        bool | None,
        typer.Option("--ucx/--no-ucx", help="UCX data plane (default off; for hosts with RDMA; needs ucxx)"),
    ] = None,
    ucx_port: Annotated[int | None, typer.Option(help="UCX listener port (default 0: a free one)")] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="PEM certificate: serve over TLS (with --tls-key)")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="PEM private key of --tls-cert")] = None,
    tls_client_ca: Annotated[
        Path | None, typer.Option(help="mutual TLS: clients must present a certificate signed by this CA")
    ] = None,
    auth_tokens_file: Annotated[Path | None, typer.Option(help="read-write bearer tokens, one per line")] = None,
    auth_read_tokens_file: Annotated[
        Path | None, typer.Option(help=f"read-only bearer tokens ({READ_ONLY_METHODS}; Gets served in place)")
    ] = None,
    auth_peer_tokens_file: Annotated[
        Path | None,
        typer.Option(help="tokens nodes present to each other to make copies (this node presents the first)"),
    ] = None,
    tenants_file: Annotated[
        Path | None, typer.Option(help="TOML: per tenant (\\[tenants.NAME]) its shares per tier and mTLS subjects")
    ] = None,
    replication: Annotated[
        bool | None,
        typer.Option(
            "--replication/--no-replication",
            help="copy hot pages to other nodes and take copies (default on, with --redis-url)",
        ),
    ] = None,
    replication_max_copies: Annotated[
        int | None, typer.Option(help="most copies a hot page gets across the cluster (default 3)")
    ] = None,
    handoff_seconds: Annotated[
        float | None,
        typer.Option(help="on SIGTERM, hand hot pages to other nodes for at most this long (default 10; 0: off)"),
    ] = None,
    kv_events_endpoint: Annotated[
        str | None,
        typer.Option(
            help="publish KV events for routers (vLLM format, ZMQ PUB) here: a port (5557: on --host, loopback "
            "by default) or tcp://HOST:PORT; an address other hosts reach needs --kv-events-curve-secret-file "
            "or --kv-events-allow-open"
        ),
    ] = None,
    kv_events_topic: Annotated[
        str | None, typer.Option(help="topic prefix: PREFIX@NODE@NAMESPACE (default kv)")
    ] = None,
    kv_events_hash_format: Annotated[
        str | None, typer.Option(help="block hashes as 'bytes' (32-byte keys, default) or 'u64' (their last 8 bytes)")
    ] = None,
    kv_events_encoding: Annotated[
        str | None, typer.Option(help="events as vLLM 0.32's maps ('map', default) or the older arrays ('array')")
    ] = None,
    kv_events_curve_secret_file: Annotated[
        Path | None,
        typer.Option(
            help="CURVE for the feed: the node's certificate with its secret key (pyzmq's NAME.key_secret, mode "
            "600); with --kv-events-subscribers-file"
        ),
    ] = None,
    kv_events_subscribers_file: Annotated[
        Path | None,
        typer.Option(help="who may subscribe: lines 'PUBLIC_KEY' (every topic) or 'PUBLIC_KEY TENANT' (its own)"),
    ] = None,
    kv_events_allow_open: Annotated[
        bool | None,
        typer.Option(
            "--kv-events-allow-open/--no-kv-events-allow-open",
            help="publish without CURVE on an address other hosts reach (a network only the indexer reaches)",
        ),
    ] = None,
    config: Annotated[Path | None, typer.Option(help="TOML file with a \\[node] table")] = None,
    ready_file: Annotated[Path | None, typer.Option(help="write {port, pid} JSON here once serving")] = None,
    log_level: Annotated[str | None, typer.Option(help="DEBUG, INFO, WARNING")] = None,
) -> None:
    """Run a cache node: tiers in DRAM, NVMe (and HBM on CUDA hosts), gRPC on HOST:PORT."""
    from kvstore.node.server import serve as run_server

    cfg = NodeConfig.load(
        config,
        host=host,
        port=port,
        node_id=node_id,
        policy=policy,
        log_level=log_level,
        redis_url=redis_url,
        advertise_addr=advertise_addr,
        index_ttl_seconds=index_ttl,
        index_register_wait_seconds=index_register_wait,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        shm_enabled=shm,
        local_socket=local_socket,
        scrub_bytes_per_second=_size(scrub_bytes_per_second),
        retain_fraction=retain_fraction,
        tcp_enabled=tcp,
        tcp_port=tcp_port,
        ucx_enabled=ucx,
        ucx_port=ucx_port,
        tls_cert_file=_path(tls_cert),
        tls_key_file=_path(tls_key),
        tls_client_ca_file=_path(tls_client_ca),
        auth_tokens_file=_path(auth_tokens_file),
        auth_read_tokens_file=_path(auth_read_tokens_file),
        auth_peer_tokens_file=_path(auth_peer_tokens_file),
        tenants_file=_path(tenants_file),
        replication=replication,
        replication_max_copies=replication_max_copies,
        handoff_seconds=handoff_seconds,
        nvme_path=str(nvme_path) if nvme_path else None,
        dram_bytes=_size(dram_bytes),
        nvme_bytes=_size(nvme_bytes),
        hbm_bytes=_size(hbm_bytes),
        max_page_bytes=_size(max_page_bytes),
        kv_events_endpoint=kv_events_endpoint,
        kv_events_topic=kv_events_topic,
        kv_events_hash_format=kv_events_hash_format,
        kv_events_encoding=kv_events_encoding,
        kv_events_curve_secret_file=_path(kv_events_curve_secret_file),
        kv_events_subscribers_file=_path(kv_events_subscribers_file),
        kv_events_allow_open=kv_events_allow_open,
    )
    setup_logging(cfg.log_level)
    services = []
    if cfg.replication and cfg.redis_url:
        from kvstore.replication import Replicator  # above the node: the CLI attaches it (kvstore/README.md)

        services.append(Replicator(cfg))
    asyncio.run(run_server(cfg, str(ready_file) if ready_file else None, services))


def _path(value: Path | None) -> str | None:
    return str(value) if value is not None else None


def _size(value: str | None) -> int | None:
    return None if value is None else parse_size(value)
