"""Who may hold what on the same-host plane: pure bookkeeping (no sockets, no mappings); kvstore/node/planes/shm.py
applies it. The TCP plane's connection rule (tcp_limits.py) is the model, and its handshake room and default
share are used here as they are.

A caller can hold three things through the node's socket, each bounded node-wide:
- connections. A *handshake* (accepted, HELLO not answered yet) counts in a room of its own: at most
  `max_handshakes` at once (an eighth of the connection cap, at least 8), each given
  `shm_hello_timeout_seconds`, and one more is refused as soon as it is accepted, so sockets that never
  authenticate cannot take the room of those that do. An authenticated connection counts in `connections`
  until it closes; one idle between requests for `shm_idle_seconds` is closed (the plane's business);
- registered buffers: each is one mapping in the node (vm.max_map_count bounds them all, 65,530 by default,
  the node's own included), so they are counted: at most MAX_BUFFERS per connection (kvstore/wire/shm.py) and
  `shm_max_registrations` in all;
- mapped bytes: at most `shm_max_mapped_bytes` of client memory in all (address space; a sparse memfd costs
  nothing until written, so a size is not a cost, only a claim).

Each node-wide figure is shared out: one caller (a token) holds at most `per_caller` of it, and one named tenant
(all its callers together) at most `per_tenant`, half of it by default, so no single reader and no single tenant
can take what the others need. The default tenant (every caller of a node without tenants; the operator's
tokens on a node with them) is held to its callers' shares only: a tenant share would halve the room of a node
whose callers are all its own. A node without tokens cannot tell callers apart: there the shares are the whole
figure.

A refusal is answered before the thing is taken (a connection before its client sent any request; a
registration before anything is mapped), so the client falls back to another plane with nothing half-done.

Invariants: every `take` is matched by one `give` of the same amount by the same holder, every
`start_handshake` by one `end_handshake`; no count goes below zero or above its limits.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvstore.node.planes.tcp_limits import HandshakeRoom, handshake_limit, tenant_limit
from kvstore.scoping import DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a part of a share: a tenant, and a caller in it (its stable subject, e.g. "token:<hash>";
    "" on a node without tokens)."""

    tenant: str
    caller: str


@dataclass(slots=True)
class Share:
    """A node-wide amount (`total`) that holders take parts of, at most `per_caller` one caller and `per_tenant`
    one tenant. `what` names the unit in messages ("same-host plane connections"), `setting` the node setting
    that sets `total`."""

    what: str
    setting: str
    total: int
    per_tenant: int
    per_caller: int
    held: int = 0
    by_tenant: Counter[str] = field(default_factory=Counter)
    by_caller: Counter[str] = field(default_factory=Counter)

    def refusal(self, who: Holder, amount: int = 1) -> str | None:
        """Why `who` may not take `amount` more now (a message for the client), or None."""
        if self.held + amount > self.total:
            return f"{amount} more {self.what} would pass the node's {self.setting} ({self.total})"
        if self.by_caller[who.caller] + amount > self.per_caller:
            return (
                f"{amount} more {self.what} would pass this caller's share of the node's {self.setting} "
                f"({self.per_caller} of {self.total}; it holds {self.by_caller[who.caller]})"
            )
        if who.tenant != DEFAULT_TENANT and self.by_tenant[who.tenant] + amount > self.per_tenant:
            return (
                f"{amount} more {self.what} would pass tenant {who.tenant!r}'s share of the node's {self.setting} "
                f"({self.per_tenant} of {self.total}; it holds {self.by_tenant[who.tenant]})"
            )
        return None

    def take(self, who: Holder, amount: int = 1) -> None:
        reason = self.refusal(who, amount)
        if reason is not None:
            raise RuntimeError(f"take over the limit (ask refusal first): {reason}")
        self.held += amount
        self.by_caller[who.caller] += amount
        self.by_tenant[who.tenant] += amount

    def give(self, who: Holder, amount: int = 1) -> None:
        if self.by_caller[who.caller] < amount or self.by_tenant[who.tenant] < amount:
            raise RuntimeError(f"give of {amount} {self.what} that {who} does not hold")
        self.held -= amount
        for counts, k in ((self.by_caller, who.caller), (self.by_tenant, who.tenant)):
            counts[k] -= amount
            if not counts[k]:
                del counts[k]


def share(what: str, setting: str, total: int, configured_per_tenant: int, shared: bool) -> Share:
    """A Share of `total`: per tenant and per caller `configured_per_tenant` (0: half, tcp_limits.tenant_limit),
    or the whole of it where callers cannot be told apart (`shared` False: a node without tokens)."""
    part = tenant_limit(total, configured_per_tenant) if shared else total
    return Share(what, setting, total, part, part)


@dataclass(slots=True)
class ShmLimits(HandshakeRoom):
    """Everything a caller may hold on the same-host plane (see the module docstring)."""

    max_handshakes: int
    connections: Share
    buffers: Share
    mapped: Share
    handshakes: int = 0

    @classmethod
    def build(
        cls,
        *,
        max_connections: int,
        per_tenant_connections: int,
        max_handshakes: int,
        max_registrations: int,
        max_mapped_bytes: int,
        shared: bool,
    ) -> ShmLimits:
        """The limits from the node's settings (0 where a setting says "the default"); `shared`: whether callers
        can be told apart (a node with tokens)."""
        return cls(
            handshake_limit(max_connections, max_handshakes),
            share("same-host plane connections", "shm_max_connections", max_connections, per_tenant_connections,
                  shared),
            share("registered buffers", "shm_max_registrations", max_registrations, 0, shared),
            share("mapped bytes", "shm_max_mapped_bytes", max_mapped_bytes, 0, shared),
        )  # fmt: skip
