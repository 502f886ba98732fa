"""Host names and addresses, as both sides of the wire read them (pure, except `host_id`, which reads /proc).

One place for parsing a gRPC target ("host:port", "ipv4:host:port", "[v6]:port") and an advertised plane
address, and for telling whether a target is this host (loopback) or another process of this host (same
boot id): security decides where a token may go from it, and the client which planes may work.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket
from pathlib import Path

HOST_ID_ENV = "KVSTORE_HOST_ID"  # tests and benchmarks only: several "hosts" on one machine (below)


def host_id() -> str:
    """This host's identity: its boot id (distinct per host and per boot; equal for every process and
    container of one kernel), else its hostname. KVSTORE_HOST_ID overrides it, so tests and benchmarks can
    play several hosts on one machine (each node and each client of a "host" sets the same value); a client
    and a node of different ids then talk over the network planes (TCP on loopback), never the same-host plane."""
    return os.environ.get(HOST_ID_ENV) or _boot_id()


@functools.cache
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def peer_host(peer: str) -> str:
    """The host a connection's peer is on, as a node tells its readers apart (kvstore/node/heat.py): "" for this
    host (loopback, a Unix socket, unknown), else the peer's address. `peer`: gRPC's form ("ipv4:1.2.3.4:5",
    "ipv6:[::1]:5", "unix:...") or "host:port"."""
    if not peer or peer.startswith("unix:"):
        return ""
    host = target_host(peer)
    return "" if not host or is_loopback(host + ":0") else host


def is_loopback(target: str) -> bool:
    """Whether a gRPC target names this host's loopback (so same-host planes can work)."""
    host = target_host(target)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def target_host(target: str) -> str:
    """The host part of a gRPC target ("host:port", "ipv4:host:port", "[v6]:port")."""
    host = target.removeprefix("ipv4:").removeprefix("ipv6:").rsplit(":", 1)[0]
    return host.strip("[]")


def split_address(address: str, default_host: str) -> tuple[str, int]:
    """(host, port) of an advertised "host:port"; an empty or wildcard host means the gRPC target's."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = default_host
    return host, int(port)
