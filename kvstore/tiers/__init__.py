"""Storage media. Each tier is a fixed array of equal slots behind one interface (`Medium`): it moves
bytes in and out of slots and knows nothing of keys, policy or placement (that is kvstore/manager's job)."""

from kvstore.names import TierKind
from kvstore.tiers.base import Absent, Medium
from kvstore.tiers.slots import SlotAllocator

__all__ = ["Absent", "Medium", "SlotAllocator", "TierKind"]
