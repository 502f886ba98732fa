"""Prefix-aware policies: victims are leaves of the chain forest, so a chain leaves from its tail.
Pure bookkeeping, no I/O."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvstore.policy.base import Key

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
        self._all_segments = tuple(range(self.SEGMENTS))
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
        return self._all_segments

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

    def _first_leaf(self, seg: int, usable: Callable[[Key], bool]) -> Key | None:
        """The usable leaf of class `seg` with the lowest prio (stale heap entries are dropped)."""
        heap = self._heaps[seg]
        nodes = self._nodes
        held: list[tuple[float, int, Key]] = []
        found: Key | None = None
        while heap:
            entry = heap[0]
            node = nodes.get(entry[2])  # NOTE: is the entry live? (this loop runs on every victim query)
            if node is None or node.seq != entry[1] or node.kids or node.seg != seg:
                heapq.heappop(heap)
            elif usable(entry[2]):
                found = entry[2]
                break
            else:
                held.append(heapq.heappop(heap))
        for entry in held:
            heapq.heappush(heap, entry)
        return found

    def first_candidate(self, usable: Callable[[Key], bool]) -> Key | None:
        for seg in self._segment_order():
            found = self._first_leaf(seg, usable)
            if found is not None:
                return found
        # NOTE: every leaf is pinned or busy; an internal key is better than failing the caller.
        return self._first_internal(usable)

    def _first_internal(self, usable: Callable[[Key], bool]) -> Key | None:
        # NOTE: one pass for the least (prio, seq) usable internal key, not a sort of them all: a small
        # tier whose leaves are all pinned by a long request asks this on every miss.
        best: tuple[float, int, Key] | None = None
        for k, n in self._nodes.items():
            if n.kids and (best is None or (n.prio, n.seq) < best[:2]) and usable(k):
                best = (n.prio, n.seq, k)
        return None if best is None else best[2]

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
        self._cold = 0  # demoted keys take prios below this (see demote)

    def _touch(self, key: Key, node: _Node, *, first: bool) -> None:
        self._clock += 1
        node.prio = float(self._clock)

    def stamp(self, key: Key) -> float | None:
        """The recency of a resident key (it changes on every insert and access of it); None if absent."""
        node = self._nodes.get(key)
        return None if node is None else node.prio

    def demote(self, keys: list[Key]) -> None:
        """Put the resident ones of `keys` (oldest first) before every other key in the victim order,
        in their order; a later access or insert gives a key its place by recency again."""
        cold = self._cold - len(keys)
        for i, key in enumerate(keys):
            node = self._nodes.get(key)
            if node is not None:
                node.prio = float(cold + i)  # NOTE: below every clock value (>= 1) and earlier demotions
                self._push(key, node)
        self._cold = cold


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
