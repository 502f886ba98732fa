"""The node side of the index: heartbeat, batched updates off the request path, resyncs, garbage collection."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Iterable

import redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from kvstore import __version__
from kvstore.index.connect import async_client
from kvstore.index.keys import (
    BEAT_S,
    BEAT_TTL_MS,
    NODES_KEY,
    PRUNE_SCRIPT,
    STRIPE_KEYS_GLOB,
    UPDATE_SCRIPT,
    alive_key,
    beat_key,
    check_node_id,
    entry_of,
    epoch_key,
    holders_of,
    node_key,
)
from kvstore.names import TierKind
from kvstore.security import redact_url
from kvstore.stats import IndexStatus

log = logging.getLogger(__name__)

Holding = tuple[str, bytes, TierKind]
# What any index call may raise: redis-py's errors, and a Redis Cluster client's own (not RedisError).
INDEX_ERRORS = (redis.RedisError, RedisClusterException, OSError)
_UPDATE_SHA = hashlib.sha1(UPDATE_SCRIPT.encode()).hexdigest()
_PRUNE_SHA = hashlib.sha1(PRUNE_SCRIPT.encode()).hexdigest()
FIELDS_PER_CALL = 500  # (field, tier) pairs per UPDATE_SCRIPT call: bounded work per script run


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
        self.node_id = check_node_id(node_id)  # it is listed in entries: ValueError naming node_id
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
        self._published_to: object = None  # the master(s) the last resync wrote to (MasterWatch.where)
        self._pending: dict[tuple[str, bytes], TierKind | None] = {}
        self._oldest_pending: float | None = None
        self._need_resync = True
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._gc_keys: list[bytes] = []  # stripes found by the last SCAN page, not yet swept
        self._gc_scan: dict[str, int] = {}  # SCAN cursor per server ("" for one Redis)
        self._gc_servers: list[str] = []  # the cluster's masters still to scan this round
        self._gc_field_cursor = 0  # HSCAN cursor in the stripe at the head of _gc_keys
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
            loop.create_task(self._beat_loop()),
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
                    await self._redis.delete(alive_key(self.node_id), beat_key(self.node_id))
            except (*INDEX_ERRORS, TimeoutError) as exc:
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
            except INDEX_ERRORS as exc:
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
            except INDEX_ERRORS as exc:
                self._failed(exc)

    async def _beat_loop(self) -> None:
        """The beat key, every BEAT_S while registered: readers treat a live node without it as suspect (a node
        that stops answering is skipped within about a second, long before its alive key expires). A failed
        beat is left to the heartbeat to notice (one short call, at most BEAT_S late)."""
        while True:
            await asyncio.sleep(BEAT_S)
            if self._need_resync or not self._registered.is_set():
                continue
            try:
                async with asyncio.timeout(BEAT_TTL_MS / 1000):
                    await self._redis.set(beat_key(self.node_id), "1", px=BEAT_TTL_MS)
            except (*INDEX_ERRORS, TimeoutError) as exc:
                log.debug("index beat failed: %s", exc)

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.gc_interval)
            try:
                await self.gc_step()
            except INDEX_ERRORS as exc:
                log.debug("index gc step failed: %s", exc)

    # -- steps

    async def _heartbeat(self) -> None:
        master = await self._master.where()
        if master != self._published_to:
            # Sentinel failed the index over to another master since the last resync, or a Redis Cluster's
            # masters changed (a failover, a master restarted empty, one added): a new master has what had
            # been replicated to it, not necessarily every recent write, and none of the scripts. Republish
            # everything under a new epoch, so no entry is missing for longer than this one republish.
            log.warning("index: the master is now %s (was %s); full resync", master, self._published_to)
            self.resync()
            return
        ttl_ms = int(self.ttl_seconds * 1000)
        ok = await self._redis.set(alive_key(self.node_id), str(self.stats.epoch), xx=True, px=ttl_ms)
        if not ok:
            # Our alive key is gone (expired during an outage, or Redis lost its data): our entries
            # may be gone too. Republish everything under a new epoch.
            log.warning("index: alive key missing; full resync")
            self.resync()
            return
        await self._write_node_info()

    def resync(self) -> None:
        """Republish every page this node holds under a new epoch, at the flush loop's next turn (what a
        failover or a lost alive key does; an operator's `kvctl` or a test may ask for it too)."""
        self._need_resync = True
        self._wake.set()

    @property
    def gc_round_done(self) -> bool:
        """Whether the sweep has no stripe, SCAN cursor or master left of its current round (the next
        gc_step starts a new round over every stripe)."""
        return not self._gc_keys and not any(self._gc_scan.values()) and not self._gc_servers

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
            "beats": 1,  # it keeps a beat key (readers take its absence as a hung node)
            **self._node_info(),
        }
        pipe = self._redis.pipeline(transaction=False)
        pipe.sadd(NODES_KEY, self.node_id)
        pipe.hset(node_key(self.node_id), mapping=info)
        pipe.expire(node_key(self.node_id), int(max(60, 30 * self.ttl_seconds)))
        await pipe.execute()

    async def _resync(self) -> None:
        """New epoch, then every holding of the node; queued updates after the snapshot still apply.

        Order (the garbage collector's safety rests on it, see gc_step): the node's record is written
        first, then the epoch taken, then the entries, and the alive key last, so this epoch's entries
        become visible at once (lookups match entries to the alive value)."""
        self._pending.clear()
        self._oldest_pending = None
        self._need_resync = False
        try:
            # Where these writes go (Sentinel, Redis Cluster: asked first, so a failover during the resync
            # is seen as a move at the next heartbeat and republished again).
            self._published_to = await self._master.where()
            await self._load_scripts()
            await self._write_node_info()
            epoch = int(await self._redis.incr(epoch_key(self.node_id)))
            snapshot = list(self._holdings())
            for start in range(0, len(snapshot), self.batch):
                await self._write_entries(
                    epoch, ((ns, h, tier) for ns, h, tier in snapshot[start : start + self.batch])
                )
            await self._redis.set(alive_key(self.node_id), str(epoch), px=int(self.ttl_seconds * 1000))
            await self._redis.set(beat_key(self.node_id), "1", px=BEAT_TTL_MS)  # alive is beating: not suspect
        except BaseException:
            self._need_resync = True
            raise
        self.stats.epoch = epoch
        self.stats.resyncs += 1
        await self._write_node_info()
        self._registered.set()
        log.info("index: published %d page(s) under epoch %d", len(snapshot), epoch)

    async def _load_scripts(self) -> None:
        """Load the entry scripts (on every master of a Redis Cluster): Redis does not replicate them, so a
        promoted replica or a restarted master lacks them until the next resync."""
        try:
            for script in (UPDATE_SCRIPT, PRUNE_SCRIPT):
                await self._redis.script_load(script)
        except redis.exceptions.NoPermissionError:
            log.error(
                "index at %s: this node's Redis user may not load the entry scripts (SCRIPT LOAD); it cannot "
                "publish: give it kvstore.index.acl.node_rules (SECURITY.md)",
                self.stats.url,
            )
            raise

    async def _write_entries(self, epoch: int, changes: Iterable[tuple[str, bytes, TierKind | None]]) -> None:
        """Set this node's entry of each page to (epoch, tier), or drop it (tier None): one UPDATE_SCRIPT
        call per stripe (and FIELDS_PER_CALL pages), pipelined. A server that lost the script (a failover,
        a restart) gets it again and the batch once more (it is idempotent)."""
        by_stripe: dict[str, list[str]] = {}
        for ns, h, tier in changes:
            key, field = entry_of(ns, h)
            by_stripe.setdefault(key, []).extend((field, "" if tier is None else str(int(tier))))
        for attempt in range(2):
            pipe = self._redis.pipeline(transaction=False)
            for key, args in by_stripe.items():
                for start in range(0, len(args), 2 * FIELDS_PER_CALL):
                    pipe.execute_command(
                        "EVALSHA",
                        _UPDATE_SHA,
                        1,
                        key,
                        self.node_id,
                        str(epoch),
                        *args[start : start + 2 * FIELDS_PER_CALL],
                    )
            try:
                await pipe.execute()
                return
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                await self._load_scripts()

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
                await self._write_entries(
                    self.stats.epoch, ((ns, h, t) for (ns, h), t in items[start : start + self.batch])
                )
        except BaseException:
            # Put the batch back under anything newer that arrived meanwhile (newer wins).
            batch.update(self._pending)
            self._pending = batch
            self._oldest_pending = oldest
            raise
        self.stats.flushed += len(batch)

    # -- garbage collection

    async def gc_step(self, count: int = 1000) -> int:
        """Sweep up to `count` entries of one stripe (one HSCAN page) for holders that can never count
        again; returns how many holders were dropped. Stripes are found by SCAN, a page at a time (on
        each master of a Redis Cluster in turn).

        A holder (node, epoch) is dropped when the node is live at a later epoch (superseded: a node never
        writes an older epoch again), or when the node is neither alive nor has a record (gone for longer
        than the record's expiry) and the epoch is at most its epoch counter as read *before* the alive
        key and the record. Why that is safe: a node that starts writes its record before it takes a new
        epoch (_resync), so a record missing after the counter was read means that any new epoch was taken
        after that read, above the bound. A node that is not alive but has a record is left alone."""
        key = await self._next_gc_stripe(count)
        if key is None:
            return 0
        cursor, fields = await self._redis.hscan(key, self._gc_field_cursor, count=count)
        self._gc_field_cursor = int(cursor)
        if not self._gc_field_cursor:
            self._gc_keys.pop(0)
        held = {f: list(holders_of(v)) for f, v in fields.items()}
        nodes = sorted({n for hs in held.values() for n, _, _ in hs})
        if not nodes:
            return 0
        pipe = self._redis.pipeline(transaction=False)  # NOTE: Redis runs these in order: counters first
        for n in nodes:
            pipe.get(epoch_key(n))
        for n in nodes:
            pipe.get(alive_key(n))
            pipe.exists(node_key(n))
        res = await pipe.execute()
        bound: dict[str, int] = {}
        for k, n in enumerate(nodes):
            counter, alive, record = res[k], res[len(nodes) + 2 * k], res[len(nodes) + 2 * k + 1]
            if alive is not None and alive.isdigit():
                bound[n] = int(alive)
            elif not record and counter is not None and counter.isdigit():
                bound[n] = int(counter) + 1
        stale = [f for f, hs in held.items() if any(n in bound and e < bound[n] for n, e, _ in hs)]
        if not stale:
            return 0
        flat = [x for n, b in bound.items() for x in (n, str(b))]
        try:
            return int(await self._redis.evalsha(_PRUNE_SHA, 1, key, str(len(bound)), *flat, *stale))
        except redis.exceptions.NoScriptError:
            await self._load_scripts()
            return 0

    async def _next_gc_stripe(self, count: int) -> bytes | None:
        """The stripe to sweep now: the head of the last SCAN page, or the first of the next page."""
        if self._gc_keys:
            return self._gc_keys[0]
        self._gc_field_cursor = 0
        if not isinstance(self._redis, RedisCluster):
            cursor, keys = await self._redis.scan(self._gc_scan.get("", 0), match=STRIPE_KEYS_GLOB, count=count)
            self._gc_scan[""] = int(cursor)
        else:
            if not self._gc_servers:  # a new round over the masters there are now
                self._gc_servers = [n.name for n in self._redis.get_primaries()]
            name = self._gc_servers[0]
            node = self._redis.get_node(node_name=name)
            if node is None:  # gone since the round began
                self._gc_servers.pop(0)
                self._gc_scan.pop(name, None)
                return None
            res = await self._redis.execute_command(
                "SCAN", self._gc_scan.get(name, 0), "MATCH", STRIPE_KEYS_GLOB, "COUNT", count, target_nodes=node
            )
            cursor, keys = res
            if isinstance(cursor, dict):  # redis-py names a cluster's cursor by its server
                cursor = next(iter(cursor.values()), 0)
            self._gc_scan[name] = int(cursor)
            if not int(cursor):
                self._gc_servers.pop(0)
        self._gc_keys = list(keys)
        return self._gc_keys[0] if self._gc_keys else None

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
