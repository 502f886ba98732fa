"""Eviction and admission policies: pure bookkeeping over opaque keys, no I/O (DESIGN.md §6).

The manager keeps one policy instance per tier and tells it what happens (insert, access, remove);
the policy answers two questions: in which order should victims be considered, and (optionally)
may a page enter this full tier at all. The manager skips candidates it cannot evict (pinned, being
read, being moved), so a policy never needs to know about pins. Every policy here is replayable on
traces without a node (devkit/sim.py, benchmarks/trace_replay.py) and deterministic: keys are only
hashed with `stable_hash`, never Python's salted hash().

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

Admission (optional method; `should_admit(policy, key, victim, parent)` asks any policy, True for
one without it; see admission.py for the exact contract):
    admit(key, victim, parent=None) -> bool
        Asked when `key` (a new page, or one moving up) would enter this tier while it is full;
        `victim` is what first_usable() chose to make room (None: nothing is evictable, the call
        only tells the policy of the reference). True: evict victim, insert key. False: leave the
        tier as it is; a new page goes to the next tier down (written through to NVMe), or is not
        stored when there is none; a page moving up stays where it is.
    refuses(key, parent=None) -> bool
        Asked first, before a victim is chosen (`refused_outright(policy, key, parent)`): True when
        admit() would refuse `key` whatever the victim (a second-sight rule's unseen key, a block
        whose chain parent is gone). The policy then counts the reference as admit() would on a
        refusal, and admit() is not asked for it: most references a strict threshold sees are
        refused, and choosing a victim for each one costs more than the rest of the question. False
        changes nothing; admit() follows. A refusal here holds even when nothing is evictable.

Modules: base (the protocol, first_usable, should_admit, refused_outright), recency (LRU, ARC), frequency (S3-FIFO),
prefix (the chain-forest policies), sketch (the frequency sketch, stable hashing), history (exact
recent reference counts, the adaptive default's ghost list), admission (rules in front of any
policy: TinyLFU, second sight), duel (the earlier default's two-shadow switch), adaptive (the default's four
thresholds), registry (config names, make_policy).

Policies (config names): "lru", "prefix-lru", "arc", "s3fifo", "prefix-arc", "tinylfu" (prefix-arc
behind TinyLFU admission, always on), "second-sight" (LRU admitting a key on its second sight: a
ghost list of 4x the tier remembers the refused keys), "duel" (prefix-arc with TinyLFU switched on
and off by two dueling shadow caches: the default before adaptive) and "adaptive" (prefix-LRU behind an
admission threshold that moves between admit-all, second sight (with or without the pages that left
the tier counting as seen) and TinyLFU's test as four sampled shadow caches show which one hits
most: the node's default). The manager asks admit() for its
host-memory tier only (kvstore/manager/placement.py: Put and promotion on read; never for an
explicit Prefetch, HBM, NVMe, recovery or the shutdown spill). benchmarks/trace_replay.py compares
them on the workload suite and any trace, against Belady's offline optimum; benchmarks/policy_bench.py
measures what each one's bookkeeping costs per event.
"""

from kvstore.policy.adaptive import AdaptivePolicy, ShadowCache
from kvstore.policy.admission import Admitted, SecondSight, TinyLFU
from kvstore.policy.base import EvictionPolicy, Key, first_usable, refused_outright, should_admit
from kvstore.policy.duel import DuelPolicy
from kvstore.policy.frequency import S3FIFOPolicy
from kvstore.policy.history import History
from kvstore.policy.prefix import PrefixARCPolicy, PrefixLRUPolicy, PrefixTreePolicy
from kvstore.policy.recency import ARCPolicy, LRUPolicy
from kvstore.policy.registry import POLICIES, make_policy
from kvstore.policy.sketch import FrequencySketch, stable_hash

__all__ = [
    "POLICIES",
    "ARCPolicy",
    "AdaptivePolicy",
    "Admitted",
    "DuelPolicy",
    "EvictionPolicy",
    "FrequencySketch",
    "History",
    "Key",
    "LRUPolicy",
    "PrefixARCPolicy",
    "PrefixLRUPolicy",
    "PrefixTreePolicy",
    "S3FIFOPolicy",
    "SecondSight",
    "ShadowCache",
    "TinyLFU",
    "first_usable",
    "make_policy",
    "refused_outright",
    "should_admit",
    "stable_hash",
]
