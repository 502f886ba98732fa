"""The workload suite: seeded generators of request streams with the shapes users run (DESIGN.md §6.4).

A request is the list of its prompt's block ids in order, as in the Mooncake trace format: ids are
chained (`Chainer`), so two requests share a block id exactly where they share the whole prefix up
to and including that block. Every generator is pure and deterministic: the same name, size and
seed give the same requests, on any machine and Python version (only `random.Random` with an
explicit seed, no `hash()` of strings).

Shapes (`WORKLOADS`; `describe()` prints them):
    chat      multi-turn conversations over a few shared system prompts; each turn resends the
              whole history plus the last answer and a new question; heavy-tailed think times and
              conversation lengths (most conversations are short, a few run long).
    rag       document QA over a large corpus of reused documents (Zipf popularity): a system prompt,
              2-4 retrieved documents and a question; only a prefix that matches in order is shared
              (the top document right after the system prompt); some follow-up questions.
    agent     agent loops: a few long shared tool prompts, sessions of many short steps that come
              back quickly, each step appending a tool call and its observation.
    batch     batch few-shot jobs: a job's long few-shot prefix (some jobs reuse a popular template)
              followed by many one-block inputs in a burst, interleaved with one-off long prompts.
    tenants   a mix of tenants with different shapes (chat, rag, agent, batch) whose shares change
              halfway through the stream: a policy must adapt online.
    conversation  production chat as the Mooncake and LMSYS statistics describe it (see Conversation).
    agentic   agent sessions as vLLM's AgentX figures describe them: 43 turns, 142K-token inputs, tool
              pauses of seconds to minutes, subagents forking their parent's context, sessions that
              end (see Agentic); generate_tagged() also gives what the agent runtime knows of each
              request (SessionTag), from which retention hints are made.

The Mooncake trace is not generated here: benchmarks/trace_replay.py takes any trace by path.

Blocks: most shapes count abstract blocks; conversation's are 512 tokens (the Mooncake traces'),
agentic's 4096 (`WorkloadSpec.block_tokens`: what a block stands for when bytes are counted).

Sizes: `Size.FULL` is what benchmarks/trace_replay.py replays (every workload 60k-150k block
accesses: the whole suite, every policy at five capacities, replays in minutes on 2 cores);
`Size.SMOKE` is ~1/25 of that for CI (the suite replays in seconds).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from devkit.sim import RetentionHint

Request = list[int]


class Size(enum.Enum):
    FULL = "full"
    SMOKE = "smoke"


class Chainer:
    """Block ids as a serving engine's chained block hashes give them: the id of a block is a
    function of its content and its parent's id, so equal ids mean equal whole prefixes.
    Invariant: ids are dense ints from 0, assigned in first-seen order (deterministic)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, Hashable], int] = {}
        self._content = itertools.count()

    def fresh(self, n: int) -> list[int]:
        """`n` blocks of content never seen before (a new question, answer or document)."""
        return [next(self._content) for _ in range(n)]

    def chain(self, content: Sequence[Hashable]) -> Request:
        ids, parent = [], -1
        for c in content:
            parent = self._ids.setdefault((parent, c), len(self._ids))
            ids.append(parent)
        return ids


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def lognormal_int(rnd: random.Random, median: float, sigma: float, lo: int = 1, hi: int | None = None) -> int:
    """A heavy-tailed positive integer: round(median * e^(sigma * N(0,1))), clamped to [lo, hi]."""
    v = max(lo, round(median * math.exp(sigma * rnd.gauss(0.0, 1.0))))
    return v if hi is None else min(v, hi)


@dataclass(order=True, slots=True)
class _Due:
    """A session whose next request is due at request number `at` (heap order; `seq` breaks ties)."""

    at: int
    seq: int
    session: _Session = field(compare=False)


@dataclass(slots=True)
class _Session:
    """A multi-request session: its content so far and the requests it still has to make."""

    content: list[Hashable]  # block contents: fresh ints, or tuples naming shared content
    left: int
    kind: str = ""
    extra: list[int] = field(default_factory=list)  # e.g. a RAG session's retrieved documents


class _Sessions:
    """Sessions coming back after think times; `pop(now)` gives the next one due, if any."""

    def __init__(self) -> None:
        self._heap: list[_Due] = []
        self._seq = itertools.count()

    def push(self, at: int, s: _Session) -> None:
        heapq.heappush(self._heap, _Due(at, next(self._seq), s))

    def pop(self, now: int) -> _Session | None:
        if self._heap and self._heap[0].at <= now:
            return heapq.heappop(self._heap).session
        return None

    def __len__(self) -> int:
        return len(self._heap)


# ------------------------------------------------------------------------------------------ shapes


class _PromptedSessions:
    """A shape whose sessions start from one of `count` shared prompts of lo..hi blocks (Zipf(1)
    popularity) and come back after think times."""

    def __init__(self, rnd: random.Random, ch: Chainer, count: int, lo: int, hi: int) -> None:
        self.rnd, self.ch = rnd, ch
        self.prompts = [ch.fresh(rnd.randint(lo, hi)) for _ in range(count)]
        self.weights = zipf_weights(count, 1.0)
        self.due = _Sessions()

    def _prompt(self) -> list[int]:
        return list(self.rnd.choices(self.prompts, self.weights)[0])


class Chat(_PromptedSessions):
    """Multi-turn chat. A new conversation picks one of PROMPTS system prompts (Zipf(1)) and asks a
    question; it has another turn with probability CONTINUE (geometric: mean 1/(1-CONTINUE) turns,
    most conversations short) until its history reaches MAX_HISTORY blocks. A turn resends the
    history, the previous answer and a new question. Think time between turns: lognormal in
    requests, median THINK, sigma THINK_SIGMA (some users answer at once, some come back much later)."""

    PROMPTS = 4
    CONTINUE = 0.7
    THINK, THINK_SIGMA = 300, 1.0
    MAX_HISTORY = 160

    def __init__(self, rnd: random.Random, ch: Chainer) -> None:
        super().__init__(rnd, ch, self.PROMPTS, 6, 24)

    def next(self, now: int) -> Request:
        rnd = self.rnd
        s = self.due.pop(now)
        if s is None:
            s = _Session(self._prompt(), 0)
        else:
            s.content += self.ch.fresh(lognormal_int(rnd, 3, 0.6, hi=12))  # the previous answer
        s.content += self.ch.fresh(lognormal_int(rnd, 1, 0.7, hi=8))  # the new question
        req = self.ch.chain(s.content)
        if rnd.random() < self.CONTINUE and len(s.content) < self.MAX_HISTORY:
            self.due.push(now + lognormal_int(rnd, self.THINK, self.THINK_SIGMA), s)
        return req


class Rag:
    """Document QA over DOCS documents (lengths lognormal, median 12 blocks), popularity Zipf(ZIPF).
    A request is one of two system prompts, K retrieved documents (K uniform in 2..4, the first by
    popularity, the others too, in retrieval order) and a one-block question. With probability
    FOLLOW_UP the user asks again on the same documents a few requests later."""

    DOCS = 6000
    ZIPF = 0.9
    FOLLOW_UP, FOLLOW_GAP = 0.25, 20

    def __init__(self, rnd: random.Random, ch: Chainer) -> None:
        self.rnd, self.ch = rnd, ch
        self.prompts = [ch.fresh(rnd.randint(3, 6)) for _ in range(2)]
        self.docs: dict[int, list[int]] = {}  # created on first retrieval: the corpus is large
        self.cum = list(itertools.accumulate(zipf_weights(self.DOCS, self.ZIPF)))
        self.due = _Sessions()

    def _doc(self, i: int) -> list[int]:
        doc = self.docs.get(i)
        if doc is None:
            doc = self.docs[i] = self.ch.fresh(lognormal_int(self.rnd, 12, 0.6, lo=2, hi=64))
        return doc

    def next(self, now: int) -> Request:
        rnd = self.rnd
        s = self.due.pop(now)
        if s is None:
            picks = rnd.choices(range(self.DOCS), cum_weights=self.cum, k=rnd.randint(2, 4))
            picks = list(dict.fromkeys(picks))  # a document is retrieved once per request
            s = _Session(list(rnd.choice(self.prompts)) + [b for i in picks for b in self._doc(i)], 0)
        content = s.content + self.ch.fresh(1)
        if rnd.random() < self.FOLLOW_UP:
            self.due.push(now + lognormal_int(rnd, self.FOLLOW_GAP, 1.0), s)
        return self.ch.chain(content)


class Agent(_PromptedSessions):
    """Agent loops: TOOLS tool prompts of 30-60 blocks (Zipf(1)); a session states a task (1-3
    blocks) and runs STEPS (lognormal, median 12) steps, each appending a tool call and its
    observation (lognormal, median 2 blocks). The next step comes back quickly (lognormal,
    median STEP_GAP requests): about that many sessions run at once."""

    TOOLS = 3
    STEPS = 12
    STEP_GAP = 15
    MAX_HISTORY = 200

    def __init__(self, rnd: random.Random, ch: Chainer) -> None:
        super().__init__(rnd, ch, self.TOOLS, 30, 60)  # the tool prompts

    def next(self, now: int) -> Request:
        rnd = self.rnd
        s = self.due.pop(now)
        if s is None:
            s = _Session(self._prompt() + self.ch.fresh(rnd.randint(1, 3)), lognormal_int(rnd, self.STEPS, 0.7, hi=60))
        else:
            s.content += self.ch.fresh(lognormal_int(rnd, 2, 0.6, hi=10))
        req = self.ch.chain(s.content)
        s.left -= 1
        if s.left > 0 and len(s.content) < self.MAX_HISTORY:
            self.due.push(now + lognormal_int(rnd, self.STEP_GAP, 0.5), s)
        return req


class Batch:
    """Batch few-shot jobs: a job has a few-shot prefix (an instruction and examples, 10-40 blocks;
    with probability TEMPLATE_SHARE one of TEMPLATES popular templates, else its own) and ITEMS
    (lognormal, median 60) requests, each the prefix plus a 1-2 block input, sent in a burst. Up to
    CONCURRENT jobs interleave; one request in ONE_OFF is a one-off long prompt (a scan)."""

    TEMPLATES, TEMPLATE_SHARE = 8, 0.4
    ITEMS = 40
    CONCURRENT = 12
    ONE_OFF = 0.3

    def __init__(self, rnd: random.Random, ch: Chainer) -> None:
        self.rnd, self.ch = rnd, ch
        self.templates = [ch.fresh(rnd.randint(20, 80)) for _ in range(self.TEMPLATES)]
        self.jobs: list[_Session] = []

    def next(self, now: int) -> Request:
        rnd = self.rnd
        if rnd.random() < self.ONE_OFF:
            return self.ch.chain(self.ch.fresh(lognormal_int(rnd, 40, 0.6, lo=4, hi=160)))
        while len(self.jobs) < self.CONCURRENT:
            shared = rnd.random() < self.TEMPLATE_SHARE
            prefix = rnd.choice(self.templates) if shared else self.ch.fresh(rnd.randint(20, 80))
            self.jobs.append(_Session(list(prefix), lognormal_int(rnd, self.ITEMS, 0.8, lo=5, hi=600)))
        job = rnd.choice(self.jobs)
        job.left -= 1
        if job.left <= 0:
            self.jobs.remove(job)
        return self.ch.chain(job.content + self.ch.fresh(rnd.randint(1, 2)))


class Tenants:
    """A mix of tenants sharing one cache, each with its own shape and prompts: in the first half
    of the stream chat and agent traffic dominate (shares PHASES[0]), in the second half document
    QA and batch jobs do (PHASES[1])."""

    PHASES = (
        {"chat": 0.45, "agent": 0.3, "rag": 0.15, "batch": 0.1},
        {"chat": 0.15, "agent": 0.1, "rag": 0.4, "batch": 0.35},
    )

    def __init__(self, rnd: random.Random, ch: Chainer, requests: int) -> None:
        self.rnd, self.requests = rnd, requests
        self.gens = {"chat": Chat(rnd, ch), "agent": Agent(rnd, ch), "rag": Rag(rnd, ch), "batch": Batch(rnd, ch)}

    def next(self, now: int) -> Request:
        shares = self.PHASES[0] if now < self.requests // 2 else self.PHASES[1]
        name = self.rnd.choices(list(shares), list(shares.values()))[0]
        return self.gens[name].next(now)


class Conversation:
    """Production chat traffic as the published statistics describe it (the Mooncake FAST'25
    conversation trace, Kimi: 12,031 requests in an hour, mean input 12,035 tokens, median about
    6,900, a long tail to 126k; mean output 343 tokens; about 40% of blocks reusable with an unbounded
    cache, a few system-prompt blocks shared by nearly every request; LMSYS-Chat-1M: 2.0 turns per
    conversation on average, user prompts of about 70 tokens, answers of about 215), in blocks of
    BLOCK_TOKENS tokens as in the released traces. Only full blocks are hashed: a turn's partial last
    block is computed anew, with the next turn's tokens, in the next request.

    A conversation starts with a system prompt (DEFAULT_SHARE of conversations use the product's
    default prompt, the others one of APPS app prompts by Zipf(1); SYSTEM_TOKENS each) and a first
    user message: with probability DOC_SHARE a popular document (one of DOCS, Zipf(DOC_ZIPF)) put in
    front of a question, otherwise the user's own content (pasted text, an uploaded file, search
    results: lognormal tokens, median FIRST_TOKENS, sigma FIRST_SIGMA; most blocks of the trace are
    these, seen once). It has another turn with probability CONTINUE (geometric: mean 1/(1-CONTINUE)
    turns) while its history is under CONTEXT tokens. A turn resends the history, the previous answer
    (lognormal, median ANSWER_TOKENS) and a new question (median QUESTION_TOKENS); with probability
    ATTACH the question carries new material (a file, search results; median ATTACH_TOKENS). Think
    time between turns: lognormal seconds (median THINK_S, sigma THINK_SIGMA) at RATE requests per
    second, so many users are in a conversation at once and most next turns come back after a few
    hundred other requests.
    """

    BLOCK_TOKENS = 512
    RATE = 3.34  # requests per second (12,031 in an hour)
    SYSTEM_TOKENS = (600, 1500)
    DEFAULT_SHARE, APPS = 0.75, 12
    DOC_SHARE, DOCS, DOC_ZIPF, DOC_TOKENS = 0.1, 300, 1.0, 6000
    FIRST_TOKENS, FIRST_SIGMA = 4800, 1.3
    MULTI, CONTINUE = 0.2, 0.85
    CONTEXT = 128_000
    ANSWER_TOKENS, QUESTION_TOKENS = 290, 50
    ATTACH, ATTACH_TOKENS = 0.15, 2500
    THINK_S, THINK_SIGMA = 150.0, 1.2
    WARMUP = 1500  # requests generated and dropped first: the trace is a window of traffic in progress

    def __init__(self, rnd: random.Random, ch: Chainer) -> None:
        self.rnd, self.ch = rnd, ch
        lo, hi = self.SYSTEM_TOKENS
        self.system = [rnd.randint(lo, hi) for _ in range(self.APPS + 1)]  # tokens; [0] is the default
        self.app_weights = zipf_weights(self.APPS, 1.0)
        self.docs: dict[int, int] = {}  # document -> tokens, made on first use
        self.doc_cum = list(itertools.accumulate(zipf_weights(self.DOCS, self.DOC_ZIPF)))
        self.due = _Sessions()
        self._clock = -self.WARMUP
        for _ in range(self.WARMUP):
            self.next(0)

    def _tokens(self, median: float, sigma: float, hi: int | None = None) -> int:
        return lognormal_int(self.rnd, median, sigma, hi=hi)

    def _start(self) -> _Session:
        rnd = self.rnd
        app = 0 if rnd.random() < self.DEFAULT_SHARE else 1 + rnd.choices(range(self.APPS), self.app_weights)[0]
        s = _Session([], int(rnd.random() < self.MULTI), kind=f"app{app}")
        # NOTE: shared content is chained by its own id, so equal prompts (and equal documents after
        # the same prompt) give equal block ids; `extra` carries [tokens not yet in a full block].
        # NOTE: every prompt opens with the product's common preamble (its first block is in nearly
        # every request of the trace), then the app's own text.
        s.content = [("system", 0 if i == 0 else app, i) for i in range(self.system[app] // self.BLOCK_TOKENS)]
        s.extra = [self.system[app] % self.BLOCK_TOKENS]
        if rnd.random() < self.DOC_SHARE:
            doc = rnd.choices(range(self.DOCS), cum_weights=self.doc_cum)[0]
            tokens = self.docs.setdefault(doc, self._tokens(self.DOC_TOKENS, 0.8, hi=60_000))
            self._shared(s, ("doc", doc), tokens)
            self._append(s, self._tokens(self.QUESTION_TOKENS, 1.0, hi=2000))
        else:
            self._append(s, self._tokens(self.FIRST_TOKENS, self.FIRST_SIGMA, hi=self.CONTEXT // 2))
        return s

    def _shared(self, s: _Session, name: tuple[str, int], tokens: int) -> None:
        """Shared content (the same for every user) after what the session holds: it chains to equal
        ids only if it starts on a block boundary, as the engine's hashing would."""
        if s.extra[0]:
            self._append(s, tokens)  # misaligned: its blocks differ from another user's copy
            return
        s.content += [(*name, i) for i in range(tokens // self.BLOCK_TOKENS)]
        s.extra[0] = tokens % self.BLOCK_TOKENS

    def _append(self, s: _Session, tokens: int) -> None:
        total = s.extra[0] + tokens
        s.content += self.ch.fresh(total // self.BLOCK_TOKENS)
        s.extra[0] = total % self.BLOCK_TOKENS

    def next(self, now: int) -> Request:
        # NOTE: an own clock, so the warm-up's requests come before request 0 of the window.
        now, self._clock = self._clock, self._clock + 1
        rnd = self.rnd
        s = self.due.pop(now)
        if s is None:
            s = self._start()
        else:
            self._append(s, self._tokens(self.ANSWER_TOKENS, 0.6, hi=4000))  # the previous answer
            extra = self._tokens(self.ATTACH_TOKENS, 1.0, hi=40_000) if rnd.random() < self.ATTACH else 0
            self._append(s, self._tokens(self.QUESTION_TOKENS, 1.0, hi=2000) + extra)
        req = self.ch.chain(s.content)
        tokens = len(s.content) * self.BLOCK_TOKENS + s.extra[0]
        if s.left and rnd.random() < self.CONTINUE and tokens < self.CONTEXT:
            think = self.THINK_S * math.exp(self.THINK_SIGMA * rnd.gauss(0.0, 1.0))
            self.due.push(now + max(1, round(think * self.RATE)), s)
        return req


@dataclass(frozen=True, slots=True)
class SessionTag:
    """What an agent runtime knows of one request of the agentic workload when it sends it: the
    retention hints an engine passes to the store (DESIGN.md §6.5) are made from these.

    `session` numbers the sessions in the order they start (a subagent is a session of its own);
    `parent` is the session a subagent forked from (None for a top-level session); `turn` counts the
    session's requests from 0; `ends` is True on the session's last request (nothing of it comes
    back unless another session shares it); `subagents` is how many subagents this request's answer
    starts (the session then waits for all of them); `pause_s` is the tool call's pause before the
    session's next request (seconds; None when it ends or waits for subagents)."""

    session: int
    parent: int | None
    turn: int
    ends: bool
    subagents: int
    pause_s: float | None


@dataclass(slots=True)
class _AgentSession:
    """One agent session's state: its context (block contents and the tokens not yet in a full
    block), its turns left, and for a parent waiting on subagents how many are still running."""

    id: int
    app: int  # the agent whose system prompt it runs under
    parent: _AgentSession | None
    content: list[Hashable]
    extra: int  # tokens after the last full block
    left: int  # requests still to make
    turn: int = 0
    spawns: list[int] = field(default_factory=list)  # turns after which it starts subagents
    running: int = 0  # its subagents still running
    results: int = 0  # tokens its finished subagents returned, appended at its next turn

    def tokens(self, block_tokens: int) -> int:
        return len(self.content) * block_tokens + self.extra


class Agentic:
    """Agent sessions as the vLLM AgentX post describes production agent traffic (quoted by vLLM's
    RFC "Programmable KV Cache": a median of 43 turns per session, a median input of 142K tokens and
    output of 444, prefix-cache hit rates above 96%, subagents in 44% of sessions), with tool-call
    pauses of seconds to minutes between turns and sessions that end.

    A session starts with one of APPS agent system prompts with their tool definitions (Zipf(1);
    SYSTEM_TOKENS each) and the user's task (lognormal, median TASK_TOKENS). It makes TURNS requests
    (lognormal, median TURNS, sigma TURNS_SIGMA). Each request resends the whole context; the answer
    (lognormal, median OUTPUT_TOKENS) calls a tool whose result (lognormal, median TOOL_TOKENS) is
    appended with it for the next turn. The next turn comes after the answer's decoding
    (OUTPUT_TOKENS / DECODE_TPS seconds) and the tool's pause (lognormal seconds, median TOOL_S,
    sigma TOOL_SIGMA: most tools answer in seconds, some in minutes). At RATE requests per second
    this is the number of other requests in between: RATE x the mean pause sessions run at once.
    A context over CONTEXT tokens is compacted: the next request is the system prompt and a summary
    (lognormal, median SUMMARY_TOKENS), so the prefix breaks there, as agents' auto-compaction does.

    Subagents: SUBAGENT_SHARE of the sessions start subagents, 1 to 3 times at random turns, FANOUT
    at a time. A subagent forks its parent's context: its requests are the parent's whole context,
    its own task (SUB_TASK_TOKENS) and its own turns (lognormal, median SUB_TURNS), with the same
    pauses. The parent waits until all of them have ended, then resumes with their results
    (RESULT_TOKENS each) appended: the pause in which its own pages must survive.

    Scaled to the suite: a block is BLOCK_TOKENS tokens (8 blocks of 512 in an engine), so a median
    request is ~35 blocks and a replay of the suite's size runs in seconds; token counts, pauses and
    rates are the published ones. `tags` gets a SessionTag per request (see generate_tagged).
    """

    BLOCK_TOKENS = 4096
    RATE = 1.0  # requests per second
    APPS = 4
    SYSTEM_TOKENS = (16_000, 32_000)  # system prompt and tool definitions
    TASK_TOKENS = 8_000
    TURNS, TURNS_SIGMA, MAX_TURNS = 43, 0.7, 400
    OUTPUT_TOKENS = 444
    TOOL_TOKENS, TOOL_TOKENS_SIGMA = 3_000, 1.0
    DECODE_TPS = 50.0
    TOOL_S, TOOL_SIGMA = 5.0, 1.4
    CONTEXT, SUMMARY_TOKENS = 256_000, 30_000
    SUBAGENT_SHARE, FANOUT = 0.44, (1, 3)
    SUB_TASK_TOKENS, SUB_TURNS, SUB_TURNS_SIGMA = 800, 8, 0.7
    RESULT_TOKENS = 1_500
    WARMUP = 1500  # requests generated and dropped first: the window opens on traffic in progress

    def __init__(self, rnd: random.Random, ch: Chainer, tags: list[SessionTag] | None = None) -> None:
        self.rnd, self.ch, self.tags = rnd, ch, tags
        lo, hi = self.SYSTEM_TOKENS
        self.system = [rnd.randint(lo, hi) for _ in range(self.APPS)]
        self.app_weights = zipf_weights(self.APPS, 1.0)
        self.due: list[tuple[int, int, _AgentSession]] = []  # (due request, seq, session): a heap
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._clock = -self.WARMUP
        for _ in range(self.WARMUP):
            self.next(0)

    def _tokens(self, median: float, sigma: float, hi: int | None = None) -> int:
        return lognormal_int(self.rnd, median, sigma, hi=hi)

    def _append(self, s: _AgentSession, tokens: int) -> None:
        total = s.extra + tokens
        s.content += self.ch.fresh(total // self.BLOCK_TOKENS)
        s.extra = total % self.BLOCK_TOKENS

    def _system(self, s: _AgentSession, app: int) -> None:
        """The app's system prompt, shared by every session of the app (its full blocks chain to equal ids)."""
        tokens = self.system[app]
        s.content = [("agent-system", app, i) for i in range(tokens // self.BLOCK_TOKENS)]
        s.extra = tokens % self.BLOCK_TOKENS

    def _start(self) -> _AgentSession:
        rnd = self.rnd
        app = rnd.choices(range(self.APPS), self.app_weights)[0]
        turns = self._tokens(self.TURNS, self.TURNS_SIGMA, hi=self.MAX_TURNS)
        s = _AgentSession(next(self._ids), app, None, [], 0, turns)
        self._system(s, app)
        self._append(s, self._tokens(self.TASK_TOKENS, 0.8))
        if turns > 2 and rnd.random() < self.SUBAGENT_SHARE:
            s.spawns = sorted(rnd.sample(range(turns - 1), min(turns - 1, rnd.randint(1, 3))))
        return s

    def _fork(self, parent: _AgentSession) -> _AgentSession:
        """A subagent: the parent's context so far, then its own task."""
        turns = self._tokens(self.SUB_TURNS, self.SUB_TURNS_SIGMA, hi=self.MAX_TURNS)
        s = _AgentSession(next(self._ids), parent.app, parent, list(parent.content), parent.extra, turns)
        self._append(s, self._tokens(self.SUB_TASK_TOKENS, 0.6))
        return s

    def _push(self, now: int, seconds: float, s: _AgentSession) -> None:
        heapq.heappush(self.due, (now + max(1, round(seconds * self.RATE)), next(self._seq), s))

    def next(self, now: int) -> Request:
        # NOTE: an own clock, so the warm-up's requests come before request 0 of the window.
        now, self._clock = self._clock, self._clock + 1
        rnd = self.rnd
        if self.due and self.due[0][0] <= now:
            s = heapq.heappop(self.due)[2]
            if s.results:  # its subagents' results, after its own last answer
                self._append(s, s.results)
                s.results = 0
        else:
            s = self._start()
        req = self.ch.chain(s.content)
        s.left -= 1
        ends = s.left <= 0
        spawn = 0 if ends or not s.spawns or s.spawns[0] != s.turn else rnd.randint(*self.FANOUT)
        output = self._tokens(self.OUTPUT_TOKENS, 0.7, hi=8000)
        pause = None
        if ends:
            if s.parent is not None:  # NOTE: the result goes back to the parent, which resumes once all are done
                p = s.parent
                p.results += self.RESULT_TOKENS
                p.running -= 1
                if p.running == 0:
                    self._push(now, self.OUTPUT_TOKENS / self.DECODE_TPS, p)
        else:
            self._append(s, output)
            if spawn:
                s.spawns.pop(0)
                s.running = spawn
                for _ in range(spawn):
                    self._push(now, self.OUTPUT_TOKENS / self.DECODE_TPS, self._fork(s))
            else:
                pause = output / self.DECODE_TPS + self.TOOL_S * math.exp(self.TOOL_SIGMA * rnd.gauss(0.0, 1.0))
                self._append(s, self._tokens(self.TOOL_TOKENS, self.TOOL_TOKENS_SIGMA, hi=60_000))
                self._push(now, pause, s)
        if self.tags is not None and now >= 0:
            self.tags.append(SessionTag(s.id, None if s.parent is None else s.parent.id, s.turn, ends, spawn, pause))
        s.turn += 1
        if s.tokens(self.BLOCK_TOKENS) > self.CONTEXT:
            self._system(s, s.app)
            self._append(s, self._tokens(self.SUMMARY_TOKENS, 0.5))
        return req


def retention_hints(tags: Sequence[SessionTag], ttl_s: float, rate: float = Agentic.RATE) -> list[RetentionHint]:
    """The retention hints an agent runtime sends with each request of the agentic workload, made only
    of what it knows when it sends it (never the pause's length): a request after which the session
    waits (a tool call, or its subagents) leases the session's blocks for `ttl_s` seconds (`rate`
    requests a second: the lease in requests); a session's last request ends it (its lease released).
    Raises ValueError for a TTL that is not a positive number."""
    if not ttl_s > 0 or math.isinf(ttl_s):
        raise ValueError(f"ttl_s must be a positive finite number of seconds, got {ttl_s}")
    lease = max(1, math.ceil(ttl_s * rate))
    return [RetentionHint(t.session, ended=True) if t.ends else RetentionHint(t.session, lease) for t in tags]


# ------------------------------------------------------------------------------------------- suite


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A suite entry: how many requests at each size, and the generator's one-line summary."""

    name: str
    full: int
    smoke: int
    summary: str
    block_tokens: int = 512  # tokens a block stands for (for bytes; the shapes without a token model count 512)


WORKLOADS: dict[str, WorkloadSpec] = {
    "chat": WorkloadSpec("chat", 4000, 160, "multi-turn chat, growing histories, 4 shared system prompts"),
    "rag": WorkloadSpec("rag", 4000, 160, "document QA over 6000 reused documents (Zipf 0.9)"),
    "agent": WorkloadSpec("agent", 2500, 100, "agent loops: long shared tool prompts, many short steps"),
    "batch": WorkloadSpec("batch", 4000, 160, "batch few-shot jobs in bursts, one-off long prompts"),
    "tenants": WorkloadSpec("tenants", 4000, 160, "four tenants of those shapes; the mix changes halfway"),
    "conversation": WorkloadSpec(
        "conversation",
        6000,
        240,
        "production chat as published (Mooncake, LMSYS): long shared system prompts, uploads, most blocks seen once",
    ),
    "agentic": WorkloadSpec(
        "agentic",
        4000,
        160,
        "agent sessions as published (vLLM AgentX): 43 turns, 142K-token inputs, tool pauses, subagents forking",
        block_tokens=Agentic.BLOCK_TOKENS,
    ),
}

_GENERATORS: dict[str, Callable[[random.Random, Chainer, int], Callable[[int], Request]]] = {
    "chat": lambda rnd, ch, _n: Chat(rnd, ch).next,
    "rag": lambda rnd, ch, _n: Rag(rnd, ch).next,
    "agent": lambda rnd, ch, _n: Agent(rnd, ch).next,
    "batch": lambda rnd, ch, _n: Batch(rnd, ch).next,
    "tenants": lambda rnd, ch, n: Tenants(rnd, ch, n).next,
    "conversation": lambda rnd, ch, _n: Conversation(rnd, ch).next,
    "agentic": lambda rnd, ch, _n: Agentic(rnd, ch).next,
}


# The workloads whose requests belong to sessions an agent runtime knows of: a generator that also
# writes a SessionTag per request.
_TAGGED: dict[str, Callable[[random.Random, Chainer, list[SessionTag]], Callable[[int], Request]]] = {
    "agentic": lambda rnd, ch, tags: Agentic(rnd, ch, tags).next,
}


SESSION_WORKLOADS = frozenset(_TAGGED)  # the workloads generate_tagged() knows


def _count(name: str, requests: int | None, size: Size | str) -> int:
    spec = WORKLOADS.get(name)
    if spec is None:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    if requests is None:
        requests = spec.full if Size(size) is Size.FULL else spec.smoke
    if requests < 0:
        raise ValueError(f"requests must be >= 0, got {requests}")
    return requests


def generate(name: str, requests: int | None = None, *, seed: int = 0, size: Size | str = Size.FULL) -> list[Request]:
    """The requests of workload `name` (`requests` of them, default: the suite's count at `size`),
    reproducible from `seed`. Raises ValueError naming the known workloads."""
    requests = _count(name, requests, size)
    rnd = random.Random(f"{name}:{seed}")  # NOTE: str seeds are hashed with SHA-512, stable across runs
    nxt = _GENERATORS[name](rnd, Chainer(), requests)
    return [nxt(i) for i in range(requests)]


def generate_tagged(
    name: str, requests: int | None = None, *, seed: int = 0, size: Size | str = Size.FULL
) -> tuple[list[Request], list[SessionTag]]:
    """The same requests as generate() with the same arguments, and the SessionTag of each (what the
    agent runtime knows when it sends it). Raises ValueError for a workload without sessions."""
    requests = _count(name, requests, size)
    make = _TAGGED.get(name)
    if make is None:
        raise ValueError(f"workload {name!r} has no session tags; workloads with them: {sorted(_TAGGED)}")
    tags: list[SessionTag] = []
    rnd = random.Random(f"{name}:{seed}")  # NOTE: the same draws as generate(): tags never consume randomness
    nxt = make(rnd, Chainer(), tags)
    return [nxt(i) for i in range(requests)], tags


def suite(size: Size | str = Size.FULL, seed: int = 0) -> dict[str, list[Request]]:
    """Every workload of the suite at `size`, in a fixed order."""
    return {name: generate(name, seed=seed, size=size) for name in WORKLOADS}


def describe() -> str:
    return "\n".join(f"{s.name:<8} {s.full:>5} requests ({s.smoke} smoke): {s.summary}" for s in WORKLOADS.values())
