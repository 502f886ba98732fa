"""The manager as one tenant's callers reach it (DESIGN.md §10): the one door every plane goes through.

`TenantView` validates a caller's namespace as a client's (no control characters, so no client can name a
scope) and scopes it to the caller's tenant (kvstore/scoping.py) before the manager sees it. Below it the
manager knows tenants only as part of the namespace string, which is also what NVMe page headers and
index keys carry, so recovery and the index keep tenancy without anything extra.

A cross-tenant miss (the page exists, but only in another tenant's scope) is answered exactly as the cold
miss it is for the caller: the request path only notes the miss (one append, whatever the cache holds) and
the ledger checks it later, off the path (kvstore/manager/ledger.py). The figure is the operator's: Stats
shows it to the default tenant only, and a tenant's own row carries 0 (a count a tenant could read would
tell it, one guess at a time, what another tenant caches). The default tenant's own misses are not
counted, so the operator's figure is not an oracle for its own calls either.

Above the manager (it takes a TierManager); the node builds one view per tenant (kvstore/node/callers.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from kvstore.errors import InvalidArgument, NamespaceNotFound
from kvstore.hashing import validate_namespace
from kvstore.layout import PageLayout
from kvstore.manager.core import TierManager
from kvstore.manager.ledger import TenantCounters
from kvstore.manager.put import PutTxn
from kvstore.manager.reads import ReadLease
from kvstore.manager.retention import RetainCall
from kvstore.names import RetainMode, RetainOp, TierKind
from kvstore.scoping import DEFAULT_TENANT, scope, split
from kvstore.stats import LookupResult, NodeStats, ReportResult, RetainResult, RetentionStats
from kvstore.wire import PutOpen

_MAX_REMEMBERED = 1024  # client namespaces a view remembers as valid (beyond, each call validates again)


class TenantView:
    """The manager as the callers of one tenant reach it: the same calls, with client namespaces."""

    __slots__ = ("_scoped", "counters", "manager", "tenant")

    def __init__(self, manager: TierManager, tenant: str) -> None:
        self.manager = manager
        self.tenant = tenant
        self.counters: TenantCounters = manager.tenants.counters_of(tenant)
        self._scoped: dict[str, str] = {}  # valid client namespaces seen -> stored ones (bounded)

    def ns(self, namespace: str) -> str:
        """The stored namespace of a client's `namespace`; InvalidArgument unless it is a valid one."""
        scoped = self._scoped.get(namespace)
        if scoped is not None:
            return scoped
        validate_namespace(namespace)  # HashContractError: an InvalidArgument naming the field
        scoped = scope(namespace, self.tenant)
        if len(self._scoped) < _MAX_REMEMBERED:
            self._scoped[namespace] = scoped
        return scoped

    def lookup(self, namespace: str, hashes: list[bytes], prefetch: bool = False) -> LookupResult:
        res = self.manager.lookup(self.ns(namespace), hashes, prefetch)
        c = self.counters
        c.lookups += 1
        c.lookup_blocks += len(hashes)
        c.lookup_matched += res.matched
        if res.matched < len(hashes):
            self._missed(namespace, hashes[res.matched])
        return res

    def begin_put(self, op: PutOpen) -> PutTxn:
        return self.manager.begin_put(replace(op, namespace=self.ns(op.namespace)))

    def get(
        self,
        namespace: str,
        hashes: list[bytes],
        *,
        promote: bool = True,
        into: Sequence[memoryview] | None = None,
        receiver_verifies: bool = False,
        expect: PageLayout | None = None,
    ) -> AsyncIterator[ReadLease]:
        """TierManager.get in this tenant's scope (arguments checked now, before the first page)."""
        try:
            leases = self.manager.get(
                self.ns(namespace),
                hashes,
                promote=promote,
                into=into,
                receiver_verifies=receiver_verifies,
                expect=expect,
            )
        except NamespaceNotFound:  # cold for this tenant: refused, and counted only if another tenant has it
            if hashes:
                self._missed(namespace, hashes[0])
            raise
        return self._counted(leases, namespace, hashes)

    async def _counted(
        self, leases: AsyncIterator[ReadLease], namespace: str, hashes: list[bytes]
    ) -> AsyncIterator[ReadLease]:
        served = 0
        try:
            async for lease in leases:
                served += 1
                yield lease
        finally:
            await leases.aclose()  # type: ignore[attr-defined]
        # Only a Get that ran to its end counts (a caller may stop early, e.g. a full shm window).
        self.counters.get_pages += len(hashes)
        self.counters.get_served += served
        if served < len(hashes):
            self._missed(namespace, hashes[served])

    def _missed(self, namespace: str, h: bytes) -> None:
        """Note a miss for the cross-tenant check, which runs later, off the request path (ledger.settle)."""
        if self.tenant != DEFAULT_TENANT:
            self.manager.tenants.note_miss(namespace, h, self.tenant)

    async def report_corrupt(
        self, namespace: str, hashes: list[bytes], allow: Callable[[int], int] | None = None
    ) -> ReportResult:
        return await self.manager.report_corrupt(self.ns(namespace), hashes, allow)

    async def delete(self, namespace: str, hashes: list[bytes]) -> tuple[int, int, int]:
        return await self.manager.delete(self.ns(namespace), hashes)

    def pin(self, namespace: str, hashes: list[bytes], ttl_seconds: float = 0.0) -> tuple[int, int]:
        return self.manager.pin(self.ns(namespace), hashes, ttl_seconds)

    def unpin(self, namespace: str, hashes: list[bytes]) -> tuple[int, int]:
        return self.manager.unpin(self.ns(namespace), hashes)

    def prefetch(self, namespace: str, hashes: list[bytes], target: TierKind = TierKind.DRAM) -> tuple[int, int, int]:
        return self.manager.prefetch(self.ns(namespace), hashes, target)

    def retain(
        self,
        session: str,
        op: RetainOp,
        namespace: str,
        hashes: list[bytes],
        *,
        ttl_seconds: float | None = None,
        priority: int | None = None,
        mode: RetainMode | None = None,
    ) -> RetainResult:
        """A Retain call in this tenant's scope: its session is this tenant's (another tenant's of the same name
        is a different session), and its hashes name this tenant's pages only: a page another tenant holds is,
        for this one, not stored (pending), exactly as a cross-tenant lookup is a cold miss."""
        if hashes and not namespace:
            raise InvalidArgument("namespace", "hashes name pages of a namespace: give it")
        ns = self.ns(namespace) if hashes else ""
        call = RetainCall(session, op, [(ns, h) for h in hashes], ttl_seconds, priority, mode)
        return self.manager.retain(self.tenant, call)

    def layout_of(self, namespace: str, first: bytes | None = None) -> PageLayout:
        """The namespace's layout. `first`: the hash a Get that asks this will start at, so a namespace cold
        for this tenant is answered, and counted, exactly as that Get's refusal would be."""
        try:
            return self.manager.layout_of(self.ns(namespace))
        except NamespaceNotFound:
            if first is not None:
                self._missed(namespace, first)
            raise

    def stats(self) -> NodeStats:
        """The node's Stats as this tenant may see them: its own namespaces (as it names them) and its
        own tenant row, without the cross-tenant figure, and none of the node's corruption and scrub counters
        (they count other tenants' pages too); the default tenant (the operator's) sees every tenant's row,
        cross-tenant misses included, and those counters."""
        stats = self.manager.stats()
        stats.namespaces = [
            (name, layout, n) for ns, layout, n in stats.namespaces for t, name in [split(ns)] if t == self.tenant
        ]
        if self.tenant != DEFAULT_TENANT:
            stats.tenants = [replace(t, cross_tenant_misses=0) for t in stats.tenants if t.tenant == self.tenant]
            stats.corrupt_reports = stats.corrupt_confirmed = stats.scrubbed_bytes = 0
            stats.corrupt_unconfirmed = stats.corrupt_unchecked = 0
            stats.retention = RetentionStats()  # every tenant's: its own is in its row
        return stats
