"""The size-class allocator (kvstore/tiers/slots.py) against a plain model, under random sequences of
allocations, frees, claims and holds (hypothesis): slots never overlap, stay 4 KiB aligned and inside one
chunk of one size, the counts add up, room is never refused while a chunk of the size has a free slot or
a chunk is free, and `Grant.reformat` says exactly when a chunk changes size."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.pageformat import slot_bytes_for
from kvstore.tiers.slots import ALIGN, SizeClassAllocator

CHUNK = 16 * ALIGN  # small chunks, so a few steps fill them and change their sizes
SIZES = [ALIGN, 2 * ALIGN, 3 * ALIGN, 5 * ALIGN, 8 * ALIGN, 9 * ALIGN, CHUNK]


class AllocatorModel(RuleBasedStateMachine):
    """Every step checked against a model: offset -> size of each allocated slot, the held chunks, and the
    size each free chunk was last laid out for."""

    @initialize(chunks=st.integers(1, 5))
    def start(self, chunks: int) -> None:
        self.a = SizeClassAllocator(chunks, CHUNK)
        self.n = chunks
        self.slots: dict[int, int] = {}
        self.held: set[int] = set()
        self.last: dict[int, int] = {}

    def in_chunk(self, c: int) -> dict[int, int]:
        return {o: s for o, s in self.slots.items() if o // CHUNK == c}

    def room(self, size: int) -> bool:
        """What the model says: a chunk of this size with a free slot, or a free chunk, not held."""
        for c in range(self.n):
            if c in self.held:
                continue
            mine = self.in_chunk(c)
            if not mine or (set(mine.values()) == {size} and len(mine) < CHUNK // size):
                return True
        return False

    @rule(size=st.sampled_from(SIZES))
    def allocate(self, size: int) -> None:
        can = self.a.can_allocate(size)
        assert can == self.room(size)  # never refuses room that exists, never offers room that does not
        if not can:
            with pytest.raises(MemoryError):
                self.a.allocate(size)
            return
        g = self.a.allocate(size)
        c, rel = divmod(g.offset, CHUNK)
        assert g.nbytes == size and g.offset % ALIGN == 0 and rel % size == 0 and rel + size <= CHUNK
        assert c not in self.held
        mine = self.in_chunk(c)
        assert all(s == size for s in mine.values())  # one size per chunk
        assert all(o + s <= g.offset or g.offset + size <= o for o, s in self.slots.items())  # no overlap
        # laid out anew exactly when a free chunk changes size (or had no known layout)
        assert g.reformat == (not mine and self.last.get(c) != size)
        self.slots[g.offset] = size

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.slots)))
        size = self.slots.pop(offset)
        self.a.free(offset)
        if not self.in_chunk(offset // CHUNK):
            self.last[offset // CHUNK] = size
        with pytest.raises(ValueError, match="not allocated"):
            self.a.free(offset)

    @rule(chunk=st.integers(0, 4), size=st.sampled_from(SIZES), j=st.integers(0, 16))
    def claim(self, chunk: int, size: int, j: int) -> None:
        offset = chunk % self.n * CHUNK + j * size
        c, rel = divmod(offset, CHUNK)
        mine = self.in_chunk(c)
        ok = c < self.n and rel % size == 0 and rel + size <= CHUNK
        ok = ok and all(s == size for s in mine.values()) and offset not in mine
        if not ok:
            with pytest.raises(ValueError):
                self.a.claim(offset, size)
            return
        self.a.claim(offset, size)
        self.slots[offset] = size

    @rule(chunk=st.integers(0, 4), size=st.sampled_from(SIZES))
    def know(self, chunk: int, size: int) -> None:
        """Recovery read a free chunk's layout: taking it for that size again needs no reformat."""
        chunk %= self.n
        self.a.know(chunk, size)
        if not self.in_chunk(chunk):
            self.last[chunk] = size

    @rule(chunk=st.integers(0, 4))
    def hold(self, chunk: int) -> None:
        chunk %= self.n
        self.a.hold(chunk)
        self.held.add(chunk)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        chunk = data.draw(st.sampled_from(sorted(self.held)))
        self.a.release(chunk)
        self.held.discard(chunk)

    @invariant()
    def counts_add_up(self) -> None:
        if not hasattr(self, "a"):
            return
        assert self.a.used_count == len(self.slots)
        assert self.a.used_bytes == sum(self.slots.values())
        assert self.a.free_chunks == sum(1 for c in range(self.n) if not self.in_chunk(c))
        assert self.a.slots_assigned == sum(CHUNK // self.a.class_of(c) for c in range(self.n) if self.a.class_of(c))
        for c in range(self.n):
            mine = self.in_chunk(c)
            assert self.a.class_of(c) == (next(iter(mine.values())) if mine else 0)
            assert self.a.slots_in(c) == sorted(mine)
            for o in mine:
                assert self.a.is_allocated(o)


TestAllocatorModel = AllocatorModel.TestCase
TestAllocatorModel.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([4096, 16 << 10, 64 << 10, 300 << 10, 1 << 20, 2 << 20]), min_size=1, max_size=400))
def test_a_full_medium_wastes_less_than_one_slot_per_chunk(pages: list[int]) -> None:
    """Pages of mixed sizes put until nothing fits: every chunk of a size is full, its unused end shorter
    than one of its slots (the fragmentation bound), and no chunk is left free while a page was refused."""
    chunk = slot_bytes_for(2 << 20)  # a node started with --max-page-bytes 2MiB
    a = SizeClassAllocator(24, chunk)
    refused, stored = False, 0
    for payload in pages:
        size = slot_bytes_for(payload)
        if a.can_allocate(size):
            assert a.allocate(size).nbytes == size  # its own size: header + payload, 4 KiB aligned
            stored += size
        else:
            refused = True
    assert a.used_bytes == stored
    if refused:
        assert a.free_chunks == 0
        for c in range(24):  # a refused size found every chunk taken: each chunk is full
            s = a.class_of(c)
            assert len(a.slots_in(c)) < chunk // s or chunk - len(a.slots_in(c)) * s < s


def test_small_and_large_pages_each_take_their_own_size() -> None:
    """The motivating case: a node for 2 MiB pages holds 64 KiB pages at 68 KiB each, beside 2 MiB ones."""
    chunk = slot_bytes_for(2 << 20)
    a = SizeClassAllocator(8, chunk)
    small = [a.allocate(slot_bytes_for(64 << 10)) for _ in range(64)]
    large = [a.allocate(chunk) for _ in range(5)]
    assert all(g.nbytes == chunk for g in large)
    per_chunk = chunk // slot_bytes_for(64 << 10)
    assert per_chunk == 30 and a.used_bytes == 64 * (68 << 10) + 5 * chunk
    assert len({g.offset // chunk for g in small}) == 3  # 64 pages in 3 chunks, not 64
    assert not a.can_allocate(chunk) and a.can_allocate(slot_bytes_for(64 << 10))  # 26 small slots left
    for g in small[:30]:  # emptying a chunk gives it back to any size
        a.free(g.offset)
    g = a.allocate(chunk)
    assert g.offset == small[0].offset and g.reformat  # laid out anew: it held 68 KiB slots
    a.free(g.offset)
    assert not a.allocate(chunk).reformat  # taken again for the size it held last: nothing to erase
