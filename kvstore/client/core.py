"""What both clients do, written once as exchanges (kvstore/client/exchange.py).

`ClientCore` builds requests, picks the data plane, falls back when a plane cannot serve, and turns
replies into results. `KVStoreClient` and `AsyncKVStoreClient` only drive its exchanges: one performs
each operation on the caller's thread, the other awaits it.

Data planes (`transport`, or KVSTORE_TRANSPORT when not given): "auto" (default) negotiates the fastest
plane both ends have (kvstore/client/planes/choice.py) and drops a plane after a PlaneUnavailable, down to
gRPC streams, then negotiates again after PLANE_RETRY_SECONDS (doubling while the plane keeps refusing, up
to PLANE_RETRY_MAX_SECONDS), so a client comes back to the fast plane after a node restart (a new plane
port) or once a full plane has room; "shm", "tcp", "ucx", "grpc" use that plane only (errors surface, and
the next call negotiates again). A new plane is one entry in PLANES.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.addresses import host_id, is_loopback
from kvstore.client.bundles import Parts, Regions, check_bundle_layout, gather, part_regions, region_views, scatter
from kvstore.client.exchange import Exchange, Unary
from kvstore.client.planes.base import DataPlane, PutResult
from kvstore.client.planes.buffers import check_buffers
from kvstore.client.planes.choice import TRANSPORTS, choose_planes
from kvstore.client.planes.pool import ReceivePool
from kvstore.client.planes.segments import SharedBuffer, SharedBuffers, Staging
from kvstore.client.planes.shm import ShmPlane, plane_path, plane_uid
from kvstore.client.planes.streams import GrpcStreams
from kvstore.client.planes.tcp import TcpPlane
from kvstore.client.planes.ucx import UcxPlane
from kvstore.errors import IncompatibleNode, InvalidArgument, PlaneUnavailable, Unavailable
from kvstore.layout import PageLayout
from kvstore.names import Buffer, RetainMode, RetainOp, TierKind
from kvstore.security import ClientSecurity, InsecureChannel
from kvstore.stats import LookupResult, NodeStats, PlaneInfo, RetainResult
from kvstore.wire import PutOpen, check_replicas
from kvstore.wire.answers import lookup_from_pb, plane_from_pb, retain_result_from_pb, stats_from_pb
from kvstore.wire.shm import shm_available
from kvstore.wire.streams import FetchedPage, PageRef, layout_to_pb
from kvstore.wire.ucx import ADDRESS_SEP as UCX_ADDRESS_SEP
from kvstore.wire.ucx import ucxx_installed

T = TypeVar("T")

DEFAULT_PAGES_PER_CALL = 256
PLANE_RETRY_SECONDS = 2.0  # after a plane refused a call, negotiate again this much later (transport "auto")...
PLANE_RETRY_MAX_SECONDS = 60.0  # ...doubling while it keeps refusing, up to this
# A plane that refuses after this share of the call's timeout is a node that does not answer, not a plane it
# lacks: the call ends there instead of starting the wait over on the next plane (one deadline per call).
FALLBACK_SHARE = 0.5


@dataclass(slots=True)
class PinResult:
    done: int
    skipped: int


@dataclass(slots=True)
class ReplicateResult:
    """What a node did with a Replicate: pages copied, held already, refused (no room), failed (not served,
    or damaged on arrival)."""

    copied: int
    already_present: int
    refused: int
    failed: int


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """What a data plane's client side may need to know of its client."""

    target: str
    pages_per_call: int
    verify: bool
    security: ClientSecurity
    timeout: float
    buffers: SharedBuffers = field(default_factory=SharedBuffers)  # this client's registered staging memory
    received: ReceivePool = field(init=False)  # where a plain get's pages land: pooled blocks of `buffers`

    def __post_init__(self) -> None:
        if isinstance(self.pages_per_call, bool) or not isinstance(self.pages_per_call, int) or self.pages_per_call < 1:
            raise ValueError(f"pages_per_call must be an integer >= 1, got {self.pages_per_call!r}")
        object.__setattr__(self, "received", ReceivePool(self.buffers))


@dataclass(frozen=True, slots=True)
class PlaneSpec:
    """A data plane a client can speak: how to open it (given what the node advertised), and whether
    this process can at all (a library or an OS feature may be missing)."""

    make: Callable[[ClientSettings, PlaneInfo | None], DataPlane]
    usable: Callable[[], bool] = lambda: True


def _ucx_plane(s: ClientSettings, info: PlaneInfo | None) -> DataPlane:
    """UCX carries the token in clear: only to an advertised address this client may send it to."""
    if info is not None and s.security.token:
        try:
            s.security.check_target(info.address.partition(UCX_ADDRESS_SEP)[0])
        except InsecureChannel as exc:
            raise PlaneUnavailable(f"ucx: {exc}") from None
    return UcxPlane(
        s.pages_per_call,
        verify=s.verify,
        timeout=s.timeout,
        token=s.security.token,
        tls=s.security.tls,
        info=info,
        received=s.received,
    )


PLANES: dict[str, PlaneSpec] = {
    "grpc": PlaneSpec(lambda s, _: GrpcStreams(s.pages_per_call, s.verify, s.received)),
    "shm": PlaneSpec(
        lambda s, info: ShmPlane(
            plane_path(info.address if info is not None else ""),
            s.pages_per_call,
            buffers=s.buffers,
            received=s.received,
            token=s.security.token,
            timeout=s.timeout,
            uid=plane_uid(info.uid if info is not None else None),
        ),
        usable=shm_available,
    ),
    "tcp": PlaneSpec(
        lambda s, info: TcpPlane(
            info,
            target=s.target,
            pages_per_call=s.pages_per_call,
            verify=s.verify,
            security=s.security,
            timeout=s.timeout,
            received=s.received,
        )
    ),
    "ucx": PlaneSpec(_ucx_plane, usable=ucxx_installed),
}


def resolve_transport(transport: str | None) -> str:
    """The transport asked for: the argument, else KVSTORE_TRANSPORT, else "auto"; validated."""
    chosen = (transport or os.environ.get("KVSTORE_TRANSPORT") or "auto").lower()
    if chosen not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {chosen!r}")
    return chosen


def check_node(stats: pb.StatsResponse, target: str) -> None:
    """IncompatibleNode unless the node speaks what this client needs: keyed checksums (ChecksumForm.KEYED),
    which bind every page to its namespace and key (an older node would fail every page this client checks,
    and refuse every page it puts). Upgrade nodes before their clients."""
    if stats.checksum_form < pb.CHECKSUM_FORM_KEYED:
        version = stats.version or "an older release"
        raise IncompatibleNode(
            f"the node at {target} ({version}) predates keyed page checksums, which this client needs: "
            "upgrade the node (nodes serve older clients; older nodes cannot serve this one)"
        )


def put_open(
    namespace: str,
    layout: PageLayout,
    *,
    target_tier: TierKind | None,
    parent: bytes | None,
    chain: bool,
    replicas: int,
) -> PutOpen:
    """The opening of a client's put from its public arguments; `replicas` is checked here (InvalidArgument naming
    it), before anything is sent."""
    return PutOpen(namespace, layout, target_tier, parent, chain, replicas=check_replicas(replicas, "replicas"))


def usable_planes() -> set[str]:
    """The planes this process can speak."""
    return {name for name, spec in PLANES.items() if spec.usable()}


class ClientCore:
    """Every client operation as an exchange. Thread-safe: the only shared state is the plane list,
    which is set once (negotiated) and then only replaced, never mutated, when a plane is given up.

    Negotiation: the first bulk call reads the node's Stats once (that it speaks what this client needs, the
    page count one request may name, and, unless transport is "grpc", its advertised planes and host id, to pick
    by `choose_planes`). Stats are read again when a dropped plane's retry is due, after the node did not
    answer a call (it may be a new process), and after it refused one (InvalidArgument: its page-count limit
    may have shrunk).
    """

    def __init__(self, settings: ClientSettings, transport: str | None) -> None:
        self.settings = settings
        self._staging = Staging(settings.buffers)
        self.transport = resolve_transport(transport)
        self._node_checked = False  # the node's Stats said it speaks what this client needs (check_node)
        self._node_pages: int | None = None  # the node's max_pages_per_request, as its Stats last said (None: unsaid)
        self._planes: tuple[DataPlane, ...] | None = None
        self._retry_at: float | None = None  # when to negotiate again after a plane was dropped
        self._retry_wait = PLANE_RETRY_SECONDS
        self._retired_corrupt = 0  # corrupt_pages of planes given up
        if self.transport == "shm" and not shm_available():
            raise ValueError("transport='shm' needs memfd_create and Unix sockets (Linux)")
        if self.transport == "grpc":
            self._planes = (PLANES[self.transport].make(settings, None),)

    @property
    def active(self) -> DataPlane | None:
        """The data plane bulk calls use now; None before the first bulk call negotiated one."""
        return self._planes[0] if self._planes else None

    @property
    def plane(self) -> str | None:
        return self._planes[0].name if self._planes else None

    @property
    def corrupt_pages(self) -> int:
        """Pages that failed their checksum on arrival (each a miss for its call, reported to the node)."""
        return self._retired_corrupt + sum(p.corrupt_pages for p in self._planes or ())

    def close(self) -> None:
        for p in self._planes or ():
            p.close()
        self._staging.close()
        self.settings.buffers.close()
        self.settings.received.close()

    def shared_buffer(self, nbytes: int) -> SharedBuffer:
        """Registered staging memory for zero-copy get_into/put_from (see SharedBuffer)."""
        return self.settings.buffers.allocate(nbytes)

    def _negotiate(self) -> Exchange[tuple[DataPlane, ...]]:
        """The planes to use, asking the node what it serves: once, and again when a dropped plane's retry
        is due (then the new planes replace the old ones, which are closed)."""
        current, retry_at = self._planes, self._retry_at
        settled = current is not None and (retry_at is None or time.monotonic() < retry_at)
        if settled and self._node_checked:
            return current
        stats = yield from self._check_node()
        if settled:  # only the node needed checking (transport "grpc", or again after the node failed a call)
            return current
        self._retry_at = None
        known = bool(stats.host_id)  # a node that predates advertising planes sends no host id
        advertised = {p.name: plane_from_pb(p) for p in stats.planes} if known else None
        # NOTE: the node's host id decides where it says one (equal for every process of a kernel, so a loopback
        # target always matches); KVSTORE_HOST_ID lets tests play several hosts on one machine (addresses.py).
        same_host = stats.host_id == host_id() if known else is_loopback(self.settings.target)
        names = choose_planes(self.transport, same_host=same_host, advertised=advertised, client_can=usable_planes())
        planes = tuple(p for n in names if (p := self._make(n, (advertised or {}).get(n))) is not None)
        for p in planes:
            p.node_pages = self._node_pages
        if self._planes is current:
            self._planes = planes
            for p in current or ():
                self._retired_corrupt += p.corrupt_pages
                p.close()
        else:  # another thread negotiated meanwhile: keep its planes
            for p in planes:
                p.close()
        return self._planes  # type: ignore[return-value]

    def _check_node(self) -> Exchange[pb.StatsResponse]:
        """Read the node's Stats: check that it speaks what this client needs (`check_node`) and learn the page
        count one of its requests may name (`max_pages_per_request`, 0 from a node that does not say it), which
        every plane's batches are cut to fit from now on (`DataPlane.call_pages`)."""
        stats: pb.StatsResponse = yield Unary("Stats", pb.StatsRequest())
        check_node(stats, self.settings.target)
        self._node_checked = True
        self._node_pages = stats.max_pages_per_request or None
        for p in self._planes or ():
            p.node_pages = self._node_pages
        return stats

    def _on_plane(self, plane: DataPlane, call: Callable[[DataPlane], Exchange[T]]) -> Exchange[T]:
        """`call(plane)`, and once more if the node refused it (InvalidArgument) and its Stats, read again, now
        say it takes fewer pages per request than the call was cut into (a node restarted with a smaller
        max_pages_per_request while this client was idle). NOTE: a call's first batch is its largest, so a
        refused page count is refused there, before anything was stored or returned: the retry repeats nothing."""
        cut = plane.call_pages
        try:
            return (yield from call(plane))
        except InvalidArgument:
            yield from self._check_node()
            if plane.call_pages >= cut:
                raise
        return (yield from call(plane))

    def _make(self, name: str, info: PlaneInfo | None) -> DataPlane | None:
        """A plane's client side; None when it refuses to open (PlaneUnavailable) and the caller did not
        insist on it (transport "auto": the next plane serves)."""
        try:
            return PLANES[name].make(self.settings, info)
        except PlaneUnavailable:
            if self.transport == name:
                raise
            return None

    def _bulk(self, call: Callable[[DataPlane], Exchange[T]]) -> Exchange[T]:
        """Run a bulk exchange on the preferred plane; on PlaneUnavailable give that plane up (until the
        next negotiation, see the module docstring) and run it on the next one, unless the caller insisted
        on it (then the error surfaces, and the next call negotiates again).

        One deadline for the call, across planes: a plane that refused only after FALLBACK_SHARE of the
        timeout had passed (a node that does not answer, rather than a plane it does not serve) is not
        followed by the next plane, which would start the wait over: the call fails as Unavailable."""
        started = time.monotonic()
        planes = yield from self._negotiate()
        for _ in range(len(planes)):
            planes = self._planes or planes
            plane = planes[0]
            try:
                result = yield from self._on_plane(plane, call)
            except Unavailable:
                # NOTE: a node that did not answer may come back as a new process (another page-count limit):
                # the next call reads its Stats again before it cuts its batches.
                self._node_checked = False
                raise
            except PlaneUnavailable as exc:
                waited = time.monotonic() - started
                insisted = self.transport == plane.name
                if waited >= FALLBACK_SHARE * self.settings.timeout and len(planes) > 1 and not insisted:
                    raise Unavailable(
                        f"the node at {self.settings.target} did not answer within {waited:.1f} s "
                        f"({plane.name} plane: {exc}); not trying slower planes past the call's deadline"
                    ) from None
                if insisted or len(planes) == 1:
                    if self.transport != "grpc":  # the node may have moved its plane (a restart)
                        self._retry_at = time.monotonic()
                    raise
                if self._planes is not None and self._planes[0] is plane:  # another thread may have already
                    self._planes = self._planes[1:]
                    self._retired_corrupt += plane.corrupt_pages
                    plane.close()
                    self._retry_at = time.monotonic() + self._retry_wait
                    self._retry_wait = min(self._retry_wait * 2, PLANE_RETRY_MAX_SECONDS)
                continue
            if len(planes) > 1:  # a faster plane than the last resort served: back to the short retry
                self._retry_wait = PLANE_RETRY_SECONDS
            return result
        raise AssertionError("unreachable: the last plane re-raises")

    # -- bulk

    def put(self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[Buffer]) -> Exchange[PutResult]:
        if len(hashes) != len(pages):
            raise ValueError(f"{len(hashes)} hashes but {len(pages)} pages")
        return (yield from self._bulk(lambda p: p.put(op, hashes, pages)))

    def get_pages(
        self, namespace: str, hashes: Sequence[bytes], promote: bool, expect: PageLayout | None = None
    ) -> Exchange[list[FetchedPage]]:
        """Pages of the longest stored prefix; `expect`: the layout the caller reads them as (checked by the node
        against the namespace's before any page: LayoutMismatch naming the difference)."""
        if not hashes:
            return []
        return (yield from self._bulk(lambda p: p.get(namespace, hashes, promote, expect)))

    def get(self, namespace: str, hashes: Sequence[bytes], promote: bool) -> Exchange[list[memoryview]]:
        """`get_pages`' payloads alone."""
        return [memoryview(p.data) for p in (yield from self.get_pages(namespace, hashes, promote))]

    def get_into(
        self, namespace: str, hashes: Sequence[bytes], buffers: Sequence[Buffer], promote: bool
    ) -> Exchange[list[PageRef]]:
        """Pages of the longest stored prefix written into `buffers` (one per hash, writable, contiguous,
        not overlapping: checked before anything is sent). On the same-host plane the node writes straight
        into buffers that lie in this client's shared buffers (`shared_buffer`); other memory, and every
        other plane, costs one copy more at most."""
        check_buffers(buffers, len(hashes), writable=True)
        if not hashes:
            return []
        return (yield from self._bulk(lambda p: p.get_into(namespace, hashes, buffers, promote)))

    def put_from(self, op: PutOpen, hashes: Sequence[bytes], buffers: Sequence[Buffer]) -> Exchange[PutResult]:
        """Put pages that lie in `buffers` (one per hash, each exactly a page of op.layout: checked first)."""
        check_buffers(buffers, len(hashes), writable=False, nbytes=op.layout.page_bytes)
        if not hashes:
            return PutResult(0, 0, [])
        return (yield from self._bulk(lambda p: p.put_from(op, hashes, buffers)))

    # -- bundles (multi-part pages: DESIGN.md §4.3, kvstore/client/bundles.py)

    def put_bundle(self, op: PutOpen, hashes: Sequence[bytes], pages: Sequence[Parts]) -> Exchange[PutResult]:
        """Store multi-part pages (`op.layout` a bundle with named parts; pages[i] maps each part name to its
        buffer or regions), each page, every part of it, atomically or not at all. A plane that `scatters` (TCP)
        sends the parts straight from their regions; on the others each page is gathered into one page of
        registered staging memory (the one copy) and put from there."""
        regions = part_regions(op.layout, pages, writable=False)
        if len(hashes) != len(pages):
            raise ValueError(f"{len(hashes)} hashes but {len(pages)} pages")
        if not hashes:
            return PutResult(0, 0, [])

        def on(p: DataPlane) -> Exchange[PutResult]:
            if p.scatters:
                return p.put_regions(op, hashes, [region_views(page) for page in regions])
            return self._put_staged(p, op, hashes, regions)

        return (yield from self._bulk(on))

    def _put_staged(
        self, plane: DataPlane, op: PutOpen, hashes: Sequence[bytes], regions: list[list[Regions]]
    ) -> Exchange[PutResult]:
        staging = self._staging.take(op.layout.page_bytes, len(hashes))
        try:
            views = staging.pages(op.layout.page_bytes, len(hashes))
            for page, view in zip(regions, views, strict=True):
                gather(page, view)
            result = yield from plane.put_from(op, hashes, views)
        except BaseException:
            staging.close()  # NOTE: memory lent to a call that failed is never reused (DESIGN.md §8.4)
            raise
        self._staging.give(staging)
        return result

    def get_bundle(
        self, namespace: str, layout: PageLayout, hashes: Sequence[bytes], promote: bool
    ) -> Exchange[list[dict[str, memoryview]]]:
        """Multi-part pages of the longest stored prefix, each as views of its parts (no copy: they lie in
        the page's received bytes); the node checks `layout` against the namespace's first."""
        check_bundle_layout(layout)
        pages = yield from self.get_pages(namespace, hashes, promote, layout)
        return [layout.split(p.data) for p in pages]

    def get_bundle_into(
        self, namespace: str, layout: PageLayout, hashes: Sequence[bytes], pages: Sequence[Parts], promote: bool
    ) -> Exchange[list[PageRef]]:
        """Multi-part pages of the longest stored prefix, each part into the caller's buffer(s) for it (pages[i]
        [name]: checked before anything is sent). A plane that `scatters` (TCP) receives each part straight into
        its regions; on the others the page lands once (verified, in the receive pool; on the same host the node
        writes it there) and its parts are copied out: one copy."""
        regions = part_regions(layout, pages, writable=True)
        if len(hashes) != len(pages):
            raise ValueError(f"{len(hashes)} hashes but {len(pages)} pages")
        if not hashes:
            return []

        def on(p: DataPlane) -> Exchange[list[PageRef]]:
            if p.scatters:
                return p.get_regions(namespace, hashes, [region_views(page) for page in regions], promote, layout)
            return self._get_copied(p, namespace, layout, hashes, regions, promote=promote)

        return (yield from self._bulk(on))

    @staticmethod
    def _get_copied(
        plane: DataPlane,
        namespace: str,
        layout: PageLayout,
        hashes: Sequence[bytes],
        regions: list[list[Regions]],
        *,
        promote: bool,
    ) -> Exchange[list[PageRef]]:
        got = yield from plane.get(namespace, hashes, promote, layout)
        out = []
        for page, parts in zip(got, regions, strict=False):
            scatter(memoryview(page.data), parts)
            out.append(PageRef(page.hash, page.tier, len(page.data)))
        return out

    # -- control

    def lookup_detail(self, namespace: str, hashes: Sequence[bytes], prefetch: bool) -> Exchange[LookupResult]:
        r = yield Unary("Lookup", pb.LookupRequest(namespace=namespace, hashes=list(hashes), prefetch=prefetch))
        return lookup_from_pb(r)

    def lookup(self, namespace: str, hashes: Sequence[bytes], prefetch: bool) -> Exchange[int]:
        """Blocks of the longest stored prefix (`lookup_detail`'s `matched`)."""
        return (yield from self.lookup_detail(namespace, hashes, prefetch)).matched

    def retain(
        self,
        session: str,
        op: RetainOp,
        namespace: str = "",
        hashes: Sequence[bytes] = (),
        *,
        ttl_seconds: float | None = None,
        priority: int | None = None,
        mode: RetainMode | None = None,
    ) -> Exchange[RetainResult]:
        """One Retain call (DESIGN.md §6.5); None leaves a field unset (the session keeps what it had)."""
        req = pb.RetainRequest(
            session=session,
            op=int(op),
            namespace=namespace,
            hashes=list(hashes),
            mode=0 if mode is None else int(mode),
        )
        if ttl_seconds is not None:
            req.ttl_seconds = ttl_seconds
        if priority is not None:
            if (
                not -(2**31) <= priority < 2**31
            ):  # NOTE: the wire field is an int32: say so here, not as an encode error
                raise InvalidArgument("priority", f"must be an integer in [0, 100], got {priority}")
            req.priority = priority
        return retain_result_from_pb((yield Unary("Retain", req)))

    def delete(self, namespace: str, hashes: Sequence[bytes]) -> Exchange[pb.DeleteResponse]:
        return (yield Unary("Delete", pb.DeleteRequest(namespace=namespace, hashes=list(hashes))))

    def pin(self, namespace: str, hashes: Sequence[bytes], ttl_seconds: float) -> Exchange[PinResult]:
        r = yield Unary("Pin", pb.PinRequest(namespace=namespace, hashes=list(hashes), ttl_seconds=ttl_seconds))
        return PinResult(r.pinned, r.not_found)

    def unpin(self, namespace: str, hashes: Sequence[bytes]) -> Exchange[PinResult]:
        r = yield Unary("Unpin", pb.UnpinRequest(namespace=namespace, hashes=list(hashes)))
        return PinResult(r.unpinned, r.not_pinned)

    def prefetch(self, namespace: str, hashes: Sequence[bytes], target_tier: TierKind) -> Exchange[pb.PrefetchResponse]:
        req = pb.PrefetchRequest(namespace=namespace, hashes=list(hashes), target_tier=int(target_tier))
        return (yield Unary("Prefetch", req))

    def report_corrupt(self, namespace: str, hashes: Sequence[bytes]) -> Exchange[pb.ReportResponse]:
        """Tell the node these pages arrived damaged (the planes do it by themselves on a checksum miss)."""
        return (yield Unary("Report", pb.ReportRequest(namespace=namespace, hashes=list(hashes))))

    def stats(self) -> Exchange[NodeStats]:
        return stats_from_pb((yield Unary("Stats", pb.StatsRequest())))

    def replicate(
        self, namespace: str, hashes: Sequence[bytes], source: str, layout: PageLayout | None, replicas: int
    ) -> Exchange[ReplicateResult]:
        """Have the node pull copies of these pages from node `source` (DESIGN.md §7.3)."""
        req = pb.ReplicateRequest(
            namespace=namespace,
            hashes=list(hashes),
            source=source,
            layout=layout_to_pb(layout) if layout is not None else None,
            replicas=replicas,
        )
        r = yield Unary("Replicate", req)
        return ReplicateResult(r.copied, r.already_present, r.refused, r.failed)
