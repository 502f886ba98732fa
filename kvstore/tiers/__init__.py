"""Storage media. Each tier is a fixed array of equal slots: it moves bytes in and out of slots and
knows nothing of keys, policy or placement (that is manager.py's job)."""

from kvstore.tiers.base import TierKind
from kvstore.tiers.slots import SlotAllocator

__all__ = ["SlotAllocator", "TierKind"]
