"""Who may hold a TCP plane connection: pure bookkeeping (no sockets); kvstore/node/planes/tcp.py applies it.

A connection is first a *handshake* (accepted, TLS and HELLO not done yet), then, once its token is
checked, an *authenticated* connection of one tenant. The two are counted apart, so callers that never
authenticate cannot take the room of those who do (SECURITY.md, review round 3, finding 5: 55 idle sockets
against a cap of 50 used to turn every client away):

- at most `max_handshakes` handshakes at once; one more is closed as soon as it is accepted (the node
  also gives each handshake only a short deadline, `tcp_hello_timeout_seconds`);
- at most `max_connections` authenticated connections at once;
- at most `max_per_tenant` of them one tenant's, so one tenant (or one stolen token) cannot hold the
  whole plane; idle ones are also closed after `tcp_idle_seconds` (the plane's business).

A refusal is answered before the client sent any request, so its client falls back to gRPC streams
(PlaneUnavailable) with nothing half-done.

Invariants: every `start_handshake` is matched by one `end_handshake`, every `admit` by one `release`;
the counts never go below zero or above their limits.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

MIN_HANDSHAKES = 8  # the default handshake room is an eighth of the cap, but never less than this


def handshake_limit(max_connections: int, configured: int) -> int:
    """The handshake room: `configured`, or (0) an eighth of `max_connections`, at least MIN_HANDSHAKES."""
    return configured or max(MIN_HANDSHAKES, max_connections // 8)


def tenant_limit(max_connections: int, configured: int) -> int:
    """One tenant's share of the authenticated connections: `configured`, or (0) half of them."""
    return min(configured or max(1, max_connections // 2), max_connections)


class HandshakeRoom:
    """The handshake count of a plane's limits (a TCP plane's, the same-host plane's): at most `max_handshakes`
    at once. Mixed into a dataclass that holds both fields."""

    __slots__ = ()
    max_handshakes: int
    handshakes: int

    def can_start_handshake(self) -> bool:
        return self.handshakes < self.max_handshakes

    def start_handshake(self) -> None:
        if not self.can_start_handshake():
            raise RuntimeError("no handshake room: ask can_start_handshake first")
        self.handshakes += 1

    def end_handshake(self) -> None:
        if self.handshakes <= 0:
            raise RuntimeError("end_handshake without start_handshake")
        self.handshakes -= 1


@dataclass(slots=True)
class ConnectionLimits(HandshakeRoom):
    """Counts of one plane's connections against its limits (see the module docstring)."""

    max_connections: int
    max_handshakes: int
    max_per_tenant: int
    handshakes: int = 0
    by_tenant: Counter[str] = field(default_factory=Counter)

    @property
    def authenticated(self) -> int:
        return sum(self.by_tenant.values())

    # -- authenticated connections

    def refusal(self, tenant: str) -> str | None:
        """Why `tenant` may not hold one more connection now (a message for the client), or None."""
        if self.authenticated >= self.max_connections:
            return (
                f"this node's TCP plane is full ({self.max_connections} connections); retry later or use gRPC streams"
            )
        if self.by_tenant[tenant] >= self.max_per_tenant:
            return (
                f"tenant {tenant!r} holds {self.max_per_tenant} TCP plane connections, its most on this node; "
                "close idle ones, retry later or use gRPC streams"
            )
        return None

    def admit(self, tenant: str) -> None:
        reason = self.refusal(tenant)
        if reason is not None:
            raise RuntimeError(f"admit over the limit: {reason}")
        self.by_tenant[tenant] += 1

    def release(self, tenant: str) -> None:
        if self.by_tenant[tenant] <= 0:
            raise RuntimeError(f"release without admit for tenant {tenant!r}")
        self.by_tenant[tenant] -= 1
        if not self.by_tenant[tenant]:
            del self.by_tenant[tenant]
