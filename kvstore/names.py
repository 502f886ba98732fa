"""Names shared by every layer (clients, the index, the node): no behaviour, no imports of other layers.

Clients and the index import `TierKind` from here, so they never touch `kvstore/tiers` (the media).
"""

from __future__ import annotations

import enum

Buffer = bytes | bytearray | memoryview  # anything a page payload may be handed in as
Key = tuple[str, bytes]  # (namespace, 32-byte block hash): a page's identity on a node


class TierKind(enum.IntEnum):
    """A storage medium, fastest first; values equal the proto's `kvstore.v1.Tier` numbers.

    The order is meaningful: a smaller value is a faster tier. Eviction demotes toward larger values,
    a hit promotes toward smaller ones.
    """

    HBM = 1
    DRAM = 2
    NVME = 3

    @property
    def label(self) -> str:
        return self.name.lower()


class RetainMode(enum.IntEnum):
    """How a session's retained pages are kept (DESIGN.md §6.5); values equal the proto's `RetainMode`."""

    HOLD = 1  # held where they are: never evicted, demoted or dropped while retained
    DEMOTE = 2  # "demote, don't drop": a faster tier may demote them; the slowest never drops them

    @property
    def label(self) -> str:
        return self.name.lower()


class RetainOp(enum.IntEnum):
    """What a Retain call does to its session; values equal the proto's `RetainOp`."""

    RETAIN = 0  # create the session or add to it
    UPDATE = 1  # change a known session's lease, priority or mode
    RELEASE = 2  # stop retaining some of its pages
    END = 3  # the session ended: release everything
    RESUME = 4  # its next turn: prefetch its pages back to DRAM


MIN_PRIORITY = 0  # a session's priority: at a tenant's retention cap, lower priorities give way
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 50
MAX_SESSION_BYTES = 128  # a session id: 1..this many bytes of UTF-8 without control characters
