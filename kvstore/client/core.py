"""What both clients do, written once as exchanges (kvstore/transport/exchange.py).

`ClientCore` builds requests, picks the data plane, falls back when a plane cannot serve, and turns
replies into results. `KVStoreClient` and `AsyncKVStoreClient` only drive its exchanges: one performs
each operation on the caller's thread, the other awaits it.

Data planes, in order of preference (`transport`, or KVSTORE_TRANSPORT when not given):
- "auto" (default): shared memory when the node is on this host's loopback and /dev/shm exists, else
  gRPC streams; a plane the node cannot serve is dropped for good after its first PlaneUnavailable;
- "shm": shared memory only (its errors surface); "grpc": gRPC streams only.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.errors import PlaneUnavailable
from kvstore.layout import PageLayout
from kvstore.names import Buffer, TierKind
from kvstore.stats import LookupResult, NodeStats
from kvstore.transport.exchange import DataPlane, Exchange, Unary
from kvstore.transport.grpc_streams import GrpcStreams
from kvstore.transport.shm import shm_available
from kvstore.transport.shm.client import ShmPlane
from kvstore.wire import FetchedPage, stats_from_pb

T = TypeVar("T")

TRANSPORTS = ("auto", "grpc", "shm")
DEFAULT_PAGES_PER_STREAM = 256


@dataclass(slots=True)
class PutResult:
    stored: int
    already_present: int


@dataclass(slots=True)
class PinResult:
    done: int
    skipped: int


def is_loopback(target: str) -> bool:
    """Whether a gRPC target names this host's loopback (so same-host planes can work)."""
    host = target.removeprefix("ipv4:").removeprefix("ipv6:").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def transport_mode(transport: str | None) -> str:
    """The transport asked for: the argument, else KVSTORE_TRANSPORT, else "auto"; validated."""
    mode = (transport or os.environ.get("KVSTORE_TRANSPORT") or "auto").lower()
    if mode not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {mode!r}")
    return mode


def plane_names(target: str, mode: str) -> list[str]:
    """The planes a client tries, most preferred first (see the module docstring)."""
    if mode == "grpc" or (mode == "auto" and not (shm_available() and is_loopback(target))):
        return ["grpc"]
    if not shm_available():
        raise ValueError("transport='shm' needs a writable /dev/shm on this host")
    return ["shm"] if mode == "shm" else ["shm", "grpc"]


class ClientCore:
    """Every client operation as an exchange. Thread-safe: the only shared state is the plane list,
    which is replaced (never mutated) when a plane is given up."""

    def __init__(self, target: str, *, pages_per_stream: int, verify: bool, transport: str | None) -> None:
        self.mode = transport_mode(transport)
        self.pages_per_stream = pages_per_stream
        self.verify = verify
        makers: dict[str, Callable[[], DataPlane]] = {
            "grpc": lambda: GrpcStreams(pages_per_stream, verify),
            "shm": lambda: ShmPlane(pages_per_stream, verify),
        }
        self._planes: tuple[DataPlane, ...] = tuple(makers[n]() for n in plane_names(target, self.mode))

    @property
    def active(self) -> DataPlane:
        """The data plane bulk calls use now."""
        return self._planes[0]

    @property
    def plane(self) -> str:
        return self._planes[0].name

    def close(self) -> None:
        for p in self._planes:
            p.close()

    def _bulk(self, call: Callable[[DataPlane], Exchange[T]]) -> Exchange[T]:
        """Run a bulk exchange on the preferred plane; on PlaneUnavailable give that plane up for good and
        run it on the next one, unless the caller insisted on it (then the error surfaces)."""
        for _ in range(len(self._planes)):
            plane = self._planes[0]
            try:
                return (yield from call(plane))
            except PlaneUnavailable:
                if self.mode == plane.name or len(self._planes) == 1:
                    raise
                if self._planes[0] is plane:  # another thread may have given it up already
                    self._planes = self._planes[1:]
                    plane.close()
        raise AssertionError("unreachable: the last plane re-raises")

    # -- bulk

    def put(self, namespace: str, layout: PageLayout, hashes: Sequence[bytes], pages: Sequence[Buffer],
            target_tier: TierKind | None, parent: bytes | None, chain: bool) -> Exchange[PutResult]:  # fmt: skip
        if len(hashes) != len(pages):
            raise ValueError(f"{len(hashes)} hashes but {len(pages)} pages")
        stored, present = yield from self._bulk(
            lambda p: p.put(namespace, layout, hashes, pages, target_tier, parent, chain))
        return PutResult(stored, present)

    def get_pages(self, namespace: str, hashes: Sequence[bytes], promote: bool) -> Exchange[list[FetchedPage]]:
        if not hashes:
            return []
        return (yield from self._bulk(lambda p: p.get(namespace, hashes, promote)))

    # -- control

    def lookup_detail(self, namespace: str, hashes: Sequence[bytes], prefetch: bool) -> Exchange[LookupResult]:
        r = yield Unary("Lookup", pb.LookupRequest(namespace=namespace, hashes=list(hashes), prefetch=prefetch))
        return LookupResult(r.matched_blocks, [TierKind(t) for t in r.tiers], r.namespace_known)

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

    def stats(self) -> Exchange[NodeStats]:
        return stats_from_pb((yield Unary("Stats", pb.StatsRequest())))
