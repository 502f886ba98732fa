"""Who may read the KV-event feed: the subscribers file, the node's CURVE key, the ZAP handler that admits
listed keys, and what each subscription may receive (`granted`).

Who may subscribe (SECURITY.md, "The KV-event feed"). The feed names tenants, namespaces and the hashes
each holds, so:
- a bare port (`--kv-events-endpoint 5557`) binds the gRPC host, loopback by default; an address other hosts
  reach is refused unless the feed is authenticated or `kv_events_allow_open` says the network is private;
- with `kv_events_curve_secret_file` and `kv_events_subscribers_file` it is CURVE-authenticated and
  encrypted (ZMQ's own mechanism, so a vLLM-style pyzmq or Go zmq4 SUB socket only sets three keys): the
  ZAP handler admits the listed public keys, a key listed with a tenant gets that tenant's topics only
  (`granted`: the socket is in XPUB_MANUAL mode, so the node decides what each connection is subscribed
  to), a key without one every topic (the router's indexer).


Invariant: a bad subscribers or key file refuses the start (ValueError naming the file and line); a file that
turns bad later admits nobody until fixed; a subscriber bound to a tenant receives only its tenant's topics.
"""

from __future__ import annotations

import logging
import os
import stat

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from kvstore.node.kv_events_wire import tenant_topics
from kvstore.scoping import DEFAULT_TENANT, check_tenant
from kvstore.security import check_private

# NOTE: the feed's log keeps the publisher's name (kv_events.py), so one logger says everything the feed did.
log = logging.getLogger("kvstore.node.kv_events")

ZAP_DOMAIN = "kvstore-kv-events"


def granted(requested: bytes, tenant: str | None, prefix: str, node_id: str) -> bytes | None:
    """What a subscription to `requested` may receive: all of it for a subscriber bound to no tenant (no
    CURVE, or a key listed without one: the default tenant's, the operator's), else the part inside its
    tenant's topics, else None (refused). Pure."""
    if tenant is None or tenant == DEFAULT_TENANT:
        return requested
    own = tenant_topics(prefix, node_id, tenant).encode()
    if own.startswith(requested):
        return own
    if requested.startswith(own):
        return requested
    return None


def read_subscribers_file(path: str) -> dict[bytes, str]:
    """{z85 public key: tenant} of a subscribers file: lines `KEY` or `KEY TENANT` (no tenant: the default
    tenant, every topic), blank lines and # comments skipped. ValueError naming the file and line for a
    key that is not 40 z85 characters, a bad tenant name, or a file other users may write."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if stat.S_IMODE(st.st_mode) & 0o022:
            raise ValueError(f"{path}: other users may write it (mode {stat.S_IMODE(st.st_mode):04o}): chmod 644")
        text = f.read().decode()
    keys: dict[bytes, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2 or len(fields[0]) != 40:
            raise ValueError(f"{path}:{n}: a line is a CURVE public key (40 z85 characters), optionally its tenant")
        try:
            z85.decode(fields[0])
        except ValueError:
            raise ValueError(f"{path}:{n}: {fields[0]!r} is not z85") from None
        keys[fields[0].encode()] = check_tenant(fields[1], f"{path}:{n}: tenant") if len(fields) > 1 else DEFAULT_TENANT
    return keys


def read_node_secret(path: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys of the node's certificate (pyzmq's NAME.key_secret format). ValueError
    naming the file when it is readable by others or holds no secret key."""
    with open(path, "rb") as f:
        check_private(path, os.fstat(f.fileno()))
    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise ValueError(f"{path}: no secret key (give the NAME.key_secret file, not NAME.key)")
    return public, secret


class SubscriberAuth(ThreadAuthenticator):
    """ZAP for the feed's socket: admits the keys of the subscribers file (re-read when it changes; a file
    that turns bad admits nobody until fixed) and tags each connection with its key's tenant (User-Id)."""

    def __init__(self, ctx: zmq.Context, path: str) -> None:
        super().__init__(ctx, log=logging.getLogger(f"{log.name}.zap"))
        self.path = path
        self.keys = read_subscribers_file(path)  # a bad file refuses the start
        self._seen = self._stat()
        self.refused = 0

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials provider: whether `key` (z85) may connect."""
        seen = self._stat()
        if seen != self._seen:
            self._seen = seen
            try:
                self.keys = read_subscribers_file(self.path)
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                log.error("kv events: subscribers file %s: %s; no subscriber is admitted until it is fixed",
                          self.path, exc)  # fmt: skip
                self.keys = {}
        if key in self.keys:
            return True
        self.refused += 1
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.keys.get(z85.encode(client_public_key), DEFAULT_TENANT)
