"""Where a put or a copy goes, and which holder a read goes to (pure: no Redis, no I/O; DESIGN.md §7.1, §7.3).

A node as these choices see it is a `NodeLoad`, read from its index record (free DRAM and NVMe slots, the
payload bytes per second it serves, its host) and the readers' view of whether it answers (suspect: its beat
key is gone, kvstore/index/keys.py; or a call to it just failed).

Reads (`read_preference`): a holder on the reader's host first (the same-host plane: no network), then the other
holders, suspect ones last; among holders of one class the longest run wins (one stream), then the least loaded,
drawn at random with odds falling with load, so readers do not all go to whichever node the last heartbeat said
was idle.

Puts and copies (`pick`): the better of two nodes drawn at random by free room and load (power of two choices),
never "the highest node id": a node that joins (empty, idle) wins nearly every draw it is in until it holds its
share, and a full or busy node is drawn but loses. A copy (`copy_targets`) draws with a generator seeded by the
pages' namespace and holders, so holders that decide to copy the same pages at the same time pick the same
destination (the second finds the pages there), and a copy never goes where it would eat into the destination's
free reserve.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from kvstore.index.lookup import Preference

# Load below this is noise (bytes/s): an idle cluster's nodes all count as equally loaded.
LOAD_FLOOR_BPS = 1 << 20
SAME_HOST, OTHER_HOST, SUSPECT = 0, 1, 2  # read classes, preferred first
DRAWS = 2  # nodes drawn per pick (power of two choices)
ROOM_FLOOR = 0.02  # a node with less free room than this takes no new chains while others have room


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """One live node as placement sees it."""

    node_id: str
    host: str = ""
    free_slots: int = 0
    total_slots: int = 0
    load_bps: float = 0.0  # payload bytes per second it serves to readers (index record, per heartbeat)
    suspect: bool = False

    @property
    def free_fraction(self) -> float:
        return self.free_slots / self.total_slots if self.total_slots > 0 else 0.0


def from_record(node_id: str, info: Mapping[str, str], suspect: bool = False) -> NodeLoad:
    """A node's load from its index record (absent or malformed fields read as 0: a record of an older node)."""

    def num(name: str) -> float:
        try:
            return max(0.0, float(info.get(name, 0) or 0))
        except ValueError:
            return 0.0

    total = used = 0
    for tier in ("dram", "nvme"):
        total += int(num(f"slots_total_{tier}"))
        used += int(num(f"slots_used_{tier}"))
    return NodeLoad(node_id, info.get("host_id", ""), max(0, total - used), total, num("load_bps"), suspect)


def score(n: NodeLoad, mean_load: float) -> float:
    """How much a node wants new pages: its free room, discounted by its load relative to the mean."""
    return n.free_fraction / (1.0 + n.load_bps / max(mean_load, LOAD_FLOOR_BPS))


def pick(cands: Sequence[NodeLoad], rng: random.Random, mean_load: float | None = None) -> NodeLoad | None:
    """The better (by `score`) of DRAWS nodes drawn from `cands`; None when there are none."""
    if not cands:
        return None
    mean = mean_load if mean_load is not None else sum(n.load_bps for n in cands) / len(cands)
    drawn = rng.sample(list(cands), min(DRAWS, len(cands)))
    return max(drawn, key=lambda n: score(n, mean))  # NOTE: ties go to the first drawn: at random, not by id


def copy_targets(
    seed: bytes, cands: Sequence[NodeLoad], *, count: int, need_slots: int, reserve: float, mean_load: float
) -> list[str]:
    """Up to `count` distinct nodes to copy `need_slots` pages to: not suspect, and left with at least `reserve`
    of their slots free after the copy. Drawn with a generator seeded by `seed` (the pages' namespace and
    holders), so every holder deciding at once draws the same nodes (given the same records)."""
    room = [
        n
        for n in cands
        if not n.suspect and n.total_slots > 0 and (n.free_slots - need_slots) / n.total_slots >= reserve
    ]
    room.sort(key=lambda n: n.node_id)  # the draw depends on the page, not on the order records came in
    rng = random.Random(hashlib.sha256(seed).digest())
    out: list[str] = []
    for _ in range(count):
        chosen = pick(room, rng, mean_load)
        if chosen is None:
            break
        out.append(chosen.node_id)
        room.remove(chosen)
    return out


def put_target(
    nodes: Sequence[NodeLoad],
    rng: random.Random,
    *,
    local: Collection[str] = (),
    affinity: Collection[str] = (),
) -> NodeLoad | None:
    """Where a new chain (or a chain's next pages) goes: among nodes that answer and have room (ROOM_FLOOR), this
    host's node (`local`; those of them holding the chain's parent first), else a node holding the parent
    (`affinity`: the longest leading run), else any, each by `pick`. None when no node is live."""
    if not nodes:
        return None
    mean = sum(n.load_bps for n in nodes) / len(nodes)
    healthy = [n for n in nodes if not n.suspect] or list(nodes)
    roomy = [n for n in healthy if n.free_fraction >= ROOM_FLOOR] or healthy
    here = [n for n in roomy if n.node_id in local]
    for group in ([n for n in here if n.node_id in affinity], here, [n for n in roomy if n.node_id in affinity]):
        if group:
            return pick(group, rng, mean)
    return pick(roomy, rng, mean)


def read_preference(
    loads: Mapping[str, NodeLoad], local_host: str, down: Collection[str], rng: random.Random
) -> Preference:
    """How a reader on `local_host` ranks a page's holders (kvstore/index/lookup.py `Preference`): class first
    (SAME_HOST, OTHER_HOST, SUSPECT: suspect in the index or `down` for this reader), then, after the run's
    length, a draw whose odds fall with the node's load."""
    mean = max(sum(n.load_bps for n in loads.values()) / len(loads) if loads else 0.0, LOAD_FLOOR_BPS)

    def prefer(node: str) -> tuple[int, float]:
        n = loads.get(node)
        if node in down or (n is not None and n.suspect):
            return SUSPECT, rng.random()
        cls = SAME_HOST if n is not None and local_host and n.host == local_host else OTHER_HOST
        load = n.load_bps if n is not None else mean
        return cls, (1.0 + load / mean) * rng.random()

    return prefer
