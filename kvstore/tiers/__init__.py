"""Storage media. Each tier is an array of equal chunks behind one interface (`Medium`), each chunk holding
slots of one size (`SizeClassAllocator`: pages of every size in one medium); a medium moves bytes at the
offsets it is given and knows nothing of keys, policy or placement (that is kvstore/manager's job)."""

from kvstore.names import TierKind
from kvstore.tiers.base import Absent, Medium
from kvstore.tiers.slots import Grant, SizeClassAllocator

__all__ = ["Absent", "Grant", "Medium", "SizeClassAllocator", "TierKind"]
