"""KV events for routers: what a node stores, moves and drops, published in vLLM's KV-event format.

A router's indexer (llm-d's kv-cache indexer, Dynamo's ZMQ relay, any subscriber decoding vLLM's
`vllm.distributed.kv_events` classes) learns which blocks this node holds in which tier, as it does
from an engine. Off unless the node is started with `--kv-events-endpoint` (config `kv_events_endpoint`).

Wire, and the events' form: kv_events_wire.py (pure).

What is published (one topic per namespace: `{prefix}@{node_id}@{namespace}`, `{prefix}@{node_id}/{tenant}@
{namespace}` for a tenant's; llm-d reads `kv@<pod>@<model>`):
- a page entering a tier (Put, promotion, demotion, recovery): `BlockStored` with `medium` the tier
  (`MEDIUM`: vLLM's GPU, CPU, STORAGE for HBM, DRAM, NVMe), its hash, its parent's when the writer
  declared the chain, the namespace's block size and no token ids (a node stores pages by hash and never sees tokens);
- a page leaving a tier (moved, evicted, deleted, dropped as corrupt): `BlockRemoved` with that tier;
- a new subscriber, a start, or events lost here: `AllBlocksCleared`, then `BlockStored` for every page
  held (a snapshot), so every subscriber converges on the node's holdings;
- a stop: `AllBlocksCleared` (best effort).
Instead of vLLM's replay socket (the last N batches by sequence number) a node answers a join or a loss with
a snapshot: its holdings can be far older than any replay buffer.

Who may subscribe: kv_events_access.py (SECURITY.md, "The KV-event feed").

Invariants: `note()` (called by the manager on every placement change, on the node's event loop) is O(1)
and never blocks: events wait in a bounded queue; beyond `max_queue` they are dropped and counted, and a
snapshot is scheduled. One thread owns the socket: it batches, encodes and sends with NOBLOCK, so a slow or
stuck subscriber costs ZMQ's per-subscriber buffer (messages past its high-water mark are dropped for it
alone, which it sees as a sequence gap), never the node's time. That buffer is bounded in bytes, not only
in messages: at most `SEND_HWM` messages of at most `MAX_EVENTS_PER_BATCH` events each (about 36 MiB; the
same messages are shared by every subscriber of the same topics, so 20 never-reading subscribers cost about
what one does). A snapshot walks the page table on the loop in slices of `SNAPSHOT_SLICE` pages, so no
request waits behind a whole walk, and snapshots come at most every `SNAPSHOT_MIN_SECONDS`, or
`SNAPSHOT_COST_FACTOR` times the last one's cost if that is longer (up to `SNAPSHOT_MAX_SECONDS`, so a new
indexer still gets the state soon): joins, however frequent, keep snapshots' share of the node's time under
1/SNAPSHOT_COST_FACTOR, unless one snapshot costs more than SNAPSHOT_MAX_SECONDS / SNAPSHOT_COST_FACTOR.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvstore.config import check_events_config
from kvstore.names import TierKind
from kvstore.node.kv_events_access import ZAP_DOMAIN, SubscriberAuth, granted, read_node_secret, read_subscribers_file
from kvstore.node.kv_events_wire import (
    MEDIUM,
    AllBlocksCleared,
    Batcher,
    BlockRemoved,
    BlockStored,
    Change,
    Describe,
    Holding,
    KVEventBatch,
    as_array,
    topic_of,
)
from kvstore.stats import KvEventsStatus

if TYPE_CHECKING:
    from kvstore.config import NodeConfig
    from kvstore.manager import TierManager

# The feed's names as they were before kv_events_wire.py and kv_events_access.py (tests and tools import them here).
__all__ = ["MEDIUM", "Batcher", "KvEventPublisher", "granted", "read_subscribers_file", "start_for_node", "topic_of"]

log = logging.getLogger(__name__)

# NOTE: a message of 256 events is at most ~36 KiB (a map-form BlockStored with one hash is ~135 bytes, a
# hash in a chain 34): with SEND_HWM that bounds what a subscriber that never reads holds in the node.
MAX_EVENTS_PER_BATCH = 256
FLUSH_SECONDS = 0.01  # how long a change may wait before it is sent (vLLM sends once per engine step)
SNAPSHOT_MIN_SECONDS = 1.0  # snapshots (O(pages held)) at most this often: joins in between share one
SNAPSHOT_COST_FACTOR = 20  # and no sooner than this many times the last one's cost (walk + encoding)...
SNAPSHOT_MAX_SECONDS = 30.0  # ...but at most this long after a join: a new indexer gets the state within it
SNAPSHOT_SLICE = 2048  # pages a snapshot reads per turn of the loop
# NOTE: vLLM's publisher buffers 100,000 messages per subscriber; with 1,024-event messages a subscriber that
# connected and never read held up to gigabytes (+160 MiB in an outside probe, kept after it left). 1,024
# messages of <= 36 KiB: <= 36 MiB, and a snapshot of 260,000 pages still fits whole.
SEND_HWM = 1024


class _Snapshot:
    """Queue marker: clear every topic, then store these holdings. Filled on the loop a slice at a time;
    the sender thread sends nothing queued behind it until it is `complete`."""

    __slots__ = ("changes", "complete", "namespaces", "started", "walk_seconds")

    def __init__(self) -> None:
        self.changes: list[Change] = []
        self.namespaces: set[str] = set()
        self.complete = False
        self.started = time.monotonic()
        self.walk_seconds = 0.0  # loop time spent reading the holdings


class KvEventPublisher:
    """The node's KV-event publisher: `note()` from the manager (on the loop), a thread that sends.

    Lifecycle: `start(loop)` binds the socket (a bad or busy endpoint, or a bad key file, raises here, so the
    node refuses to start) and queues the first snapshot; `close()` sends `AllBlocksCleared` and stops the
    thread. With `curve_secret_file` and `subscribers_file` only listed keys may subscribe (CURVE).
    """

    # keyword-only tuning settings, each with a default
    def __init__(  # noqa: PLR0913
        self,
        endpoint: str,
        node_id: str,
        holdings: Callable[[], Iterable[Holding]],
        describe: Describe,
        *,
        topic_prefix: str = "kv",
        hash_format: str = "bytes",
        max_queue: int = 100_000,
        encoding: str = "map",
        flush_seconds: float = FLUSH_SECONDS,
        send_hwm: int = SEND_HWM,
        curve_secret_file: str | None = None,
        subscribers_file: str | None = None,
    ) -> None:
        check_events_config(endpoint, hash_format, max_queue, topic_prefix, encoding)
        if (curve_secret_file is None) != (subscribers_file is None):
            raise ValueError("kv_events_curve_secret_file and kv_events_subscribers_file go together (CURVE)")
        self._arrays = encoding == "array"
        self.endpoint = endpoint
        self.node_id = node_id
        self.topic_prefix = topic_prefix
        self.batcher = Batcher(topic_prefix, node_id, hash_format)
        self.max_queue = max_queue
        self.flush_seconds = flush_seconds
        self.send_hwm = send_hwm
        self.curve_secret_file = curve_secret_file
        self.subscribers_file = subscribers_file
        self.status = KvEventsStatus(endpoint=endpoint, curve=curve_secret_file is not None)
        self._holdings = holdings
        self._describe = describe
        self._queue: deque[Change | _Snapshot] = deque()  # appended on the loop, drained by the thread
        self._known: set[str] = set()  # namespaces ever published (the thread's: what a clear covers)
        self._snapshot_due = False  # set on the loop when one is scheduled or being built
        self._snapshot_again = False  # changes were dropped while one was being built: another after it
        self._last_snapshot = -SNAPSHOT_MIN_SECONDS
        self._last_cost = 0.0  # seconds the last snapshot cost (walk on the loop + encoding in the thread)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.Context | None = None
        self._auth: SubscriberAuth | None = None
        self._sock: zmq.Socket | None = None
        self._seq = 0

    # -- called by the manager (on the loop; O(1), never blocks)

    def note(self, namespace: str, h: bytes, tier: TierKind | None, previous: TierKind | None = None) -> None:
        """A page entered `tier` (None: left the node) from `previous` (None: it is new here)."""
        if len(self._queue) >= self.max_queue:
            self.status.dropped_events += 1
            self._schedule_snapshot()
            return
        parent, block_size = (None, 0)
        if tier is not None:
            parent, block_size = self._describe(namespace, h)
        self._queue.append((namespace, h, tier, previous, parent, block_size))
        if len(self._queue) >= MAX_EVENTS_PER_BATCH:
            self._wake.set()

    # -- lifecycle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # NOTE: a context of its own: the ZAP handler binds inproc://zeromq.zap.01, one per context.
        self._ctx = zmq.Context()
        sock: zmq.Socket | None = None
        try:
            sock = self._ctx.socket(zmq.XPUB)
            sock.setsockopt(zmq.SNDHWM, self.send_hwm)
            sock.setsockopt(zmq.XPUB_MANUAL, 1)  # every (un)subscription comes here; granted() decides
            sock.setsockopt(zmq.LINGER, 500)
            if self.curve_secret_file is not None and self.subscribers_file is not None:
                _, secret = read_node_secret(self.curve_secret_file)
                self._auth = SubscriberAuth(self._ctx, self.subscribers_file)
                self._auth.start()
                self._auth.configure_curve_callback(ZAP_DOMAIN, self._auth)
                sock.curve_server = True
                sock.curve_secretkey = secret
                sock.zap_domain = ZAP_DOMAIN.encode()
            sock.bind(self.endpoint)
        except (zmq.ZMQError, OSError, ValueError) as exc:
            self._close_zmq(sock)
            if isinstance(exc, zmq.ZMQError):
                raise OSError(f"kv_events_endpoint: cannot bind {self.endpoint!r}: {exc}") from None
            raise
        self._sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT) or self.endpoint  # tcp://...:0 -> the port
        self.status.endpoint = self.endpoint
        self._schedule_snapshot()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop: send what is queued and an `AllBlocksCleared` per topic, then close (bounded)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("kv events: sender thread did not stop within %.1fs", timeout)
                return  # it still owns the socket; the process exits around it
            self._thread = None
        self._close_zmq(None)

    def _close_zmq(self, sock: zmq.Socket | None) -> None:
        if sock is not None:
            sock.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def snapshot_status(self) -> KvEventsStatus:
        """A copy of the counters (read on the loop: Stats, /metrics)."""
        s = self.status
        return KvEventsStatus(
            s.endpoint,
            len(self._queue),
            s.sent_events,
            s.sent_batches,
            s.dropped_events,
            s.snapshots,
            s.subscribers,
            s.send_errors,
            s.refused + (self._auth.refused if self._auth is not None else 0),
            s.curve,
        )

    # -- snapshots (read on the loop, a slice per turn, so they are consistent with the changes queued around
    #    them: every change after the walk began is queued behind it)

    def snapshot_interval(self) -> float:
        """Seconds between snapshots now: joins in between share one."""
        return max(SNAPSHOT_MIN_SECONDS, min(SNAPSHOT_MAX_SECONDS, SNAPSHOT_COST_FACTOR * self._last_cost))

    def _schedule_snapshot(self) -> None:
        if self._loop is None:
            return
        if self._snapshot_due:
            self._snapshot_again = True  # drops while one is built are not in it: another follows
            return
        self._snapshot_due = True
        # Always called on the loop (the thread goes through call_soon_threadsafe).
        wait = self._last_snapshot + self.snapshot_interval() - time.monotonic()
        if wait > 0:
            self._loop.call_later(wait, self._begin_snapshot)
        else:
            self._loop.call_soon(self._begin_snapshot)

    def _begin_snapshot(self) -> None:
        self._snapshot_again = False
        self._last_snapshot = time.monotonic()
        snap = _Snapshot()
        # NOTE: the snapshot replaces what is queued: changes before it are part of the state it shows, and
        # changes from now on are queued behind it, so a page that changes during the walk ends right.
        self._queue.clear()
        self._queue.append(snap)
        self._read_slice(snap, iter(self._holdings()))

    def _read_slice(self, snap: _Snapshot, pages: Iterator[Holding]) -> None:
        t0 = time.monotonic()
        n = 0
        for ns, h, tier in itertools.islice(pages, SNAPSHOT_SLICE):
            parent, block_size = self._describe(ns, h)
            snap.changes.append((ns, h, tier, None, parent, block_size))
            snap.namespaces.add(ns)
            n += 1
        snap.walk_seconds += time.monotonic() - t0
        if n == SNAPSHOT_SLICE and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon(self._read_slice, snap, pages)  # requests waiting on the loop go first
            return
        snap.complete = True
        self._snapshot_due = False
        self._wake.set()
        if self._snapshot_again:
            self._schedule_snapshot()

    # -- the sender thread (owns the socket)

    def _run(self) -> None:
        assert self._sock is not None
        try:
            while not self._stop.is_set():
                self._wake.wait(self.flush_seconds)
                self._wake.clear()
                self._read_subscriptions()
                self._drain()
            self._drain(final=True)
            self._send({t: [AllBlocksCleared()] for t in map(self.batcher.topic, sorted(self._known))})
        except Exception:  # the node must keep serving whatever happens to its event feed
            log.exception("kv events: sender thread failed; no more events are published")
        finally:
            self._sock.close()

    def _read_subscriptions(self) -> None:
        """Subscribe each new subscription's connection to what `granted` allows it (XPUB_MANUAL: the socket
        subscribes the connection the last message came from, so each is answered before the next is read)."""
        assert self._sock is not None
        joined = False
        for _ in range(1000):  # bounded: subscription messages are tiny and rare
            try:
                frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            msg = frame.bytes
            try:
                tenant = frame.get("User-Id") if self._auth is not None else None
            except zmq.ZMQError:  # a closed connection's withdrawals carry no metadata: ZMQ dropped them
                tenant = None
            if msg[:1] == b"\x01":
                topic = granted(msg[1:], tenant, self.topic_prefix, self.node_id)
                if topic is None:
                    self.status.refused += 1
                    log.info("kv events: a subscriber of tenant %r asked for %r: refused", tenant, msg[1:80])
                    continue
                self._sock.setsockopt(zmq.SUBSCRIBE, topic)
                self.status.subscribers += 1
                joined = True
            elif msg[:1] == b"\x00":
                topic = granted(msg[1:], tenant, self.topic_prefix, self.node_id)
                if topic is not None:
                    self._sock.setsockopt(zmq.UNSUBSCRIBE, topic)
                self.status.subscribers = max(0, self.status.subscribers - 1)
        if joined and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._schedule_snapshot)

    def _drain(self, final: bool = False) -> None:
        while self._queue:
            run: list[Change] = []
            while self._queue and len(run) < MAX_EVENTS_PER_BATCH:
                item = self._queue[0]
                if isinstance(item, _Snapshot):
                    break
                run.append(self._queue.popleft())  # type: ignore[arg-type]
            if run:
                self._known.update(c[0] for c in run)
                self._send(self.batcher.batches(run))
                continue
            snap = self._queue[0]
            assert isinstance(snap, _Snapshot)
            if not snap.complete:
                if final:  # stopping: what it read so far is not a snapshot; the final clears follow
                    self._queue.popleft()
                    continue
                return  # the loop is still reading it; what is queued behind it waits
            self._queue.popleft()
            t0 = time.monotonic()
            self.status.snapshots += 1
            cleared = [self.batcher.topic(ns) for ns in sorted(self._known | snap.namespaces)]
            self._known.update(snap.namespaces)
            # A node that never held a page says so on its node topic, so a new subscriber hears it is live.
            self._send({t: [AllBlocksCleared()] for t in cleared or [self.batcher.node_topic]})
            for i in range(0, len(snap.changes), MAX_EVENTS_PER_BATCH):
                self._send(self.batcher.batches(snap.changes[i : i + MAX_EVENTS_PER_BATCH]))
            self._last_cost = snap.walk_seconds + time.monotonic() - t0

    def _send(self, per_topic: dict[str, list[BlockStored | BlockRemoved | AllBlocksCleared]]) -> None:
        assert self._sock is not None
        for topic, events in per_topic.items():
            for i in range(0, len(events), MAX_EVENTS_PER_BATCH):
                chunk = events[i : i + MAX_EVENTS_PER_BATCH]
                wire = [as_array(e) for e in chunk] if self._arrays else chunk
                payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=wire))
                try:
                    self._sock.send_multipart([topic.encode(), self._seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                except zmq.Again:
                    self.status.send_errors += 1  # XPUB without NODROP drops instead; kept for safety
                    continue
                except zmq.ZMQError as exc:
                    self.status.send_errors += 1
                    log.warning("kv events: send failed: %s", exc)
                    continue
                self._seq += 1
                self.status.sent_batches += 1
                self.status.sent_events += sum(
                    len(e.block_hashes) if not isinstance(e, AllBlocksCleared) else 1 for e in chunk
                )


def start_for_node(manager: TierManager, config: NodeConfig, loop: asyncio.AbstractEventLoop) -> KvEventPublisher:
    """Bind the node's KV-event feed (config `kv_events_*`), attach it to the manager's placement changes
    and to Stats. Raises OSError when the endpoint cannot be bound (the node then refuses to start)."""
    assert config.kv_events_endpoint is not None
    table = manager.table

    def describe(namespace: str, h: bytes) -> tuple[bytes | None, int]:
        entry = table.get((namespace, h))
        if entry is None:
            return None, 0
        parent = entry.parent[1] if entry.parent is not None and entry.parent[0] == namespace else None
        return parent, entry.layout.block_size

    def holdings() -> Iterator[Holding]:
        # NOTE: a copy of the table's entries (one C-level pass) read lazily, a slice per loop turn: an entry
        # gone since is skipped, and every change since is queued behind the snapshot anyway.
        entries = list(table)
        for e in entries:
            if table.get(e.key) is e:
                yield e.namespace, e.hash, e.tier

    pub = KvEventPublisher(
        config.kv_events_endpoint,
        config.node_id,
        holdings,
        describe,
        topic_prefix=config.kv_events_topic,
        hash_format=config.kv_events_hash_format,
        max_queue=config.kv_events_max_queue,
        encoding=config.kv_events_encoding,
        curve_secret_file=config.kv_events_curve_secret_file,
        subscribers_file=config.kv_events_subscribers_file,
    )
    pub.start(loop)
    manager.listen(pub.note)
    manager.kv_events_status = pub.snapshot_status
    log.info(
        "kv events: publishing on %s (topics %s@%s@<namespace>; %s)",
        pub.endpoint,
        config.kv_events_topic,
        config.node_id,
        "CURVE: listed subscribers only" if pub.status.curve else "open to whoever reaches it",
    )
    return pub
