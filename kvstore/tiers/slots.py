"""Free-list allocator over a fixed number of equal slots (pure bookkeeping, no memory behind it)."""

from __future__ import annotations


class SlotAllocator:
    """Hands out slot indices in [0, num_slots).

    Invariants: every index is either free or allocated, never both; `free_count + used_count ==
    num_slots`; freeing an index that is not allocated raises instead of corrupting the list.
    Allocation is LIFO so recently freed (cache-warm) slots are reused first.
    """

    __slots__ = ("_allocated", "_free", "num_slots")

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        self.num_slots = num_slots
        # Highest index at the bottom so slot 0 is handed out first: pages fill files front to back.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._allocated = bytearray(num_slots)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.num_slots - len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        return len(self._free) >= n

    def allocate(self) -> int:
        """Take a free slot; raises MemoryError when none is free (check can_allocate first)."""
        if not self._free:
            raise MemoryError("no free slot")
        slot = self._free.pop()
        self._allocated[slot] = 1
        return slot

    def claim(self, slot: int) -> None:
        """Mark a specific free slot allocated (used by NVMe recovery to re-adopt durable pages)."""
        if not 0 <= slot < self.num_slots or self._allocated[slot]:
            raise ValueError(f"slot {slot} is not free")
        self._allocated[slot] = 1
        self._free.remove(slot)

    def claim_many(self, slots: list[int]) -> None:
        """Claim many slots at once in O(num_slots) instead of O(n * num_slots)."""
        taken = set(slots)
        for s in taken:
            if not 0 <= s < self.num_slots or self._allocated[s]:
                raise ValueError(f"slot {s} is not free")
            self._allocated[s] = 1
        self._free = [s for s in self._free if s not in taken]

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or not self._allocated[slot]:
            raise ValueError(f"slot {slot} is not allocated")
        self._allocated[slot] = 0
        self._free.append(slot)

    def is_allocated(self, slot: int) -> bool:
        return bool(self._allocated[slot])
