"""Names shared by the tiers."""

from __future__ import annotations

import enum


class TierKind(enum.IntEnum):
    """A storage medium, fastest first; values equal the proto's `kvstore.v1.Tier` numbers."""

    HBM = 1
    DRAM = 2
    NVME = 3

    @property
    def label(self) -> str:
        return self.name.lower()
