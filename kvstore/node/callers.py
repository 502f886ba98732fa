"""Who a request runs as: one resolver for every plane (gRPC, the same-host plane, TCP, UCX).

A caller is resolved in three steps, the same everywhere:
1. `check(method, metadata)`: the bearer token, before anything of the request is read or allocated
   (kvstore/node/limits.py says why); None on a node without tokens;
2. `bind(who, cert_names)`: the tenant of the client's mTLS certificate, where the tenants file binds one
   (kvstore/node/tenancy.py). A plane that carries no certificate (UCX) passes None: a caller whose tenant
   would come from one is refused rather than served as the default tenant;
3. `caller(who)`: the `Caller` a handler works with: the manager in its tenant's scope (the one door every
   namespace passes, kvstore/manager/views.py) and whether it may move pages.

Invariant: a read-only caller never moves pages: `may_move` is False for it, so its Gets are served in
place (no promotion: on a full node a promotion makes room by dropping the coldest page, and reading
must not be a way to evict) and its Prefetches are refused; its Puts never reach the manager (step 1).

A caller also carries what replication needs (DESIGN.md §7.3): the host it reads from (`host`: "" for this
node's host, else its peer address) and the node's heat table, whose reads it feeds; another node (a peer
token) acts for the tenant it names and feeds no heat (a copy is not a read).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

from kvstore.errors import PermissionDenied
from kvstore.manager.core import TierManager
from kvstore.manager.views import TenantView
from kvstore.node.heat import HeatTable
from kvstore.node.tenancy import TenantBinder
from kvstore.scoping import DEFAULT_TENANT
from kvstore.security import Principal, Role, TokenAuthenticator

Metadata = Sequence[tuple[str, str | bytes]] | None


@dataclass(frozen=True, slots=True)
class Caller:
    """A resolved caller: who (None on a node without tokens), the manager in its tenant's scope, the host it
    calls from ("" this node's) and what its reads feed (None: nothing)."""

    principal: Principal | None
    view: TenantView
    host: str = ""
    heat: HeatTable | None = None
    reads: ReadCounters | None = None
    copies: bool = False  # its Gets pull copies (another node): counted apart, never heat

    @property
    def peer(self) -> bool:
        """Another node (a peer token): it may act for any tenant."""
        return self.principal is not None and self.principal.role >= Role.PEER

    @property
    def may_move(self) -> bool:
        """Whether this caller may change where pages live (promote, prefetch): not a read-only one."""
        return self.principal is None or self.principal.role >= Role.WRITE


# The caller of the gRPC call being handled: set by the interceptor in the call's own task context.
CALLER: ContextVar[Caller | None] = ContextVar("kvstore_caller", default=None)


class Callers:
    """The node's caller resolver (see the module docstring); one per node, shared by every plane."""

    def __init__(self, manager: TierManager, auth: TokenAuthenticator | None, binder: TenantBinder | None) -> None:
        self.manager = manager
        self.auth = auth  # None: the node runs without tokens
        self.binder = binder  # None: no tenant is bound to certificates
        self._views: dict[str, TenantView] = {}
        self.heat: HeatTable | None = None  # set where the node replicates by heat (kvstore/replication)
        self.reads = ReadCounters()  # what Gets served, to clients and to other nodes (copies)

    def check(self, method: str, metadata: Metadata) -> Principal | None:
        """The caller, unless its token does not allow `method` (Unauthenticated, PermissionDenied)."""
        return None if self.auth is None else self.auth.check(method, metadata)

    def bind(self, who: Principal | None, cert_names: Iterable[str] | None) -> Principal | None:
        """`who` bound to its certificate's tenant; `cert_names` None: the plane carries no certificate."""
        if self.binder is None:
            return who
        if cert_names is None:
            if who is None or who.tenant is None:
                raise PermissionDenied(
                    "this node binds tenants to client certificates, which this data plane does not carry: "
                    "use a token whose line names its tenant, or another plane"
                )
            return who
        return self.binder.bind(who, cert_names)

    def view(self, tenant: str) -> TenantView:
        """The manager as `tenant`'s callers reach it (one view per tenant, kept)."""
        v = self._views.get(tenant)
        if v is None:
            v = self._views[tenant] = TenantView(self.manager, tenant)
        return v

    def caller(self, who: Principal | None, host: str = "", copies: bool = False) -> Caller:
        """`host`: the caller's host as its plane sees it (addresses.peer_host; "" this node's). `copies`: the call
        says it pulls copies (security.COPY_HEADER); a peer token's calls always do."""
        copies = copies or (who is not None and who.role >= Role.PEER)
        view = self.view(DEFAULT_TENANT if who is None else who.scope)
        return Caller(who, view, host, self.heat, self.reads, copies)

    def authenticate(self, method: str, metadata: Metadata, cert_names: Iterable[str] | None, host: str = "") -> Caller:
        """All three steps at once, for planes that see a request's credentials and its bytes together."""
        return self.caller(self.bind(self.check(method, metadata), cert_names), host)


@dataclass(slots=True)
class ReadCounters:
    """Payload served by Gets: to clients (what a node's load is) and to other nodes (copies)."""

    served_pages: int = 0
    served_bytes: int = 0
    copies_out: int = 0
    copy_bytes_out: int = 0


def current() -> Caller:
    """The caller of the gRPC call being handled (set by the interceptor before the handler runs)."""
    caller = CALLER.get()
    if caller is None:
        raise RuntimeError("no caller: a KVStore handler runs only behind the node's interceptor")
    return caller
