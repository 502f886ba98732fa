"""KV events for routers: what a node stores, moves and drops, published in vLLM's KV-event format.

A router's indexer (llm-d's kv-cache indexer, Dynamo's ZMQ relay, any subscriber decoding vLLM's
`vllm.distributed.kv_events` classes) learns which blocks this node holds in which tier, as it does
from an engine. Off unless the node is started with `--kv-events-endpoint` (config `kv_events_endpoint`).

Wire (vLLM 0.32's `ZmqEventPublisher`): a ZMQ PUB socket (XPUB here, to see subscribers join) bound to
the endpoint; every message is three frames: the topic, an 8-byte big-endian sequence number (+1 per
message from 0, so a subscriber sees a gap when it lost messages), and a msgpack `KVEventBatch`
`[ts, [event, ...]]`. Events are msgspec tagged structs as vLLM 0.32 defines them: maps with a "type"
(`BlockStored`: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, later
fields omitted at their defaults; `BlockRemoved`: block_hashes, medium; `AllBlocksCleared`), which
`msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)` decodes (tests/engines) and Dynamo's
relay reads (serde `tag = "type"`). `kv_events_encoding = "array"` sends vLLM's older array form
(`["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name]`), which
llm-d-kv-cache's vLLM adapter decodes (`msgpack:",array"` structs).

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
Block hashes are the 32-byte keys (msgpack bin, as vLLM sends its own sha256 hashes), or with
`kv_events_hash_format = "u64"` their last 8 bytes as a big-endian unsigned int (the same number llm-d
derives from the bytes; for indexers that take only integers).

Invariants: `note()` (called by the manager on every placement change, on the node's event loop) is O(1)
and never blocks: events wait in a bounded queue; beyond `max_queue` they are dropped and counted, and a
snapshot is scheduled. One thread owns the socket: it batches, encodes and sends with NOBLOCK, so a slow or
stuck subscriber costs ZMQ's per-subscriber buffer (messages past its high-water mark are dropped for it
alone, which it sees as a sequence gap), never the node's time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kvstore.names import TierKind
from kvstore.node.config import check_events_config
from kvstore.scoping import DEFAULT_TENANT, tenant_of, unscope
from kvstore.stats import KvEventsStatus

if TYPE_CHECKING:
    from kvstore.manager import TierManager
    from kvstore.node.config import NodeConfig

log = logging.getLogger(__name__)

MEDIUM = {TierKind.HBM: "GPU", TierKind.DRAM: "CPU", TierKind.NVME: "STORAGE"}  # vLLM's MEDIUM_* names
MAX_EVENTS_PER_BATCH = 1024  # one message stays well under a subscriber's buffers
FLUSH_SECONDS = 0.01  # how long a change may wait before it is sent (vLLM sends once per engine step)
SNAPSHOT_MIN_SECONDS = 1.0  # snapshots (O(pages held), on the node's loop) at most this often: joins share one
SEND_HWM = 100_000  # messages ZMQ buffers per subscriber before dropping for that subscriber (vLLM's value)

# (namespace, hash, tier now or None, tier before or None, parent hash or None, block size)
Change = tuple[str, bytes, TierKind | None, TierKind | None, bytes | None, int]
Holding = tuple[str, bytes, TierKind]
Describe = Callable[[str, bytes], tuple[bytes | None, int]]  # (parent hash or None, block size) of a held page


# -- the wire types (vLLM 0.32, vllm/distributed/kv_events.py: same names, fields and order)


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A KV cache event: a msgpack map whose "type" is the class name (vLLM 0.32 encodes events as maps)."""


class BlockStored(_Event):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The same events in vLLM's older array form (`[tag, field, ...]`, trailing defaults omitted), which
    indexers written before vLLM's map form decode (llm-d-kv-cache's vLLM adapter); `kv_events_encoding`."""


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


def as_array(event: BlockStored | BlockRemoved | AllBlocksCleared) -> _ArrayEvent:
    """An event in the array form (the fields that form has)."""
    if isinstance(event, BlockStored):
        return _ArrayBlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
        )
    if isinstance(event, BlockRemoved):
        return _ArrayBlockRemoved(event.block_hashes, event.medium)
    return _ArrayAllBlocksCleared()


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]  # BlockStored | BlockRemoved | AllBlocksCleared, or their array forms
    data_parallel_rank: int | None = None


def topic_of(prefix: str, node_id: str, namespace: str) -> str:
    """The topic of a stored (tenant-scoped) namespace's events."""
    tenant = tenant_of(namespace)
    pod = node_id if tenant == DEFAULT_TENANT else f"{node_id}/{tenant}"
    return f"{prefix}@{pod}@{unscope(namespace)}"


class Batcher:
    """Turns placement changes into per-topic event batches. Pure: no I/O, no clock.

    Invariants: within a topic, events keep the order of the changes; consecutive stores of one chain in
    one medium become one `BlockStored` (its hashes in chain order, the first one's parent as the
    event's); consecutive removals from one medium become one `BlockRemoved`.
    """

    def __init__(self, prefix: str, node_id: str, hash_format: str = "bytes") -> None:
        self.prefix = prefix
        self.node_id = node_id
        self._u64 = hash_format == "u64"
        self._topics: dict[str, str] = {}

    @property
    def node_topic(self) -> str:
        """The topic of node-wide events (no namespace)."""
        return f"{self.prefix}@{self.node_id}@"

    def wire_hash(self, h: bytes) -> bytes | int:
        return int.from_bytes(h[-8:], "big") if self._u64 else h

    def topic(self, namespace: str) -> str:
        t = self._topics.get(namespace)
        if t is None:
            if len(self._topics) > 65536:  # namespaces come and go: keep the memo bounded
                self._topics.clear()
            t = self._topics[namespace] = topic_of(self.prefix, self.node_id, namespace)
        return t

    def batches(self, changes: Iterable[Change]) -> dict[str, list[BlockStored | BlockRemoved | AllBlocksCleared]]:
        """Events per topic for a run of changes, in order."""
        out: dict[str, list[BlockStored | BlockRemoved | AllBlocksCleared]] = {}
        last_hash: dict[str, bytes] = {}  # per topic: the last hash appended to an open BlockStored
        for ns, h, tier, previous, parent, block_size in changes:
            events = out.setdefault(self.topic(ns), [])
            if previous is not None:
                medium = MEDIUM[previous]
                tail = events[-1] if events else None
                if isinstance(tail, BlockRemoved) and tail.medium == medium:
                    tail.block_hashes.append(self.wire_hash(h))
                else:
                    events.append(BlockRemoved([self.wire_hash(h)], medium))
            if tier is not None:
                medium = MEDIUM[tier]
                tail = events[-1] if events else None
                topic = self.topic(ns)
                if (
                    isinstance(tail, BlockStored)
                    and tail.medium == medium
                    and tail.block_size == block_size
                    and parent is not None
                    and last_hash.get(topic) == parent
                ):
                    tail.block_hashes.append(self.wire_hash(h))
                else:
                    events.append(
                        BlockStored(
                            [self.wire_hash(h)],
                            None if parent is None else self.wire_hash(parent),
                            [],
                            block_size,
                            None,
                            medium,
                            None,
                        )
                    )
                last_hash[topic] = h
        return out


class _Snapshot:
    """Queue marker: clear every topic, then store these holdings."""

    __slots__ = ("changes", "namespaces")

    def __init__(self, changes: list[Change], namespaces: list[str]) -> None:
        self.changes = changes
        self.namespaces = namespaces


class KvEventPublisher:
    """The node's KV-event publisher: `note()` from the manager (on the loop), a thread that sends.

    Lifecycle: `start(loop)` binds the socket (a bad or busy endpoint raises here, so the node refuses
    to start) and queues the first snapshot; `close()` sends `AllBlocksCleared` and stops the thread.
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
    ) -> None:
        check_events_config(endpoint, hash_format, max_queue, topic_prefix, encoding)
        self._arrays = encoding == "array"
        self.endpoint = endpoint
        self.batcher = Batcher(topic_prefix, node_id, hash_format)
        self.max_queue = max_queue
        self.flush_seconds = flush_seconds
        self.send_hwm = send_hwm
        self.status = KvEventsStatus(endpoint=endpoint)
        self._holdings = holdings
        self._describe = describe
        self._queue: deque[Change | _Snapshot] = deque()  # appended on the loop, drained by the thread
        self._known: set[str] = set()  # namespaces ever published (the thread's: what a clear covers)
        self._snapshot_due = False  # set on the loop when one is queued or being built
        self._last_snapshot = -SNAPSHOT_MIN_SECONDS
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.Context | None = None
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
        self._ctx = zmq.Context.instance()
        sock = self._ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.SNDHWM, self.send_hwm)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, so each new subscriber gets a snapshot
        sock.setsockopt(zmq.LINGER, 500)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise OSError(f"kv_events_endpoint: cannot bind {self.endpoint!r}: {exc}") from None
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
            self._thread = None

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
        )

    # -- snapshots (taken on the loop, so they are consistent with the changes queued around them)

    def _schedule_snapshot(self) -> None:
        if self._snapshot_due or self._loop is None:
            return
        self._snapshot_due = True
        # Always called on the loop (the thread goes through call_soon_threadsafe). Rate-limited: a burst of
        # joins (or a client reconnecting in a loop) costs the node one walk of its page table per interval.
        wait = self._last_snapshot + SNAPSHOT_MIN_SECONDS - time.monotonic()
        if wait > 0:
            self._loop.call_later(wait, self._take_snapshot)
        else:
            self._loop.call_soon(self._take_snapshot)

    def _take_snapshot(self) -> None:
        self._last_snapshot = time.monotonic()
        changes: list[Change] = []
        namespaces: set[str] = set()
        for ns, h, tier in self._holdings():
            parent, block_size = self._describe(ns, h)
            changes.append((ns, h, tier, None, parent, block_size))
            namespaces.add(ns)
        # NOTE: the snapshot replaces what is queued: changes before it are part of the state it shows.
        self._queue.clear()
        self._queue.append(_Snapshot(changes, sorted(namespaces)))
        self._snapshot_due = False
        self._wake.set()

    # -- the sender thread (owns the socket)

    def _run(self) -> None:
        assert self._sock is not None
        try:
            while not self._stop.is_set():
                self._wake.wait(self.flush_seconds)
                self._wake.clear()
                self._read_subscriptions()
                self._drain()
            self._drain()
            self._send({t: [AllBlocksCleared()] for t in map(self.batcher.topic, sorted(self._known))})
        except Exception:  # the node must keep serving whatever happens to its event feed
            log.exception("kv events: sender thread failed; no more events are published")
        finally:
            self._sock.close()

    def _read_subscriptions(self) -> None:
        assert self._sock is not None
        joined = False
        for _ in range(1000):  # bounded: subscription messages are tiny and rare
            try:
                msg = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if msg[:1] == b"\x01":
                self.status.subscribers += 1
                joined = True
            elif msg[:1] == b"\x00":
                self.status.subscribers = max(0, self.status.subscribers - 1)
        if joined and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._schedule_snapshot)

    def _drain(self) -> None:
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
            snap = self._queue.popleft()
            assert isinstance(snap, _Snapshot)
            self.status.snapshots += 1
            cleared = [self.batcher.topic(ns) for ns in sorted(self._known | set(snap.namespaces))]
            self._known.update(snap.namespaces)
            # A node that never held a page says so on its node topic, so a new subscriber hears it is live.
            self._send({t: [AllBlocksCleared()] for t in cleared or [self.batcher.node_topic]})
            for i in range(0, len(snap.changes), MAX_EVENTS_PER_BATCH):
                self._send(self.batcher.batches(snap.changes[i : i + MAX_EVENTS_PER_BATCH]))

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

    pub = KvEventPublisher(
        config.kv_events_endpoint,
        config.node_id,
        manager.holdings,
        describe,
        topic_prefix=config.kv_events_topic,
        hash_format=config.kv_events_hash_format,
        max_queue=config.kv_events_max_queue,
        encoding=config.kv_events_encoding,
    )
    pub.start(loop)
    manager.listen(pub.note)
    manager.kv_events_status = pub.snapshot_status
    log.info(
        "kv events: publishing on %s (topics %s@%s@<namespace>)", pub.endpoint, config.kv_events_topic, config.node_id
    )
    return pub
