"""The secured cache plane: TLS (optionally mutual) and bearer tokens with two roles.

Server side (`NodeConfig`): `tls_cert_file` + `tls_key_file` turn on TLS; `tls_client_ca_file`
also requires every client to present a certificate signed by that CA (mTLS). `auth_tokens_file`
holds the tokens that may do everything; `auth_read_tokens_file` the tokens that may only read
(Lookup, Get, GetShm, Prefetch, Stats). A token file has one token per line (blank lines and `#` comments
ignored), so a rotation is: add the new token, roll clients, remove the old one; files are re-read
when they change (checked at most once a second), with no restart.

Client side (`ClientSecurity`): a token and/or the TLS material; `ClientSecurity.from_env()` reads
KVSTORE_TOKEN or KVSTORE_TOKEN_FILE, KVSTORE_TLS_CA, KVSTORE_TLS_CERT, KVSTORE_TLS_KEY and
KVSTORE_TLS_SERVER_NAME, which is how kvctl, the cluster client and the workers pick them up without
flags. The token travels as `authorization: Bearer <token>` metadata on every call.

Status codes (DESIGN.md §8): no token or an unknown one -> UNAUTHENTICATED; a read token on a write
method -> PERMISSION_DENIED; nothing is changed in either case. The grpc health service stays open
(load balancers and kubelets probe it without credentials); reflection is only served when no tokens
are configured. Tokens compare in constant time.
"""

from __future__ import annotations

import enum
import hmac
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvstore.errors import PermissionDenied, Unauthenticated

AUTH_HEADER = "authorization"
WRITE_METHODS = frozenset({"Put", "PutShm", "Delete", "Pin", "Unpin"})  # change what a node holds
RELOAD_EVERY_S = 1.0


class Role(enum.IntEnum):
    READ = 1
    WRITE = 2  # includes read


def read_token_file(path: str | os.PathLike[str]) -> list[str]:
    """Tokens in a file: one per line, blank lines and # comments skipped. Raises ValueError when a
    token is too short to be a secret (< 16 characters) or the file holds none."""
    tokens = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        tok = line.strip()
        if not tok or tok.startswith("#"):
            continue
        if len(tok) < 16 or any(c.isspace() for c in tok):
            raise ValueError(f"{path}:{n}: a token must be >= 16 characters without spaces")
        tokens.append(tok)
    if not tokens:
        raise ValueError(f"{path}: no tokens")
    return tokens


class TokenAuthenticator:
    """Maps a call's metadata to a Role, or raises Unauthenticated. Thread-safe; re-reads its token
    files when their mtime changes (at most once per RELOAD_EVERY_S). A file that turns unreadable or
    invalid keeps the last good tokens (and the error is reported by `last_error`)."""

    def __init__(self, write_file: str | None, read_file: str | None) -> None:
        if not write_file and not read_file:
            raise ValueError("TokenAuthenticator needs at least one token file")
        self._files = {Role.WRITE: write_file, Role.READ: read_file}
        self._mtimes: dict[Role, float] = {}
        self._tokens: dict[Role, list[bytes]] = {Role.WRITE: [], Role.READ: []}
        self._lock = threading.Lock()
        self._checked = 0.0
        self.last_error: str | None = None
        self._reload(force=True)

    def _reload(self, force: bool = False) -> None:
        for role, path in self._files.items():
            if not path:
                continue
            try:
                mtime = os.stat(path).st_mtime_ns
                if not force and self._mtimes.get(role) == mtime:
                    continue
                tokens = [t.encode() for t in read_token_file(path)]
            except (OSError, ValueError) as exc:
                if force:
                    raise ValueError(f"auth token file for {role.name.lower()} access: {exc}") from exc
                self.last_error = str(exc)
                continue
            self._tokens[role], self._mtimes[role] = tokens, mtime
            self.last_error = None

    def role_of(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Role:
        now = time.monotonic()
        if now - self._checked >= RELOAD_EVERY_S:
            with self._lock:
                if now - self._checked >= RELOAD_EVERY_S:
                    self._checked = now
                    self._reload()
        presented = _bearer(metadata)
        if presented is None:
            raise Unauthenticated("this node requires a token (set KVSTORE_TOKEN or KVSTORE_TOKEN_FILE; "
                                  "on the wire: 'authorization: Bearer <token>')")
        # Check every token (no early exit), so timing says nothing about which one nearly matched.
        role: Role | None = None
        for r in (Role.WRITE, Role.READ):
            for tok in self._tokens[r]:
                if hmac.compare_digest(tok, presented) and role is None:
                    role = r
        if role is None:
            raise Unauthenticated("unknown token")
        return role

    def check(self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None) -> None:
        """Raise unless the call's token allows `method` (the short RPC name, e.g. "Put")."""
        role = self.role_of(metadata)
        if method in WRITE_METHODS and role < Role.WRITE:
            raise PermissionDenied(f"{method} needs a read-write token; this token may only read")


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
    """What a client presents: a bearer token and/or TLS (roots, optional client certificate)."""

    token: str | None = None
    ca_file: str | None = None  # PEM roots that signed the node certificates; set -> TLS
    cert_file: str | None = None  # client certificate (mTLS), with key_file
    key_file: str | None = None
    server_name: str | None = None  # name to check in the node certificate instead of the target host

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
        return cls(token=token, ca_file=env.get("KVSTORE_TLS_CA") or None,
                   cert_file=env.get("KVSTORE_TLS_CERT") or None, key_file=env.get("KVSTORE_TLS_KEY") or None,
                   server_name=env.get("KVSTORE_TLS_SERVER_NAME") or None)  # fmt: skip

    @property
    def tls(self) -> bool:
        return self.ca_file is not None

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return ((AUTH_HEADER, f"Bearer {self.token}"),) if self.token else None

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.tls and self.server_name else []

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        assert self.ca_file is not None
        ca = Path(self.ca_file).read_bytes()
        key = Path(self.key_file).read_bytes() if self.key_file else None
        cert = Path(self.cert_file).read_bytes() if self.cert_file else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
