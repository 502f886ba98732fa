"""The node side of a bulk data plane: a server the node starts beside gRPC and advertises.

A plane server moves page bytes only; every page still goes through the TierManager's Put transaction
(PutTxn) and leased reads (TierManager.get), so atomicity, verification, tiers and stats are the same as
for Put/Get streams. It checks credentials with the node's TokenAuthenticator (same tokens, same roles)
before touching anything.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from kvstore.config import NodeConfig
from kvstore.manager import TierManager
from kvstore.security import TokenAuthenticator
from kvstore.stats import PlaneInfo
from kvstore.tenancy import TenantBinder
from kvstore.transport.ucx import ucxx_installed


@dataclass(slots=True)
class NodeServices:
    """What a plane server may use of its node."""

    manager: TierManager
    config: NodeConfig
    auth: TokenAuthenticator | None  # None: the node runs without tokens
    advertise_host: str  # the host part other machines reach this node at
    binder: TenantBinder | None = None  # binds callers to tenants by their mTLS certificates (kvstore/tenancy.py)


class PlaneServer(abc.ABC):
    """One data plane's listener. `start` binds and serves, returning what the node advertises;
    `stop` closes the listener and every connection (bounded in time)."""

    name: str

    @abc.abstractmethod
    async def start(self, services: NodeServices) -> PlaneInfo: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...


def build_plane_servers(config: NodeConfig) -> list[PlaneServer]:
    """The plane servers this node's config turns on (besides shm, which the gRPC servicer serves)."""
    servers: list[PlaneServer] = []
    if config.tcp_enabled:
        from kvstore.transport.tcp.node import TcpPlaneServer  # the node side imports this module

        servers.append(TcpPlaneServer())
    if config.ucx_enabled:
        if not ucxx_installed():
            raise ValueError("ucx_enabled: the UCX data plane needs ucxx (pip install 'kvstore[ucx]')")
        from kvstore.transport.ucx.node import UcxPlaneServer  # imports ucxx lazily, in start()

        servers.append(UcxPlaneServer(config.ucx_port, config.ucx_io_timeout_seconds))
    return servers
