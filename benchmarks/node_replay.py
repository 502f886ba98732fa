"""Replay a trace through a real cache node over gRPC, with the simulator's exact semantics.

`NodeReplayCache` implements `devkit.sim.ReplayCache` (and `ProbingCache`) on top of a node, so
`devkit.sim.replay` drives a node exactly as it drives `TieredBlockCache`: the same hit counts prove
the node runs the policy the simulation models (DESIGN.md §6). Per request, mirroring
`TieredBlockCache.put`: the request's cached blocks are pinned (the simulator pins the request being
served); then, in request order, a cached block is read (a one-page Get: the policy sees an access and
the page's read count grows) and a missing block is put with its chain parent (a one-page Put: the
policy sees an insertion with `parent`), then pinned; finally every pin is released. The node has one
DRAM tier of exactly `capacity` slots and no NVMe, so an evicted page is dropped, as in a single-tier
simulation. Block ids become 32-byte keys by SHA-256 of their decimal text; `node_requests` gives
the simulation the node's own keys, (namespace, hash), so a policy that hashes keys (the admission
sketch) sees the same values in both. A page the node declines to store (admission, no lower tier)
is simply not pinned: the simulation does not store it either.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.errors import ResourceExhausted
from kvstore.layout import DType, PageLayout
from kvstore.pageformat import slot_bytes_for

NAMESPACE = "replay"
LAYOUT = PageLayout(DType.UINT8, num_layers=1, num_kv_heads=1, head_dim=512, block_size=1)  # 1 KiB pages
PAGE = bytes(LAYOUT.page_bytes)


def block_key(block: int) -> bytes:
    return hashlib.sha256(str(block).encode()).digest()


def node_requests(requests: Sequence[Sequence[int]]) -> list[list[tuple[str, bytes]]]:
    """The requests with each block id replaced by the key the node files its page under."""
    return [[(NAMESPACE, block_key(b)) for b in req] for req in requests]


class NodeReplayCache:
    """A single-tier cache of `capacity` blocks backed by a real node started for it (close() stops it)."""

    tier_names = ("dram",)

    def __init__(self, capacity: int, policy: str) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-replay-")
        slot = slot_bytes_for(LAYOUT.page_bytes)
        self.node = NodeProcess(dram_bytes=capacity * slot, max_page_bytes=LAYOUT.page_bytes,
                                node_id=f"replay-{policy}", extra_args=["--policy", policy],
                                log_path=Path(self._tmp.name) / "node.log").start()  # fmt: skip
        self.kv = KVStoreClient(self.node.addr, timeout=60)
        self.rpcs = 0
        self.not_stored = 0
        self._probed: tuple[tuple[int, ...], list[int | None]] | None = None

    def close(self) -> None:
        self.kv.close()
        self.node.close()
        self._tmp.cleanup()

    def lookup(self, blocks: Sequence[int]) -> int:
        self.rpcs += 1
        return self.kv.lookup(NAMESPACE, [block_key(b) for b in blocks])

    def probe(self, blocks: Sequence[int]) -> list[int | None]:
        """Tier of each block (0) or None: one Lookup per block (read-only, like the simulator's probe)."""
        out: list[int | None] = []
        for b in blocks:
            self.rpcs += 1
            out.append(0 if self.kv.lookup(NAMESPACE, [block_key(b)]) else None)
        self._probed = (tuple(blocks), out)
        return out

    def put(self, blocks: Sequence[int]) -> None:
        keys = [block_key(b) for b in blocks]
        # replay() probes a request right before putting it and nothing runs in between: reuse that.
        probed, self._probed = self._probed, None
        present = probed[1] if probed is not None and probed[0] == tuple(blocks) else self.probe(blocks)
        pinned = [k for k, p in zip(keys, present, strict=True) if p is not None]
        if pinned:
            self.rpcs += 1
            self.kv.pin(NAMESPACE, pinned)
        try:
            parent: bytes | None = None
            for k, p in zip(keys, present, strict=True):
                self.rpcs += 1
                if p is not None:
                    self.kv.get(NAMESPACE, [k])  # an access: recency and read count
                else:
                    try:
                        self.kv.put(NAMESPACE, LAYOUT, [k], [PAGE], parent=parent)
                    except ResourceExhausted:
                        self.not_stored += 1  # every slot pinned by this request: as the simulator, skip it
                    else:
                        self.rpcs += 1
                        if self.kv.pin(NAMESPACE, [k]).done:  # 0 when the node did not store it
                            pinned.append(k)
                parent = k
        finally:
            if pinned:
                self.rpcs += 1
                self.kv.unpin(NAMESPACE, pinned)
