"""Disaggregated prefill/decode through the cache: the logic of the workers, free of Ray.

`PrefillEngine` and `DecodeEngine` hold a model and a cache link; `workers/actors.py` wraps them in
Ray actors. Keeping them plain classes lets tests and the single-process path run the exact same code.

Prefill (one request): hash the prompt's full blocks (the v1 contract), look up the longest cached
prefix through the cluster index, fetch those pages into the paged cache, compute only the rest, put
the new full pages back (on the node holding the chain), return the first token and the block hashes.

Decode (one request): fetch the prompt's pages by hash (from the node the prefill stored them on, or
wherever the index says), recompute whatever did not come back (the trailing partial block always,
and any block evicted meanwhile), then decode token by token. A page that vanished between prefill and
decode costs recompute, never a wrong token.

Pages travel in the deployment's encoding (`WorkerConfig.kv_encoding`, workers/page_codec.py): `raw`, the
bytes of `[num_layers, 2, block_size, num_kv_heads, head_dim]` in the model's KV dtype (DESIGN.md §4), as
`PagedLlama.export_pages` produces them per block; or `fp8-e4m3`, quantized on the worker's device before
the Put and dequantized there after the fetch: half the bytes stored and moved, within the fp8 bound.
The namespace names the encoding (`namespace_for`), since a namespace holds one encoding.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import NonFiniteKV
from kvstore.client.cluster import ClusterClient
from kvstore.errors import KVStoreError
from kvstore.hashing import prefix_hashes
from kvstore.index import ClusterLookup
from kvstore.integrations.hints import SessionHints
from kvstore.layout import PageEncoding
from workers.loader import load_checkpoint
from workers.model import CacheConfig, PagedLlama
from workers.page_codec import PageCodec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerConfig:
    """What every worker needs: the checkpoint, the cache plane, and its own KV cache size."""

    model_dir: str
    redis_url: str
    namespace: str
    num_blocks: int = 512
    block_size: int = 16
    dtype: str = "float32"
    local_node: str | None = None  # the cache node on this worker's host: puts go there first
    torch_threads: int | None = None
    kv_encoding: str = "raw"  # how pages are stored: raw, or fp8 (fp8-e4m3, quantized by the workers)


@dataclass(slots=True)
class Timings:
    lookup_s: float = 0.0
    fetch_s: float = 0.0
    compute_s: float = 0.0
    put_s: float = 0.0

    def total(self) -> float:
        return self.lookup_s + self.fetch_s + self.compute_s + self.put_s


@dataclass(slots=True)
class PrefillResult:
    """What a decode worker needs from a prefill: the first token and where the prompt's pages are."""

    request_id: str
    prompt_len: int
    first_token: int
    block_hashes: list[bytes]  # the prompt's full blocks
    cached_blocks: int  # blocks that came from the cache (not computed)
    stored_blocks: int  # new pages put back
    stored_on: str | None  # node the new pages went to
    timings: Timings = field(default_factory=Timings)
    cached_tiers: dict[str, int] = field(default_factory=dict)  # tier label -> cached blocks found there
    first_logprob: float = 0.0  # log-probability of first_token under the model (greedy: the largest)
    retained_on: list[str] = field(default_factory=list)  # nodes that retain the prompt's pages for its session


@dataclass(slots=True)
class DecodeStats:
    fetched_blocks: int
    recomputed_tokens: int
    timings: Timings
    logprobs: list[float] = field(default_factory=list)  # of each token decoded after the first, in order


def token_logprob(logits: torch.Tensor, token: int) -> float:
    """log softmax(logits)[token], in float32 (what engines report as a token's log-probability)."""
    return float(torch.log_softmax(logits.float(), dim=-1)[token])


BLOCK_SIZE_UNNAMED = 16  # the block size a namespace does not name (namespace_for's NOTE)
SESSION_TTL_S = 300.0  # a conversation's lease when its hints name none: renewed by each of its turns


def namespace_for(
    model_dir: str | Path,
    dtype: str,
    tp: str = "tp1",
    encoding: str | PageEncoding = "raw",
    block_size: int = BLOCK_SIZE_UNNAMED,
) -> str:
    """A namespace naming everything that makes pages incompatible (DESIGN.md §3): the checkpoint
    (name and a digest of its config and weight file names and sizes), the KV dtype, the TP shard, the
    block size (tokens per page) and, for an encoded deployment, the page encoding.

    NOTE: a node binds a namespace to one page layout, so each of these gets its own namespace: workers of
    one model with another encoding or block size can share a node (during a rollout, say) and miss, instead
    of having every Put of one refused. The keys of two block sizes differ anyway (the hash root holds it).
    Namespaces of raw pages of 16-token blocks are what they were before either was named, so pages cached
    by earlier builds still hit."""
    d = Path(model_dir)
    h = hashlib.sha256((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        h.update(f.name.encode() + str(f.stat().st_size).encode())
    enc = PageEncoding.parse(encoding)
    block = "" if block_size == BLOCK_SIZE_UNNAMED else f"/b{block_size}"
    suffix = "" if enc is PageEncoding.RAW else f"/{enc.label}"
    return f"{d.name}@{h.hexdigest()[:12]}/{dtype}/{tp}{block}{suffix}"


class _Engine:
    def __init__(self, cfg: WorkerConfig) -> None:
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.cfg = cfg
        ckpt = load_checkpoint(
            cfg.model_dir,
            cache=CacheConfig(block_size=cfg.block_size, num_blocks=cfg.num_blocks),
            dtype=getattr(torch, cfg.dtype),
        )
        self.model: PagedLlama = ckpt.model
        self.tokenizer = ckpt.tokenizer
        self.codec = PageCodec(self.model.page_layout(), cfg.kv_encoding)
        self.layout = self.codec.stored  # what the cache stores: the model's pages in the deployment's encoding
        self.cache = ClusterClient(cfg.redis_url, local_node=cfg.local_node)
        self._seq = itertools.count()

    def close(self) -> None:
        self.cache.close()

    def hashes(self, prompt: Sequence[int]) -> list[bytes]:
        return prefix_hashes(prompt, self.cfg.block_size, self.cfg.namespace)

    def _fetch(
        self,
        hashes: Sequence[bytes],
        prefer_node: str | None = None,
        tiers: dict[str, int] | None = None,
        found: ClusterLookup | None = None,
    ) -> torch.Tensor | None:
        """Pages of the longest retrievable prefix of hashes, as [k, *page_shape] (None when k == 0);
        counts in `tiers` where each page was found."""
        if not hashes:
            return None
        got = self.cache.get_pages(self.cfg.namespace, hashes, prefer_node=prefer_node, found=found)
        if not got:
            return None
        if tiers is not None:
            for p in got:
                tiers[p.tier.label] = tiers.get(p.tier.label, 0) + 1
        data = [p.data for p in got]
        try:
            return self.codec.decode(data, device=self.model.device)
        except NonFiniteKV as exc:  # a stored page this encoder would never write: a miss from there on
            log.warning("cached page unusable, prefix cut at page %d: %s", exc.page, exc)
            return self.codec.decode(data[: exc.page], device=self.model.device) if exc.page else None

    def _local_match(self, hashes: Sequence[bytes], index_matched: int) -> int:
        """The local node's own longest match when the index shows less than the whole chain.

        NOTE: the index is updated in batches (tens of ms behind a put); the local node's index is
        authoritative for what it holds, so a request right after another that stored the same
        prefix still finds it. One cheap RPC, only on a partial index match.
        """
        if index_matched >= len(hashes) or not self.cfg.local_node:
            return 0
        try:
            return self.cache.call_node(self.cfg.local_node, lambda c: c.lookup(self.cfg.namespace, hashes))
        except KVStoreError:
            return 0

    def _import(self, seq: str, pages: torch.Tensor | None) -> int:
        return 0 if pages is None else self.model.import_pages(seq, pages) // self.cfg.block_size


class PrefillEngine(_Engine):
    """Computes the uncached part of prompts and publishes their pages."""

    def prefill(self, request_id: str, prompt: Sequence[int], session: SessionHints | None = None) -> PrefillResult:
        """The whole prefill, pages stored: the last of prefill_steps."""
        result = None
        for result in self.prefill_steps(request_id, prompt, session):  # noqa: B007 - the last one is the answer
            pass
        assert result is not None
        return result

    def prefill_steps(
        self, request_id: str, prompt: Sequence[int], session: SessionHints | None = None
    ) -> Iterator[PrefillResult]:
        """Yields twice: as soon as the first token is known (time to first token), then once the new
        pages are stored (stored_blocks/stored_on set) — a decode must start only after the second. With a
        `session` (a conversation's id and its retention hints, DESIGN.md §6.5), the prompt's pages are retained
        for it on the nodes holding them (`retained_on`), so its next turn finds them after a pause."""
        t = Timings()
        prompt = list(prompt)
        hashes = self.hashes(prompt)
        # The prompt's last token is always computed (its logits give the first token), so a prompt of
        # exactly k full blocks can reuse at most k - 1 of them.
        usable = (len(prompt) - 1) // self.cfg.block_size
        seq = f"p{next(self._seq)}-{request_id}"
        t0 = time.perf_counter()
        found = self.cache.lookup(self.cfg.namespace, hashes[:usable])
        matched = max(found.matched, self._local_match(hashes[:usable], found.matched))
        t1 = time.perf_counter()
        tiers: dict[str, int] = {}
        pages = self._fetch(hashes[:matched], prefer_node=self.cfg.local_node, tiers=tiers, found=found)
        t2 = time.perf_counter()
        try:
            cached = self._import(seq, pages)
            start = cached * self.cfg.block_size
            logits = self.model.prefill(seq, prompt[start:], start_pos=start)
            first = int(torch.argmax(logits))
            first_lp = token_logprob(logits, first)
            t3 = time.perf_counter()
            t.lookup_s, t.fetch_s, t.compute_s = t1 - t0, t2 - t1, t3 - t2
            yield PrefillResult(request_id, len(prompt), first, hashes, cached, 0, None, t, tiers, first_lp)
            new = range(cached, len(hashes))
            stored_on = None
            stored = 0
            if new:
                out = self.model.export_pages(seq, list(new))
                try:
                    blobs = self.codec.encode_buffers(out)
                except NonFiniteKV as exc:  # NaN/inf KV is not cached: the pages before it still are
                    log.warning("not caching pages from block %d on: %s", cached + exc.page, exc)
                    blobs = self.codec.encode_buffers(out[: exc.page]) if exc.page else []
                if blobs:
                    stored_on, res = self.cache.put(
                        self.cfg.namespace,
                        self.layout,
                        hashes[cached : cached + len(blobs)],
                        blobs,
                        parent_chain=hashes[:cached],
                    )
                    stored = res.stored
            t4 = time.perf_counter()
        finally:
            self.model.free(seq)
        t.put_s = t4 - t3
        holders = {node for block in found.holders[: found.matched] for node in block}  # every copy, not the route
        if matched > found.matched and self.cfg.local_node:  # the index lags: the local node said it holds more
            holders.add(self.cfg.local_node)
        if stored_on:
            holders.add(stored_on)
        retained = self._retain(session, hashes, sorted(holders))
        yield PrefillResult(
            request_id, len(prompt), first, hashes, cached, stored, stored_on, t, tiers, first_lp, retained
        )

    def _retain(self, session: SessionHints | None, hashes: list[bytes], nodes: list[str]) -> list[str]:
        """Name the prompt's pages for `session` on every node holding some of them (what each holds is retained,
        the rest is retained there once put); the nodes that answered. A failed hint costs the request nothing."""
        if session is None or session.end:
            return []
        done = []
        for node in nodes:
            try:
                self.cache.call_node(
                    node,
                    lambda c: c.retain(session.session, self.cfg.namespace, hashes, ttl_seconds=session.lease(
                        SESSION_TTL_S), priority=session.priority, mode=session.mode),
                )  # fmt: skip
                done.append(node)
            except KVStoreError as exc:
                log.warning("session %r: node %s did not retain its pages: %s", session.session, node, exc)
        return done


class DecodeEngine(_Engine):
    """Rebuilds a prompt's KV from the cache and decodes."""

    def generate(
        self,
        request_id: str,
        prompt: Sequence[int],
        prefill: PrefillResult,
        max_new_tokens: int,
        stats: list[DecodeStats] | None = None,
    ) -> Iterator[int]:
        """Yield max_new_tokens tokens, the first being prefill's. `stats` receives one DecodeStats."""
        prompt = list(prompt)
        if max_new_tokens <= 0:
            return
        seq = f"d{next(self._seq)}-{request_id}"
        t = Timings()
        try:
            usable = (len(prompt) - 1) // self.cfg.block_size
            t0 = time.perf_counter()
            pages = self._fetch(prefill.block_hashes[:usable], prefer_node=prefill.stored_on)
            t1 = time.perf_counter()
            fetched = self._import(seq, pages)
            start = fetched * self.cfg.block_size
            self.model.prefill(seq, prompt[start:], start_pos=start)  # the part no page covers
            t2 = time.perf_counter()
            t.fetch_s, t.compute_s = t1 - t0, t2 - t1
            ds = DecodeStats(fetched, len(prompt) - start, t)
            if stats is not None:
                stats.append(ds)  # NOTE: the caller may keep it now; ds.logprobs fills in as tokens are made
            token = prefill.first_token
            yield token
            for _ in range(max_new_tokens - 1):
                logits = self.model.decode([seq], [token])[0]
                token = int(torch.argmax(logits))
                ds.logprobs.append(token_logprob(logits, token))
                yield token
        finally:
            self.model.free(seq)
