"""How LMCache's multiprocess server names its objects and how they map onto kvstore (mapping l2v1), and the
L2 adapter's settings (`adapter_params`). Pure: no LMCache, torch, grpc or I/O. The legacy plugin's mapping
(v1) and the settings both doors share are in lmcache_mapping.py.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvstore.hashing import HashContractError, validate_namespace

# The helpers both doors share (settings parsing, bounded namespaces) stay with mapping v1.
from kvstore.integrations.lmcache_mapping import (
    _TRANSPORTS,
    MappingError,
    PluginSettings,
    Target,
    _boolean,
    _bounded_namespace,
    _positive,
    revision_setting,
)
from kvstore.layout import DType, PageLayout

# -- mapping l2v1: LMCache's multiprocess server and its L2 adapters (kvstore/integrations/lmcache_l2.py)
#
# LMCache's `lmcache server` names an object with an ObjectKey (chunk hash, model name, kv rank, object
# group id, cache salt); every object of one group is a full chunk of one MemoryLayoutDesc (shapes and
# dtypes per tensor). Mapping l2v1:
#   key:       SHA-256(b"kvstore-lmcache-l2/v1\x00" || utf8(LMCache's own key string)), the string being
#              `model@kv_rank (8 hex)@group (hex)@chunk hash (hex)[@salt]` as LMCache's native L2
#              connectors and fs adapter write it, so every identity field is in the key;
#   namespace: `{prefix}/l2v1/{model}/r{kv_rank hex}/g{group}/{layout}[/s={salt}]` where model is the key's
#              model name, `@{revision}` appended when adapter_params.model_revision gives one (an ObjectKey
#              carries no revision: lmcache_mapping.model_part), and layout lists each
#              tensor's shape and dtype (`2x2x256x128:bfloat16`, '+' between tensors): a chunk of another
#              layout, dtype or chunk size is another namespace, so a cold miss, never wrong KV. A salt
#              that is not plain ([A-Za-z0-9._:=+-], at most 64) is written `s~` + 32 hex of its SHA-256.
#              An explicit namespace (adapter_params.namespace) replaces all of it: one namespace for every
#              key, whose page size the node then enforces (another layout is refused and logged);
#   page:      the object's bytes in LMCache's order, described to the node as uint8 (`page_bytes` equal).

L2_MAPPING_VERSION = "l2v1"
L2_KEY_TAG = b"kvstore-lmcache-l2/v1\x00"
_PLAIN_SALT = re.compile(r"[A-Za-z0-9._:=+-]{1,64}")
_LAYOUT_TAG_MAX = 96  # longer layout tags (many tensors per object) are written as a digest


def l2_key_string(model: str, kv_rank: int, group: int, chunk_hash: bytes, salt: str = "") -> str:
    """LMCache's serialized ObjectKey (lmcache/v1/distributed/l2_adapters/native_connector_l2_adapter.py)."""
    base = f"{model}@{kv_rank:08x}@{group:x}@{chunk_hash.hex()}"
    return f"{base}@{salt}" if salt else base


def l2_page_key(model: str, kv_rank: int, group: int, chunk_hash: bytes, salt: str = "") -> bytes:
    """The 32-byte kvstore key of one LMCache ObjectKey."""
    return hashlib.sha256(L2_KEY_TAG + l2_key_string(model, kv_rank, group, chunk_hash, salt).encode()).digest()


def l2_layout_tag(shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> str:
    """`2x2x256x128:bfloat16[+...]`: what makes two objects' bytes incompatible besides their key."""
    if not shapes or len(shapes) != len(dtypes):
        raise MappingError(
            f"an object layout needs one dtype per tensor shape, got {len(shapes)} shapes and {len(dtypes)} dtypes"
        )
    parts = []
    for shape, dtype in zip(shapes, dtypes, strict=True):
        dims = [int(d) for d in shape]
        if not dims or any(d < 1 for d in dims):
            raise MappingError(f"tensor shape {dims}: needs at least one dimension, each >= 1")
        parts.append("x".join(map(str, dims)) + f":{dtype}")
    tag = "+".join(parts)
    return tag if len(tag) <= _LAYOUT_TAG_MAX else "L~" + hashlib.sha256(tag.encode()).hexdigest()[:32]


def l2_salt_part(salt: str) -> str:
    """The namespace component of a cache salt ("" for none)."""
    if not salt:
        return ""
    if _PLAIN_SALT.fullmatch(salt):
        return f"s={salt}"
    return "s~" + hashlib.sha256(salt.encode()).hexdigest()[:32]


def l2_namespace(prefix: str, model: str, kv_rank: int, group: int, *, salt: str, layout_tag: str) -> str:
    """The namespace of one (model, kv rank, object group, cache salt, layout)."""
    rest = f"r{kv_rank:x}/g{group}/{layout_tag}"
    model = model.lstrip("/") or "-"  # a model given as an absolute path: no empty component
    if salt:
        rest += "/" + l2_salt_part(salt)
    return _bounded_namespace(f"{prefix}/{L2_MAPPING_VERSION}", model, rest, "the model name")


def l2_namespace_salt_part(namespace: str) -> str:
    """The salt component of an l2v1 namespace ("" when it has none): how usage is split per salt."""
    last = namespace.rsplit("/", 1)[-1]
    return last if last.startswith(("s=", "s~")) else ""


def l2_page_layout(nbytes: int) -> PageLayout:
    """The node-side layout of an object of `nbytes`: bytes (the namespace's layout tag says the rest)."""
    if nbytes < 2 or nbytes % 2:
        raise MappingError(
            f"an object of {nbytes} bytes cannot be a page (kvstore pages hold an even, non-zero number of bytes)"
        )
    return PageLayout(DType.UINT8, 1, 1, nbytes // 2, 1)


@dataclass(frozen=True, slots=True)
class L2Settings:
    """The L2 adapter's `adapter_params` after validation (names in L2_PARAMS)."""

    remote: PluginSettings  # what RemoteStore needs (target, timeouts, transport, credentials, threads)
    namespace: str | None = None  # one explicit namespace for every key; None: derived per key (l2v1)
    namespace_prefix: str = "lmcache"
    lock: bool = True  # lookup-and-lock pins the pages found (with a lease) until unlock
    usage_interval: float = 10.0  # seconds between the node Stats that usage reports are read from
    max_capacity_bytes: int = 0  # capacity reported when the caller has no tenant share (0: unknown)
    model_revision: str | None = None  # the weights' revision of every model served (model_part), or per model:
    model_revisions: Mapping[str, str] = field(default_factory=dict)  # model name -> its revision

    def revision_of(self, model: str) -> str | None:
        """The weights' revision the namespace of `model`'s keys carries (None: the model name alone)."""
        return self.model_revisions.get(model, self.model_revision)


# adapter_params: name -> (what it is, for messages and `help`)
L2_PARAMS: dict[str, str] = {
    "target": "host:port of one kvstore node (or redis_url)",
    "redis_url": "redis://[user:password@]host:port/db of a cluster's index (or target)",
    "namespace": "one kvstore namespace for every key (default: derived per model, rank, group, salt, layout)",
    "namespace_prefix": "first component of derived namespaces (default lmcache)",
    "transport": "auto|grpc|tcp|shm|ucx (default auto)",
    "timeout_s": "seconds a store or load call may take before it is a miss (default 5)",
    "lookup_timeout_s": "seconds a lookup, pin or unpin may take before it is a miss (default 1)",
    "token_file": "file holding the bearer token (default: KVSTORE_TOKEN / KVSTORE_TOKEN_FILE)",
    "tls_ca": "CA file for a TLS node (default KVSTORE_TLS_CA)",
    "tls_cert": "client certificate for mutual TLS (with tls_key)",
    "tls_key": "client key for mutual TLS (with tls_cert)",
    "tls_server_name": "name the node's certificate must carry",
    "local_node": "a cluster's node on this host, preferred for stores",
    "threads": "worker threads for stores, and as many for lookups and loads (default 4)",
    "lock": "pin the pages a lookup found until LMCache unlocks them (default true)",
    "pin_lease_s": "lease of those pins: they expire on their own after it (default 30)",
    "prefetch": "lookups ask the node to promote found pages toward DRAM (default true)",
    "down_backoff_s": "after the node failed to answer: misses without trying, this long (default 2)",
    "usage_interval_s": "seconds between the node Stats usage reports read (default 10)",
    "max_capacity_gb": "capacity to report when the token has no tenant share (default 0: unknown)",
    "model_revision": "the weights' revision or digest: one string for every model, or {model name: revision}",
}


def parse_l2_params(params: Mapping[str, object] | None) -> L2Settings:
    """Validate the adapter's `adapter_params`; MappingError naming `adapter_params.<field>`."""
    raw = dict(params or {})
    unknown = sorted(set(raw) - set(L2_PARAMS))
    if unknown:
        raise MappingError(f"adapter_params.{unknown[0]}: unknown parameter (known: {', '.join(L2_PARAMS)})")
    if ("target" in raw) == ("redis_url" in raw):
        raise MappingError(
            "adapter_params.target / adapter_params.redis_url: give exactly one (a node's host:port, "
            "or a cluster's redis:// URL)"
        )
    if "target" in raw:
        target = Target(addr=_host_port(raw["target"], "adapter_params.target"))
    else:
        url = str(raw["redis_url"])
        if not url.startswith(("redis://", "rediss://")) or not urlsplit(url).hostname:
            raise MappingError(f"adapter_params.redis_url: {url!r} is not redis://host:port/db (or rediss://)")
        target = Target(redis_url=url)
    timeout = _positive(raw.get("timeout_s", 5.0), "adapter_params.timeout_s", float)
    remote: dict[str, object] = {
        "target": target,
        "timeout": timeout,
        "lookup_timeout": _positive(
            raw.get("lookup_timeout_s", min(1.0, timeout)), "adapter_params.lookup_timeout_s", float
        ),
        "threads": int(_positive(raw.get("threads", 4), "adapter_params.threads", int)),
        "pin_lease": _positive(raw.get("pin_lease_s", 30.0), "adapter_params.pin_lease_s", float),
        "down_backoff": _positive(raw.get("down_backoff_s", 2.0), "adapter_params.down_backoff_s", float),
        "prefetch": _boolean(raw.get("prefetch", True), "adapter_params.prefetch"),
        "tune_malloc": False,  # the server's allocations are LMCache's own memory objects
    }
    transport = str(raw.get("transport", "auto")).lower()
    if transport not in _TRANSPORTS:
        raise MappingError(f"adapter_params.transport: one of {', '.join(_TRANSPORTS)}, got {raw['transport']!r}")
    remote["transport"] = transport
    for name in ("token_file", "tls_ca", "tls_cert", "tls_key", "tls_server_name", "local_node"):
        if name in raw:
            if not isinstance(raw[name], str) or not raw[name]:
                raise MappingError(f"adapter_params.{name}: a non-empty string, got {raw[name]!r}")
            remote[name] = raw[name]
    if ("tls_cert" in raw) != ("tls_key" in raw):
        raise MappingError("adapter_params.tls_cert / adapter_params.tls_key: give both or neither")
    kw: dict[str, object] = {"remote": PluginSettings(**remote)}  # type: ignore[arg-type]
    if "namespace" in raw:
        try:
            validate_namespace(raw["namespace"])  # type: ignore[arg-type]
        except HashContractError as exc:
            raise MappingError(f"adapter_params.namespace: {exc}") from None
        kw["namespace"] = raw["namespace"]
    if "namespace_prefix" in raw:
        text = raw["namespace_prefix"]
        if not isinstance(text, str) or not 1 <= len(text) <= 64 or any(ord(c) < 0x21 or ord(c) == 0x7F for c in text):
            raise MappingError(
                f"adapter_params.namespace_prefix: 1-64 printable characters without spaces, got {text!r}"
            )
        kw["namespace_prefix"] = text
    kw["lock"] = _boolean(raw.get("lock", True), "adapter_params.lock")
    kw["usage_interval"] = _positive(raw.get("usage_interval_s", 10.0), "adapter_params.usage_interval_s", float)
    if "max_capacity_gb" in raw:
        cap = raw["max_capacity_gb"]
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0:
            raise MappingError(f"adapter_params.max_capacity_gb: a number >= 0, got {cap!r}")
        kw["max_capacity_bytes"] = int(cap * (1 << 30))
    if "model_revision" in raw:
        rev = raw["model_revision"]
        if isinstance(rev, Mapping):
            if not rev or not all(isinstance(m, str) and m for m in rev):
                raise MappingError("adapter_params.model_revision: an object of model name -> revision, non-empty")
            kw["model_revisions"] = {
                m: revision_setting(r, f"adapter_params.model_revision.{m}") for m, r in rev.items()
            }
        else:
            kw["model_revision"] = revision_setting(rev, "adapter_params.model_revision")
    return L2Settings(**kw)  # type: ignore[arg-type]


def _host_port(value: object, field: str) -> str:
    text = str(value)
    parts = urlsplit(f"//{text}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.path or parts.query or parts.username:
        raise MappingError(f"{field}: {text!r} is not host:port")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"
