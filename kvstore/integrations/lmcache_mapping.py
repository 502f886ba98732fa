"""How LMCache's keys and chunks map onto kvstore (mapping v1). Pure: no LMCache, torch, grpc or I/O.

LMCache names a chunk with a CacheEngineKey (model name, world size, worker id, chunk hash, KV dtype,
request tags; layerwise keys add a layer id) and holds its KV in a MemoryObj of a fixed memory format.
kvstore names a page with (namespace, 32-byte hash) and binds every namespace to one PageLayout.

Namespace: everything that makes two chunks' bytes incompatible, so a mismatch is a cold miss and
never wrong KV handed to a model (DESIGN.md §3):

    {prefix}/v1/{model}/ws{world_size}/w{worker_id}/{key dtype}/{format}/{shapes}/c{chunk_size}[/tail]

`shapes` lists each KV group's MemoryObj shape with the token dimension written `T` and its dtype,
e.g. `2x32xTx1024:bfloat16` (vLLM, Llama-3-8B, TP 1). The model name comes from the key (so
LMCache's MLA "read rank 0's copy" mode maps to worker 0's namespace, as it should), followed by
`@{revision}` when the plugin's `model_revision` setting gives the weights' revision (LMCache's keys and
metadata carry none: `model_part`); a model name that
would push the namespace past 256 bytes is shortened to its first 48 characters plus 16 hex digits of
its SHA-256.

Hash: `SHA-256(b"kvstore-lmcache/v1\\x00" || utf8(key.to_string()))`. The key string already carries
every identity field, request tags and (layerwise) the layer id, and LMCache's chunk hash is itself a
prefix hash, so equal keys mean equal prefixes.

Last partial chunk (LMCache's `save_unfull_chunk`): a namespace has one page size, and a reader knows
only the key, not how many tokens its chunk holds. So a chunk of t < chunk_size tokens goes to the
sibling namespace `.../tail` (same layout as the full one) as a full-size page: its t tokens' bytes,
zero padding, and a 16-byte trailer `KVSLMCT1 || u32le(t) || u32le(0)` in the last bytes. A reader
that misses in the full namespace asks the tail namespace for the rest of the chain (one more call,
only when partial chunks are enabled); the page checksum covers the trailer like the payload.

Layout: when the chunk is one KV group of a dtype kvstore knows (fp16, bf16, fp32, fp8 e4m3, uint8)
with separate K and V, the layout gives the real dimensions (layers, KV heads, head dim, chunk size),
so `kvctl stats` reads naturally; otherwise (MLA, several groups, other dtypes) it describes the
chunk as uint8 bytes of the same total size. The bytes are in LMCache's own order either way; the
namespace's format field says which.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvstore.client.planes.choice import TRANSPORTS
from kvstore.hashing import MAX_NAMESPACE_BYTES, HashContractError, validate_namespace
from kvstore.layout import DType, PageLayout

MAPPING_VERSION = "v1"
KEY_TAG = b"kvstore-lmcache/v1\x00"
TOKEN = -1  # marks the token dimension in a shape template
TAIL_SUFFIX = "/tail"
TAIL_TRAILER = struct.Struct("<8sII")  # magic, tokens, reserved (0)
TAIL_MAGIC = b"KVSLMCT1"
_MODEL_KEEP = 48  # characters of a too-long model name kept before its digest
_PLAIN_REVISION = re.compile(r"[A-Za-z0-9._+=-]{1,40}")  # a git sha, a tag, a short digest: written as is

# LMCache's dtype names (lmcache.utils.TORCH_DTYPE_TO_STR_DTYPE) that have a kvstore DType.
_DTYPES: dict[str, DType] = {
    "half": DType.FLOAT16,
    "bfloat16": DType.BFLOAT16,
    "float": DType.FLOAT32,
    "uint8": DType.UINT8,
    "fp8_e4m3fn": DType.FLOAT8_E4M3,
}


class MappingError(ValueError):
    """A chunk or key that mapping v1 cannot represent; the message says which field and why."""


@dataclass(frozen=True, slots=True)
class GroupShape:
    """One KV group of a chunk: its MemoryObj shape with TOKEN at the token dimension, and its dtype."""

    template: tuple[int, ...]
    dtype: str  # LMCache's name, e.g. "bfloat16"
    itemsize: int

    def __post_init__(self) -> None:
        if self.template.count(TOKEN) != 1 or any(d < 1 for d in self.template if d != TOKEN):
            raise MappingError(f"shape template {self.template}: needs exactly one token dimension and sizes >= 1")
        if self.itemsize < 1:
            raise MappingError(f"dtype {self.dtype}: itemsize must be >= 1")

    def shape(self, tokens: int) -> tuple[int, ...]:
        return tuple(tokens if d == TOKEN else d for d in self.template)

    @property
    def token_bytes(self) -> int:
        return math.prod(d for d in self.template if d != TOKEN) * self.itemsize

    def tag(self) -> str:
        return "x".join("T" if d == TOKEN else str(d) for d in self.template) + f":{self.dtype}"


@dataclass(frozen=True, slots=True)
class Geometry:
    """What every chunk of one LMCache engine looks like. Invariant: chunk_bytes == chunk_size * token_bytes."""

    fmt: str  # LMCache MemoryFormat name, e.g. "KV_2LTD"
    groups: tuple[GroupShape, ...]
    chunk_size: int
    kv_heads: int = 0  # real dimensions for the page layout when known (0: describe as bytes)
    head_dim: int = 0

    def __post_init__(self) -> None:
        if not self.groups:
            raise MappingError("a chunk needs at least one KV group")
        if self.chunk_size < 1:
            raise MappingError(f"chunk_size must be >= 1, got {self.chunk_size}")

    @property
    def token_bytes(self) -> int:
        return sum(g.token_bytes for g in self.groups)

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_size * self.token_bytes

    def shapes(self, tokens: int) -> list[tuple[int, ...]]:
        return [g.shape(tokens) for g in self.groups]

    def tokens_of(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[str], fmt: str) -> int:
        """Token count of a MemoryObj with these shapes, dtypes and format; MappingError if it is not
        a chunk of this geometry (wrong format, dtype, shape, or more tokens than a chunk)."""
        if fmt != self.fmt:
            raise MappingError(f"memory format {fmt}, expected {self.fmt}")
        if [g.dtype for g in self.groups] != list(dtypes):
            raise MappingError(f"dtypes {list(dtypes)}, expected {[g.dtype for g in self.groups]}")
        if len(shapes) != len(self.groups):
            raise MappingError(f"{len(shapes)} KV groups, expected {len(self.groups)}")
        tokens = None
        for g, shape in zip(self.groups, shapes, strict=True):
            t = g.template.index(TOKEN)
            got = tuple(int(d) for d in shape)
            if len(got) != len(g.template) or got != g.shape(got[t]):
                raise MappingError(f"shape {list(got)}, expected {g.tag()} (T = tokens)")
            if tokens is not None and got[t] != tokens:
                raise MappingError(f"KV groups disagree on the token count ({tokens} vs {got[t]})")
            tokens = got[t]
        assert tokens is not None
        if not 1 <= tokens <= self.chunk_size:
            raise MappingError(f"{tokens} tokens in one chunk; chunk_size is {self.chunk_size}")
        return tokens

    def shape_tag(self) -> str:
        return "+".join(g.tag() for g in self.groups)

    def page_layout(self) -> PageLayout:
        """The layout of every page of this geometry's namespaces (full and tail pages: one size).

        Real dimensions when the chunk is one group of a known dtype holding separate K and V of
        `kv_heads x head_dim` per token and layer; uint8 bytes of the same total size otherwise."""
        g = self.groups[0]
        dtype = _DTYPES.get(g.dtype)
        hidden = self.kv_heads * self.head_dim
        dims = [d for d in g.template if d != TOKEN]
        if len(self.groups) == 1 and dtype is not None and hidden > 0 and dims[-1] == hidden and 2 in dims[:-1]:
            layers, rest = divmod(math.prod(dims), 2 * hidden)
            if rest == 0:
                return PageLayout(dtype, layers, self.kv_heads, self.head_dim, self.chunk_size)
        if self.token_bytes % 2:
            raise MappingError(f"{self.token_bytes} bytes per token is odd; kvstore pages hold K and V halves")
        return PageLayout(DType.UINT8, 1, 1, self.token_bytes // 2, self.chunk_size)


def chunked_geometry(
    fmt: str,
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[str],
    itemsizes: Sequence[int],
    chunk_size: int,
    *,
    kv_heads: int = 0,
    head_dim: int = 0,
) -> Geometry:
    """Geometry of a whole-chunk (non-layerwise) engine from LMCache's full-chunk shapes
    (`LMCacheMetadata.get_shapes()`: [kv, layers, tokens, hidden] per group; the token dimension is 2)."""
    groups = []
    for shape, dtype, size in zip(shapes, dtypes, itemsizes, strict=True):
        dims = [int(d) for d in shape]
        if len(dims) != 4 or dims[2] != chunk_size:
            raise MappingError(f"full-chunk shape {dims}: expected [kv, layers, {chunk_size}, hidden]")
        dims[2] = TOKEN
        groups.append(GroupShape(tuple(dims), dtype, size))
    return Geometry(fmt, tuple(groups), chunk_size, kv_heads, head_dim)


def layerwise_geometry(
    fmt: str, kv: int, hidden: int, dtype: str, itemsize: int, *, chunk_size: int, kv_heads: int = 0, head_dim: int = 0
) -> Geometry:
    """Geometry of a layerwise engine: one MemoryObj per layer and chunk, shaped as LMCache's layerwise
    GPU connectors make it: KV_T2D [T, 2, hidden], KV_2TD [2, T, hidden], KV_MLA_FMT [T, hidden]."""
    templates = {"KV_T2D": (TOKEN, 2, hidden), "KV_2TD": (2, TOKEN, hidden), "KV_MLA_FMT": (TOKEN, hidden)}
    if fmt not in templates:
        raise MappingError(f"layerwise memory format {fmt} is not supported (one of {sorted(templates)})")
    if fmt != "KV_MLA_FMT" and kv != 2:
        raise MappingError(f"layerwise format {fmt} needs separate K and V (kv=2), got kv={kv}")
    heads, dim = (kv_heads, head_dim) if fmt != "KV_MLA_FMT" else (0, 0)
    return Geometry(fmt, (GroupShape(templates[fmt], dtype, itemsize),), chunk_size, heads, dim)


def namespace_for(
    prefix: str, model: str, world_size: int, worker_id: int, key_dtype: str, *, geometry: Geometry, tail: bool = False
) -> str:
    """The namespace of one (model, world size, worker, dtype) x geometry; `tail` for partial chunks."""
    rest = (
        f"ws{world_size}/w{worker_id}/{key_dtype}/{geometry.fmt.lower()}/{geometry.shape_tag()}"
        f"/c{geometry.chunk_size}{TAIL_SUFFIX if tail else ''}"
    )
    return _bounded_namespace(f"{prefix}/{MAPPING_VERSION}", model, rest, "namespace_prefix")


def _bounded_namespace(head: str, model: str, rest: str, hint: str) -> str:
    """`head/model/rest`, with a model name that would push it past the namespace limit shortened to its
    first 48 characters plus 16 hex digits of its SHA-256; MappingError (naming `hint`) if still invalid."""
    ns = f"{head}/{model}/{rest}"
    if len(ns.encode()) > MAX_NAMESPACE_BYTES:
        digest = hashlib.sha256(model.encode()).hexdigest()[:16]
        ns = f"{head}/{model[:_MODEL_KEEP]}~{digest}/{rest}"
    try:
        validate_namespace(ns)
    except HashContractError as exc:
        raise MappingError(f"namespace {ns[:80]!r}...: {exc} (shorten {hint})") from None
    return ns


def model_part(model: str, revision: str | None = None) -> str:
    """The model component of a door's namespace: `model`, or `model@revision` where the weights' revision (or
    digest) is known, so other weights under the same name are a cold miss. A revision that is not plain
    ([A-Za-z0-9._+=-], at most 40 characters) is written `@~` + 16 hex of its SHA-256. Every door uses this
    one rule; no revision leaves the namespace as it was (mapping v1 and l2v1 vectors hold)."""
    if not revision:
        return model
    if _PLAIN_REVISION.fullmatch(revision):
        return f"{model}@{revision}"
    return f"{model}@~{hashlib.sha256(revision.encode()).hexdigest()[:16]}"


def page_key(key_string: str) -> bytes:
    """The 32-byte kvstore key of an LMCache key (its `to_string()`)."""
    return hashlib.sha256(KEY_TAG + key_string.encode()).digest()


def pack_tail(data: memoryview, tokens: int, page_bytes: int) -> bytearray:
    """A tail page: `data` (tokens' bytes), zeros, then the trailer in the last 16 bytes."""
    if len(data) + TAIL_TRAILER.size > page_bytes:
        raise MappingError(f"a {len(data)}-byte partial chunk leaves no room for the trailer in {page_bytes} B")
    page = bytearray(page_bytes)
    page[: len(data)] = data
    page[-TAIL_TRAILER.size :] = TAIL_TRAILER.pack(TAIL_MAGIC, tokens, 0)
    return page


def tail_tokens(page: Buffer, chunk_size: int) -> int:
    """Token count of a tail page; MappingError if its trailer is not mapping v1's."""
    magic, tokens, reserved = TAIL_TRAILER.unpack_from(page, len(page) - TAIL_TRAILER.size)
    if magic != TAIL_MAGIC or reserved != 0 or not 1 <= tokens < chunk_size:
        raise MappingError(f"tail page trailer is not kvstore-lmcache v1 (magic {magic!r}, {tokens} tokens)")
    return int(tokens)


Buffer = bytes | bytearray | memoryview


# -- plugin settings: `remote_storage_plugin.<name>.<field>` entries of LMCache's extra_config


@dataclass(frozen=True, slots=True)
class Target:
    """Where pages go: one node (`addr`) or a cluster through its Redis index (`redis_url`)."""

    addr: str | None = None
    redis_url: str | None = None

    def describe(self) -> str:
        return f"kvstore node {self.addr}" if self.addr else f"kvstore cluster (index {self.redis_url})"


def parse_url(url: str, field: str = "url") -> Target:
    """`kvstore://host:port` (one node) or `kvstore+redis://host:port/db` (`+rediss` for TLS): a cluster;
    `kvstore+redis+sentinel://host:port,host:port/master/db`: a cluster whose index is behind Redis Sentinel."""
    parts = urlsplit(url)
    if parts.scheme == "kvstore":
        if not parts.hostname or parts.port is None or parts.path not in ("", "/") or parts.query:
            raise MappingError(f"{field}: {url!r} is not kvstore://host:port")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return Target(addr=f"{host}:{parts.port}")
    if parts.scheme in ("kvstore+redis+sentinel", "kvstore+rediss+sentinel"):
        if not parts.netloc.rpartition("@")[2]:
            raise MappingError(f"{field}: {url!r} names no sentinel")
        return Target(redis_url=url.removeprefix("kvstore+"))
    if parts.scheme in ("kvstore+redis", "kvstore+rediss"):
        if not parts.hostname:
            raise MappingError(f"{field}: {url!r} names no Redis host")
        return Target(redis_url=url.removeprefix("kvstore+"))
    raise MappingError(f"{field}: {url!r} must start with kvstore:// (one node) or kvstore+redis:// (a cluster)")


@dataclass(frozen=True, slots=True)
class PluginSettings:
    """The plugin's settings after validation. Invariants: timeouts and intervals > 0, threads >= 1."""

    target: Target
    timeout: float = 10.0  # per data call (Get/Put); LMCache's blocking_timeout_secs by default
    lookup_timeout: float = 5.0  # per Lookup/Pin/Delete call
    transport: str | None = None  # None: the client's default ("auto": shared memory on this host)
    token: str | None = None
    token_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    namespace_prefix: str = "lmcache"
    local_node: str | None = None
    threads: int = 4
    down_backoff: float = 2.0  # after the remote failed to answer: misses without trying, this long
    pin_lease: float = 30.0  # lease of pins taken for LMCache's pinned async lookups
    prefetch: bool = True  # lookups ask the node to promote the matched pages toward DRAM
    tune_malloc: bool = True  # raise glibc's mmap/trim thresholds in the engine (kvstore.memtune)
    model_revision: str | None = None  # the weights' revision or digest, where the engine does not say (model_part)
    retain_ttl: float = 300.0  # the lease of a session a request names without its own (integrations/hints.py)


_LMCACHE_FIELDS = {"module_path", "class_name"}  # LMCache's own plugin-loading keys
_FLOATS = {"timeout", "lookup_timeout", "down_backoff", "pin_lease", "retain_ttl"}
_STRINGS = {"token", "token_file", "tls_ca", "tls_cert", "tls_key", "tls_server_name", "local_node"}
_REVISION_MAX = 256
_TRANSPORTS = TRANSPORTS  # every plane a client speaks


def parse_settings(extra: Mapping[str, object] | None, plugin_name: str, default_timeout: float) -> PluginSettings:
    """Validate `remote_storage_plugin.<plugin_name>.*`; MappingError names the offending key."""
    prefix = f"remote_storage_plugin.{plugin_name}."
    raw = {k[len(prefix) :]: v for k, v in (extra or {}).items() if k.startswith(prefix)}
    fields = set(PluginSettings.__slots__) - {"target"}  # type: ignore[attr-defined]
    unknown = sorted(set(raw) - fields - _LMCACHE_FIELDS - {"url"})
    if unknown:
        raise MappingError(f"{prefix}{unknown[0]}: unknown setting (known: url, {', '.join(sorted(fields))})")
    if "url" not in raw:
        raise MappingError(f"{prefix}url: required (kvstore://host:port or kvstore+redis://host:port/db)")
    kw: dict[str, object] = {"target": parse_url(str(raw["url"]), prefix + "url"), "timeout": default_timeout}
    for name, value in raw.items():
        key = prefix + name
        if name in _FLOATS:
            kw[name] = _positive(value, key, float)
            if not math.isfinite(kw[name]):  # type: ignore[arg-type]
                raise MappingError(f"{key}: a finite number > 0, got {value!r}")
        elif name == "threads":
            kw[name] = int(_positive(value, key, int))
        elif name in ("prefetch", "tune_malloc"):
            kw[name] = _boolean(value, key)
        elif name == "transport":
            if str(value).lower() not in _TRANSPORTS:
                raise MappingError(f"{key}: one of {', '.join(_TRANSPORTS)}, got {value!r}")
            kw[name] = str(value).lower()
        elif name == "namespace_prefix":
            text = str(value)
            if not text or len(text) > 64 or any(ord(c) < 0x21 or ord(c) == 0x7F for c in text):
                raise MappingError(f"{key}: 1-64 printable characters without spaces, got {value!r}")
            kw[name] = text
        elif name in _STRINGS:
            kw[name] = str(value)
        elif name == "model_revision":
            kw[name] = revision_setting(value, key)
    if (kw.get("tls_cert") is None) != (kw.get("tls_key") is None):
        raise MappingError(f"{prefix}tls_cert / {prefix}tls_key: give both or neither")
    return PluginSettings(**kw)  # type: ignore[arg-type]


def revision_setting(value: object, key: str) -> str:
    """A `model_revision` setting: 1-256 printable characters (a commit, a tag, a weights digest)."""
    text = value if isinstance(value, str) else None
    if not text or len(text) > _REVISION_MAX or any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        raise MappingError(f"{key}: 1-{_REVISION_MAX} printable characters (a commit, tag or digest), got {value!r}")
    return text


def _positive(value: object, key: str, kind: type) -> float:
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise MappingError(f"{key}: a number > 0, got {value!r}") from None
    if not number > 0:
        raise MappingError(f"{key}: a number > 0, got {value!r}")
    return float(number)


def _boolean(value: object, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise MappingError(f"{key}: true or false, got {value!r}")
