"""Which pages of one store the node actually holds afterwards: the rule every engine door reports by. Pure.

A Put answers per page whether the node holds it (`PutResult.held`, the node's own answer: a page it refused,
or that the same Put stored and then evicted, is not held), and the doors report exactly that. What follows is
the rule for a node that predates that answer: its Put answers with counts for the whole call (`stored` new
pages, `already_present` ones), and a page the node refused (full DRAM whose policy did not admit it, with no
NVMe to write it through; no room at all) is neither. An engine asks per page (SGLang's `batch_set_v1` list,
LMCache's store result and its L2 usage notices, vLLM's store job), so a door must never answer "stored" for
a page the node did not keep:

- fast path: stored + already_present == pages in the call. Every page is held; nothing more is asked
  (measured: a comparison and one tuple, about a microsecond per call: benchmarks/doors_bench.py part 3,
  RESULTS.md);
- refused pages: the counts say how many, not which. Prefix Lookups of the call's hashes find them: a
  Lookup from page i answers how many pages from i on are held, so the page after that run is one the node
  refused, and the next Lookup starts past it. At most MAX_RESOLVE_LOOKUPS of them per call; pages not
  reached by then are reported failed. That is the safe direction: a page reported failed that the node
  did keep costs the engine a store it did not need, a page reported stored that it did not keep costs the
  engine KV it believes it has (LMCache drops its L1 copy, SGLang moves its backup on);
- nothing held (stored + already_present == 0), or the call failed: every page failed, no Lookup.

A page evicted by other traffic between the Put and the Lookups reads as refused (reported failed), for the
same reason. Lookups touch no recency on the node (TierManager.lookup), so resolving changes no eviction
order. What the counts cannot show: a page the node stored and then evicted within the same Put (a Put larger
than a DRAM-only node's DRAM, whose later pages push out its earlier ones) is counted as stored, so the fast
path reports it held; the per-page answer of this release's nodes closes that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# NOTE: each Lookup finds at least one refused page, so this bounds the slow path to 8 small control round
# trips per call (~0.3 ms each on loopback) however the node's admission policy interleaved its refusals;
# the pages past the 8th refusal are reported failed (see the module docstring for why that is the safe side).
MAX_RESOLVE_LOOKUPS = 8

HeldFrom = Callable[[int], "int | None"]  # i -> leading pages of hashes[i:] the node holds; None: could not ask


@dataclass(frozen=True, slots=True)
class Stored:
    """The outcome of one store, per page. Invariants: `held[i]` is True only for a page the node stored in
    this call or already held when it answered; `new <= sum(held)` (new: the node's `stored` count)."""

    held: tuple[bool, ...]
    new: int = 0

    @classmethod
    def failed(cls, pages: int) -> Stored:
        """Nothing held: the call failed or the node refused every page."""
        return cls((False,) * pages, 0)

    @property
    def ok(self) -> bool:
        """Every page held (an empty store is a success)."""
        return all(self.held)

    @property
    def count(self) -> int:
        """Pages held."""
        return sum(self.held)

    def __len__(self) -> int:
        return len(self.held)

    def __add__(self, other: Stored) -> Stored:
        """The outcome of two consecutive calls, as one."""
        return Stored(self.held + other.held, self.new + other.new)


def held_pages(pages: int, reported: int, held_from: HeldFrom, max_lookups: int = MAX_RESOLVE_LOOKUPS) -> list[bool]:
    """Which of a call's `pages` the node holds, from its count `reported` (stored + already present) and,
    only when that falls short, at most `max_lookups` calls of `held_from` (module docstring)."""
    if reported >= pages:
        return [True] * pages
    held = [False] * pages
    if reported <= 0:
        return held
    i = found = 0
    for _ in range(max_lookups):
        if i >= pages or found >= reported:
            break  # past the end, or every page the node counted is placed: the rest were refused
        run = held_from(i)
        if run is None:
            break  # the node did not answer: what is not known to be held is reported failed
        run = max(0, min(run, pages - i))
        held[i : i + run] = [True] * run
        found += run
        i += run + 1  # page i + run is one the node does not hold
    return held


def pages_held(regions: Sequence[bool], per_page: int) -> list[bool]:
    """Per engine page, from per region (a page stored as `per_page` kvstore pages): held when all its regions are."""
    return [all(regions[p * per_page : (p + 1) * per_page]) for p in range(len(regions) // per_page)]
