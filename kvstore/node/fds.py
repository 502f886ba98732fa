"""The node's descriptor budget: the data planes' connections never take the descriptors the rest of the node
needs (its gRPC connections, NVMe segment files, Redis, the metrics endpoint).

Every connection a data plane holds costs the node one descriptor (a socket); registered client memory costs
none (kvstore/node/planes/shm_memory.py). At start the node raises its soft RLIMIT_NOFILE to the hard limit (the
soft default, often 1,024, is meant for interactive programs), then fits the planes' connection caps
(authenticated connections plus handshakes, as configured) under that limit less a reserve: a quarter of it,
at least FD_RESERVE descriptors. Caps that do not fit are lowered in proportion, each plane's alike, and the
node says so once. `fit_caps` is pure; `raise_soft_limit` is the one call that changes the process.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Mapping

log = logging.getLogger(__name__)

FD_RESERVE = 256  # descriptors kept out of the planes' reach at least (gRPC, files, Redis), however low the limit


def raise_soft_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (where allowed); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # a container may forbid it: keep what we have
            log.info("cannot raise the descriptor limit from %d to %d: %s", soft, target, exc)
    return soft


def reserve_for(limit: int) -> int:
    """Descriptors the planes may not use of `limit`: a quarter of it, at least FD_RESERVE."""
    return max(FD_RESERVE, limit // 4)


def fit_caps(limit: int, caps: Mapping[str, int]) -> dict[str, int]:
    """`caps` (a name per connection cap: "tcp connections", "shm handshakes", ...) lowered in proportion so that
    together they fit in `limit` less its reserve; unchanged when they fit. Each stays at least 1."""
    budget = max(len(caps), limit - reserve_for(limit))
    wanted = sum(caps.values())
    if wanted <= budget:
        return dict(caps)
    return {name: max(1, n * budget // wanted) for name, n in caps.items()}
