"""The node-to-node copier (see kvstore/replication/__init__.py for the rules and DESIGN.md §7.3 for why)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from kvstore.client import AsyncKVStoreClient
from kvstore.errors import KVStoreError, NamespaceNotFound, Unavailable
from kvstore.index import IndexReader
from kvstore.index.choose import NodeLoad, copy_targets, from_record
from kvstore.layout import PageLayout
from kvstore.names import Key, TierKind
from kvstore.node.callers import Caller
from kvstore.node.drivers import PageHead, drive_put
from kvstore.node.heat import HeatTable
from kvstore.node.servicer import Copied
from kvstore.pageformat import slot_bytes_for, wire_checksum
from kvstore.scoping import DEFAULT_TENANT, split
from kvstore.security import ClientSecurity, InsecureChannel, read_token_file
from kvstore.stats import ReplicationStatus
from kvstore.wire import PutOpen
from kvstore.wire.streams import FetchedPage

if TYPE_CHECKING:
    from kvstore.config import NodeConfig
    from kvstore.node.server import Node

log = logging.getLogger(__name__)

COPY_BATCH = 64  # pages per Replicate request (and per pull)
CONCURRENCY = 4  # Replicate requests this node has in flight, and pulls it runs, each
ROUND_PAGES = 4096  # pages a round considers, hottest first
LAGGARD_ROUNDS = 3  # rounds a non-leader holder sees a page short before it makes the copy itself
CALL_TIMEOUT_S = 30.0  # one Replicate (the destination pulls COPY_BATCH pages) or one pull
# A node leaving hands off every page read at least this often lately (about once in the last half minute), hot
# or not: the readers that came to it will look for it elsewhere.
HANDOFF_MIN_RATE = 0.02


def peer_security(config: NodeConfig) -> ClientSecurity:
    """What this node presents to other nodes: the environment's TLS settings (KVSTORE_TLS_CA, ...) and the
    first token of `auth_peer_tokens_file` (else the environment's token, else none)."""
    sec = ClientSecurity.from_env()
    if config.auth_peer_tokens_file:
        sec = dataclasses.replace(sec, token=read_token_file(config.auth_peer_tokens_file)[0])
    return sec


def leader(page: bytes, holders: Sequence[str]) -> str:
    """The holder that copies `page` first (rendezvous hashing: every holder computes the same one)."""
    return max(holders, key=lambda n: hashlib.sha256(page + n.encode()).digest())


class ByteBudget:
    """At most `rate` bytes per second, in bursts of up to one second's worth (0: unbounded)."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._tokens = float(rate)
        self._at = time.monotonic()

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        for _ in range(1000):  # bounded: each round sleeps until enough has accrued
            now = time.monotonic()
            self._tokens = min(float(self.rate), self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens >= min(n, self.rate):
                self._tokens -= n
                return
            await asyncio.sleep((min(n, self.rate) - self._tokens) / self.rate)


class _FetchedPlane:
    """drive_put's page plane over pages already pulled (and verified) from the source."""

    def __init__(self, pages: Sequence[FetchedPage]) -> None:
        self.pages = pages

    async def read_into(self, index: int, view: memoryview) -> None:
        view[:] = memoryview(self.pages[index].data).cast("B")

    async def discard(self, index: int, nbytes: int) -> None:
        return None


class Replicator:
    """Replication by heat on one node: a NodeService (kvstore/node/server.py). Runs on the node's event loop;
    its Redis reads (blocking) run in threads."""

    def __init__(self, config: NodeConfig, security: ClientSecurity | None = None) -> None:
        if not config.redis_url:
            raise ValueError("replication needs an index (redis_url)")
        self.config = config
        self.security = peer_security(config) if security is None else security
        self.heat = HeatTable()
        self.status = ReplicationStatus(enabled=True)
        self.node: Node | None = None
        self.index = IndexReader(config.redis_url, tenant=DEFAULT_TENANT, socket_timeout=2.0)
        self._budget = ByteBudget(config.replication_bytes_per_second)
        self._clients: dict[tuple[str, str, str], AsyncKVStoreClient] = {}  # (node, address, tenant)
        self._addrs: dict[str, str] = {}
        self._loads: dict[str, NodeLoad] = {}
        self._short: dict[Key, int] = {}  # pages a non-leader saw short, rounds in a row
        self._layouts: dict[tuple[str, str, str], PageLayout] = {}  # (source, tenant, namespace)
        self._task: asyncio.Task[None] | None = None
        self._sends = asyncio.Semaphore(CONCURRENCY)  # Replicate requests this node sends at once
        self._pulls = asyncio.Semaphore(CONCURRENCY)  # pulls this node runs at once (others wait their turn)
        self._warned: set[str] = set()

    # -- NodeService

    async def start(self, node: Node) -> None:
        self.node = node
        node.callers.heat = self.heat
        node.servicer.replicate = self.take_copies
        node.servicer.replication = self.snapshot
        node.manager.listen(self._changed)
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.node is not None:
            self.node.manager.unlisten(self._changed)
            self.node.servicer.replicate = None
        clients, self._clients = self._clients, {}
        for c in clients.values():
            with contextlib.suppress(Exception):
                await c.close()
        await asyncio.to_thread(self.index.close)

    async def handoff(self, deadline: float) -> None:
        """SIGTERM: hand the pages read lately that no other live node holds (and the copies hot pages ask for)
        to others, hottest first, until `deadline`."""
        try:
            sent = await self.round(handoff=True, deadline=deadline)
            log.info("hand-off: %d page(s) copied to other nodes", sent)
        except Exception:
            log.exception("hand-off failed")

    def snapshot(self) -> ReplicationStatus:
        """Stats' view: this node's counters, served bytes and how many pages ask for copies now."""
        assert self.node is not None
        reads = self.node.callers.reads
        return dataclasses.replace(
            self.status,
            copies_out=reads.copies_out,
            copy_bytes_out=reads.copy_bytes_out,
            served_bytes=reads.served_bytes,
            served_pages=reads.served_pages,
        )

    def _changed(self, namespace: str, h: bytes, tier: TierKind | None, previous: TierKind | None = None) -> None:
        if tier is None:
            self.heat.forget((namespace, h))

    # -- making copies

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.replication_interval_seconds)
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the index or a peer failing must not end replication
                self._warn(f"round:{type(exc).__name__}", f"a round failed (retried every round): {exc}")

    async def round(self, *, handoff: bool = False, deadline: float | None = None) -> int:
        """One round: the pages this node holds that ask for more copies than they have, copied to other nodes.
        `handoff`: this node is leaving, so it does not count as a holder and does not wait to be the leader.
        Returns how many pages the destinations copied."""
        assert self.node is not None
        cfg, me, manager = self.config, self.config.node_id, self.node.manager
        now = time.monotonic()
        cands = self.heat.candidates(
            now,
            cfg.replication_hot_reads_per_second,
            cfg.replication_max_copies,
            ROUND_PAGES,
            HANDOFF_MIN_RATE if handoff else None,
        )
        by_ns: dict[str, list[bytes]] = {}
        for (ns, h), _ in cands:
            if manager.entry(ns, h) is not None:
                by_ns.setdefault(ns, []).append(h)
        if not by_ns:
            return 0
        self._loads = await asyncio.to_thread(self._read_loads)
        holders = await asyncio.to_thread(self._read_holders, by_ns)
        # NOTE: pages grouped by namespace, holders and deficit go to the same destinations (drawn once, seeded
        # by the group): a hot chain's copies stay together (one stream per read), and holders deciding at once
        # draw alike.
        groups: dict[tuple[str, tuple[str, ...], int], list[tuple[bytes, int]]] = {}
        mean = sum(n.load_bps for n in self._loads.values()) / max(1, len(self._loads))
        hot = 0
        for ns, hashes in by_ns.items():
            for h, held in zip(hashes, holders[ns], strict=True):
                key = (ns, h)
                healthy = sorted({n for n in held if n in self._loads and not self._loads[n].suspect} | {me})
                wanted = self.heat.wanted(
                    key, len(healthy), now, cfg.replication_hot_reads_per_second, cfg.replication_max_copies
                )
                others = len(healthy) - 1
                hot += wanted > 1
                deficit = wanted - (others if handoff else len(healthy))
                if handoff and deficit <= 0 and others == 0:
                    deficit = 1  # leaving: a hot page keeps at least one copy
                if deficit <= 0:
                    self._short.pop(key, None)
                    continue
                if not handoff and leader(h, healthy) != me:
                    seen = self._short.get(key, 0) + 1
                    self._short[key] = seen
                    if seen < LAGGARD_ROUNDS:
                        continue
                self._short.pop(key, None)
                replicas = self.heat.pages[key].replicas if key in self.heat.pages else 0
                groups.setdefault((ns, tuple(sorted(held | {me})), deficit), []).append((h, replicas))
        if len(self._short) > 4 * ROUND_PAGES:  # pages that left meanwhile: forget the oldest notes
            self._short.clear()
        if not handoff:
            self.status.hot_pages = hot
        plan: dict[tuple[str, str], list[tuple[bytes, int]]] = {}  # (destination, namespace) -> (page, replicas)
        for (ns, held_by, deficit), pages in groups.items():
            cands_nodes = [n for n in self._loads.values() if n.node_id not in held_by]
            seed = "\0".join((ns, *held_by)).encode()
            for dest in copy_targets(
                seed,
                cands_nodes,
                count=deficit,
                need_slots=len(pages),
                reserve=cfg.replication_free_reserve,
                mean_load=mean,
            ):
                plan.setdefault((dest, ns), []).extend(pages)
        sends = [
            self._send(dest, ns, batch[i : i + COPY_BATCH], handoff, deadline)
            for (dest, ns), batch in plan.items()
            for i in range(0, len(batch), COPY_BATCH)
        ]
        return sum(await asyncio.gather(*sends))

    def _read_loads(self) -> dict[str, NodeLoad]:
        infos = [n for n in self.index.nodes() if n.alive and n.addr]
        suspect = self.index.suspects()
        self._addrs = {n.node_id: n.addr for n in infos}
        return {n.node_id: from_record(n.node_id, n.info, n.node_id in suspect) for n in infos}

    def _read_holders(self, by_ns: dict[str, list[bytes]]) -> dict[str, list[set[str]]]:
        return {ns: [set(b) for b in self.index.holders(ns, hashes)] for ns, hashes in by_ns.items()}

    async def _send(
        self, dest: str, ns: str, pages: list[tuple[bytes, int]], handoff: bool, deadline: float | None
    ) -> int:
        """One Replicate to `dest` (it pulls the pages from this node); returns how many it copied."""
        assert self.node is not None
        tenant, name = split(ns)
        try:
            layout = self.node.manager.layout_of(ns)
        except NamespaceNotFound:
            return 0
        replicas = max(r for _, r in pages)
        hashes = [h for h, _ in pages]
        async with self._sends:
            if deadline is not None and time.monotonic() >= deadline:
                return 0
            timeout = CALL_TIMEOUT_S if deadline is None else max(0.1, deadline - time.monotonic())
            self.status.copy_requests += 1
            try:
                client = self._client(dest, tenant)
                async with asyncio.timeout(timeout):
                    res = await client.replicate(name, hashes, self.config.node_id, layout=layout, replicas=replicas)
            except (KVStoreError, TimeoutError, InsecureChannel) as exc:
                self.status.copy_failures += len(hashes)
                self._warn(dest, f"could not ask node {dest} for copies: {type(exc).__name__}: {exc}")
                return 0
        self.status.copies_refused += res.refused
        if handoff:
            self.status.handoff_pages += res.copied
        return res.copied

    def _client(self, node: str, tenant: str, pulls: bool = False) -> AsyncKVStoreClient:
        """A client of `node` acting for `tenant` (its name in the call's metadata where it is not the default).
        `pulls`: it pulls copies, over gRPC streams: the plane whose calls carry metadata (the tenant's name, and
        the copy marker that keeps a copy out of the source's heat and served bytes)."""
        addr = self._addrs.get(node)
        if addr is None:
            raise Unavailable(f"node {node!r} is not live in the index")
        key = (node, addr, f"{tenant}/{pulls}")
        client = self._clients.get(key)
        if client is None:
            sec = dataclasses.replace(self.security.for_node(node), copies=pulls)
            if tenant != DEFAULT_TENANT:
                sec = dataclasses.replace(sec, acting_for=tenant)
            sec.check_target(None)  # a token goes only where TLS proves who answers (or plaintext was allowed)
            transport = "grpc" if pulls else None
            client = AsyncKVStoreClient(addr, timeout=CALL_TIMEOUT_S, security=sec, transport=transport)
            self._clients[key] = client
        return client

    def _warn(self, what: str, message: str) -> None:
        if what not in self._warned:  # once per node: a misconfigured peer must not flood the log
            self._warned.add(what)
            log.warning("replication: %s", message)
        else:
            log.debug("replication: %s", message)

    # -- taking copies (a Replicate this node answers)

    async def take_copies(
        self,
        caller: Caller,
        namespace: str,
        hashes: list[bytes],
        *,
        source: str,
        layout: PageLayout | None,
        replicas: int,
    ) -> Copied:
        """Pull `hashes` of `namespace` (the caller's tenant's) from node `source` and store them here (see the
        package docstring: free room only, verified on arrival, the one put driver)."""
        assert self.node is not None
        manager = self.node.manager
        view = caller.view
        scoped = view.ns(namespace)
        out = Copied()
        distinct = list(dict.fromkeys(hashes))
        out.already_present = len(hashes) - len(distinct)
        if source == self.config.node_id:
            out.already_present = len(hashes)
            return out
        todo = [h for h in distinct if manager.entry(scoped, h) is None]
        out.already_present += len(distinct) - len(todo)
        room = self._room()
        out.refused = max(0, len(todo) - room)
        self.status.copies_refused += out.refused
        todo = todo[: max(0, room)]
        if not todo:
            return out
        if source not in self._addrs:
            self._addrs = await asyncio.to_thread(self.index.node_addrs)
        try:
            async with self._pulls, asyncio.timeout(CALL_TIMEOUT_S):
                client = self._client(source, view.tenant, pulls=True)
                if layout is None:
                    layout = await self._layout(client, source, view.tenant, namespace, scoped)
                share = self._share_room(view.tenant, layout)
                if share is not None and share < len(todo):
                    out.refused += len(todo) - share
                    self.status.copies_refused += len(todo) - share
                    todo = todo[:share]
                    if not todo:
                        return out
                await self._budget.take(len(todo) * layout.page_bytes)
                corrupt = client.corrupt_pages
                pages = await client.get_pages(namespace, todo, promote=False)
                bad = client.corrupt_pages - corrupt
        except (KVStoreError, TimeoutError, InsecureChannel, ValueError) as exc:
            out.failed = len(todo)
            self.status.copy_failures += len(todo)
            self._warn(source, f"could not pull copies from node {source}: {type(exc).__name__}: {exc}")
            return out
        self.status.copy_corrupt += bad
        pages = [p for p in pages if len(p.data) == layout.page_bytes]
        out.failed = len(todo) - len(pages)
        self.status.copy_failures += out.failed
        if pages:
            op = PutOpen(namespace, layout, None, None, False, replicas=replicas)
            try:
                done = await drive_put(
                    lambda: (caller, op), _heads(namespace, pages), _FetchedPlane(pages), drain=False
                )
            except KVStoreError as exc:  # no room after all, a layout this node knows otherwise, ...
                out.failed += len(pages)
                self.status.copy_failures += len(pages)
                self._warn(f"store:{source}", f"copies from node {source} not stored: {type(exc).__name__}: {exc}")
                return out
            out.copied = done.stored
            out.already_present += done.present
            out.refused += len(pages) - done.stored - done.present
            self.status.copies_in += done.stored
            self.status.copy_bytes_in += done.stored * layout.page_bytes
        return out

    async def _layout(
        self, client: AsyncKVStoreClient, source: str, tenant: str, namespace: str, scoped: str
    ) -> PageLayout:
        """The namespace's layout: this node's, else the source's (its Stats, once per source and namespace)."""
        assert self.node is not None
        with contextlib.suppress(NamespaceNotFound):
            return self.node.manager.layout_of(scoped)
        key = (source, tenant, namespace)
        if key not in self._layouts:
            stats = await client.stats()
            for ns, layout, _ in stats.namespaces:
                self._layouts[(source, tenant, ns)] = layout
        if key not in self._layouts:
            raise NamespaceNotFound(namespace, f"node {source}")
        return self._layouts[key]

    def _room(self) -> int:
        """Pages a copy may take here: free DRAM and NVMe slots beyond the reserve."""
        assert self.node is not None
        manager = self.node.manager
        occ = manager.occupancy()
        total = free = 0
        for tier in ("dram", "nvme"):
            total += occ.get(f"slots_total_{tier}", 0)
            free += occ.get(f"slots_total_{tier}", 0) - occ.get(f"slots_used_{tier}", 0)
        return max(0, free - int(self.config.replication_free_reserve * total))

    def _share_room(self, tenant: str, layout: PageLayout) -> int | None:
        """Pages of `layout` the tenant's DRAM share here has room for (None: no share). NOTE: shares count slot
        bytes (kvstore/manager/quotas.py), so a page counts its slot's size, as the put that stores it will."""
        assert self.node is not None
        manager = self.node.manager
        quotas = manager.placement.quotas
        cap = quotas.cap(tenant, TierKind.DRAM) if quotas is not None else None
        if cap is None:
            return None
        held = manager.table.tiers[TierKind.DRAM].tenant_bytes.get(tenant, 0)
        return max(0, (cap - held) // slot_bytes_for(layout.page_bytes))


async def _heads(namespace: str, pages: Sequence[FetchedPage]) -> AsyncIterator[PageHead]:
    """Each pulled page as a Put announces it, with the checksum its writer would declare (KEYED)."""
    for p in pages:
        view = memoryview(p.data).cast("B")
        yield PageHead(p.hash, len(view), wire_checksum(namespace, p.hash, view))
