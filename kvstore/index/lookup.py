"""What a cluster lookup found, and the plan to fetch it (pure: no Redis, no I/O)."""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.index.keys import holders_of
from kvstore.names import TierKind

# How a reader ranks a holder: (class, tie-break); smaller first. The class goes before the run's length
# (kvstore/index/choose.py: this host's node, then other nodes, then suspect ones), the tie-break after it.
Preference = Callable[[str], tuple[int, float]]


@dataclass(slots=True)
class NodeShare:
    """How much of a looked-up prefix one live node holds."""

    node_id: str
    blocks: int  # matched blocks this node holds (anywhere in the prefix)
    leading: int  # length of the run it holds from block 0
    tiers: dict[TierKind, int] = field(default_factory=dict)  # blocks per tier


@dataclass(slots=True)
class ClusterLookup:
    """Longest prefix held anywhere, and who holds each block of it (live nodes, current epochs)."""

    matched: int
    holders: list[dict[str, TierKind]]  # per matched block: node_id -> tier
    nodes: dict[str, NodeShare]

    def best_holder(
        self, i: int, excluded: Container[tuple[str, int]] = (), prefer: Preference | None = None
    ) -> tuple[str, int] | None:
        """(node, run) to fetch from at block i: the holder `prefer` ranks first (its class: e.g. this host's
        node before others, a suspect node last), then the longest run from i, then `prefer`'s tie-break (e.g.
        the least loaded), the hotter tier, the node id (stable); None when every holder of block i is
        excluded. Without `prefer`, every holder is of one class and ties go to the tier and node id."""
        best: tuple[int, int, float, int, str] | None = None
        for node, tier in self.holders[i].items():
            if (node, i) in excluded:
                continue
            run = 1
            while i + run < self.matched and node in self.holders[i + run]:
                run += 1
            cls, tie = prefer(node) if prefer is not None else (0, 0.0)
            cand = (cls, -run, tie, int(tier), node)
            if best is None or cand < best:
                best = cand
        return None if best is None else (best[4], -best[1])

    def plan(self, prefer: Preference | None = None) -> list[tuple[str, int, int]]:
        """Segments (node_id, start, end) covering blocks [0, matched), chosen by best_holder."""
        out: list[tuple[str, int, int]] = []
        i = 0
        while i < self.matched:
            node, run = self.best_holder(i, (), prefer)  # type: ignore[misc]  # every matched block has a holder
            out.append((node, i, i + run))
            i += run
        return out


def from_entries(values: Sequence[bytes | str | None], live: Mapping[str, int]) -> ClusterLookup:
    """What a chain's entries say (pure): values[i] is block i's entry (None: none, or unknown), `live` the
    current epoch of each live node. A holder counts only for a live node at its current epoch; the
    prefix ends at the first block with no holder that counts."""
    holders: list[dict[str, TierKind]] = []
    for value in values:
        block = holders_in(value, live) if value else {}
        if not block:
            break
        holders.append(block)
    return summarize(holders)


def holders_in(value: bytes | str, live: Mapping[str, int]) -> dict[str, TierKind]:
    """The holders of one entry that count: node -> tier, for live nodes at their current epoch (pure)."""
    block: dict[str, TierKind] = {}
    for node, epoch, tier in holders_of(value):
        if live.get(node) == epoch and tier in _TIERS:
            block[node] = TierKind(tier)
    return block


_TIERS = frozenset(int(t) for t in TierKind)


def summarize(holders: list[dict[str, TierKind]]) -> ClusterLookup:
    """The ClusterLookup of a matched prefix, given who holds each of its blocks (pure)."""
    nodes: dict[str, NodeShare] = {}
    for i, block in enumerate(holders):
        for node, tier in block.items():
            share = nodes.setdefault(node, NodeShare(node, 0, 0))
            share.blocks += 1
            share.tiers[tier] = share.tiers.get(tier, 0) + 1
            if share.leading == i:
                share.leading += 1
    return ClusterLookup(len(holders), holders, nodes)
