"""The secured cache plane: TLS (optionally mutual) and bearer tokens with two roles.

Server side (`NodeConfig`): `tls_cert_file` + `tls_key_file` turn on TLS; `tls_client_ca_file`
also requires every client to present a certificate signed by that CA (mTLS). `auth_tokens_file`
holds the tokens that may do everything; `auth_read_tokens_file` the tokens that may only read
(Lookup, Get, Report, Stats) and never change where pages live: their Gets are served without
promotion, and Prefetch or Lookup with prefetch need a read-write token. A token file has one
token per line, optionally followed by the name of the tenant it belongs to (kvstore/scoping.py; blank
lines and `#` comments ignored), so a rotation is: add the new token, roll
clients, remove the old one; files are re-read when they change (checked at most once a second), with
no restart.

Client side (`ClientSecurity`): a token and/or the TLS material; `ClientSecurity.from_env()` reads
KVSTORE_TOKEN or KVSTORE_TOKEN_FILE, KVSTORE_TLS_CA, KVSTORE_TLS_CERT, KVSTORE_TLS_KEY and
KVSTORE_TLS_SERVER_NAME, which is how kvctl, the cluster client and the workers pick them up without
flags. The token travels as `authorization: Bearer <token>` metadata on every call.

Status codes (DESIGN.md §8): no token or an unknown one -> UNAUTHENTICATED; a read token on a write
method -> PERMISSION_DENIED; nothing is changed in either case, and the request is not even read
(kvstore/node/limits.py). The grpc health service stays open (load balancers and kubelets probe it
without credentials); reflection is only served when no tokens are configured. Tokens compare in
constant time.

Token files fail closed: a file that is removed, emptied, made unreadable or invalid, or readable by
other users revokes every token of its role until it is fixed; a file readable by others (or by a
group other than the node's own, e.g. mode 0644) is refused at start with a message saying so.

Where a client may send its token (`ClientSecurity.check_target`): over TLS anywhere (the node's
certificate is checked; for an address read from the index, it must name the node id, see
`for_node`); without TLS only to a loopback address the caller gave itself, unless the operator opted
in with KVSTORE_ALLOW_PLAINTEXT_TOKEN=1 (a trusted network, SECURITY.md). Credentials in URLs never
leave the process nor reach a log: `redact_url`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import logging
import os
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import grpc

from kvstore.addresses import is_loopback
from kvstore.errors import PermissionDenied, Unauthenticated
from kvstore.scoping import DEFAULT_TENANT, check_tenant

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
# The tenant a peer (another node) acts for on this call (DESIGN.md §7.3): honoured for peer tokens only.
TENANT_HEADER = "kvstore-tenant"
# A node pulling copies marks its Gets: they feed neither the source's heat nor its served bytes (a marker,
# not a credential: a client that sends it only hides its reads from the heat that would copy them for it).
COPY_HEADER = "kvstore-copy"
# Change what a node holds or where (Prefetch promotes, which on a full node drops the coldest page; Retain holds
# pages, displaces sessions and promotes them; Replicate stores copies).
WRITE_METHODS = frozenset({"Put", "Delete", "Pin", "Unpin", "Prefetch", "Retain", "Replicate"})
RELOAD_EVERY_S = 1.0


_SECRET_QUERY_KEYS = ("pass", "token", "secret", "key")  # query parameters whose values are redacted


class Role(enum.IntEnum):
    READ = 1
    WRITE = 2  # includes read
    PEER = 3  # another node: writes, and acts for any tenant it names (copies, DESIGN.md §7.3)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a call is: its role, a stable, non-secret subject ("token:<16 hex of SHA-256>", or
    "mtls:<certificate name>") and the tenant it is bound to (DESIGN.md §10)."""

    role: Role
    subject: str
    # The tenant the server binds this caller to (kvstore/scoping.py): from its token's line in the token
    # file or from its mTLS subject in the tenants file; None: unbound, i.e. the default tenant.
    tenant: str | None = None

    @property
    def scope(self) -> str:
        """The tenant whose namespaces this caller reaches."""
        return self.tenant or DEFAULT_TENANT


class InsecureChannel(ValueError):
    """A client would send its token where it cannot verify who receives it (see check_target)."""


def redact_url(url: str) -> str:
    """`url` fit for a log, a Stats reply or a terminal: the password of its userinfo and the values of
    password-like query parameters replaced by ***; the user name, host, port and path kept."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if colon else f"***@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, "***" if any(s in k.lower() for s in _SECRET_QUERY_KEYS) else v) for k, v in pairs], safe="*/:"
        )
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def check_private(path: str | os.PathLike[str], st: os.stat_result) -> None:
    """Raise ValueError unless only this user (and at most the process's own group, as Kubernetes'
    fsGroup gives Secret volumes) may access the file: a token readable by others is no secret."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o007 or (mode & 0o070 and st.st_gid != os.getegid()):
        who = "every user" if mode & 0o007 else f"group {st.st_gid}"
        raise ValueError(
            f"{path}: accessible to {who} (mode {mode:04o}); a token file must be private "
            f"to the user that reads it: chmod 600 {path}"
        )


def read_token_entries(path: str | os.PathLike[str]) -> list[tuple[str, str | None]]:
    """(token, tenant or None) per line of a token file: `TOKEN` or `TOKEN TENANT` (the tenant the node
    binds the token's callers to; none: the default tenant), blank lines and # comments skipped. Raises
    ValueError when the file is accessible to other users (check_private), a token is too short to be a
    secret (< 16 characters), a tenant name is invalid, a line has more fields, or there are no tokens."""
    with open(path, "rb") as f:
        check_private(path, os.fstat(f.fileno()))
        text = f.read().decode()
    entries: list[tuple[str, str | None]] = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2 or len(fields[0]) < 16:
            raise ValueError(
                f"{path}:{n}: a line is a token (>= 16 characters without spaces), optionally "
                "followed by its tenant's name"
            )
        tenant = check_tenant(fields[1], f"{path}:{n}: tenant") if len(fields) == 2 else None
        entries.append((fields[0], tenant))
    if not entries:
        raise ValueError(f"{path}: no tokens")
    return entries


def read_token_file(path: str | os.PathLike[str]) -> list[str]:
    """The tokens of a token file (read_token_entries without their tenants)."""
    return [tok for tok, _ in read_token_entries(path)]


class TokenAuthenticator:
    """Maps a call's metadata to a Principal, or raises Unauthenticated. Thread-safe; re-reads its token
    files when they change (checked at most once per RELOAD_EVERY_S). Fails closed: a file that is
    gone, empty, unreadable, invalid or accessible to others revokes every token of its role until it
    is fixed (the error is logged once and kept in `last_error`)."""

    def __init__(self, write_file: str | None, read_file: str | None, peer_file: str | None = None) -> None:
        """`peer_file`: the tokens nodes present to each other (Role.PEER): a peer may name the tenant it acts
        for on each call (TENANT_HEADER), so its token is as powerful as a node: keep it to the nodes."""
        if not write_file and not read_file and not peer_file:
            raise ValueError("TokenAuthenticator needs at least one token file")
        self._files = {Role.WRITE: write_file, Role.READ: read_file, Role.PEER: peer_file}
        self._seen: dict[Role, tuple[int, ...] | None] = {}  # what each file was when last read (None: failed)
        self._tokens: dict[Role, list[tuple[bytes, str | None]]] = {Role.WRITE: [], Role.READ: [], Role.PEER: []}
        self._lock = threading.Lock()
        self._checked = 0.0
        self.last_error: str | None = None
        self._reload(force=True)

    def _reload(self, force: bool = False) -> None:
        for role, path in self._files.items():
            if not path:
                continue
            try:
                st = os.stat(path)
                seen = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode, st.st_uid, st.st_gid)
                if not force and self._seen.get(role) == seen:
                    continue
                tokens = [(t.encode(), tenant) for t, tenant in read_token_entries(path)]
                if role is Role.PEER and any(tenant for _, tenant in tokens):
                    raise ValueError(f"{path}: a peer token acts for every tenant; its line names none")
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                if force:
                    raise ValueError(f"auth token file for {role.name.lower()} access: {exc}") from exc
                if self._seen.get(role) is not None:
                    log.error(
                        "auth token file %s: %s; every %s token is revoked until the file is fixed",
                        path,
                        exc,
                        role.name.lower(),
                    )
                self._tokens[role], self._seen[role] = [], None
                self.last_error = str(exc)
                continue
            self._tokens[role], self._seen[role] = tokens, seen
            self.last_error = None

    def identify(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Principal:
        now = time.monotonic()
        if now - self._checked >= RELOAD_EVERY_S:
            with self._lock:
                if now - self._checked >= RELOAD_EVERY_S:
                    self._checked = now
                    self._reload()
        presented = _bearer(metadata)
        if presented is None:
            raise Unauthenticated(
                "this node requires a token (set KVSTORE_TOKEN or KVSTORE_TOKEN_FILE; "
                "on the wire: 'authorization: Bearer <token>')"
            )
        # Check every token (no early exit), so timing says nothing about which one nearly matched.
        found: tuple[Role, str | None] | None = None
        for r in (Role.PEER, Role.WRITE, Role.READ):
            for tok, tenant in self._tokens[r]:
                if hmac.compare_digest(tok, presented) and found is None:
                    found = (r, tenant)
        if found is None:
            raise Unauthenticated("unknown token")
        role, tenant = found
        if role is Role.PEER:
            tenant = _named_tenant(metadata)
        return Principal(role, "token:" + hashlib.sha256(presented).hexdigest()[:16], tenant)

    def role_of(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Role:
        return self.identify(metadata).role

    def check(self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None) -> Principal:
        """The caller, unless its token does not allow `method` (the short RPC name, e.g. "Put")."""
        who = self.identify(metadata)
        if method in WRITE_METHODS and who.role < Role.WRITE:
            raise PermissionDenied(f"{method} needs a read-write token; this token may only read")
        return who


def _named_tenant(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The tenant a peer's call names (TENANT_HEADER), None when it names none; Unauthenticated when the name is
    not a tenant's (nothing of the call is read)."""
    for key, value in metadata or ():
        if key.lower() == TENANT_HEADER:
            name = value.decode(errors="replace") if isinstance(value, bytes) else value
            try:
                return check_tenant(name, TENANT_HEADER)
            except ValueError as exc:
                raise Unauthenticated(str(exc)) from None
    return None


def marks_copy(metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
    """Whether a call says it pulls copies (COPY_HEADER)."""
    return any(key.lower() == COPY_HEADER for key, _ in metadata or ())


def _bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> bytes | None:
    for key, value in metadata or ():
        if key.lower() == AUTH_HEADER:
            raw = value.encode() if isinstance(value, str) else value
            scheme, _, token = raw.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
    return None


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None) -> grpc.ServerCredentials:
    """TLS credentials for the node; with a client CA, clients must present a certificate it signed."""
    key, cert = Path(key_file).read_bytes(), Path(cert_file).read_bytes()
    ca = Path(client_ca_file).read_bytes() if client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    """What a client presents: a bearer token and/or TLS (roots, optional client certificate), and
    where it may present them (check_target)."""

    token: str | None = None
    ca_file: str | None = None  # PEM roots that signed the node certificates; set -> TLS
    cert_file: str | None = None  # client certificate (mTLS), with key_file
    key_file: str | None = None
    # The name to check in a node's certificate instead of the target host. For nodes found in the
    # index it may hold "{node_id}" (per-node certificates); without it every node must carry this one
    # name (one certificate shared by the cluster's nodes); unset, the node id itself.
    server_name: str | None = None
    allow_plaintext_token: bool = False  # send the token without TLS anywhere: a trusted network only
    node_id: str | None = None  # set by for_node(): the channel goes to this node, at an index address
    acting_for: str | None = None  # a peer's calls on behalf of this tenant (TENANT_HEADER; nodes only)
    copies: bool = False  # the calls pull copies (COPY_HEADER; nodes only)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs both cert_file and key_file")
        if self.cert_file and not self.ca_file:
            raise ValueError("a client certificate needs ca_file too (mTLS runs over TLS)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientSecurity:
        env = os.environ if env is None else env
        token = env.get("KVSTORE_TOKEN") or None
        if token is None and env.get("KVSTORE_TOKEN_FILE"):
            token = read_token_file(env["KVSTORE_TOKEN_FILE"])[0]
        plaintext = env.get("KVSTORE_ALLOW_PLAINTEXT_TOKEN", "").strip().lower() in {"1", "true", "yes", "on"}
        return cls(
            token=token,
            ca_file=env.get("KVSTORE_TLS_CA") or None,
            cert_file=env.get("KVSTORE_TLS_CERT") or None,
            key_file=env.get("KVSTORE_TLS_KEY") or None,
            server_name=env.get("KVSTORE_TLS_SERVER_NAME") or None,
            allow_plaintext_token=plaintext,
        )

    @property
    def tls(self) -> bool:
        return self.ca_file is not None

    def for_node(self, node_id: str) -> ClientSecurity:
        """The security of a channel to `node_id` at an address read from the index. The index is not
        trusted with identities: over TLS the node's certificate must name the node (server_name with
        "{node_id}" filled in, the shared node name, or the node id); without TLS the token goes only
        where the operator allowed plaintext tokens (check_target)."""
        return dataclasses.replace(self, node_id=node_id)

    def expected_name(self) -> str | None:
        """The name a node's certificate must carry on this channel; None: the target's host."""
        if self.node_id is None:
            return None if self.server_name is None or "{node_id}" in self.server_name else self.server_name
        if self.server_name is None:
            return self.node_id
        return self.server_name.replace("{node_id}", self.node_id)

    def check_target(self, target: str | None) -> None:
        """Raise InsecureChannel unless this client may send its token to `target` (None: to addresses
        read from the index): always over TLS, where the certificate proves who answers; without TLS
        only to a loopback target the caller named itself, or anywhere once the operator allowed
        plaintext tokens (allow_plaintext_token, KVSTORE_ALLOW_PLAINTEXT_TOKEN: a trusted network)."""
        if not self.token or self.tls or self.allow_plaintext_token:
            return
        if self.node_id is None and target is not None and is_loopback(target):
            return
        where = target or "node addresses read from the index"
        if self.node_id is not None:
            where = f"{target} (node {self.node_id!r} as the index lists it)"
        raise InsecureChannel(
            f"refusing to send the token in clear to {where}: nothing proves who answers there. Use TLS "
            "(KVSTORE_TLS_CA; node certificates naming their node ids), or on a trusted network set "
            "KVSTORE_ALLOW_PLAINTEXT_TOKEN=1 (see SECURITY.md)"
        )

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        md: tuple[tuple[str, str], ...] = ((AUTH_HEADER, f"Bearer {self.token}"),) if self.token else ()
        if self.acting_for is not None:
            md += ((TENANT_HEADER, self.acting_for),)
        if self.copies:
            md += ((COPY_HEADER, "1"),)
        return md or None

    def channel_options(self) -> list[tuple[str, str]]:
        name = self.expected_name() if self.tls else None
        return [("grpc.ssl_target_name_override", name)] if name else []

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        assert self.ca_file is not None
        ca = Path(self.ca_file).read_bytes()
        key = Path(self.key_file).read_bytes() if self.key_file else None
        cert = Path(self.cert_file).read_bytes() if self.cert_file else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
