"""Every exception kvstore raises to a caller, in one tree under `KVStoreError`: catch that one base.

Each class carries the status it travels as: the node's gRPC interceptor (kvstore/node/interceptor.py)
turns it into that gRPC status code, the TCP and UCX planes into an ERROR frame naming it, and a client
turns either back into the same class (`from_status`). Every message names the offending field, so a
caller can fix the request without reading server logs.

Outside this tree, on purpose: configuration errors an engine's door raises while it is built (`MappingError`,
`ConfigError`, `HintError`: ValueErrors, what engines expect of a bad config, each naming its key), the node's
own start-up errors (`NvmeFormatError`, `NvmeSpaceError`: an operator's, never a caller's) and errors a plane
turns into one of these before they leave it (`HeaderError`, `UcxTimeout`, `FrameError`).
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error the cache node reports to a caller."""

    status_name = "INTERNAL"


class InvalidArgument(KVStoreError):
    """Malformed request: the named field is wrong. Nothing was changed."""

    status_name = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class HashContractError(InvalidArgument, ValueError):
    """Input outside the prefix-hash contract (DESIGN.md §3): a malformed namespace, a block size or token id
    out of range, a key that is not 32 bytes. Also a ValueError, as the pure hashing functions' callers expect."""


class NamespaceNotFound(KVStoreError):
    """The node has never stored a page of this namespace."""

    status_name = "NOT_FOUND"

    def __init__(self, namespace: str, where: str = "this node") -> None:
        # NOTE: the raiser names a tenant's namespace as its clients name it (scoping.unscope): a cold miss either way.
        super().__init__(f"namespace: {namespace!r} is not known to {where} (no page was ever put under it)")
        self.namespace = namespace


class SessionNotFound(KVStoreError):
    """A retention call named a session its tenant does not have (never created, ended, expired or displaced)."""

    status_name = "NOT_FOUND"
    PREFIX = "session: "  # how a client tells it from NamespaceNotFound, which travels as the same status

    def __init__(self, session: str) -> None:
        super().__init__(
            f"{self.PREFIX}{session!r} is not a session of this tenant on this node (never retained here, or it "
            "ended, expired or was displaced at the tenant's retention cap)"
        )
        self.session = session


class LayoutMismatch(KVStoreError):
    """A Put's layout differs from the one its namespace is bound to."""

    status_name = "FAILED_PRECONDITION"


class ResourceExhausted(KVStoreError):
    """No free slot and nothing evictable (all pinned, being read or being written)."""

    status_name = "RESOURCE_EXHAUSTED"


class DataLoss(KVStoreError):
    """Bytes did not match their checksum."""

    status_name = "DATA_LOSS"


class Unavailable(KVStoreError):
    """The node is shutting down or a dependency is not reachable."""

    status_name = "UNAVAILABLE"


class IndexUnavailable(Unavailable):
    """The Redis index cannot be reached (down, restarting, or timing out). Nodes keep serving their own
    pages meanwhile; a caller may go to a node it knows directly or retry."""


class IndexFailure(KVStoreError):
    """The index answered with an error: a reply error of Redis (a key of kvstore's of another type, a script
    refused, an out-of-memory Redis). Not a miss: the index is in a state the reader cannot read."""


class Unauthenticated(KVStoreError):
    """No valid credentials on the call (kvstore/security.py)."""

    status_name = "UNAUTHENTICATED"


class PermissionDenied(KVStoreError):
    """Valid credentials, but not for this method (a read-only token on a write)."""

    status_name = "PERMISSION_DENIED"


class PlaneUnavailable(KVStoreError):
    """A bulk data plane cannot be used for this call; the client falls back to gRPC streams (Put/Get)
    unless the caller insisted on that plane."""

    status_name = "UNIMPLEMENTED"


class StreamError(KVStoreError):
    """A transfer broke on its way to this client: framing out of order, a page truncated, or a page whose
    bytes do not match their checksum after crossing the wire. Raised by the client, never sent by a node;
    the data of the call is not handed out."""

    status_name = "DATA_LOSS"


class ProtocolError(StreamError):
    """A peer broke its plane's protocol (a message that does not parse; a wrong magic, version, kind, size or
    sequence): the connection cannot go on and is closed, after an ERROR where the peer can still read one.
    The same-host and UCX planes raise it (the TCP plane's `FrameError` is its counterpart there, an
    InvalidArgument naming the frame's field)."""

    status_name = "INVALID_ARGUMENT"


class PageCorrupt(StreamError):
    """A received page failed its checksum (DESIGN.md §8: the party that receives the bytes verifies them).
    Raised inside a client's data plane with the pages of the batch verified before it (`good`); the client
    turns it into a miss from that page on and reports the page to the node (the Report RPC)."""

    def __init__(self, index: int, page_hash: bytes, good: list[object]) -> None:
        super().__init__(f"page {index}: checksum mismatch after transfer")
        self.index = index
        self.hash = page_hash
        self.good = good


class IncompatibleNode(KVStoreError):
    """The node predates something this client needs (raised by the client, never sent by a node)."""

    status_name = "FAILED_PRECONDITION"


class ReplicationOff(KVStoreError):
    """A node asked to take copies does not make or take copies (replication off, or no index)."""

    status_name = "FAILED_PRECONDITION"


class RemoteError(KVStoreError):
    """A status from the server that maps to no specific class (UNKNOWN, INTERNAL, DEADLINE_EXCEEDED...)."""

    def __init__(self, status_name: str, message: str) -> None:
        super().__init__(f"{status_name}: {message}")
        self.status_name = status_name


_BY_STATUS: dict[str, type[KVStoreError]] = {
    cls.status_name: cls
    for cls in (
        InvalidArgument,
        NamespaceNotFound,
        LayoutMismatch,
        ResourceExhausted,
        DataLoss,
        Unavailable,
        Unauthenticated,
        PermissionDenied,
    )
}


def from_status(status_name: str, message: str) -> KVStoreError:
    """Rebuild, on the client, the exception the server raised (same class, the server's message)."""
    cls = _BY_STATUS.get(status_name)
    if cls is NamespaceNotFound and message.startswith(SessionNotFound.PREFIX):
        cls = SessionNotFound
    if cls is None:
        return RemoteError(status_name, message)
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    if cls is InvalidArgument:
        exc.field = message.split(":", 1)[0]  # type: ignore[attr-defined]
    return exc
