"""The KV-event feed's wire: vLLM's KV-event types, the topic of a namespace, and placement changes turned into
per-topic event batches (`Batcher`). Pure: no I/O, no clock; the publisher (kv_events.py) queues, times and
sends them.

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

Block hashes are the 32-byte keys (msgpack bin, as vLLM sends its own sha256 hashes), or with
`kv_events_hash_format = "u64"` their last 8 bytes as a big-endian unsigned int (the same number llm-d
derives from the bytes; for indexers that take only integers).

Invariant: the events are vLLM 0.32's classes (same names, fields and order), so vLLM's own decoder reads them
(tests/engines/test_kv_events_vllm.py); a namespace's topic names its node and, for a tenant's, the tenant.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from kvstore.names import TierKind
from kvstore.scoping import DEFAULT_TENANT, tenant_of, unscope

MEDIUM = {TierKind.HBM: "GPU", TierKind.DRAM: "CPU", TierKind.NVME: "STORAGE"}  # vLLM's MEDIUM_* names

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


def tenant_topics(prefix: str, node_id: str, tenant: str) -> str:
    """The prefix every topic of `tenant`'s namespaces starts with (a tenant's subscription is cut to it)."""
    return f"{prefix}@{node_id}/{tenant}@"


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
