"""Ray actors: PrefillWorker, DecodeWorker and the cache-aware Router (DESIGN.md §1).

The workers wrap `workers.serving` engines. GPUs are requested only where Ray sees GPUs; on a CPU host
everything runs on CPU under a local `ray.init()` (see workers/runtime.py for token auth).

Router policy:
- prefill: the worker whose local cache node holds the longest run of the prompt's prefix (one Redis
  round trip), ties to the fewest requests in flight; without a holder, the least busy worker;
- decode: the least busy decode worker;
- bounded queues: at most `max_inflight` requests per worker; a request waits (bounded by its
  deadline) for a slot rather than piling onto a busy worker.

Sessions (DESIGN.md §6.5): a conversation's requests carry one `SessionHints` (its id, chosen by the caller, and
its lease, priority and mode). The prefill worker retains the prompt's pages for it on the nodes holding them;
the router remembers those nodes (at most MAX_SESSIONS conversations) and, when the conversation's next turn
arrives, asks them to promote its pages back to DRAM (resume) before the request waits for a prefill slot, so
the promotion overlaps the queueing. `end_session` (or a request whose hints say `end`) releases them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import ray
import redis

from kvstore.client import KVStoreClient
from kvstore.client.cluster import ClusterClient
from kvstore.errors import KVStoreError, SessionNotFound
from kvstore.hashing import prefix_hashes
from kvstore.index import IndexReader
from kvstore.integrations.hints import SessionHints
from workers.serving import DecodeEngine, DecodeStats, PrefillEngine, PrefillResult, Timings, WorkerConfig

log = logging.getLogger(__name__)
MAX_SESSIONS = 100_000  # conversations whose retaining nodes the router remembers (the oldest forgotten first)


def _ignore_unknown(fn: Callable[[], object]) -> object:
    """A session hint to a node that no longer has the session (expired, displaced, restarted) is no news."""
    try:
        return fn()
    except SessionNotFound:
        return None


@ray.remote
class PrefillWorker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.engine = PrefillEngine(cfg)
        self.local_node = cfg.local_node

    def info(self) -> dict[str, object]:
        return {"local_node": self.local_node, "layout": self.engine.layout.describe()}

    def prefill(
        self, request_id: str, prompt: list[int], session: SessionHints | None = None
    ) -> Iterator[PrefillResult]:
        """Streams two results (call with .options(num_returns="streaming")): the first token, then the
        same with the new pages stored (and retained for `session` where it is given)."""
        yield from self.engine.prefill_steps(request_id, prompt, session)


@ray.remote
class DecodeWorker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.engine = DecodeEngine(cfg)
        self._stats: dict[str, DecodeStats] = {}

    def generate(
        self, request_id: str, prompt: list[int], prefill: PrefillResult, max_new_tokens: int
    ) -> Iterator[int]:
        """Streams tokens (call with .options(num_returns="streaming"))."""
        stats: list[DecodeStats] = []
        for token in self.engine.generate(request_id, prompt, prefill, max_new_tokens, stats):
            if stats:
                self._stats[request_id] = stats.pop()
            yield token

    def pop_stats(self, request_id: str) -> DecodeStats | None:
        return self._stats.pop(request_id, None)


@dataclass(slots=True)
class RequestResult:
    request_id: str
    prompt_len: int
    tokens: list[int]
    cached_blocks: int  # prompt blocks the prefill fetched instead of computing
    cached_tiers: dict[str, int]  # where those blocks were found (hbm / dram / nvme)
    decode_fetched_blocks: int
    prefill_worker: int
    decode_worker: int
    ttft_s: float  # request arrival at the router -> first token known
    total_s: float
    prefill: Timings = field(default_factory=Timings)
    decode: Timings = field(default_factory=Timings)
    queued_s: float = 0.0
    logprobs: list[float] = field(default_factory=list)  # of each of `tokens` under the model, in order
    retained_on: list[str] = field(default_factory=list)  # nodes retaining the prompt's pages for its session


@ray.remote(num_cpus=0)
class Router:
    """Cache-aware routing over prefill and decode workers with bounded per-worker queues."""

    def __init__(
        self,
        prefill: Sequence[ray.actor.ActorHandle],
        decode: Sequence[ray.actor.ActorHandle],
        redis_url: str,
        namespace: str,
        block_size: int,
        *,
        local_nodes: Sequence[str | None],
        max_inflight: int = 4,
        queue_timeout_s: float = 300.0,
    ) -> None:
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.redis_url = redis_url
        self.index = IndexReader(redis_url)
        self._cluster: ClusterClient | None = None  # node clients for session hints (made on first use)
        self._sessions: dict[str, list[str]] = {}  # conversation -> nodes retaining its pages (oldest first)
        self.namespace = namespace
        self.block_size = block_size
        self.local_nodes = list(local_nodes)
        self.queue_timeout_s = queue_timeout_s
        self._p_slots = [asyncio.Semaphore(max_inflight) for _ in self.prefill]
        self._d_slots = [asyncio.Semaphore(max_inflight) for _ in self.decode]
        self._p_busy = [0] * len(self.prefill)
        self._d_busy = [0] * len(self.decode)

    def _pick_prefill(self, prompt: Sequence[int]) -> int:
        hashes = prefix_hashes(prompt, self.block_size, self.namespace)
        shares = self.index.lookup(self.namespace, hashes).nodes if hashes else {}

        def score(i: int) -> tuple[int, int]:
            node = self.local_nodes[i]
            held = shares[node].leading if node in shares else 0
            return (-held, self._p_busy[i])

        return min(range(len(self.prefill)), key=score)

    def _session_call(self, session: str, nodes: Sequence[str], fn: Callable[[KVStoreClient], object]) -> None:
        """fn on each node's client, off the router's loop; a hint that fails is logged, never the request's."""

        def run() -> None:
            for node in nodes:
                try:
                    self._nodes().call_node(node, fn)
                except (KVStoreError, redis.exceptions.RedisError) as exc:
                    log.warning("session %r on node %s: %s", session, node, exc)

        asyncio.get_running_loop().run_in_executor(None, run)

    def _nodes(self) -> ClusterClient:
        if self._cluster is None:
            self._cluster = ClusterClient(self.redis_url)
        return self._cluster

    async def end_session(self, session: str) -> list[str]:
        """The conversation ended: its pages are released on the nodes that retained them; those nodes."""
        nodes = self._sessions.pop(session, [])
        self._session_call(session, nodes, lambda c: _ignore_unknown(lambda: c.end_session(session)))
        return nodes

    async def generate(
        self, request_id: str, prompt: list[int], max_new_tokens: int, session: SessionHints | None = None
    ) -> RequestResult:
        t0 = time.perf_counter()
        if session is not None and session.resume and (nodes := self._sessions.get(session.session)):
            hints = session  # the conversation's next turn: its pages back toward DRAM while it queues
            self._session_call(
                hints.session,
                nodes,
                lambda c: _ignore_unknown(
                    lambda: c.resume_session(
                        hints.session, ttl_seconds=hints.ttl_s, priority=hints.priority, mode=hints.mode
                    )
                ),
            )
        p = self._pick_prefill(prompt)
        d = min(range(len(self.decode)), key=lambda i: self._d_busy[i])
        async with asyncio.timeout(self.queue_timeout_s):  # not wait_for: it can swallow a cancel on 3.11
            await self._p_slots[p].acquire()
        queued = time.perf_counter() - t0
        self._p_busy[p] += 1
        try:
            steps = self.prefill[p].prefill.options(num_returns="streaming").remote(request_id, prompt, session)
            pre: PrefillResult = await (await steps.__anext__())
            ttft = time.perf_counter() - t0  # the first token exists now; its pages are being stored
            async for ref in steps:
                pre = await ref
        finally:
            self._p_busy[p] -= 1
            self._p_slots[p].release()
        async with asyncio.timeout(self.queue_timeout_s):  # not wait_for: it can swallow a cancel on 3.11
            await self._d_slots[d].acquire()
        self._d_busy[d] += 1
        tokens: list[int] = []
        try:
            stream = (
                self.decode[d].generate.options(num_returns="streaming").remote(request_id, prompt, pre, max_new_tokens)
            )
            async for ref in stream:
                tokens.append(await ref)
            stats: DecodeStats | None = await self.decode[d].pop_stats.remote(request_id)
        finally:
            self._d_busy[d] -= 1
            self._d_slots[d].release()
        if session is not None:
            self._remember(session.session, pre.retained_on)
            if session.end:
                await self.end_session(session.session)
        return RequestResult(
            request_id=request_id,
            prompt_len=len(prompt),
            tokens=tokens,
            cached_blocks=pre.cached_blocks,
            cached_tiers=pre.cached_tiers,
            decode_fetched_blocks=stats.fetched_blocks if stats else 0,
            prefill_worker=p,
            decode_worker=d,
            ttft_s=ttft,
            total_s=time.perf_counter() - t0,
            prefill=pre.timings,
            decode=stats.timings if stats else Timings(),
            queued_s=queued,
            logprobs=[pre.first_logprob, *(stats.logprobs if stats else [])][: len(tokens)],
            retained_on=list(pre.retained_on),
        )

    def _remember(self, session: str, nodes: Sequence[str]) -> None:
        """The nodes retaining a conversation's pages (the most recent MAX_SESSIONS conversations)."""
        known = self._sessions.pop(session, [])
        self._sessions[session] = sorted(set(known) | set(nodes))
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.pop(next(iter(self._sessions)))
