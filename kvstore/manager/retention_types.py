"""What retention is made of (DESIGN.md §6.5): a Retain call and the checks of its fields, a tenant's caps, a
session, what a call did, and a tenant's counters. Pure: no I/O, no clocks; the bookkeeping over them is
retention.py's `Retention`.

Invariant: `check_call` checks every field of a call, each error naming its field (InvalidArgument), before
anything is looked up or changed; a session id is 1..MAX_SESSION_BYTES of UTF-8 without control characters.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from kvstore.names import MAX_PRIORITY, MAX_SESSION_BYTES, MIN_PRIORITY, Key, RetainMode, RetainOp, TierKind
from kvstore.stats import SessionState

MAX_SESSIONS_PER_TENANT = 65536
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # C0 and C1 control characters, DEL


@dataclass(frozen=True, slots=True)
class RetainCall:
    """One Retain request, its fields as the client gave them (None: not given), keys already scoped."""

    session: str
    op: RetainOp
    keys: list[Key]
    ttl_seconds: float | None = None
    priority: int | None = None
    mode: RetainMode | None = None


@dataclass(frozen=True, slots=True)
class RetainCaps:
    """A tenant's caps: retained pages on the node, and HOLD pages per tier above the slowest."""

    total: int
    hold: dict[TierKind, int]
    fraction: float  # for messages: the fraction of the tenant's slots these are


@dataclass(slots=True, eq=False)
class Session:
    """One live session. `keys`: every page it named, in naming order; counters by the pages' state now."""

    tenant: str
    name: str
    priority: int
    mode: RetainMode
    deadline: float
    seq: int
    keys: dict[Key, None] = field(default_factory=dict)
    held: int = 0  # named pages stored here and retained
    unheld: int = 0  # named pages stored here, not retained (arrived at the tenant's cap)
    pending: int = 0  # named pages not stored here


@dataclass(slots=True)
class RetainOutcome:
    """What a Retain call did. `prefetch`: the pages a RESUME asks the manager to promote, in naming order."""

    retained: int = 0
    pending: int = 0
    released: int = 0
    state: SessionState | None = None
    displaced: list[str] = field(default_factory=list)
    prefetch: list[Key] = field(default_factory=list)


@dataclass(slots=True)
class TenantRetention:
    """One tenant's retained pages and counters."""

    total: int = 0
    by_tier: dict[TierKind, int] = field(default_factory=dict)
    held_in: dict[TierKind, int] = field(default_factory=dict)
    incoming: dict[TierKind, int] = field(default_factory=dict)  # HOLD pages being promoted into a tier
    sessions: dict[str, Session] = field(default_factory=dict)
    named: int = 0  # keys named by its sessions, counted once per session
    calls: int = 0
    refused: int = 0
    expired: int = 0
    ended: int = 0
    displaced: int = 0
    unheld: int = 0
    resumed: int = 0


def check_session(name: str) -> None:
    """InvalidArgument naming `session` unless it is 1..MAX_SESSION_BYTES of UTF-8 without control characters."""
    size = len(name.encode("utf-8", "surrogatepass"))
    if not 1 <= size <= MAX_SESSION_BYTES:
        raise InvalidArgument("session", f"a session id is 1..{MAX_SESSION_BYTES} bytes of UTF-8, got {size}")
    if _CONTROL.search(name):
        raise InvalidArgument("session", f"{name!r} contains a control character")


def check_call(call: RetainCall, creating: bool) -> None:
    """Every field of a Retain call, each error naming its field; nothing is looked up or changed."""
    check_session(call.session)
    if not isinstance(call.op, RetainOp):
        raise InvalidArgument("op", f"{call.op!r} is not a RetainOp")
    ttl = call.ttl_seconds
    if ttl is not None and not (math.isfinite(ttl) and ttl > 0):  # NOTE: NaN fails both comparisons
        raise InvalidArgument("ttl_seconds", f"a lease is a finite number of seconds > 0, got {ttl}")
    if creating and ttl is None:
        raise InvalidArgument("ttl_seconds", f"session {call.session!r} is new here: its lease must be given")
    p = call.priority
    if p is not None and not (isinstance(p, int) and MIN_PRIORITY <= p <= MAX_PRIORITY):
        raise InvalidArgument("priority", f"must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {p!r}")
    if call.mode is not None and not isinstance(call.mode, RetainMode):
        raise InvalidArgument("mode", f"{call.mode!r} is not a RetainMode (HOLD or DEMOTE)")
    if call.op is RetainOp.END and call.keys:
        raise InvalidArgument("hashes", "END releases every page of the session: name none")
