"""Which data plane a client uses: the names and the choice rule (pure; host identity: kvstore/addresses.py).

A node advertises the planes it serves (Stats.planes, and its index record); a client knows which it
can speak. With transport "auto" a client takes, in order:
- on the node's host (a loopback target, or the node's host_id equals ours): shm, then tcp;
- on another host: ucx, then tcp;
each only where the node advertises it and this client can speak it, and always gRPC streams last.
An explicit transport ("shm", "tcp", "ucx", "grpc") is that plane alone; its errors surface.
A node too old to advertise planes (no host_id) is treated as offering gRPC streams only.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from kvstore.errors import PlaneUnavailable
from kvstore.stats import PlaneInfo

TRANSPORTS = ("auto", "grpc", "shm", "tcp", "ucx")
SAME_HOST_ORDER = ("shm", "tcp")
OTHER_HOST_ORDER = ("ucx", "tcp")


def choose_planes(
    transport: str, *, same_host: bool, advertised: Mapping[str, PlaneInfo] | None, client_can: Collection[str]
) -> list[str]:
    """The planes to try, most preferred first, ending with "grpc" for transport "auto" (see the module docstring).

    advertised: the node's planes by name; None when the node predates advertising (then: gRPC only).
    Raises PlaneUnavailable when an explicit plane is not served by the node, ValueError when this
    client cannot speak it.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    offered = set() if advertised is None else set(advertised)
    if transport == "grpc":
        return ["grpc"]
    if transport != "auto":
        if transport not in client_can:
            raise ValueError(f"transport={transport!r} is not available in this client (kvstore.client.planes.choice)")
        if transport not in offered:
            raise PlaneUnavailable(f"the node does not serve the {transport} data plane (it offers {sorted(offered)})")
        return [transport]
    order = SAME_HOST_ORDER if same_host else OTHER_HOST_ORDER
    return [n for n in order if n in offered and n in client_can] + ["grpc"]
