"""Cluster client: find a prefix through the Redis index, fetch each part from the node holding it.

    with ClusterClient("redis://10.0.0.5:6379/0") as kv:
        hashes = prefix_hashes(tokens, layout.block_size, ns)
        found = kv.lookup(ns, hashes)              # one Redis round trip
        pages = kv.get(ns, hashes[: found.matched]) # one stream per node segment
        kv.put(ns, layout, hashes[len(pages):], new_pages, parent_chain=hashes[: len(pages)])

Get: a page may have several holders (copies, DESIGN.md §7.3). Each segment goes to the holder on this
client's host first (the same-host plane), then to the other holders, longest run first, then the least
loaded (a draw whose odds fall with each node's load, from its index record: readers do not herd), and to a
node the index marks suspect (it stopped beating: hung or cut off) or that just failed a call of this client
(skipped for DOWN_S) only when no other holder has the block (kvstore/index/choose.py). A segment that comes
back short (stale entry, node gone, a node that timed out) is completed from the other holders of the missing
block, and when every holder fails the prefix ends there: a stale entry costs a miss, never an error. After
the last segment, the node that served it is asked for more of the chain directly, so blocks the index has
not caught up with yet (updates are batched) are still found.

Locality: when this client reads pages a second time from a node on another host while a node of its own host
answers, it asks that node to take copies (Replicate, in the background, at most once per page per
LOCAL_COPY_WINDOW_S): the bytes go node to node, and the next reads are same-host.

Trust: node addresses come from Redis, which is not trusted with identities. Each node is dialled with
`security.for_node(node_id)`: over TLS its certificate must name that node, and without TLS the token
is only sent where the operator allowed plaintext tokens (a client refuses at construction otherwise).
A node that cannot be verified, answers UNIMPLEMENTED, breaks the stream framing or sends pages that
fail their checks is a miss for that segment (logged), never an error to the caller.

Put placement (kvstore/index/choose.py `put_target`), in this order, and why:
1. this host's node (`local_node`, else a live node whose record names this client's host): no network
   hop for the producer, the same host's reader reads it fastest, and writers on every host spread their
   chains over every host's node (a shared prefix gets copies where it is read: DESIGN.md §7.3);
2. prefix affinity: a node holding the longest leading run of `parent_chain` (fetched in one stream);
3. any node: the better of two drawn at random by free DRAM+NVMe room and load (power of two choices).
Each step skips suspect and full nodes while others remain, and draws among equals: never "the highest
node id", so a node that joins takes its share of new chains. Hashing the chain head was rejected: it
ignores load and locality.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvstore.addresses import host_id
from kvstore.client import KVStoreClient, PutResult
from kvstore.client.bundles import Parts
from kvstore.errors import KVStoreError, NamespaceNotFound, Unavailable
from kvstore.index import ClusterLookup, IndexReader, NodeInfo
from kvstore.index.choose import NodeLoad, from_record, put_target, read_preference
from kvstore.index.lookup import Preference
from kvstore.layout import PageLayout
from kvstore.names import Buffer
from kvstore.security import ClientSecurity
from kvstore.wire.streams import FetchedPage, PageRef

log = logging.getLogger(__name__)

_NODE_ERRORS = (Unavailable, NamespaceNotFound)
# What a node that is gone, unverifiable or misbehaving (UNIMPLEMENTED, garbage, wrong pages) raises in a
# read: each is a miss for that node's segment.
_MISS_ERRORS = (KVStoreError, ValueError)
_NO_ANSWER = ("UNAVAILABLE", "DEADLINE_EXCEEDED")  # a node that did not answer: read from last for DOWN_S
T = TypeVar("T")
R = TypeVar("R")

DOWN_S = 5.0  # a node whose call failed (unreachable, timed out) is read from last by this client this long
LOADS_REFRESH_S = 2.0  # how old this client's view of the nodes' records (load, room, host) may get
LOCAL_COPY_READS = 2  # remote reads of a page (within the window) after which this host's node is asked for it
LOCAL_COPY_WINDOW_S = 60.0
PLACED_MEMORY_S = 10.0  # how long this client counts its own puts against a node's room (records trail them)
_REMOTE_PAGES = 4096  # pages whose remote reads are remembered (oldest forgotten first)
_HINTS_IN_FLIGHT = 4  # locality requests waiting or running; past it new ones are dropped


class NoLiveNode(KVStoreError):
    """The index lists no live node to put to."""

    status_name = "UNAVAILABLE"


class ClusterClient:
    """Blocking cluster client. One channel per node, opened on first use and kept. Thread-safe."""

    # keyword-only settings, each with a default
    def __init__(  # noqa: PLR0913
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
        local_copies: bool = True,
        seed: int | None = None,
    ) -> None:
        """`local_copies`: ask this host's node for copies of pages read remotely again (module docstring).
        `seed`: the generator behind read and put draws (None: a fresh one)."""
        self.security = ClientSecurity.from_env() if security is None else security  # for every node
        self.security.check_target(None)  # addresses come from the index: no token in clear to them
        self.index = IndexReader(redis_url, tenant=tenant)  # tenant: whose index entries (KVSTORE_TENANT)
        self.local_node = local_node
        self.timeout = timeout
        self.verify = verify
        self.probe_tail = probe_tail
        self.transport = transport  # every node client's data plane (None: KVSTORE_TRANSPORT, else auto)
        self.host = host_id()  # this client's host (KVSTORE_HOST_ID in tests playing several hosts)
        self.local_copies = local_copies
        self._clients: dict[tuple[str, str], KVStoreClient] = {}  # (node id, address) -> client
        self._addrs: dict[str, str] = {}
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._down: dict[str, float] = {}  # node -> until when it is read from last (a failed call)
        self._loads: dict[str, NodeLoad] = {}
        self._loads_at = -1e18
        self._remote: OrderedDict[tuple[str, bytes], tuple[int, float]] = OrderedDict()  # page -> (reads, first)
        self._placed: list[tuple[float, str, int]] = []  # (when, node, pages) this client put lately
        self._hints: ThreadPoolExecutor | None = None
        self._hints_pending = 0
        self.local_copy_requests = 0  # Replicate requests sent to this host's node (counted)

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._hints is not None:
            # NOTE: not waited for: a request in flight ends on its own (its node pulls meanwhile), failing at worst.
            self._hints.shutdown(wait=False, cancel_futures=True)
            self._hints = None
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
        with self._lock:
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

    def loads(self) -> dict[str, NodeLoad]:
        """Live nodes as placement sees them (index records, at most LOADS_REFRESH_S old; suspects marked)."""
        now = time.monotonic()
        if now - self._loads_at >= LOADS_REFRESH_S:
            self._loads_at = now
            try:
                infos = [n for n in self.index.nodes() if n.alive and n.addr]
            except KVStoreError as exc:
                log.info("node records could not be read (%s): using the last ones", exc)
                return self._loads
            suspect = self.index.suspects()
            self._loads = {n.node_id: from_record(n.node_id, n.info, n.node_id in suspect) for n in infos}
            self._addrs.update({n.node_id: n.addr for n in infos})  # fresh: a node may have restarted
        return self._loads

    def mark_down(self, node: str) -> None:
        """`node` failed a call: read from it last for DOWN_S (a hung node costs one timeout, not one per call)."""
        self._down[node] = time.monotonic() + DOWN_S

    def _down_now(self) -> set[str]:
        now = time.monotonic()
        return {n for n, until in list(self._down.items()) if until > now}

    def preference(self) -> Preference:
        """How this client ranks a page's holders now (kvstore/index/choose.py `read_preference`)."""
        loads = self.loads()
        suspect = self.index.suspects()
        if suspect:
            loads = {k: (NodeLoad(v.node_id, v.host, v.free_slots, v.total_slots, v.load_bps, k in suspect))
                     for k, v in loads.items()}  # fmt: skip
        return read_preference(loads, self.host, self._down_now(), self._rng)

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
        return self._read(namespace, hashes, lambda c, a, b: c.get_pages(namespace, hashes[a:b]), prefer_node, found)

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
        return self._read(
            namespace, hashes, lambda c, a, b: c.get_into(namespace, hashes[a:b], buffers[a:b]), prefer_node, found
        )

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
        return self._read(
            namespace,
            hashes,
            lambda c, a, b: c.get_bundle_into(namespace, layout, hashes[a:b], pages[a:b]),
            prefer_node,
            found,
        )

    def _read(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        read: Callable[[KVStoreClient, int, int], list[R]],
        prefer_node: str | None,
        found: ClusterLookup | None,
    ) -> list[R]:
        """What read(client of a node, a, b) gives for blocks [a, b), in order, over the nodes `_walk` picks."""
        out: list[R] = []

        def fetch(node: str, a: int, b: int) -> int:
            got = self._fetch(node, b - a, lambda c: read(c, a, b))
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
        prefer = self.preference()
        excluded: set[tuple[str, int]] = set()  # (node, block) pairs known not to work
        last_node: str | None = None
        i = 0
        # Each pass either advances i or excludes one (node, block) pair: bounded by blocks * holders.
        for _ in range(max(1, sum(len(h) for h in found.holders) + found.matched)):
            if i >= found.matched:
                break
            choice = found.best_holder(i, excluded, prefer)
            if choice is None:
                break
            node, run = choice
            got = fetch(node, i, i + run)
            if not got:
                excluded.add((node, i))
                continue
            self._note_remote(namespace, node, hashes[i : i + got], found.holders[i : i + got])
            i += got
            last_node = node
            if got < run:
                excluded.add((node, i))
        probe = last_node or prefer_node
        if self.probe_tail and probe is not None and i < len(hashes) and probe not in self._down_now():
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

    def _fetch(self, node: str, blocks: int, read: Callable[[KVStoreClient], list[R]]) -> list[R]:
        """read(client of node): `blocks` pages from one node; a node that is gone, unverifiable or
        misbehaving yields [] (the caller tries elsewhere), and one that did not answer is read from last."""
        try:
            return self.call_node(node, read)
        except NamespaceNotFound as exc:
            log.info("node %s could not serve %d block(s): %s", node, blocks, exc)
        except _MISS_ERRORS as exc:
            if isinstance(exc, Unavailable) or getattr(exc, "status_name", "") in _NO_ANSWER:
                self.mark_down(node)
                log.info("node %s could not serve %d block(s): %s", node, blocks, exc)
            else:
                log.warning(
                    "node %s misbehaved serving %d block(s), counted as a miss: %s: %s",
                    node,
                    blocks,
                    type(exc).__name__,
                    exc,
                )
        return []

    # -- locality: copies on this host's node of what this client reads from others

    def _local_nodes(self) -> list[str]:
        loads = self.loads()
        if self.local_node is not None:
            return [self.local_node] if self.local_node in loads else []
        return sorted(n for n, v in loads.items() if v.host == self.host and not v.suspect)

    def _note_remote(
        self, namespace: str, node: str, hashes: Sequence[bytes], holders: Sequence[dict[str, object]]
    ) -> None:
        """Pages just read from `node`: when it is on another host and this host's node lacks them, count the
        read; the second within LOCAL_COPY_WINDOW_S asks this host's node to copy them from `node`."""
        if not self.local_copies or not hashes:
            return
        local = self._local_nodes()
        if not local or node in local:
            return
        target = local[0]
        now = time.monotonic()
        due: list[bytes] = []
        with self._lock:
            for h, held in zip(hashes, holders, strict=False):
                if target in held:
                    continue
                key = (namespace, h)
                reads, first = self._remote.pop(key, (0, now))
                if now - first > LOCAL_COPY_WINDOW_S:
                    reads, first = 0, now
                reads += 1
                if reads >= LOCAL_COPY_READS:
                    due.append(h)
                    reads, first = -1_000_000, now  # asked: not again within the window
                self._remote[key] = (reads, first)
            while len(self._remote) > _REMOTE_PAGES:
                self._remote.popitem(last=False)
            if not due or self._hints_pending >= _HINTS_IN_FLIGHT:
                return
            self._hints_pending += 1
            if self._hints is None:
                self._hints = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-local-copies")
        self.local_copy_requests += 1
        self._hints.submit(self._ask_copy, target, namespace, due, node)

    def _ask_copy(self, target: str, namespace: str, hashes: list[bytes], source: str) -> None:
        try:
            res = self.call_node(target, lambda c: c.replicate(namespace, hashes, source))
            log.debug("node %s copied %d page(s) from %s (%s)", target, res.copied, source, res)
        except Exception as exc:  # best effort, in the background: a failure is only logged
            log.info("node %s could not copy %d page(s) from %s: %s", target, len(hashes), source, exc)
        finally:
            with self._lock:
                self._hints_pending -= 1

    # -- writes

    def choose_node(self, namespace: str, parent_chain: Sequence[bytes] = ()) -> str:
        """Where a put goes (see the module docstring for the rule and why)."""
        loads = self.loads()
        if not loads:
            self._loads_at = -1e18  # none known: ask the index again now (a node may have just started)
            loads = self.loads()
        if not loads:
            raise NoLiveNode("no live cache node is registered in the index")
        loads = self._with_placed(loads)
        affinity: set[str] = set()
        if parent_chain:
            shares = [s for s in self.index.lookup(namespace, parent_chain).nodes.values() if s.node_id in loads]
            longest = max((s.leading for s in shares), default=0)
            affinity = {s.node_id for s in shares if s.leading == longest and longest > 0}
        local = self._local_nodes() if self.local_node is None else [self.local_node]
        down = self._down_now()
        nodes = [v if v.node_id not in down else NodeLoad(v.node_id, v.host, v.free_slots, v.total_slots,
                                                             v.load_bps, True) for v in loads.values()]  # fmt: skip
        chosen = put_target(nodes, self._rng, local=local, affinity=affinity)
        assert chosen is not None
        return chosen.node_id

    def put(
        self,
        namespace: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        pages: Sequence[Buffer],
        *,
        parent_chain: Sequence[bytes] = (),
        replicas: int = 0,
    ) -> tuple[str, PutResult]:
        """Store pages on the node choose_node picks; `parent_chain` is the chain before hashes[0]. `replicas`:
        copies the cluster should keep (KVStoreClient.put): the node copies them to others."""
        parent = parent_chain[-1] if parent_chain else None
        return self._place(
            namespace, parent_chain, lambda c: c.put(namespace, layout, hashes, pages, parent=parent, replicas=replicas)
        )

    def put_bundle(
        self,
        namespace: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        pages: Sequence[Parts],
        *,
        parent_chain: Sequence[bytes] = (),
        replicas: int = 0,
    ) -> tuple[str, PutResult]:
        """`put` of multi-part pages (as KVStoreClient.put_bundle) on the node choose_node picks."""
        parent = parent_chain[-1] if parent_chain else None
        return self._place(
            namespace,
            parent_chain,
            lambda c: c.put_bundle(namespace, layout, hashes, pages, parent=parent, replicas=replicas),
        )

    def _place(
        self, namespace: str, parent_chain: Sequence[bytes], put: Callable[[KVStoreClient], PutResult]
    ) -> tuple[str, PutResult]:
        """put(client of the node choose_node picks), its pages then counted against that node's room."""
        node = self.choose_node(namespace, parent_chain)
        res = self.call_node(node, put)
        with self._lock:
            self._placed.append((time.monotonic(), node, res.stored))
        return node, res

    def _with_placed(self, loads: dict[str, NodeLoad]) -> dict[str, NodeLoad]:
        """The records' room less what this client put since (PLACED_MEMORY_S): records trail puts by up to a
        heartbeat, and a client that placed by them alone would send a burst of chains to one node."""
        now = time.monotonic()
        with self._lock:
            self._placed = [p for p in self._placed if now - p[0] < PLACED_MEMORY_S]
            taken: dict[str, int] = {}
            for _, node, n in self._placed:
                taken[node] = taken.get(node, 0) + n
        return {k: dataclasses.replace(v, free_slots=max(0, v.free_slots - taken.get(k, 0))) for k, v in loads.items()}
