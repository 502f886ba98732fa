"""A hybrid model's groups of one chunk as one bundle: the grouping every engine door shares (pure, no I/O).

Engines with several KV cache groups (vLLM's hybrid memory allocator: an OffloadKey is a block hash and a group
index; LMCache's multiprocess object groups: an ObjectKey's `object_group_id`; SGLang's pools) hand a door a
flat list of items, one per (chunk, group). A door stores every group of a chunk that one call carries as one
multi-part page (DESIGN.md §4.3): its groups commit together and load together, or not at all. Which groups a
chunk's bundle holds is named in its namespace, so a call that carries another set of groups (a sliding-window
group past its window) reads and writes other pages: a miss, never some groups of a chunk.

`runs(items)` cuts the items into runs of consecutive chunks that carry the same set of groups, in order of each
chunk's first item; each run is one namespace and one bundle call.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Run:
    """Consecutive chunks carrying exactly `groups` (sorted): `chunks[j]` is chunk j's identity and `items[j]`
    maps each group to the index of its item in the caller's list."""

    groups: tuple[int, ...]
    chunks: list[Hashable] = field(default_factory=list)
    items: list[dict[int, int]] = field(default_factory=list)


def runs(items: Sequence[tuple[Hashable, int]]) -> list[Run]:
    """Items (chunk identity, group) cut into runs of chunks with the same groups (module docstring). An item
    repeated for the same chunk and group keeps its first place."""
    order: list[Hashable] = []
    of: dict[Hashable, dict[int, int]] = {}
    for i, (chunk, group) in enumerate(items):
        if chunk not in of:
            order.append(chunk)
            of[chunk] = {}
        of[chunk].setdefault(int(group), i)
    out: list[Run] = []
    for chunk in order:
        groups = tuple(sorted(of[chunk]))
        if not out or out[-1].groups != groups:
            out.append(Run(groups))
        out[-1].chunks.append(chunk)
        out[-1].items.append(of[chunk])
    return out


def part_name(group: int) -> str:
    """A group's part in a bundle: `g0`, `g1`, ..."""
    return f"g{group}"


def groups_label(groups: Sequence[int]) -> str:
    """The groups a bundle holds, as a namespace names them: `g0+g1`."""
    return "+".join(part_name(g) for g in groups)
