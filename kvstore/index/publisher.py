"""The node side of the index: heartbeat, batched updates off the request path, resyncs, garbage collection."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

import redis

from kvstore import __version__
from kvstore.index.connect import async_client
from kvstore.index.keys import (
    ALIVE_PREFIX,
    BLOCK_KEYS_GLOB,
    LOOKUP_SCRIPT,
    NODES_KEY,
    alive_key,
    block_key,
    epoch_key,
    node_key,
)
from kvstore.names import TierKind
from kvstore.security import redact_url
from kvstore.stats import IndexStatus

log = logging.getLogger(__name__)

Holding = tuple[str, bytes, TierKind]


class IndexPublisher:
    """A node's side of the index: heartbeat, batched updates off the request path, resyncs.

    Thread model: everything runs on the node's event loop; `note()` is synchronous and O(1) (called
    by the TierManager on every placement change). Invariants: at most `max_pending` distinct keys are
    queued (beyond that the queue is dropped and a full resync is scheduled); a key's queued value is
    always its latest state (tier, or None for removal), so coalescing never reorders a key's history.
    """

    # keyword-only tuning settings, each with a default
    def __init__(  # noqa: PLR0913
        self,
        url: str,
        node_id: str,
        addr: str,
        holdings: Callable[[], Iterable[Holding]],
        node_info: Callable[[], dict[str, int | str]],
        *,
        ttl_seconds: float = 10.0,
        flush_interval: float = 0.02,
        max_pending: int = 100_000,
        batch: int = 2000,
        gc_interval: float = 60.0,
    ) -> None:
        self.url = url
        self.node_id = node_id
        self.addr = addr
        self._holdings = holdings
        self._node_info = node_info
        self.ttl_seconds = ttl_seconds
        self.flush_interval = flush_interval
        self.max_pending = max_pending
        self.batch = batch
        self.gc_interval = gc_interval
        # A stuck Redis call must give up well before the next heartbeat is due (every ttl/3).
        timeout = max(0.25, ttl_seconds / 4)
        self._redis, self._master = async_client(url, timeout)  # one Redis or Sentinel (index/connect.py)
        self._published_to: tuple[str, int] | None = None  # the master the last resync wrote to (Sentinel)
        self._pending: dict[tuple[str, bytes], TierKind | None] = {}
        self._oldest_pending: float | None = None
        self._need_resync = True
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._gc_cursor = 0
        self._registered = asyncio.Event()  # set once the first full publish has landed
        self.stats = IndexStatus(url=redact_url(url))  # live counters (no password: Stats shows them)

    # -- called by the manager (sync, cheap)

    def note(self, namespace: str, h: bytes, tier: TierKind | None, previous: TierKind | None = None) -> None:
        """Record a page's new placement (None: gone from this node; `previous` is not needed here)."""
        if self._need_resync:
            return  # a resync republishes everything from the manager's state anyway
        if len(self._pending) >= self.max_pending and (namespace, h) not in self._pending:
            self._pending.clear()
            self._oldest_pending = None
            self._need_resync = True
            self.stats.overflows += 1
            log.warning("index update queue overflowed (%d keys): full resync scheduled", self.max_pending)
        else:
            self._pending[(namespace, h)] = tier
            if self._oldest_pending is None:
                self._oldest_pending = time.monotonic()
        if len(self._pending) >= self.batch:
            self._wake.set()

    # -- lifecycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._flush_loop()),
            loop.create_task(self._heartbeat_loop()),
            loop.create_task(self._gc_loop()),
        ]

    async def wait_registered(self, timeout: float) -> bool:
        """Wait (bounded) until this node's holdings and address are published; False on timeout.

        A restarted node is only findable through the index after this: before it, lookups still see
        the previous incarnation (old address, old epoch) until that alive key expires.
        """
        try:
            async with asyncio.timeout(timeout):
                await self._registered.wait()
        except TimeoutError:
            return False
        return True

    async def close(self, deregister: bool = True) -> None:
        """Stop; with deregister, flush what is queued and drop the alive key so lookups skip this node
        at once (its entries stay until swept; the next start takes a new epoch)."""
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            # Bounded: a loop that swallowed its cancellation must not hang the node's shutdown.
            _, stuck = await asyncio.wait(self._tasks, timeout=max(1.0, self.ttl_seconds))
            if stuck:
                log.warning("index: %d background task(s) did not stop on cancel", len(stuck))
        if deregister:
            try:
                async with asyncio.timeout(self.ttl_seconds):
                    await self._flush_once()
                async with asyncio.timeout(self.ttl_seconds):
                    await self._redis.delete(alive_key(self.node_id))
            except (redis.RedisError, OSError, TimeoutError) as exc:
                log.info("index deregistration skipped: %s", exc)
        await self._redis.aclose()
        await self._master.aclose()

    # -- loops (each iteration bounded in time by socket timeouts; loops end on cancel)

    async def _flush_loop(self) -> None:
        backoff = self.flush_interval
        while True:
            # NOTE: asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
            # lands as the event fires, and this loop would then run forever and hang the node's stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):
                    await self._wake.wait()
            self._wake.clear()
            try:
                talked = self._need_resync or bool(self._pending)
                if self._need_resync:
                    await self._resync()
                await self._flush_once()
                backoff = self.flush_interval
                if talked:
                    self._connected(True)
            except (redis.RedisError, OSError) as exc:
                self._failed(exc)
                backoff = min(2.0, max(backoff * 2, 0.1))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_seconds / 3)
            if self._need_resync:
                continue  # the flush loop registers us when it resyncs
            if self._pending and not self.stats.connected:
                continue  # flush the backlog first: a heartbeat must not announce entries not yet written
            try:
                await self._heartbeat()
                self._connected(True)
            except (redis.RedisError, OSError) as exc:
                self._failed(exc)

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.gc_interval)
            try:
                await self.gc_step()
            except (redis.RedisError, OSError) as exc:
                log.debug("index gc step failed: %s", exc)

    # -- steps

    async def _heartbeat(self) -> None:
        master = await self._master.where()
        if master != self._published_to:
            # Sentinel failed the index over to another master since the last resync: the new master has
            # what had been replicated to it, not necessarily every recent write. Republish everything
            # under a new epoch, so no entry is missing for longer than this one republish.
            log.warning("index: the master is now %s (was %s); full resync", master, self._published_to)
            self._need_resync = True
            self._wake.set()
            return
        ttl_ms = int(self.ttl_seconds * 1000)
        ok = await self._redis.set(alive_key(self.node_id), str(self.stats.epoch), xx=True, px=ttl_ms)
        if not ok:
            # Our alive key is gone (expired during an outage, or Redis lost its data): our entries
            # may be gone too. Republish everything under a new epoch.
            log.warning("index: alive key missing; full resync")
            self._need_resync = True
            self._wake.set()
            return
        await self._write_node_info()

    def status(self) -> IndexStatus:
        """A snapshot of the counters, with the queue length, lag and resync flag as of now."""
        self.stats.queued = len(self._pending)
        self.stats.lag_seconds = time.monotonic() - self._oldest_pending if self._oldest_pending else 0.0
        self.stats.resync_pending = self._need_resync
        return dataclasses.replace(self.stats)

    async def _write_node_info(self) -> None:
        self.status()
        info: dict[str, int | str] = {
            "addr": self.addr,
            "epoch": self.stats.epoch,
            "version": __version__,
            "queued": self.stats.queued,
            "lag_ms": int(self.stats.lag_seconds * 1000),
            "resyncs": self.stats.resyncs,
            "overflows": self.stats.overflows,
            "heartbeat": int(time.time()),
            **self._node_info(),
        }
        pipe = self._redis.pipeline(transaction=False)
        pipe.sadd(NODES_KEY, self.node_id)
        pipe.hset(node_key(self.node_id), mapping=info)
        pipe.expire(node_key(self.node_id), int(max(60, 30 * self.ttl_seconds)))
        await pipe.execute()

    async def _resync(self) -> None:
        """New epoch, then every holding of the node; queued updates after the snapshot still apply."""
        self._pending.clear()
        self._oldest_pending = None
        self._need_resync = False
        try:
            # Where these writes go (Sentinel: asked first, so a failover during the resync is seen as a
            # move at the next heartbeat and republished again).
            self._published_to = await self._master.where()
            # Nodes load the lookup script: read-only clients may only run it (EVALSHA), see acl.py. An
            # operator's Redis user without SCRIPT LOAD leaves that to clients allowed to load it.
            with contextlib.suppress(redis.exceptions.NoPermissionError):
                await self._redis.script_load(LOOKUP_SCRIPT)
            epoch = int(await self._redis.incr(epoch_key(self.node_id)))
            snapshot = list(self._holdings())
            for start in range(0, len(snapshot), self.batch):
                pipe = self._redis.pipeline(transaction=False)
                for ns, h, tier in snapshot[start : start + self.batch]:
                    pipe.hset(block_key(ns, h), self.node_id, f"{epoch}:{int(tier)}")
                await pipe.execute()
            # Only now do this epoch's entries become visible: lookups match entries to the alive value.
            await self._redis.set(alive_key(self.node_id), str(epoch), px=int(self.ttl_seconds * 1000))
        except BaseException:
            self._need_resync = True
            raise
        self.stats.epoch = epoch
        self.stats.resyncs += 1
        await self._write_node_info()
        self._registered.set()
        log.info("index: published %d page(s) under epoch %d", len(snapshot), epoch)

    async def _flush_once(self) -> None:
        if not self._pending or self._need_resync:
            return
        batch = self._pending
        self._pending = {}
        oldest = self._oldest_pending
        self._oldest_pending = None
        try:
            items = list(batch.items())
            for start in range(0, len(items), self.batch):
                pipe = self._redis.pipeline(transaction=False)
                for (ns, h), tier in items[start : start + self.batch]:
                    if tier is None:
                        pipe.hdel(block_key(ns, h), self.node_id)
                    else:
                        pipe.hset(block_key(ns, h), self.node_id, f"{self.stats.epoch}:{int(tier)}")
                await pipe.execute()
        except BaseException:
            # Put the batch back under anything newer that arrived meanwhile (newer wins).
            batch.update(self._pending)
            self._pending = batch
            self._oldest_pending = oldest
            raise
        self.stats.flushed += len(batch)

    async def gc_step(self, count: int = 1000) -> int:
        """Remove up to one SCAN page of dead or stale fields; returns how many fields were removed."""
        cursor, keys = await self._redis.scan(self._gc_cursor, match=BLOCK_KEYS_GLOB, count=count)
        self._gc_cursor = int(cursor)
        if not keys:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        for k in keys:
            pipe.hgetall(k)
        contents = await pipe.execute()
        nodes = {n for c in contents for n in c}
        pipe = self._redis.pipeline(transaction=False)
        for n in nodes:
            pipe.get(ALIVE_PREFIX.encode() + n)
        epochs = dict(zip(nodes, await pipe.execute(), strict=True))
        pipe = self._redis.pipeline(transaction=False)
        removed = 0
        for k, c in zip(keys, contents, strict=True):
            for n, v in c.items():
                ep = epochs[n]
                if ep is None or v.split(b":", 1)[0] != ep:
                    pipe.hdel(k, n)
                    removed += 1
        if removed:
            await pipe.execute()
        return removed

    def _connected(self, ok: bool) -> None:
        if ok and not self.stats.connected:
            log.info("index: connected to %s", self.stats.url)
        self.stats.connected = ok

    def _failed(self, exc: BaseException) -> None:
        if self.stats.connected:
            log.warning("index: Redis unreachable (%s); serving locally, queueing updates", exc)
        self.stats.connected = False
        self.stats.errors += 1
        # Keep queueing (bounded). When Redis answers again the queue is flushed; if Redis lost our
        # entries meanwhile (restart, or our alive key expired), the heartbeat finds the alive key gone
        # and a full resync follows. Only a queue overflow forces a resync by itself.
