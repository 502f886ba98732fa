"""The node side of a bulk data plane: a server the node starts beside gRPC and advertises.

A plane server moves page bytes only: it resolves its caller with the node's one resolver
(kvstore/node/callers.py: same tokens, roles and tenants as gRPC) before touching anything, and runs the
node's put and get drivers (kvstore/node/drivers.py), so atomicity, verification, tiers and stats are
those of every plane.
"""

from __future__ import annotations

import abc
import asyncio
import errno
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.config import NodeConfig
from kvstore.node.callers import Callers
from kvstore.stats import PlaneInfo

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeServices:
    """What a plane server may use of its node: its caller resolver (which reaches the manager only in a
    caller's tenant scope), its config, and the host part other machines reach it at."""

    callers: Callers
    config: NodeConfig
    advertise_host: str
    port: int  # the node's bound gRPC port


class PlaneServer(abc.ABC):
    """One data plane's listener. `start` binds and serves, returning what the node advertises;
    `stop` closes the listener and every connection (bounded in time)."""

    name: str

    @abc.abstractmethod
    async def start(self, services: NodeServices) -> PlaneInfo: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...


async def accept_forever(listener: socket.socket, admit: Callable[[socket.socket], None], what: str) -> None:
    """Accept connections on `listener` until cancelled, handing each new socket to `admit` (which owns it
    from then on). An accept that fails (EMFILE and the like) is logged and tried again 0.1 s later: the
    connections already served go on."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            sock, _ = await loop.sock_accept(listener)
        except OSError as exc:
            log.warning("%s: accept failed: %s", what, exc)
            await asyncio.sleep(0.1)
            continue
        admit(sock)


def port_refusal(what: str, host: str, port: int, flag: str, exc: OSError) -> str:
    """The one-line refusal of a plane whose listener cannot bind `host:port`: what, where, why (from the
    OS error, in words) and what to do, naming the flag that sets the port."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        why = "the port is in use (another kvstore node, or another program, is serving it)"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = "the address is not this host's"
    elif exc.errno == errno.EACCES:
        why = "binding it needs privileges this process does not have"
    else:
        why = exc.strerror or str(exc)
    todo = f"choose another {flag} (0 picks a free one) or stop the other one"
    return f"cannot serve the {what} on {where}: {why}; {todo}"
