"""The workload suite (devkit/workloads.py): seeded and deterministic (also across processes), chained
like real block hashes, the shapes it claims, its sizes, and clear errors for bad input."""

from __future__ import annotations

import hashlib
import os
import statistics
import subprocess
import sys
from collections import Counter

import pytest

from devkit.workloads import (
    WORKLOADS,
    Agentic,
    Chainer,
    Size,
    describe,
    generate,
    generate_tagged,
    retention_hints,
    suite,
)


def _digest(requests: list[list[int]]) -> str:
    return hashlib.sha256(repr(requests).encode()).hexdigest()


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_seeded_and_chained(name: str) -> None:
    a = generate(name, 120, seed=2)
    assert a == generate(name, 120, seed=2) and len(a) == 120 and all(a)
    assert a != generate(name, 120, seed=3)
    # a block id names its whole prefix: it always follows the same parent
    parent: dict[int, int | None] = {}
    for req in a:
        prev = None
        for b in req:
            assert parent.setdefault(b, prev) == prev
            prev = b


def test_the_same_in_every_process() -> None:
    here = {name: _digest(reqs) for name, reqs in suite(Size.SMOKE, seed=5).items()}
    code = (
        "import hashlib; from devkit.workloads import suite, Size; "
        "print({n: hashlib.sha256(repr(r).encode()).hexdigest() for n, r in suite(Size.SMOKE, seed=5).items()})"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "777"})  # fmt: skip
    assert out.stdout.strip() == str(here)


def test_chainer_shares_ids_exactly_on_equal_prefixes() -> None:
    ch = Chainer()
    a, b = ch.fresh(3), ch.fresh(2)
    x = ch.chain(a + b)
    assert ch.chain(a) == x[:3]  # same prefix, same ids
    assert ch.chain(b)[0] != x[3]  # same content after another prefix: another block
    assert ch.chain(a[:1] + b)[:1] == x[:1] and ch.chain(a[:1] + b)[1] != x[1]


def _extends(requests: list[list[int]]) -> float:
    """Share of requests that start with the whole of an earlier request (a resent history)."""
    seen: set[tuple[int, ...]] = set()
    n = 0
    for r in requests:
        n += any(tuple(r[:k]) in seen for k in range(1, len(r)))
        seen.add(tuple(r))
    return n / len(requests)


def test_shapes() -> None:
    chat, agent, rag, batch = (generate(n, 800, seed=1) for n in ("chat", "agent", "rag", "batch"))
    # chat: many turns resend an earlier turn whole; four system prompts start every conversation
    assert _extends(chat) > 0.25 and len({r[0] for r in chat}) <= 4
    # agent: long shared tool prompts, many steps of each session
    heads = Counter(tuple(r[:30]) for r in agent)
    assert len(heads) <= 3 and _extends(agent) > 0.8
    # rag: a large corpus: most blocks are seen once, a popular few often
    counts = Counter(b for r in rag for b in r)
    assert sum(1 for c in counts.values() if c == 1) > 0.5 * len(counts) and max(counts.values()) > 50
    # batch: one-off long prompts and jobs whose requests share a long prefix
    assert sum(1 for r in batch if len(r) >= 20 and counts_once(batch, r)) > 0.1 * len(batch)


def counts_once(requests: list[list[int]], req: list[int]) -> bool:
    first = req[0]
    return sum(1 for r in requests if r[0] == first) == 1


def test_conversation_has_the_published_shape() -> None:
    """Mooncake's conversation trace (FAST'25) and LMSYS-Chat-1M, as devkit/workloads.py cites them:
    input lengths in 512-token blocks (mean about 23.5, median about 13.5, a long tail), a block
    shared by nearly every request (the system prompt's first), most blocks seen once, about 40% of
    block references reusable with an unbounded cache, turns that resend the whole history (about half
    the requests)."""
    reqs = generate("conversation")
    lens = sorted(map(len, reqs))
    assert 20 <= sum(lens) / len(lens) <= 27 and 11 <= lens[len(lens) // 2] <= 16 and lens[-1] > 100
    counts = Counter(b for r in reqs for b in r)
    assert counts.most_common(1)[0][1] >= 0.95 * len(reqs)
    assert sum(1 for c in counts.values() if c == 1) > 0.6 * len(counts)  # most blocks seen once
    ceiling = 1 - len(counts) / sum(counts.values())
    assert 0.35 <= ceiling <= 0.5
    # follow-up turns resend the history: LMSYS-Chat-1M's 2.0 turns per conversation make about half the
    # requests follow-ups; a first turn on a popular document may extend another user's request too
    assert 0.4 < _extends(reqs) < 0.8


def test_agentic_has_the_published_shape() -> None:
    """vLLM AgentX's agent traffic as devkit/workloads.py cites it: a median of 43 turns per session,
    median inputs of about 142K tokens (here in 4096-token blocks: the whole block only, so a little
    under), prefix reuse above 95% with an unbounded cache (block-level: a turn's partial last block is
    computed anew), subagents in about 44% of sessions, tool pauses of seconds to minutes."""
    reqs, tags = generate_tagged("agentic", 8000)
    assert reqs == generate("agentic", 8000) and len(tags) == len(reqs)
    lens = sorted(map(len, reqs))
    assert 110_000 <= lens[len(lens) // 2] * Agentic.BLOCK_TOKENS <= 160_000
    counts = Counter(b for r in reqs for b in r)
    assert 1 - len(counts) / sum(counts.values()) > 0.94
    turns: Counter[int] = Counter()
    first_turn: dict[int, int] = {}
    ended: set[int] = set()
    with_subagents = {t.parent for t in tags if t.parent is not None}
    for t in tags:
        first_turn.setdefault(t.session, t.turn)
        turns[t.session] += 1
        ended |= {t.session} if t.ends else set()
    whole = [s for s, n in turns.items() if first_turn[s] == 0 and s in ended and s not in
             {t.session for t in tags if t.parent is not None}]  # fmt: skip
    assert len(whole) >= 30
    assert 33 <= statistics.median(turns[s] for s in whole) <= 55
    assert 0.3 <= sum(s in with_subagents for s in whole) / len(whole) <= 0.6
    pauses = sorted(t.pause_s for t in tags if t.pause_s is not None)
    assert pauses[len(pauses) // 10] < 10 and pauses[-len(pauses) // 100] > 60


def test_agentic_tags_follow_the_sessions() -> None:
    """A session's requests are its turns in order, extending its context (until a compaction starts it
    again from its system prompt); nothing follows its last request; a subagent's first request
    extends the request of its parent that started it, and the parent resumes only once every one of
    them has ended."""
    reqs, tags = generate_tagged("agentic", 3000, seed=4)
    last: dict[int, int] = {}  # session -> index of its latest request
    running: dict[int, int] = {}  # parent -> subagents not yet ended
    spawned_by: dict[int, int] = {}  # parent -> index of the request that started its subagents
    forks = 0
    for i, t in enumerate(tags):
        if t.session in last:
            prev = last[t.session]
            assert tags[prev].turn + 1 == t.turn and not tags[prev].ends
            assert reqs[i][: len(reqs[prev])] == reqs[prev] or reqs[i][0] == reqs[prev][0]  # extends, or compacted
            assert running.get(t.session, 0) == 0  # a parent waits for all its subagents
        elif t.parent in spawned_by:  # NOTE: a session first seen later than its turn 0 began in the warm-up
            assert t.turn == 0 and reqs[i][: len(reqs[spawned_by[t.parent]])] == reqs[spawned_by[t.parent]]
            forks += 1
        if t.subagents:
            running[t.session], spawned_by[t.session] = t.subagents, i
            assert t.pause_s is None
        if t.ends:
            assert t.pause_s is None and t.subagents == 0
            if t.parent is not None and t.parent in running:
                running[t.parent] -= 1
        last[t.session] = i
    assert forks >= 10 and any(t.ends for t in tags)
    with pytest.raises(ValueError, match=r"no session tags.*agentic"):
        generate_tagged("chat", 10)


def test_retention_hints_are_what_the_runtime_knows() -> None:
    """A request after which its session waits leases the session for the TTL (never the pause's own
    length, which the runtime does not know); a last request ends the session. A TTL that is not a
    positive finite number is refused, naming it."""
    _, tags = generate_tagged("agentic", 500, seed=2)
    hints = retention_hints(tags, 30.0)
    assert len(hints) == len(tags)
    for t, h in zip(tags, hints, strict=True):
        assert h.session == t.session
        assert (h.ended, h.lease) == ((True, None) if t.ends else (False, 30))
    assert retention_hints(tags, 0.2, rate=1.0)[0].lease in (None, 1)  # at least one request
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ttl_s"):
            retention_hints(tags, bad)


def test_tenants_change_halfway() -> None:
    reqs = generate("tenants", 1000, seed=0)
    first, second = reqs[:500], reqs[500:]
    mean = [sum(map(len, half)) / len(half) for half in (first, second)]
    assert mean[0] != mean[1]  # the mix of shapes (and so the request lengths) changes


def test_sizes_and_errors() -> None:
    for spec in WORKLOADS.values():
        assert len(generate(spec.name, size=Size.SMOKE)) == spec.smoke < spec.full
    assert len(generate("chat", size="full")) == WORKLOADS["chat"].full
    assert generate("chat", 0) == []
    with pytest.raises(ValueError, match=r"unknown workload .nope.*chat"):
        generate("nope")
    with pytest.raises(ValueError, match="requests must be >= 0"):
        generate("chat", -1)
    with pytest.raises(ValueError):
        generate("chat", size="huge")
    assert all(name in describe() for name in WORKLOADS)
