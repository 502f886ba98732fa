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
