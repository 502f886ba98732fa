"""Eviction policies: pure bookkeeping over opaque keys, no I/O (DESIGN.md §6).

The manager keeps one policy instance per tier and tells it what happens (insert, access, remove);
the policy answers one question: in which order should victims be considered. The manager skips
candidates it cannot evict (pinned, being read, being moved), so a policy never needs to know about
pins. Every policy here is replayable on traces without a node (kvstore/sim.py,
benchmarks/trace_replay.py).

Interface (what the TierManager calls; all forms below must keep working):
    on_insert(key)          key entered this tier
    on_access(key)          key was read (a hit in this tier)
    on_remove(key)          key left this tier (evicted, deleted, or moved to another tier)
    candidates()            iterator over every key, each once, victim order first (may be a snapshot)
    len(policy)             number of keys inserted and not removed
    first_usable(policy, usable)   module function: the first candidate with usable(key) true,
                            through the optional fast path `policy.first_candidate(usable)`

Optional hints (keyword arguments with defaults; every policy works without them, see each class):
    on_insert(key, parent=None, reads=0)
        `parent`: the key of the previous block of the same chain (the block before it in the
        request; None for a chain's first block or when unknown). Prefix-aware policies use it to
        evict a chain's tail before its head (a block whose ancestor is gone cannot be matched by a
        longest-prefix lookup); the others ignore it.
        `reads`: how many times the page was read since it was stored, in any tier (0 for a page
        just computed). A page that moves up on a hit or down on eviction carries its history into
        the next tier's policy with it; prefix-arc files a page with reads > 0 as re-referenced.
        The TierManager should pass both on every insert into a tier, including moves between
        tiers (it keeps them in its Entry for that).
    admit(key, parent=None) -> bool
        Asked before a missing block is stored; `should_admit(policy, key, parent)` asks it of any
        policy. Every policy here admits everything: prefix-arc's RECENT class already lets one-off
        blocks go first, and refusing a first sight would make the second reference a miss too
        (admit-on-second-sight moved the Mooncake synthetic trace's block hit rate by < 0.02).

Policies (config names): "lru", "prefix-lru", "arc", "s3fifo", "prefix-arc". The recommended
default is "prefix-arc" (PrefixARCPolicy): benchmarks/trace_replay.py compares them, against
Belady's offline optimum, on any trace.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Protocol

Key = Hashable


class EvictionPolicy(Protocol):
    """What the TierManager needs from a policy. Invariant: `len(policy)` equals the number of keys
    inserted and not yet removed; `candidates()` yields each of them exactly once."""

    name: str

    def on_insert(self, key: Key) -> None: ...
    def on_access(self, key: Key) -> None: ...
    def on_remove(self, key: Key) -> None: ...
    def candidates(self) -> Iterator[Key]: ...
    def __len__(self) -> int: ...


def should_admit(policy: EvictionPolicy, key: Key, parent: Key | None = None) -> bool:
    """Whether `policy` wants a missing block stored (its optional `admit`; True if it has none)."""
    fn = getattr(policy, "admit", None)
    return True if fn is None else bool(fn(key, parent))


# --------------------------------------------------------------------------------------------------
# LRU


class LRUPolicy:
    """Least recently used first. O(1) insert, access and remove. Ignores hints."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key, parent: Key | None = None, reads: int = 0) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def admit(self, key: Key, parent: Key | None = None) -> bool:
        return True

    def candidates(self) -> Iterator[Key]:
        # NOTE: iterate a snapshot so the manager may mutate the policy while walking victims.
        return iter(list(self._order))

    def first_candidate(self, usable: Callable[[Key], bool]) -> Key | None:
        """The oldest key for which usable(key) is true, without copying the whole order."""
        for key in self._order:
            if usable(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


# --------------------------------------------------------------------------------------------------
# ARC (Megiddo & Modha, FAST'03)


class ARCPolicy:
    """Adaptive Replacement Cache. T1 holds keys seen once recently, T2 keys seen at least twice;
    the ghost lists B1/B2 remember keys recently evicted from each, and a ghost hit moves the target
    size `p` of T1 towards the list that would have kept it. Invariants: T1, T2 hold exactly the
    resident keys; |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c, where c is the most keys this tier
    has held (a policy is not told its tier's capacity; a full tier stays at its high-water mark).

    NOTE: ARC picks its victim knowing the incoming key (a B2 hit tips the choice towards T1); here
    the victim is chosen before the insert, so the rule is |T1| > p alone. Hints are ignored.
    """

    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._p = 0.0
        self._c = 0

    def on_insert(self, key: Key, parent: Key | None = None, reads: int = 0) -> None:
        if key in self._t1 or key in self._t2:
            self.on_access(key)
            return
        self._c = max(self._c, len(self) + 1)
        if key in self._b1:
            self._p = min(float(self._c), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def on_access(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        self._trim_ghosts()

    def admit(self, key: Key, parent: Key | None = None) -> bool:
        return True

    def _trim_ghosts(self) -> None:
        while self._b1 and len(self._t1) + len(self._b1) > self._c:
            self._b1.popitem(last=False)
        while self._b2 and len(self) + len(self._b1) + len(self._b2) > 2 * self._c:
            self._b2.popitem(last=False)

    def _lists(self) -> tuple[OrderedDict[Key, None], OrderedDict[Key, None]]:
        """(first, second): the list victims come from first, by the |T1| > p rule."""
        if self._t1 and (len(self._t1) > self._p or not self._t2):
            return self._t1, self._t2
        return self._t2, self._t1

    def candidates(self) -> Iterator[Key]:
        first, second = self._lists()
        return iter([*first, *second])

    def first_candidate(self, usable: Callable[[Key], bool]) -> Key | None:
        first, second = self._lists()
        for lst in (first, second):
            for key in lst:
                if usable(key):
                    return key
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


# --------------------------------------------------------------------------------------------------
# S3-FIFO (Yang et al., SOSP'23)


class S3FIFOPolicy:
    """S3-FIFO: a small FIFO S for new keys, a main FIFO M, a ghost FIFO G of keys evicted from S.
    A key is inserted into S (into M if G remembers it); an access raises its 2-bit counter. The
    victim comes from S while S holds at least SMALL_FRACTION of the keys: S's head moves to M if it
    was accessed, else it is the victim. Otherwise M's head is the victim if its counter is 0, else
    its counter drops by one and it goes to M's tail. Invariants: S and M hold exactly the resident
    keys; |G| <= |M|'s share of the high-water mark. Hints are ignored.

    NOTE: `first_candidate` performs those moves (S -> M, M head -> tail) as it looks: they only
    reorder resident keys. `candidates()` runs the same procedure on a copy, so its first usable key
    is what `first_candidate` returns (up to the |S| test, which a skipped pinned key shifts).
    """

    name = "s3fifo"
    SMALL_FRACTION = 0.1  # NOTE: the paper's value; S is a probation window for one-hit wonders
    MAX_FREQ = 3  # 2-bit counter, as in the paper

    def __init__(self) -> None:
        self._s: OrderedDict[Key, None] = OrderedDict()
        self._m: OrderedDict[Key, None] = OrderedDict()
        self._g: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._c = 0

    def on_insert(self, key: Key, parent: Key | None = None, reads: int = 0) -> None:
        if key in self._freq:
            self.on_access(key)
            return
        self._freq[key] = 0
        if key in self._g:
            del self._g[key]
            self._m[key] = None
        else:
            self._s[key] = None
        self._c = max(self._c, len(self._freq))

    def on_access(self, key: Key) -> None:
        f = self._freq.get(key)
        if f is not None:
            self._freq[key] = min(f + 1, self.MAX_FREQ)

    def on_remove(self, key: Key) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._s:
            del self._s[key]
            self._g[key] = None
            while len(self._g) > max(1, self._c - int(self._c * self.SMALL_FRACTION)):
                self._g.popitem(last=False)
        else:
            del self._m[key]

    def admit(self, key: Key, parent: Key | None = None) -> bool:
        return True

    @staticmethod
    def _walk(
        s: OrderedDict[Key, None],
        m: OrderedDict[Key, None],
        freq: dict[Key, int],
        small_min: float,
        usable: Callable[[Key], bool],
    ) -> Key | None:
        """The S3-FIFO eviction procedure, passing over keys usable() rejects; moves keys as it goes.
        Terminates: every pass either returns, moves a key from S to M (at most |S| times) or lowers
        a counter (at most 3 per key)."""
        skipped: set[Key] = set()
        while True:
            if len(s) >= small_min:
                head = _first(s, skipped, usable, freq)
                if head is not None and freq[head] > 0:
                    del s[head]
                    freq[head] = 0
                    m[head] = None
                    continue
                if head is not None:
                    return head
            head = _first(m, skipped, usable, freq)
            if head is not None and freq[head] > 0:
                freq[head] -= 1
                m.move_to_end(head)
                continue
            if head is not None:
                return head
            # Every key of M is unusable: S's usable keys, in order, whatever their counters.
            return next((k for k in s if k not in skipped and usable(k)), None)

    def first_candidate(self, usable: Callable[[Key], bool]) -> Key | None:
        return self._walk(self._s, self._m, self._freq, self._c * self.SMALL_FRACTION, usable)

    def candidates(self) -> Iterator[Key]:
        s, m, freq = OrderedDict(self._s), OrderedDict(self._m), dict(self._freq)
        small_min = self._c * self.SMALL_FRACTION
        order: list[Key] = []
        while s or m:
            key = self._walk(s, m, freq, small_min, lambda _k: True)
            if key is None:  # pragma: no cover - the walk always finds one while keys remain
                break
            order.append(key)
            s.pop(key, None)
            m.pop(key, None)
        return iter(order)

    def __len__(self) -> int:
        return len(self._freq)


def _first(
    fifo: OrderedDict[Key, None], skipped: set[Key], usable: Callable[[Key], bool], freq: dict[Key, int]
) -> Key | None:
    """The first key of `fifo` not skipped that is either accessed (to be moved) or usable; an
    unaccessed unusable key is added to `skipped` on the way."""
    for key in fifo:
        if key in skipped:
            continue
        if freq[key] > 0 or usable(key):
            return key
        skipped.add(key)
    return None


# --------------------------------------------------------------------------------------------------
# Prefix-aware policies: leaves of the chain forest first


@dataclass(slots=True)
class _Node:
    parent: Key | None  # previous block of the chain (hint), None for a head or when unknown
    kids: int  # children resident in this tier
    seg: int  # segment (victim class) of the node; 0 for single-segment policies
    prio: float = 0.0  # eviction priority within its segment, lowest first
    seq: int = 0  # the heap entry that is live for this node (older entries are stale)
    freq: int = 0  # references (inserts and accesses), history included


class PrefixTreePolicy:
    """Base of the prefix-aware policies. Keys form a forest through the `parent` hint; a block can
    only be matched while every ancestor is cached, so victims are taken from the leaves (resident
    keys with no resident child in this tier): a chain's tail always goes before its head.
    Resident keys are split into SEGMENTS classes; `_segment_order()` says which class gives victims
    first, and within a class the leaf with the lowest `prio` goes first. Subclasses decide the class
    on insert (`_entering`) and set prio on every insert and access (`_touch`).

    Invariants: `_nodes` holds exactly the resident keys; `kids` of a node is the number of resident
    keys naming it as parent; `_seg_size[s]` counts resident keys of class s; every resident leaf has
    exactly one live entry (prio, seq, key) in its class's heap, with seq == node.seq (entries of
    internal nodes, of other classes and superseded ones are stale and skipped). Victim choice is
    O(log n) amortised: heaps of leaves with lazy invalidation, rebuilt when stale entries outnumber
    live keys.

    candidates() is a snapshot: for each class in victim order its leaves by prio, then the
    internal keys by prio, so its first key accepted by any usable() is exactly
    first_candidate(usable). (Evicting a leaf can make its parent a leaf; the snapshot does not show
    that, the fast path does.) Only when no leaf is usable does an internal key become a victim; its
    resident children then cannot be matched until it returns. Without parent hints every key is a
    leaf and the policy is its class and prio rules alone.

    A key whose parent is not resident in this tier is a head here (the parent may be cached in
    another tier, e.g. after a promotion), so tiers do not need to see each other.
    """

    name = "prefix-tree"
    SEGMENTS = 1
    COMPACT_SLACK = 64  # stale heap entries tolerated beyond 2x the live keys before a rebuild

    def __init__(self) -> None:
        self._nodes: dict[Key, _Node] = {}
        self._kids: dict[Key, set[Key]] = {}  # parent key -> its resident children (parent may be absent)
        self._heaps: list[list[tuple[float, int, Key]]] = [[] for _ in range(self.SEGMENTS)]
        self._seg_size = [0] * self.SEGMENTS
        self._seq = 0

    # -- events -------------------------------------------------------------------------------------

    def on_insert(self, key: Key, parent: Key | None = None, reads: int = 0) -> None:
        if key in self._nodes:
            self.on_access(key)
            return
        parent, seg = self._entering(key, parent, reads)
        kids = self._kids.get(key)
        node = _Node(parent, len(kids) if kids else 0, seg)
        self._nodes[key] = node
        self._seg_size[seg] += 1
        if parent is not None:
            self._kids.setdefault(parent, set()).add(key)
            pnode = self._nodes.get(parent)
            if pnode is not None:
                pnode.kids += 1
        self._touch(key, node, first=True)
        self._push(key, node)

    def on_access(self, key: Key) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        self._touch(key, node, first=False)
        self._push(key, node)

    def on_remove(self, key: Key) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        self._seg_size[node.seg] -= 1
        if node.parent is not None:
            siblings = self._kids.get(node.parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._kids[node.parent]
            pnode = self._nodes.get(node.parent)
            if pnode is not None:
                pnode.kids -= 1
                self._push(node.parent, pnode)
        self._removed(key, node)

    def admit(self, key: Key, parent: Key | None = None) -> bool:
        return True

    # -- subclass hooks -----------------------------------------------------------------------------

    def _entering(self, key: Key, parent: Key | None, reads: int) -> tuple[Key | None, int]:
        """(parent to use, class) for a key entering the tier."""
        return parent, 0

    def _touch(self, key: Key, node: _Node, *, first: bool) -> None:
        """Set node.prio (and maybe its class, through _move) for an insert (first) or an access."""
        raise NotImplementedError

    def _removed(self, key: Key, node: _Node) -> None:
        """A key left (evicted, deleted or moved to another tier)."""

    def _segment_order(self) -> tuple[int, ...]:
        """Classes in the order victims are taken from them."""
        return tuple(range(self.SEGMENTS))

    def _move(self, node: _Node, seg: int) -> None:
        self._seg_size[node.seg] -= 1
        self._seg_size[seg] += 1
        node.seg = seg

    # -- victims ------------------------------------------------------------------------------------

    def _push(self, key: Key, node: _Node) -> None:
        if node.kids:
            return
        self._seq += 1
        node.seq = self._seq
        heap = self._heaps[node.seg]
        heapq.heappush(heap, (node.prio, self._seq, key))
        if len(heap) > 2 * len(self._nodes) + self.COMPACT_SLACK:
            seg = node.seg
            heap[:] = [(n.prio, n.seq, k) for k, n in self._nodes.items() if not n.kids and n.seg == seg]
            heapq.heapify(heap)

    def _live(self, entry: tuple[float, int, Key], seg: int) -> bool:
        node = self._nodes.get(entry[2])
        return node is not None and node.seq == entry[1] and not node.kids and node.seg == seg

    def first_candidate(self, usable: Callable[[Key], bool]) -> Key | None:
        for seg in self._segment_order():
            heap = self._heaps[seg]
            held: list[tuple[float, int, Key]] = []
            found: Key | None = None
            while heap:
                entry = heap[0]
                if not self._live(entry, seg):
                    heapq.heappop(heap)
                elif usable(entry[2]):
                    found = entry[2]
                    break
                else:
                    held.append(heapq.heappop(heap))
            for entry in held:
                heapq.heappush(heap, entry)
            if found is not None:
                return found
        # NOTE: every leaf is pinned or busy; an internal key is better than failing the caller.
        return next((k for k in self._internal_order() if usable(k)), None)

    def _internal_order(self) -> list[Key]:
        return [k for _, _, k in sorted((n.prio, n.seq, k) for k, n in self._nodes.items() if n.kids)]

    def candidates(self) -> Iterator[Key]:
        order: list[Key] = []
        for seg in self._segment_order():
            leaves = sorted((n.prio, n.seq, k) for k, n in self._nodes.items() if not n.kids and n.seg == seg)
            order.extend(k for _, _, k in leaves)
        order.extend(self._internal_order())
        return iter(order)

    def __len__(self) -> int:
        return len(self._nodes)


class PrefixLRUPolicy(PrefixTreePolicy):
    """Prefix-aware LRU: the least recently used leaf first (a chain is eaten from its tail)."""

    name = "prefix-lru"

    def __init__(self) -> None:
        super().__init__()
        self._clock = 0

    def _touch(self, key: Key, node: _Node, *, first: bool) -> None:
        self._clock += 1
        node.prio = float(self._clock)


class _Seg:
    """The two victim classes of PrefixARCPolicy (ARC's T1 and T2)."""

    RECENT = 0  # seen once: inserted and not referenced since (T1)
    FREQUENT = 1  # referenced again: accessed while resident, or re-inserted from a ghost list (T2)


class PrefixARCPolicy(PrefixTreePolicy):
    """ARC's adaptive recency/frequency split, applied to the leaves of the chain forest: the
    recommended policy for prefix-chain workloads (multi-turn conversations, shared system prompts,
    shared documents).

    Victim rule. Keys are in one of two classes: RECENT (seen once) and FREQUENT (referenced again:
    accessed while resident, inserted with reads > 0, or found in a ghost list on insert). The victim
    is the least recently used *leaf* (a key with no resident child, see PrefixTreePolicy) of RECENT
    while RECENT holds more than the target `p` keys, else of FREQUENT (the other class when one has
    no usable leaf). A chain therefore leaves from its tail, so the cache stays prefix-closed and
    every cached block of a chain is usable by the longest-prefix lookup.

    Adaptation (Megiddo & Modha, FAST'03). Ghost lists B1/B2 remember keys recently evicted from
    RECENT/FREQUENT. A key re-inserted from B1 would have hit had RECENT been larger: p grows by
    max(1, |B2|/|B1|); one from B2: p shrinks by max(1, |B1|/|B2|). So the split follows the workload:
    one-off prompts (long documents asked once, unique question suffixes) churn through a small
    RECENT class while re-used chains (system prompts, conversation histories) hold FREQUENT; when
    second references come soon (a chat's next turn), p grows and RECENT keeps new turns longer.

    Invariants: as PrefixTreePolicy; the ghost lists hold only non-resident keys;
    |RECENT| + |B1| <= c and |RECENT| + |FREQUENT| + |B1| + |B2| <= 2c; 0 <= p <= c. Here c, the
    capacity ARC is sized by, is the most keys this tier has held: a policy is not told its tier's
    size, and a full tier stays at its high-water mark. A ghost entry keeps the key's parent, so a
    chain re-inserted without hints is re-linked.

    NOTE: textbook ARC picks its victim knowing the incoming key (a B2 hit tips the choice to T1);
    here the victim is chosen before the insert (the manager frees a slot first), so the rule is
    |RECENT| > p alone. Without parent hints every key is a leaf and this is ARC with that rule.
    """

    name = "prefix-arc"
    SEGMENTS = 2

    def __init__(self) -> None:
        super().__init__()
        self._clock = 0
        self._c = 0
        self._p = 0.0
        self._b1: OrderedDict[Key, Key | None] = OrderedDict()  # ghost of RECENT: key -> parent
        self._b2: OrderedDict[Key, Key | None] = OrderedDict()  # ghost of FREQUENT: key -> parent

    def _entering(self, key: Key, parent: Key | None, reads: int) -> tuple[Key | None, int]:
        self._c = max(self._c, len(self._nodes) + 1)
        b1, b2 = len(self._b1), len(self._b2)
        if key in self._b1:
            old_parent = self._b1.pop(key)
            self._p = min(float(self._c), self._p + max(b2 / b1, 1.0))
        elif key in self._b2:
            old_parent = self._b2.pop(key)
            self._p = max(0.0, self._p - max(b1 / b2, 1.0))
        else:
            return parent, (_Seg.FREQUENT if reads > 0 else _Seg.RECENT)
        return (parent if parent is not None else old_parent), _Seg.FREQUENT

    def _touch(self, key: Key, node: _Node, *, first: bool) -> None:
        self._clock += 1
        node.prio = float(self._clock)
        if first:
            self._trim_ghosts()
        elif node.seg == _Seg.RECENT:
            self._move(node, _Seg.FREQUENT)

    def _removed(self, key: Key, node: _Node) -> None:
        (self._b1 if node.seg == _Seg.RECENT else self._b2)[key] = node.parent
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        while self._b1 and self._seg_size[_Seg.RECENT] + len(self._b1) > self._c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._nodes) + len(self._b1) + len(self._b2) > 2 * self._c:
            self._b2.popitem(last=False)

    def _segment_order(self) -> tuple[int, ...]:
        if self._seg_size[_Seg.RECENT] > self._p:
            return (_Seg.RECENT, _Seg.FREQUENT)
        return (_Seg.FREQUENT, _Seg.RECENT)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "prefix-lru": PrefixLRUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "prefix-arc": PrefixARCPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by its config name; raises ValueError naming the known ones."""
    try:
        return POLICIES[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None


def first_usable(policy: EvictionPolicy, usable: Callable[[Key], bool]) -> Key | None:
    """First candidate accepted by usable(), using a policy's fast path when it has one."""
    fast = getattr(policy, "first_candidate", None)
    if fast is not None:
        return fast(usable)
    return next((k for k in policy.candidates() if usable(k)), None)
