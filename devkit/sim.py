"""Trace replay of a block cache: pure simulation, no I/O (DESIGN.md §6).

A trace is a list of requests in arrival order; a request is the list of its prompt's block ids
(chained hashes: two requests share a block id only where they share the whole prefix up to it).
`replay` serves each request against a cache object and counts hits; `belady_block_hits` gives the
offline optimum for the same trace; `TieredBlockCache` is the simulated cache that drives the eviction
policies of `kvstore.policy` the way the TierManager does. Reading trace files is the caller's job
(benchmarks/trace_replay.py); `TraceRecord.from_json` turns one decoded JSON object into a record.

Semantics of one request (what a serving engine does):
    1. lookup: the blocks are looked up in order, before anything of this request is stored. The
       engine can only use the longest cached prefix (attention over block d needs blocks 0..d-1).
    2. put: every block of the request is then accessed in order (a cached block is touched, a block
       in a lower tier is promoted, a missing block is computed and inserted), each with `parent` =
       the previous block of the request (None for the first one).

Hit rates (all over the total number of blocks in the trace):
    block hit rate   blocks found cached at lookup time, at any position of the request. A block
                     cached after the first miss of its request counts here: it is a hit for the
                     cache, but the engine cannot use it, since its prefix must be recomputed.
    prefix hit rate  per request, the length of the longest cached prefix: the blocks whose prefill
                     is really saved. Always <= the block hit rate.
    per tier         for a tiered cache, the block (prefix) hits served from each tier; they sum to
                     the block (prefix) hit rate.
    first reuse      the block hits on a block's second reference (its first reuse), a part of the
                     block hit rate: a policy that admits a block only on evidence of reuse (second
                     sight) cannot get them, so where Belady's lead over it is made of these, no
                     such policy closes it.
    Belady           `belady_block_hits`: Belady's MIN with bypass, the most block hits any cache of
                     that capacity can get on the trace (an upper bound for both rates above).

While a request is served its blocks are pinned (the engine holds them), so a request never evicts
its own blocks; a request longer than the cache stores what fits. devkit/workloads.py generates
the workload suite (chat, RAG, agents, batch jobs, tenants) to replay here.

Admission (see kvstore/policy/admission.py): a block that is not in the top tier (a miss, or a hit
in a lower tier) and would enter it while it is full is first offered to the top tier's policy as
`admit(key, victim, parent)`, victim being the key its first_usable() chose (None when every block
there is pinned: the call then only tells the policy of the reference). Refused, a missing block is
written through to the next tier down (never lost while a lower tier has room) or, with no lower
tier, not stored; a block in a lower tier stays there and is read from there. The victim chosen for
the question is the one evicted: the policy is not asked twice. A policy that refuses the block
whatever the victim says so first (`refuses`, asked through refused_outright) and no victim is chosen.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvstore.policy import EvictionPolicy, first_usable, make_policy, refused_outright, should_admit

Block = Hashable


@dataclass(slots=True, frozen=True)
class TraceRecord:
    """One request of a Mooncake-format trace (FAST'25): arrival time, lengths in tokens, and the
    prompt's block ids (512 tokens per block in the released traces)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TraceRecord:
        """From one decoded JSON line; raises ValueError naming the missing or malformed field."""
        try:
            return cls(
                timestamp_ms=float(obj["timestamp"]),
                input_length=int(obj.get("input_length", 0)),
                output_length=int(obj.get("output_length", 0)),
                hash_ids=tuple(int(h) for h in obj["hash_ids"]),
            )
        except KeyError as e:
            raise ValueError(f"trace record lacks field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"malformed trace record: {e}") from None


@dataclass(slots=True, frozen=True)
class TierSpec:
    """One tier of a simulated cache: a name (for reports) and a capacity in blocks."""

    name: str
    capacity: int

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"tier {self.name!r}: capacity must be >= 1 block, got {self.capacity}")


def parse_tiers(text: str) -> tuple[TierSpec, ...]:
    """'hbm:1000,dram:4000,nvme:16000' -> tiers, top first. A bare number is one tier named 'cache'."""
    text = text.strip()
    if text.isdigit():
        return (TierSpec("cache", int(text)),)
    tiers = []
    for part in text.split(","):
        name, sep, cap = part.strip().partition(":")
        if not sep or not name or not cap.strip().isdigit():
            raise ValueError(f"tier spec {part!r} is not NAME:BLOCKS (in {text!r})")
        tiers.append(TierSpec(name.strip(), int(cap)))
    if len({t.name for t in tiers}) != len(tiers):
        raise ValueError(f"tier names repeat in {text!r}")
    return tuple(tiers)


@runtime_checkable
class ReplayCache(Protocol):
    """What `replay` drives. A simulated cache implements it here; a cache node reached over gRPC
    can implement the same two calls (lookup = longest cached prefix, put = store the request)."""

    def lookup(self, blocks: Sequence[Block]) -> int:
        """Length of the longest prefix of `blocks` that is cached. Must not change the cache."""
        ...

    def put(self, blocks: Sequence[Block]) -> None:
        """The request was served: touch its cached blocks and store the others, in order."""
        ...


@runtime_checkable
class ProbingCache(ReplayCache, Protocol):
    """A cache that can also say, per block, which tier holds it (None = not cached), read-only.
    Needed for the block hit rate and the per-tier figures; without it `replay` counts prefix hits."""

    tier_names: tuple[str, ...]

    def probe(self, blocks: Sequence[Block]) -> list[int | None]: ...


@dataclass(slots=True)
class ReplayResult:
    """Counts from one replay. Rates are over `blocks`, the number of block lookups in the trace."""

    requests: int = 0
    blocks: int = 0
    block_hits: int | None = 0
    prefix_hits: int = 0
    first_reuse_hits: int | None = 0  # block hits on a block's second reference (None: not probed)
    tier_names: tuple[str, ...] = ()
    tier_block_hits: list[int] = field(default_factory=list)
    tier_prefix_hits: list[int] = field(default_factory=list)

    @property
    def block_hit_rate(self) -> float | None:
        return None if self.block_hits is None else self.block_hits / max(self.blocks, 1)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / max(self.blocks, 1)

    @property
    def first_reuse_hit_rate(self) -> float | None:
        return None if self.first_reuse_hits is None else self.first_reuse_hits / max(self.blocks, 1)

    def tier_rates(self) -> dict[str, tuple[float, float]]:
        """Tier name -> (block hit rate, prefix hit rate) served from that tier."""
        n = max(self.blocks, 1)
        return {
            name: (self.tier_block_hits[i] / n, self.tier_prefix_hits[i] / n) for i, name in enumerate(self.tier_names)
        }


@dataclass(slots=True, frozen=True)
class RetentionHint:
    """What an engine tells the store with a request, as a Retain call (DESIGN.md §6.5) carries it: its
    `session`, which is resumed before the request if it holds a lease; then keep this request's blocks
    for `lease` more requests (the session pauses; None: no lease), or the session `ended` (released)."""

    session: int
    lease: int | None = None
    ended: bool = False


def replay(
    requests: Iterable[Sequence[Block]],
    cache: ReplayCache,
    hints: Sequence[RetentionHint | None] | None = None,
) -> ReplayResult:
    """Serve every request in order (lookup, then put) and count hits; see the module docstring.
    With `hints` (one per request, for a TieredBlockCache), each request's session is resumed before
    its lookup and its blocks are stored with its hint (TieredBlockCache.resume, put_hinted), the
    request's index the clock of the leases."""
    probing = isinstance(cache, ProbingCache)
    names: tuple[str, ...] = cache.tier_names if probing else ()
    res = ReplayResult(
        block_hits=0 if probing else None,
        first_reuse_hits=0 if probing else None,
        tier_names=names,
        tier_block_hits=[0] * len(names),
        tier_prefix_hits=[0] * len(names),
    )
    seen: set[Block] = set()  # blocks referenced once so far
    reused: set[Block] = set()  # blocks referenced more than once
    for blocks in requests:
        res.requests += 1
        res.blocks += len(blocks)
        if hints is not None:
            cache.resume(res.requests - 1, hints[res.requests - 1])  # type: ignore[attr-defined]
        prefix = cache.lookup(blocks)
        res.prefix_hits += prefix
        if probing:
            where = cache.probe(blocks)  # type: ignore[attr-defined]
            for i, tier in enumerate(where):
                b = blocks[i]
                if tier is not None:
                    res.block_hits += 1  # type: ignore[operator]
                    res.tier_block_hits[tier] += 1
                    if i < prefix:
                        res.tier_prefix_hits[tier] += 1
                    if b in seen and b not in reused:
                        res.first_reuse_hits += 1  # type: ignore[operator]
                if b in seen:
                    reused.add(b)
                else:
                    seen.add(b)
        if hints is None:
            cache.put(blocks)
        else:
            cache.put_hinted(res.requests - 1, blocks, hints[res.requests - 1])  # type: ignore[attr-defined]
    return res


class _Verdict(enum.Enum):
    """What the top tier says to a block that is not in it."""

    ROOM = "room"  # not full: no question asked
    PINNED = "pinned"  # full, and every block in it is pinned
    ADMITTED = "admitted"  # full; the policy lets the block take its victim's place
    REFUSED = "refused"  # full; the policy keeps its victim (the block goes one tier down, or is not stored)


@dataclass(slots=True)
class CacheCounters:
    """What a TieredBlockCache did, for reports and tests."""

    inserted: int = 0  # missing blocks stored (at the top tier, or lower when the top was all pinned)
    promoted: int = 0  # lower-tier hits moved to the top tier
    demoted: int = 0  # victims moved one tier down
    dropped: int = 0  # victims of the last tier (gone from the cache)
    not_admitted: int = 0  # blocks the top tier's admit() refused (stored lower down, or not at all)
    not_stored: int = 0  # missing blocks with no room anywhere (every block pinned)
    leased: int = 0  # blocks a retention lease asked to keep that were kept (one per block per lease)
    lease_refused: int = 0  # blocks a lease asked to keep past the cap on retained blocks (not kept)


class TieredBlockCache:
    """Exclusive tiers of fixed capacity in blocks, one eviction policy instance per tier (as in the
    TierManager). Invariants: a block is in at most one tier; a tier never holds more than its
    capacity; each tier's policy holds exactly that tier's blocks.

    Moves: a hit in a lower tier promotes the block to the top tier; a victim of tier i is demoted
    into tier i+1 (whose own victims go further down) and dropped from the last tier; a miss is
    inserted at the top. The blocks of the request being served are pinned (the engine holds them
    while it runs), so they are never chosen as victims; if a tier has no unpinned block, a
    promotion leaves the block where it is and an insertion tries the next tier down.

    A promotion first takes the block out of its tier, then makes room at the top, so the slot it
    frees can take the block demoted by that (a swap; nothing is dropped for it).

    A promoted block is inserted with the reads it had, then its read is an access in the top tier
    (the manager publishes the page, then counts the read that moved it).

    `hints=True` passes `parent` (the previous block of the request) and `reads` (hits on the block
    since it was stored, in any tier) on every insert, also when a block moves between tiers (every
    policy in POLICIES takes them; `hints=False` uses the bare `on_insert(key)`).
    `admission=True` asks the top tier's policy `admit(key, victim, parent)` (if it has one; see the
    module docstring) before a block enters the full top tier; False never asks.

    Retention (`put_hinted`, as DESIGN.md §6.5's sessions in HOLD mode): a Put with a lease names the
    request's blocks to its session; each stored one is held (never chosen as a victim in any tier) until
    the lease expires, is replaced by the session's next one, or the session ends, unless its tier already
    holds `retain_share` x its capacity held blocks (then it is stored, not held: `lease_refused`). A block
    several sessions name is held while any does. The session's next request first resumes it: its held
    blocks in lower tiers are promoted to the top tier without asking admission (as the Prefetcher does),
    within the top tier's hold cap; a held block's promotion by read is bounded by that cap too.
    """

    def __init__(
        self,
        tiers: Sequence[TierSpec] | int,
        policy: str | Callable[[], EvictionPolicy] = "lru",
        *,
        hints: bool = True,
        admission: bool = True,
        retain_share: float = 0.5,
    ) -> None:
        if not 0 <= retain_share <= 1:
            raise ValueError(f"retain_share must be in [0, 1], got {retain_share}")
        if isinstance(tiers, int):
            tiers = (TierSpec("cache", tiers),)
        if not tiers:
            raise ValueError("a cache needs at least one tier")
        self.tiers = tuple(tiers)
        self.tier_names = tuple(t.name for t in self.tiers)
        factory = (lambda: make_policy(policy)) if isinstance(policy, str) else policy
        self.policies: list[EvictionPolicy] = [factory() for _ in self.tiers]
        self.hints = hints
        self.admission = admission
        self.counters = CacheCounters()
        self._where: dict[Block, int] = {}
        self._size = [0] * len(self.tiers)
        self._parent: dict[Block, Block | None] = {}  # of resident blocks, for moves between tiers
        self._reads: dict[Block, int] = {}  # of resident blocks: hits since the block was stored
        self._pinned: frozenset[Block] = frozenset()
        self._hold_cap = [int(retain_share * t.capacity) for t in self.tiers]
        self._held: dict[Block, int] = {}  # held block -> the sessions whose lease holds it
        self._held_in = [0] * len(self.tiers)  # held blocks per tier
        self._leases: dict[int, tuple[int, tuple[Block, ...]]] = {}  # session -> (expiry, its blocks)
        self._expiry: list[tuple[int, int, int]] = []  # (expiry, seq, session): a heap, stale entries skipped
        self._lease_seq = 0

    # -- queries ------------------------------------------------------------------------------------

    def probe(self, blocks: Sequence[Block]) -> list[int | None]:
        return [self._where.get(b) for b in blocks]

    def lookup(self, blocks: Sequence[Block]) -> int:
        n = 0
        for b in blocks:
            if b not in self._where:
                break
            n += 1
        return n

    def tier_of(self, block: Block) -> int | None:
        return self._where.get(block)

    def size(self, tier: int = 0) -> int:
        return self._size[tier]

    def __len__(self) -> int:
        return len(self._where)

    # -- the request path ---------------------------------------------------------------------------

    def put(self, blocks: Sequence[Block]) -> None:
        self._pinned = frozenset(blocks)
        try:
            parent: Block | None = None
            for key in blocks:
                self._serve_block(key, parent)
                parent = key
        finally:
            self._pinned = frozenset()

    def _serve_block(self, key: Block, parent: Block | None) -> None:
        tier = self._where.get(key)
        if tier == 0:
            self._reads[key] += 1
            self.policies[0].on_access(key)
            return
        if tier is not None and not self._may_promote(key):
            self._reads[key] += 1
            self.policies[tier].on_access(key)  # NOTE: held, and the top tier's hold cap is full: read in place
            return
        verdict, victim = self._top_verdict(key, parent)
        if tier is not None:
            if verdict is _Verdict.PINNED or verdict is _Verdict.REFUSED:
                self._reads[key] += 1
                self.policies[tier].on_access(key)  # not promoted: served from where it is
                return
            # NOTE: take the block out first, so the slot it frees can take the block demoted by
            # the room-making below (exclusive tiers: the promotion is a swap, not a drop).
            reads = self._reads[key]
            self._remove(key)
            self._make_room(0, victim)
            # As the manager: the page is published in the top tier with the reads it had, then the
            # read that promoted it is an access there.
            self._place(key, parent, 0, reads)
            self._reads[key] += 1
            self.policies[0].on_access(key)
            self.counters.promoted += 1
            return
        for t in range(1 if verdict is _Verdict.REFUSED else 0, len(self.tiers)):
            if self._make_room(t, victim if t == 0 else None):
                self._place(key, parent, t)
                self.counters.inserted += 1
                return
        if verdict is not _Verdict.REFUSED:
            self.counters.not_stored += 1

    def _top_verdict(self, key: Block, parent: Block | None) -> tuple[_Verdict, Block | None]:
        """May a block not in the top tier (missing, or in a lower tier) enter it now, and which
        victim would make room for it? The policy is asked `admit(key, victim)` only when the tier is
        full and has a victim; a refusal is counted in `not_admitted` (the policy counts the reference
        itself). NOTE: the victim is chosen once and is the one evicted (as the manager does):
        choosing can reorder a policy's keys (S3-FIFO, the W-TinyLFU window), so a second
        first_usable() need not name the same key."""
        if self._size[0] < self.tiers[0].capacity:
            return _Verdict.ROOM, None
        hint = parent if self.hints else None
        if self.admission and refused_outright(self.policies[0], key, hint):
            self.counters.not_admitted += 1  # NOTE: as the manager: refused before any victim is chosen
            return _Verdict.REFUSED, None
        victim = first_usable(self.policies[0], self._usable)
        if victim is None:
            if self.admission:  # as the manager: the policy still hears of the reference
                should_admit(self.policies[0], key, None, hint)
            return _Verdict.PINNED, None
        if self.admission and not should_admit(self.policies[0], key, victim, hint):
            self.counters.not_admitted += 1
            return _Verdict.REFUSED, None
        return _Verdict.ADMITTED, victim

    def _usable(self, key: Block) -> bool:
        return key not in self._pinned and key not in self._held

    # -- retention ----------------------------------------------------------------------------------

    def retained(self) -> int:
        """Blocks held by a lease now."""
        return len(self._held)

    def resume(self, now: int, hint: RetentionHint | None) -> None:
        """Before request `now` is looked up (a clock that never goes back): the leases due expire, and
        the request's session, if it holds a lease, is resumed (the engine's router resumes a session
        while its next turn queues): see the class docstring."""
        heap = self._expiry
        while heap and heap[0][0] <= now:
            expiry, _, session = heapq.heappop(heap)
            lease = self._leases.get(session)
            if lease is not None and lease[0] == expiry:
                self._release(session)
        if hint is not None and hint.session in self._leases:
            self._resume(self._leases[hint.session][1])

    def put_hinted(self, now: int, blocks: Sequence[Block], hint: RetentionHint | None) -> None:
        """put(blocks), then `hint` applies: a lease (until request `now` + `hint.lease`) names the
        request's blocks to its session (replacing the session's last lease), an end releases it."""
        heap = self._expiry
        self.put(blocks)
        if hint is None:
            return
        self._release(hint.session)
        if hint.ended or hint.lease is None:
            return
        held, held_in, where, kept = self._held, self._held_in, self._where, []
        for key in blocks:
            tier = where.get(key)
            if tier is None:
                continue  # NOTE: not stored (refused with no tier below): nothing to hold
            if key in held:
                held[key] += 1
            elif held_in[tier] < self._hold_cap[tier]:
                held[key] = 1
                held_in[tier] += 1
            else:
                self.counters.lease_refused += 1
                continue
            kept.append(key)
        if kept:
            self.counters.leased += len(kept)
            expiry = now + max(1, hint.lease)
            self._leases[hint.session] = (expiry, tuple(kept))
            self._lease_seq += 1
            heapq.heappush(heap, (expiry, self._lease_seq, hint.session))

    def _may_promote(self, key: Block) -> bool:
        return key not in self._held or self._held_in[0] < self._hold_cap[0]

    def _resume(self, keys: Sequence[Block]) -> None:
        """Promote the session's held blocks in lower tiers to the top tier, in order, without asking
        admission (an explicit Prefetch), while the top tier's hold cap allows; never evicting each other."""
        self._pinned = frozenset(keys)
        try:
            for key in keys:
                tier = self._where.get(key)
                if not tier or not self._may_promote(key):
                    continue
                parent, reads = self._parent[key], self._reads[key]
                self._remove(key)
                if self._make_room(0):
                    self._place(key, parent, 0, reads)
                    self.counters.promoted += 1
                else:
                    self._place(key, parent, tier, reads)
        finally:
            self._pinned = frozenset()

    def _release(self, session: int) -> None:
        lease = self._leases.pop(session, None)
        if lease is None:
            return
        held, where, held_in = self._held, self._where, self._held_in
        for b in lease[1]:
            n = held[b] - 1
            if n:
                held[b] = n
            else:
                del held[b]
                held_in[where[b]] -= 1

    def _make_room(self, tier: int, victim: Block | None = None) -> bool:
        """Evict from `tier` (demoting down the stack) until one block fits; False if all are pinned.
        `victim`, when given, is the first one evicted (already chosen by the policy)."""
        while self._size[tier] >= self.tiers[tier].capacity:
            if victim is None:
                victim = first_usable(self.policies[tier], self._usable)
                if victim is None:
                    return False
            parent, reads = self._parent[victim], self._reads[victim]
            self._remove(victim)
            if tier + 1 < len(self.tiers) and self._make_room(tier + 1):
                self._place(victim, parent, tier + 1, reads)
                self.counters.demoted += 1
            else:
                self.counters.dropped += 1
            victim = None
        return True

    def _place(self, key: Block, parent: Block | None, tier: int, reads: int = 0) -> None:
        self._where[key] = tier
        if key in self._held:
            self._held_in[tier] += 1
        self._parent[key] = parent
        self._reads[key] = reads
        self._size[tier] += 1
        if self.hints:
            self.policies[tier].on_insert(key, parent=parent, reads=reads)  # type: ignore[call-arg]
        else:
            self.policies[tier].on_insert(key)

    def _remove(self, key: Block) -> None:
        tier = self._where.pop(key)
        if key in self._held:
            self._held_in[tier] -= 1
        del self._parent[key]
        del self._reads[key]
        self._size[tier] -= 1
        self.policies[tier].on_remove(key)


def replay_policy(
    requests: Sequence[Sequence[Block]],
    tiers: Sequence[TierSpec] | int,
    policy: str | Callable[[], EvictionPolicy],
    *,
    hints: bool = True,
    admission: bool = True,
) -> tuple[ReplayResult, CacheCounters]:
    """Replay `requests` through a fresh TieredBlockCache; returns the hit counts and its counters."""
    cache = TieredBlockCache(tiers, policy, hints=hints, admission=admission)
    return replay(requests, cache), cache.counters


def belady_block_hits(requests: Sequence[Sequence[Block]], capacity: int) -> ReplayResult:
    """Belady's MIN with bypass on the block access stream of `requests` (every block of every
    request in order): on a miss with a full cache, of the cached blocks and the missing one, the one
    whose next use is farthest is not kept. The most block hits a cache of `capacity` blocks can get
    on this trace (every policy here, admission and pins included, is a restriction of it).

    A hit is counted when the block is accessed in the stream. `replay` counts at lookup time, before
    the request's puts; the two agree for a cache that pins the request's blocks while serving it
    (TieredBlockCache does), so this is an upper bound for it.

    O(N log N): a max-heap of (next use, block) with lazy invalidation (an entry is stale when the
    block's next use has moved on). Counts are per request as in `replay`; prefix hits are counted
    on the same run (they are not the optimum of the prefix hit rate).
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    stream = [b for req in requests for b in req]
    never = len(stream)
    next_use = [never] * len(stream)
    last_seen: dict[Block, int] = {}
    for i in range(len(stream) - 1, -1, -1):
        next_use[i] = last_seen.get(stream[i], never)
        last_seen[stream[i]] = i
    cached: dict[Block, int] = {}  # block -> its next use
    heap: list[tuple[int, int, Block]] = []  # (-next use, seq, block); seq keeps blocks uncompared
    res = ReplayResult(requests=0, blocks=0, block_hits=0, prefix_hits=0)
    refs: dict[Block, int] = {}  # references so far (up to 2: only "the second" matters)
    i = 0
    for req in requests:
        res.requests += 1
        res.blocks += len(req)
        in_prefix = True
        for b in req:
            n = refs.get(b, 0)
            if n < 2:
                refs[b] = n + 1
            if b in cached:
                res.block_hits += 1  # type: ignore[operator]
                res.prefix_hits += in_prefix
                res.first_reuse_hits += n == 1  # type: ignore[operator]
            else:
                in_prefix = False
            nxt = next_use[i]
            if b in cached or len(cached) < capacity:
                cached[b] = nxt
                heapq.heappush(heap, (-nxt, i, b))
            else:
                while True:  # the cached block used farthest ahead
                    neg, _, far = heap[0]
                    if cached.get(far) == -neg:
                        break
                    heapq.heappop(heap)
                if -neg > nxt:
                    heapq.heappop(heap)
                    del cached[far]
                    cached[b] = nxt
                    heapq.heappush(heap, (-nxt, i, b))
                # else: bypass, b itself is the one used farthest ahead
            if nxt == never and b in cached:
                # NOTE: a block never used again is dead weight; dropping it now keeps the heap small
                # and changes no decision (it would be the first victim anyway).
                del cached[b]
            i += 1
            if len(heap) > 4 * capacity + 64:
                heap = [e for e in heap if cached.get(e[2]) == -e[0]]
                heapq.heapify(heap)
    return res
