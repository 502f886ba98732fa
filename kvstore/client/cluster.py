"""Cluster client: find a prefix through the Redis index, fetch each part from the node holding it.

    with ClusterClient("redis://10.0.0.5:6379/0") as kv:
        hashes = prefix_hashes(tokens, layout.block_size, ns)
        found = kv.lookup(ns, hashes)              # one Redis round trip
        pages = kv.get(ns, hashes[: found.matched]) # one stream per node segment
        kv.put(ns, layout, hashes[len(pages):], new_pages, parent_chain=hashes[: len(pages)])

Get: the index's plan (longest run per node, hotter tier first) is followed segment by segment; a
segment that comes back short (stale entry, node gone) is completed from the other holders of the
missing block, and when every holder fails the prefix ends there: a stale entry costs a miss, never
an error. After the last segment, the node that served it is asked for more of the chain directly,
so blocks the index has not caught up with yet (updates are batched) are still found.

Trust: node addresses come from Redis, which is not trusted with identities. Each node is dialled with
`security.for_node(node_id)`: over TLS its certificate must name that node, and without TLS the token
is only sent where the operator allowed plaintext tokens (a client refuses at construction otherwise).
A node that cannot be verified, answers UNIMPLEMENTED, breaks the stream framing or sends pages that
fail their checks is a miss for that segment (logged), never an error to the caller.

Put placement, in this order, and why:
1. prefix affinity: the live node holding the longest leading run of `parent_chain`. A chain kept
   on one node is fetched in one stream, and that node likely holds the shared prefix already.
2. the local node (`local_node`, e.g. the cache node on the same host): no network hop for the
   producer, and the same host's decode worker reads it fastest.
3. the least loaded live node (most free DRAM+NVMe slots per its last heartbeat).
Hashing the chain head was rejected as the rule: it ignores load and locality, and affinity already
keeps chains together without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvstore.client import KVStoreClient, PutResult
from kvstore.client.bundles import Parts
from kvstore.errors import KVStoreError, NamespaceNotFound, Unavailable
from kvstore.index import ClusterLookup, IndexReader, NodeInfo
from kvstore.layout import PageLayout
from kvstore.names import Buffer
from kvstore.security import ClientSecurity
from kvstore.wire.streams import FetchedPage, PageRef

log = logging.getLogger(__name__)

_NODE_ERRORS = (Unavailable, NamespaceNotFound)
# What a node that is gone, unverifiable or misbehaving (UNIMPLEMENTED, garbage, wrong pages) raises in a
# read: each is a miss for that node's segment.
_MISS_ERRORS = (KVStoreError, ValueError)
T = TypeVar("T")
R = TypeVar("R")


class NoLiveNode(KVStoreError):
    """The index lists no live node to put to."""

    status_name = "UNAVAILABLE"


class ClusterClient:
    """Blocking cluster client. One channel per node, opened on first use and kept."""

    def __init__(
        self,
        redis_url: str,
        *,
        local_node: str | None = None,
        timeout: float = 60.0,
        verify: bool = True,
        probe_tail: bool = True,
        security: ClientSecurity | None = None,
        tenant: str | None = None,
        transport: str | None = None,
    ) -> None:
        self.security = ClientSecurity.from_env() if security is None else security  # for every node
        self.security.check_target(None)  # addresses come from the index: no token in clear to them
        self.index = IndexReader(redis_url, tenant=tenant)  # tenant: whose index entries (KVSTORE_TENANT)
        self.local_node = local_node
        self.timeout = timeout
        self.verify = verify
        self.probe_tail = probe_tail
        self.transport = transport  # every node client's data plane (None: KVSTORE_TRANSPORT, else auto)
        self._clients: dict[tuple[str, str], KVStoreClient] = {}  # (node id, address) -> client
        self._addrs: dict[str, str] = {}

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()
        self.index.close()

    # -- nodes

    def nodes(self) -> list[NodeInfo]:
        return self.index.nodes()

    def node(self, node_id: str) -> KVStoreClient:
        """The client of one node (refreshing addresses from the index when the id is unknown)."""
        if node_id not in self._addrs:
            self._addrs = self.index.node_addrs()
        addr = self._addrs.get(node_id)
        if addr is None:
            raise Unavailable(f"node {node_id!r} is not live in the index")
        client = self._clients.get((node_id, addr))
        if client is None:
            client = KVStoreClient(
                addr,
                timeout=self.timeout,
                verify=self.verify,
                security=self.security.for_node(node_id),
                transport=self.transport,
            )
            self._clients[(node_id, addr)] = client
        return client

    # -- reads

    def lookup(self, namespace: str, hashes: Sequence[bytes]) -> ClusterLookup:
        """Longest prefix held by any live node, and per node how much of it: one Redis round trip."""
        return self.index.lookup(namespace, hashes)

    def get_pages(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        *,
        prefer_node: str | None = None,
        found: ClusterLookup | None = None,
    ) -> list[FetchedPage]:
        """Pages of the longest retrievable prefix of `hashes`, in order, from whichever nodes hold them.

        prefer_node: a node known to hold (part of) the chain, e.g. where a prefill worker just stored
        it; it is asked for what the index does not show yet (the index is updated in batches).
        found: this chain's lookup when the caller just did it (saves a Redis round trip).
        """
        out: list[FetchedPage] = []

        def fetch(node: str, a: int, b: int) -> int:
            got = self._fetch(node, namespace, hashes[a:b], lambda c, hs: c.get_pages(namespace, hs))
            out.extend(got)
            return len(got)

        self._walk(namespace, hashes, fetch, prefer_node, found)
        return out

    def get_into(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        buffers: Sequence[Buffer],
        *,
        prefer_node: str | None = None,
        found: ClusterLookup | None = None,
    ) -> list[PageRef]:
        """`get_pages` into the caller's buffers (page i into buffers[i], as KVStoreClient.get_into: one
        per hash, writable, each at least a page; checked by each node's client before anything is sent)."""
        if len(buffers) != len(hashes):
            raise ValueError(f"buffers: {len(buffers)} buffers for {len(hashes)} hashes (one buffer per hash)")
        out: list[PageRef] = []

        def fetch(node: str, a: int, b: int) -> int:
            got = self._fetch(node, namespace, hashes[a:b], lambda c, hs: c.get_into(namespace, hs, buffers[a:b]))
            out.extend(got)
            return len(got)

        self._walk(namespace, hashes, fetch, prefer_node, found)
        return out

    def get_bundle_into(
        self,
        namespace: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        pages: Sequence[Parts],
        *,
        prefer_node: str | None = None,
        found: ClusterLookup | None = None,
    ) -> list[PageRef]:
        """`get_into` of multi-part pages: each part into pages[i][part] (as KVStoreClient.get_bundle_into)."""
        if len(pages) != len(hashes):
            raise ValueError(f"pages: {len(pages)} pages for {len(hashes)} hashes (one mapping of parts per hash)")
        out: list[PageRef] = []

        def fetch(node: str, a: int, b: int) -> int:
            got = self._fetch(
                node, namespace, hashes[a:b], lambda c, hs: c.get_bundle_into(namespace, layout, hs, pages[a:b])
            )
            out.extend(got)
            return len(got)

        self._walk(namespace, hashes, fetch, prefer_node, found)
        return out

    def _walk(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        fetch: Callable[[str, int, int], int],
        prefer_node: str | None,
        found: ClusterLookup | None,
    ) -> int:
        """Follow the index's plan for the longest retrievable prefix: fetch(node, a, b) reads blocks
        [a, b) from a node (in order) and returns how many leading ones it got. Returns the prefix length."""
        if found is None or found.matched > len(hashes):
            found = self.index.lookup(namespace, hashes)
        excluded: set[tuple[str, int]] = set()  # (node, block) pairs known not to work
        last_node: str | None = None
        i = 0
        # Each pass either advances i or excludes one (node, block) pair: bounded by blocks * holders.
        for _ in range(max(1, sum(len(h) for h in found.holders) + found.matched)):
            if i >= found.matched:
                break
            choice = found.best_holder(i, excluded)
            if choice is None:
                break
            node, run = choice
            got = fetch(node, i, i + run)
            if not got:
                excluded.add((node, i))
                continue
            i += got
            last_node = node
            if got < run:
                excluded.add((node, i))
        probe = last_node or prefer_node
        if self.probe_tail and probe is not None and i < len(hashes):
            i += fetch(probe, i, len(hashes))
        return i

    def get(self, namespace: str, hashes: Sequence[bytes], *, prefer_node: str | None = None) -> list[memoryview]:
        return [memoryview(p.data) for p in self.get_pages(namespace, hashes, prefer_node=prefer_node)]

    def call_node(self, node: str, fn: Callable[[KVStoreClient], T]) -> T:
        """fn(client of node). A node that restarted on another address (per the index) is retried
        once there; otherwise the node's error propagates."""
        for attempt in range(2):
            try:
                return fn(self.node(node))
            except _NODE_ERRORS:
                old = self._addrs.pop(node, None)
                self._addrs = self.index.node_addrs()
                if attempt == 0 and self._addrs.get(node) not in (None, old):
                    continue
                raise
        raise AssertionError("unreachable")

    def _fetch(
        self,
        node: str,
        namespace: str,
        hashes: Sequence[bytes],
        read: Callable[[KVStoreClient, Sequence[bytes]], list[R]],
    ) -> list[R]:
        """read(client of node, hashes): pages from one node; a node that is gone, unverifiable or
        misbehaving yields [] (the caller tries elsewhere)."""
        try:
            return self.call_node(node, lambda c: read(c, hashes))
        except _NODE_ERRORS as exc:
            log.info("node %s could not serve %d block(s): %s", node, len(hashes), exc)
        except _MISS_ERRORS as exc:
            log.warning(
                "node %s misbehaved serving %d block(s), counted as a miss: %s: %s",
                node,
                len(hashes),
                type(exc).__name__,
                exc,
            )
        return []

    # -- writes

    def choose_node(self, namespace: str, parent_chain: Sequence[bytes] = ()) -> str:
        """Where a put goes (see the module docstring for the rule and why)."""
        live = [n for n in self.index.nodes() if n.alive and n.addr]
        if not live:
            raise NoLiveNode("no live cache node is registered in the index")
        self._addrs.update({n.node_id: n.addr for n in live})  # fresh: a node may have restarted
        names = {n.node_id for n in live}
        if parent_chain:
            shares = self.index.lookup(namespace, parent_chain).nodes
            best = max(
                (s for s in shares.values() if s.node_id in names and s.leading > 0),
                key=lambda s: (s.leading, s.node_id),
                default=None,
            )
            if best is not None:
                return best.node_id
        if self.local_node in names:
            return self.local_node  # type: ignore[return-value]
        return max(live, key=lambda n: (_free_slots(n), n.node_id)).node_id

    def put(
        self,
        namespace: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        pages: Sequence[Buffer],
        *,
        parent_chain: Sequence[bytes] = (),
    ) -> tuple[str, PutResult]:
        """Store pages on the node choose_node picks; `parent_chain` is the chain before hashes[0]."""
        node = self.choose_node(namespace, parent_chain)
        parent = parent_chain[-1] if parent_chain else None
        return node, self.call_node(node, lambda c: c.put(namespace, layout, hashes, pages, parent=parent))

    def put_bundle(
        self,
        namespace: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        pages: Sequence[Parts],
        *,
        parent_chain: Sequence[bytes] = (),
    ) -> tuple[str, PutResult]:
        """`put` of multi-part pages (as KVStoreClient.put_bundle) on the node choose_node picks."""
        node = self.choose_node(namespace, parent_chain)
        parent = parent_chain[-1] if parent_chain else None
        return node, self.call_node(node, lambda c: c.put_bundle(namespace, layout, hashes, pages, parent=parent))


def _free_slots(n: NodeInfo) -> int:
    free = 0
    for tier in ("dram", "nvme"):
        free += int(n.info.get(f"slots_total_{tier}", 0)) - int(n.info.get(f"slots_used_{tier}", 0))
    return free
