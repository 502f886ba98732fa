"""`kvctl health`: the node's gRPC health status, over TLS when the environment says so.

Kubelet's native gRPC probe speaks no TLS; the chart probes a TLS node with this command inside its pod
(KVSTORE_TLS_CA / KVSTORE_TLS_SERVER_NAME / KVSTORE_TLS_CERT+KEY for mutual TLS, as every client reads
them). A node reports SERVING once it is registered in the index (bounded wait) and NOT_SERVING while
it drains. Exit status: 0 SERVING, 1 anything else (the one-line reason on stderr).
"""

from __future__ import annotations

from typing import Annotated

import grpc
import typer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.cli.common import err_console


def health(
    addr: Annotated[str, typer.Option(help="node address host:port")] = "127.0.0.1:50051",
    service: Annotated[str, typer.Option(help="service name ('' = the whole node)")] = "",
    timeout: Annotated[float, typer.Option(min=0.1, help="seconds to wait for the answer")] = 5.0,
) -> None:
    """Exit 0 when the node's gRPC health is SERVING (it is registered in the index), else 1."""
    from kvstore.security import ClientSecurity

    security = ClientSecurity.from_env()
    creds = security.channel_credentials()
    options = security.channel_options()
    channel = (
        grpc.secure_channel(addr, creds, options=options) if creds else grpc.insecure_channel(addr, options=options)
    )
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    except grpc.RpcError as exc:
        err_console.print(f"[bold red]not healthy:[/] {addr}: {exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]
        raise SystemExit(1) from None
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    typer.echo(f"{addr}: {status}")
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise SystemExit(1)
