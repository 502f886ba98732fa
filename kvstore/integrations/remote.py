"""One kvstore node, or a cluster through its Redis index, behind one blocking interface with the error
policy an engine needs: every failure is a logged miss (or a dropped store), never an exception.

    store = RemoteStore(settings, log)          # settings: lmcache_mapping.PluginSettings
    n = store.lookup(ns, hashes)                # leading blocks held; 0 when the remote fails
    pages = store.get(ns, hashes[:n])           # checksum-verified pages of the longest prefix
    sizes = store.get_into(ns, hashes[:n], bufs)  # the same, received straight into the caller's buffers
    done = store.put(ns, layout, hashes, pages)  # Stored: per page, held by the node or not (outcome.py)

Errors, and what the engine's log says (each kind at most once per LOG_INTERVAL seconds; the policy is
remote_failures.py):
- the remote does not answer (node down, Redis down, no live node, deadline): one ERROR on the edge,
  then calls are answered with a miss without trying for `down_backoff` seconds (one probe per period),
  and one INFO when it answers again with how many calls were skipped;
- a wrong or read-only token: ERROR naming the setting to fix;
- a page the node refuses (size or layout not the namespace's, larger than its max_page_bytes): ERROR;
- a page that fails its checksum after the transfer: ERROR, and a miss from that page on;
- the node is full of pinned or in-flight pages: WARNING, the store is dropped;
- the node answered a store but did not keep some pages (full DRAM that did not admit them and no NVMe to
  write them through): WARNING, and those pages are failures in the `Stored` the door reports to its engine.

Stores report per page (kvstore/integrations/outcome.py: the counts of the Put, and prefix Lookups on the
node that took it only when they fall short), so no door tells its engine it stored a page the node refused.

Thread-safety: every method may be called from any thread. One node: a data client (transport per
settings) and a control client (gRPC, short deadline) shared by all threads (KVStoreClient is
thread-safe). A cluster: one ClusterClient per thread, since ClusterClient keeps unlocked caches.

`get_into` and the same-host plane: shm moves pages only into memory registered with the client
(`shared_buffer`), and a caller's buffers (an engine's own KV memory) are not. So with transport "auto",
once the data client has settled on shm, `get_into` goes through a second client that receives into any
memory (the TCP plane, else gRPC streams): still one copy, verified on arrival. With transport "shm"
insisted on, pages are fetched and then copied into the buffers (a second copy; say so in the docs).
A cluster's `get_into` uses node clients on the TCP plane for the same reason unless a transport is set.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence

from kvstore.client import KVStoreClient, PutResult
from kvstore.client.bundles import Parts
from kvstore.client.cluster import ClusterClient
from kvstore.errors import SessionNotFound
from kvstore.integrations.health import LogLimiter, Outage
from kvstore.integrations.hints import SessionHints
from kvstore.integrations.lmcache_mapping import PluginSettings
from kvstore.integrations.outcome import Stored, held_pages
from kvstore.integrations.remote_failures import FAILURES, LOG_INTERVAL, FailurePolicy
from kvstore.layout import PageLayout
from kvstore.security import ClientSecurity, read_token_file
from kvstore.stats import NodeStats
from kvstore.wire.streams import Buffer, FetchedPage

# NOTE: one client call holds all its pages in memory at once (a Get's buffers, a shared-memory Put's
# segment of their total size). Callers slice long chains to this many bytes per call: at ~1-2 GB/s a
# 64 MiB call takes ~40 ms, so the extra ~1 ms per call is noise, and memory stays bounded.
CALL_BYTES = 64 << 20
# A namespace no door writes (the mapping's namespaces all carry a prefix and a version): `warm` reads a page of
# it so the node's answer (not found) costs nothing and changes nothing.
WARM_NAMESPACE = "kvstore-warm/none"


def call_slices(n: int, page_bytes: int) -> list[tuple[int, int]]:
    """[a, b) ranges of a chain of n pages, each of at most CALL_BYTES (at least one page)."""
    per = max(1, CALL_BYTES // max(1, page_bytes))
    return [(a, min(a + per, n)) for a in range(0, n, per)]


def client_security(s: PluginSettings) -> ClientSecurity:
    """The KVSTORE_* environment, overridden by the settings that are given."""
    env = ClientSecurity.from_env()
    token = s.token or (read_token_file(s.token_file)[0] if s.token_file else env.token)
    tls = s.tls_ca is not None
    return ClientSecurity(
        token=token,
        ca_file=s.tls_ca if tls else env.ca_file,
        cert_file=s.tls_cert if tls else env.cert_file,
        key_file=s.tls_key if tls else env.key_file,
        server_name=s.tls_server_name or env.server_name,
    )


class RemoteStore(FailurePolicy):
    """A node or a cluster; see the module docstring for the error policy."""

    def __init__(self, settings: PluginSettings, log: logging.Logger, *, setting_prefix: str = "") -> None:
        self.settings = settings
        self.log = log
        self.where = settings.target.describe()
        self._hint = setting_prefix  # e.g. "remote_storage_plugin.kvstore." for messages
        self.outage = Outage(settings.down_backoff)
        self.limiter = LogLimiter(LOG_INTERVAL)
        self.security = client_security(settings)
        self._local = threading.local()
        self._clusters: list[ClusterClient] = []
        self._lock = threading.Lock()
        self._closed = False
        self._data: KVStoreClient | None = None
        self._ctl: KVStoreClient | None = None
        if settings.target.addr is not None:
            self._data = KVStoreClient(
                settings.target.addr, timeout=settings.timeout, security=self.security, transport=settings.transport
            )
            self._ctl = KVStoreClient(
                settings.target.addr, timeout=settings.lookup_timeout, security=self.security, transport="grpc"
            )

    # -- operations (never raise for a remote failure)

    def lookup(self, ns: str, hashes: Sequence[bytes], *, prefetch: bool = False) -> int:
        """Leading blocks of `hashes` the remote holds (0 on failure)."""
        if not hashes:
            return 0
        if self._ctl is not None:
            ctl = self._ctl
            return self._guard("lookup", ns, lambda: ctl.lookup(ns, hashes, prefetch=prefetch), 0)
        return self._guard("lookup", ns, lambda: self._cluster().lookup(ns, hashes).matched, 0)

    def get(self, ns: str, hashes: Sequence[bytes]) -> list[FetchedPage]:
        """Checksum-verified pages of the longest prefix of `hashes` the remote can serve."""
        if not hashes:
            return []
        if self._data is not None:
            data = self._data
            return self._guard("get", ns, lambda: data.get_pages(ns, hashes), [])
        return self._guard("get", ns, lambda: self._cluster().get_pages(ns, hashes), [])

    def get_into(self, ns: str, hashes: Sequence[bytes], buffers: Sequence[Buffer]) -> list[int]:
        """Sizes of the pages of the longest prefix of `hashes` the remote served, each written into buffers[i]
        (the engine's own memory) and verified once ([] on failure; buffers past the prefix hold undefined
        bytes). One node: received straight into the buffers on a network plane, copied there by the node on
        the same-host plane (one copy more where they are not the client's registered memory)."""
        if not hashes:
            return []
        if self._data is not None:
            data = self._data
            return self._guard("get", ns, lambda: [r.nbytes for r in data.get_into(ns, hashes, buffers)], [])
        return self._guard("get", ns, lambda: [r.nbytes for r in self._cluster().get_into(ns, hashes, buffers)], [])

    def put_from(
        self,
        ns: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        views: Sequence[Buffer],
        parent_chain: Sequence[bytes] = (),
        *,
        chain: bool = True,
    ) -> Stored:
        """`put` of pages lying in the engine's memory (each exactly layout.page_bytes): sent straight from it
        (or copied out of it by the node on the same-host plane). `chain` False: the pages are independent
        blocks (no parent hints)."""
        if not hashes:
            return Stored(())
        if self._data is not None:
            data, parent = self._data, (parent_chain[-1] if parent_chain else None)
            res = self._guard(
                "put", ns, lambda: data.put_from(ns, layout, hashes, views, parent=parent, chain=chain), None
            )
            return self._outcome(ns, hashes, None if res is None else (None, res))
        placed = self._guard(
            "put", ns, lambda: self._cluster().put(ns, layout, hashes, views, parent_chain=parent_chain), None
        )
        return self._outcome(ns, hashes, placed)

    def put_bundle(
        self,
        ns: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        pages: Sequence[Parts],
        parent_chain: Sequence[bytes] = (),
        *,
        chain: bool = True,
    ) -> Stored:
        """Multi-part pages (each part's bytes in the engine's memory: pages[i][part], a buffer or its regions),
        one atomic page each (DESIGN.md §4.3); per page, whether the node holds it now."""
        if not hashes:
            return Stored(())
        if self._data is not None:
            data, parent = self._data, (parent_chain[-1] if parent_chain else None)
            res = self._guard(
                "put", ns, lambda: data.put_bundle(ns, layout, hashes, pages, parent=parent, chain=chain), None
            )
            return self._outcome(ns, hashes, None if res is None else (None, res))
        placed = self._guard(
            "put", ns, lambda: self._cluster().put_bundle(ns, layout, hashes, pages, parent_chain=parent_chain), None
        )
        return self._outcome(ns, hashes, placed)

    def get_bundle_into(self, ns: str, layout: PageLayout, hashes: Sequence[bytes], pages: Sequence[Parts]) -> int:
        """How many leading pages of `hashes` landed whole, every part in pages[i][part] (0 on failure: a miss).
        The node checks `layout` against the namespace's (a part it never held, or one left out, is logged)."""
        if not hashes:
            return 0
        if self._data is not None:
            data = self._data
            return self._guard("get", ns, lambda: len(data.get_bundle_into(ns, layout, hashes, pages)), 0)
        return self._guard("get", ns, lambda: len(self._cluster().get_bundle_into(ns, layout, hashes, pages)), 0)

    def warm(self, page_bytes: int = 0, pages: int = 0) -> None:
        """Pay one node's per-client set-up before a transfer needs it (a cluster: nothing). Never raises.

        The data client's plane is negotiated and its first connection opened by a Get of a page nobody stores
        (WARM_NAMESPACE: a miss); then, where that plane is the same-host one, receive memory for `pages` pages
        of `page_bytes` is mapped once (the blocks a store copies pages into and a load lands in, kept mapped
        by the pool for the calls after: kvstore/client/planes/pool.py)."""
        if self._data is None or self._closed:
            return
        data = self._data
        self._guard("warm", WARM_NAMESPACE, lambda: data.get_pages(WARM_NAMESPACE, [bytes(32)]), [])
        if page_bytes > 0 and pages > 0 and data.plane == "shm":
            pool = data.receive_pool
            with contextlib.suppress(MemoryError, OSError, ValueError):
                blocks = [pool.take(page_bytes) for _ in range(pages)]
                del blocks  # back to the pool's free list: mapped, faulted in, registered on first use

    @property
    def plane(self) -> str | None:
        """The data plane of the node client (None for a cluster, or before the first transfer)."""
        return self._data.plane if self._data is not None else None

    def unpin(self, ns: str, hashes: Sequence[bytes]) -> int:
        """Release one pin of each page (pins also expire with their lease); returns how many were released."""
        return self._control("unpin", ns, hashes, lambda c, hs: c.unpin(ns, hs).done)

    def stats(self) -> list[NodeStats]:
        """Every node's Stats as this caller may see them ([] on failure; a cluster's dead nodes are skipped)."""
        if self._ctl is not None:
            ctl = self._ctl
            return self._guard("stats", "", lambda: [ctl.stats()], [])

        def each() -> list[NodeStats]:
            cc = self._cluster()
            out = []
            for n in cc.nodes():
                if n.alive:
                    try:
                        out.append(cc.call_node(n.node_id, lambda c: c.stats()))
                    except FAILURES:
                        continue  # a node that does not answer adds nothing to the usage
            return out

        return self._guard("stats", "", each, [])

    def put(
        self,
        ns: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        pages: Sequence[Buffer],
        parent_chain: Sequence[bytes] = (),
    ) -> Stored:
        """Store pages as one chain continuing `parent_chain`; per page, whether the node holds it now
        (outcome.py). A cluster places it next to its parent (ClusterClient's prefix affinity)."""
        if not hashes:
            return Stored(())
        if self._data is not None:
            data, parent = self._data, (parent_chain[-1] if parent_chain else None)
            res = self._guard("put", ns, lambda: data.put(ns, layout, hashes, pages, parent=parent), None)
            return self._outcome(ns, hashes, None if res is None else (None, res))
        placed = self._guard(
            "put", ns, lambda: self._cluster().put(ns, layout, hashes, pages, parent_chain=parent_chain), None
        )
        return self._outcome(ns, hashes, placed)

    def pin(self, ns: str, hashes: Sequence[bytes], lease: float) -> int:
        """Pin the pages for `lease` seconds (they expire on their own); returns how many were pinned."""
        return self._control("pin", ns, hashes, lambda c, hs: c.pin(ns, hs, ttl_seconds=lease).done)

    # -- retention (DESIGN.md §6.5; the hints' schema: kvstore/integrations/hints.py)

    def retain(self, ns: str, hashes: Sequence[bytes], hints: SessionHints) -> int:
        """Retain these pages for the hints' session (created when new, its lease renewed: the hints' own or
        `retain_ttl`); how many are retained now (0 on failure: logged; at the tenant's cap: a WARNING). A cluster:
        on every node holding a prefix of them."""
        ttl = hints.lease(self.settings.retain_ttl)

        def fn(c: KVStoreClient, hs: list[bytes]) -> int:
            return c.retain(hints.session, ns, hs, ttl_seconds=ttl, priority=hints.priority, mode=hints.mode).retained

        return self._control("retain", ns, hashes, fn)

    def resume(self, hints: SessionHints) -> int:
        """The session's next turn: its pages are promoted back toward DRAM (and its lease renewed); promotions
        started (0 for a session this node does not have yet: a first turn). A cluster: on every live node."""
        ttl = hints.lease(self.settings.retain_ttl)

        def fn(c: KVStoreClient) -> int:
            try:
                return c.resume_session(
                    hints.session, ttl_seconds=ttl, priority=hints.priority, mode=hints.mode
                ).prefetching
            except SessionNotFound:
                return 0

        return self._on_nodes("resume", fn)

    def end_session(self, session: str) -> int:
        """The session ended: its pages are released; how many (0 where the node did not have it)."""

        def fn(c: KVStoreClient) -> int:
            try:
                return c.end_session(session).released
            except SessionNotFound:
                return 0

        return self._on_nodes("end-session", fn)

    def lookup_estimate(self, ns: str, hashes: Sequence[bytes]) -> tuple[int, float]:
        """Leading blocks held and the node's expected milliseconds to fetch them (DESIGN.md §6.6); (0, 0.0) on
        failure. A cluster: the blocks its index lists, and no estimate (0.0): each node estimates its own."""
        if not hashes:
            return 0, 0.0
        if self._ctl is not None:
            ctl = self._ctl

            def one() -> tuple[int, float]:
                d = ctl.lookup_detail(ns, hashes)
                return d.matched, d.fetch_ms

            return self._guard("lookup", ns, one, (0, 0.0))
        return self._guard("lookup", ns, lambda: (self._cluster().lookup(ns, hashes).matched, 0.0), (0, 0.0))

    def _on_nodes(self, op: str, fn: Callable[[KVStoreClient], int]) -> int:
        """fn on the node (its control client), or on every live node of a cluster; a sum, 0 on failure."""
        if self._ctl is not None:
            ctl = self._ctl
            return self._guard(op, "", lambda: fn(ctl), 0)

        def each() -> int:
            cc = self._cluster()
            return sum(cc.call_node(n.node_id, fn) for n in cc.nodes() if n.alive)

        return self._guard(op, "", each, 0)

    def delete(self, ns: str, hashes: Sequence[bytes]) -> int:
        """Delete the pages wherever they are held; returns how many were deleted."""
        return self._control("delete", ns, hashes, lambda c, hs: c.delete(ns, hs).deleted)

    def ping(self) -> bool:
        """True when the remote answers (a node's Stats; a cluster's index lists a live node)."""
        if self._ctl is not None:
            ctl = self._ctl
            return self._guard("ping", "", lambda: ctl.stats() is not None, False)
        return self._guard("ping", "", lambda: any(n.alive for n in self._cluster().nodes()), False)

    def close(self) -> None:
        self._closed = True
        for c in (self._data, self._ctl):
            if c is not None:
                c.close()
        with self._lock:
            clusters, self._clusters = self._clusters, []
        for cc in clusters:
            cc.close()

    # -- helpers

    def _cluster(self) -> ClusterClient:
        """This thread's cluster client."""
        cc = getattr(self._local, "cluster", None)
        if cc is None:
            s = self.settings
            assert s.target.redis_url is not None
            cc = ClusterClient(
                s.target.redis_url,
                local_node=s.local_node,
                timeout=s.timeout,
                security=self.security,
                transport=s.transport,
            )
            self._local.cluster = cc
            with self._lock:
                self._clusters.append(cc)
        return cc

    def _outcome(self, ns: str, hashes: Sequence[bytes], answer: tuple[str | None, PutResult] | None) -> Stored:
        """Per page, what the node that took a Put holds (outcome.held_pages): the Put's counts, and prefix
        Lookups on that node (its control client; a cluster's node by id) only when they fall short."""
        n = len(hashes)
        if answer is None:
            return Stored.failed(n)  # the call failed: logged by _guard
        node, res = answer
        if res.held is not None and len(res.held) == n:  # the node's own per-page answer
            if not all(res.held):
                self._not_kept(ns, n - sum(res.held), n)
            return Stored(tuple(res.held), res.stored)
        reported = res.stored + res.already_present  # an older node: its counts, then Lookups
        if reported >= n:
            return Stored((True,) * n, res.stored)  # the fast path: one comparison

        def held_from(i: int) -> int | None:
            rest = list(hashes[i:])
            if node is None:
                assert self._ctl is not None
                ctl = self._ctl
                return self._guard("lookup", ns, lambda: ctl.lookup(ns, rest), None)
            on_node = node
            cc = self._cluster()
            return self._guard("lookup", ns, lambda: cc.call_node(on_node, lambda c: c.lookup(ns, rest)), None)

        held = held_pages(n, reported, held_from)
        self._not_kept(ns, n - sum(held), n)
        return Stored(tuple(held), min(res.stored, sum(held)))

    def _not_kept(self, ns: str, missing: int, n: int) -> None:
        self.say(
            "not-stored",
            logging.WARNING,
            "%s did not keep %d of %d pages of a store in namespace %r (its full memory tier did not admit them "
            "and it could not write them through to NVMe, or the store outgrew it): the engine is told they failed",
            self.where,
            missing,
            n,
            ns,
        )

    def _control(
        self, op: str, ns: str, hashes: Sequence[bytes], fn: Callable[[KVStoreClient, list[bytes]], int]
    ) -> int:
        """fn(client, hashes) on the node (its control client), or on every node of a cluster holding a
        prefix of them; a count, 0 on failure."""
        if not hashes:
            return 0
        if self._ctl is not None:
            ctl = self._ctl
            return self._guard(op, ns, lambda: fn(ctl, list(hashes)), 0)
        return self._guard(op, ns, lambda: self._on_holders(ns, hashes, fn), 0)

    def _on_holders(self, ns: str, hashes: Sequence[bytes], fn: Callable[[KVStoreClient, list[bytes]], int]) -> int:
        """fn(node client, the hashes it holds) on every node the index lists for a prefix of `hashes`."""
        cc = self._cluster()
        found = cc.lookup(ns, hashes)
        by_node: dict[str, list[bytes]] = {}
        for i, holders in enumerate(found.holders):
            for node in holders:
                by_node.setdefault(node, []).append(hashes[i])
        return sum(cc.call_node(node, lambda c, hs=hs: fn(c, hs)) for node, hs in sorted(by_node.items()))
