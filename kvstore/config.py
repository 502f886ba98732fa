"""One typed node config, loaded from a TOML file, the environment and flags, in that order of
precedence (flags win). Validated in __post_init__ so a bad value fails at start, naming the field.

File (`--config FILE`): a `[node]` table with the field names below. Environment: `KVSTORE_<FIELD>`
(upper case), e.g. `KVSTORE_DRAM_BYTES=8GiB`. Sizes accept plain bytes or suffixes K/M/G/T (powers of
1000) and KiB/MiB/GiB/TiB (powers of 1024).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.pageformat import slot_bytes_for
from kvstore.policy import POLICIES
from kvstore.wire import MAX_REPLICAS

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE_FIELDS = {
    "dram_bytes",
    "nvme_bytes",
    "hbm_bytes",
    "max_page_bytes",
    "nvme_segment_bytes",
    "scrub_bytes_per_second",
    "shm_max_mapped_bytes",
    "replication_bytes_per_second",
}


def parse_size(value: str | int) -> int:
    """Bytes from an int or a string like "64MiB", "2G", "4096"."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"not a size: {value!r} (examples: 4096, 64MiB, 2G)")
    num, unit = m.group(1), (m.group(2) or "").lower()
    base = unit[0] if unit and unit != "b" else ""
    mult = 1024 ** ("kmgt".index(base) + 1) if "i" in unit else _UNITS[base]
    return int(float(num) * mult)


@dataclass(slots=True)
class NodeConfig:
    """Everything a cache node needs to start. Invariants after construction: sizes are >= 0,
    max_page_bytes > 0, an NVMe budget implies an NVMe path, and the policy name is known."""

    host: str = "127.0.0.1"
    port: int = 50051
    node_id: str = field(default_factory=socket.gethostname)
    dram_bytes: int = 1 << 30
    nvme_path: str | None = None
    nvme_bytes: int = 0
    nvme_segment_bytes: int = 1 << 30
    hbm_bytes: int = 0
    max_page_bytes: int = 2 << 20
    policy: str = "adaptive"  # see kvstore/policy/adaptive.py and benchmarks/RESULTS.md (trace_replay; DESIGN.md §6.1)
    io_threads: int = 4
    max_pages_per_request: int = 4096
    grace_seconds: float = 5.0
    read_ahead_pages: int = 4  # pages a Get reads (NVMe I/O, promotion) ahead of the one it streams
    alloc_wait_seconds: float = 5.0  # how long a write waits for space held by other in-flight streams
    # The DRAM scrubber (kvstore/manager/scrub.py) re-verifies resident DRAM pages at this rate, since remote
    # reads do not re-hash them (DESIGN.md §8). 64 MiB/s costs about 1% of a core; 0 turns it off.
    scrub_bytes_per_second: int = 64 << 20
    # Retention (kvstore/manager/retention.py, DESIGN.md §6.5): a tenant's sessions may retain at most this
    # fraction of its slots of the slowest tier (its share where it has one, else the tier), and hold (HOLD) at
    # most this fraction of its slots of each faster tier; 0 turns retention of stored pages off.
    retain_fraction: float = 0.5
    spill_on_shutdown: bool = True
    spill_seconds: float = 30.0
    log_level: str = "INFO"
    redis_url: str | None = None  # cluster index; None runs the node standalone
    advertise_addr: str | None = None  # host:port clients use to reach this node (default host:port)
    index_ttl_seconds: float = 10.0  # heartbeat TTL: a node silent this long stops matching lookups
    index_max_pending: int = 100_000  # queued index updates before a full resync
    # Startup waits this long for the first index publish before reporting SERVING (and writing the
    # ready file); past it the node serves anyway (Redis down must not keep local pages unreachable).
    index_register_wait_seconds: float = 5.0
    # Prometheus /metrics endpoint (kvstore/node/metrics.py): None = off, 0 = a free port (in the ready file).
    metrics_port: int | None = None
    metrics_host: str | None = None  # address to bind it to (default: host)
    # Same-host plane (kvstore/wire/shm.py): pages cross through client memory (memfds passed over a Unix
    # socket). local_socket: where the socket is (None: kvstore-<uid>/node-<port>.sock in the runtime directory;
    # in Kubernetes a hostPath the workers' pods mount too). What callers may hold on it
    # (kvstore/node/planes/shm_limits.py): at most shm_max_connections authenticated connections, at most
    # shm_max_connections_per_tenant of them one tenant's and one caller's (0: half), and besides them at most
    # shm_max_handshakes before their HELLO (0: an eighth of shm_max_connections, at least 8), each given
    # shm_hello_timeout_seconds to send it; a connection idle (between requests) for shm_idle_seconds is closed.
    # Client memory mapped: at most shm_max_registrations buffers (each one mapping in the node) and
    # shm_max_mapped_bytes in all, half of each at most one caller's and one tenant's (past it:
    # RESOURCE_EXHAUSTED, and the client uses another plane).
    shm_enabled: bool = True
    local_socket: str | None = None
    shm_max_mapped_bytes: int = 1 << 40
    shm_max_registrations: int = 16384
    shm_max_connections: int = 1024
    shm_max_connections_per_tenant: int = 0
    shm_max_handshakes: int = 0
    shm_hello_timeout_seconds: float = 3.0
    shm_idle_seconds: float = 120.0
    # Bulk TCP data plane (kvstore/wire/tcp): on by default on a free port, advertised in Stats and
    # the index record, so clients on other hosts move pages over it instead of gRPC streams.
    tcp_enabled: bool = True
    tcp_port: int = 0  # 0: a free port (clients learn it by negotiation); set one for a firewall rule
    tcp_timeout_seconds: float = 10.0  # a TCP plane connection stalled this long mid-frame is closed
    # Who may hold TCP plane connections (kvstore/node/planes/tcp_limits.py): at most tcp_max_connections
    # authenticated ones, at most tcp_max_connections_per_tenant of them one tenant's (0: half of
    # tcp_max_connections), and besides them at most tcp_max_handshakes still before their HELLO (0: an
    # eighth of tcp_max_connections, at least 8), each given tcp_hello_timeout_seconds to send it. An
    # authenticated connection idle (between requests) for tcp_idle_seconds is closed; clients reopen.
    tcp_max_connections: int = 1024
    tcp_max_connections_per_tenant: int = 0
    tcp_max_handshakes: int = 0
    tcp_hello_timeout_seconds: float = 3.0
    tcp_idle_seconds: float = 120.0
    # UCX data plane (kvstore/wire/ucx): off by default. Turn it on where hosts have RDMA (InfiniBand,
    # RoCE): over plain TCP, UCX is no faster than the TCP plane (benchmarks/RESULTS.md), and loading it
    # costs ~1.3 s of node start. On: ucxx must be installed, or the node refuses to start.
    ucx_enabled: bool = False
    ucx_port: int = 0  # the UCX listener's port; 0 picks a free one (advertised in Stats and the index)
    ucx_io_timeout_seconds: float = 30.0  # a UCX HELLO or transfer slower than this closes its connection
    # The secured cache plane (kvstore/security.py): TLS, mutual TLS, bearer tokens (write / read-only).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # set: clients must present a certificate this CA signed
    auth_tokens_file: str | None = None  # tokens allowed every RPC, one per line
    auth_read_tokens_file: str | None = None  # tokens allowed Lookup, Get, Stats, Report only
    # Tokens nodes present to each other to make copies (kvstore/security.py Role.PEER): a node presents this
    # file's first token and accepts any of them; a peer acts for the tenant it names, so keep it to the nodes.
    auth_peer_tokens_file: str | None = None
    # Replication by heat (kvstore/replication, DESIGN.md §7.3), on where the node has an index (redis_url): a
    # page read often (or by several hosts) gets copies on other nodes, up to replication_max_copies and only
    # into free room (a destination keeps replication_free_reserve of its slots free); a Put's replicas=k keeps
    # k copies; a lost holder's copies are made again. A node pulls copies at most at
    # replication_bytes_per_second (0: unbounded). SIGTERM hands this node's hot pages to others for at most
    # handoff_seconds (0: no hand-off) before the drain and spill.
    replication: bool = True
    replication_max_copies: int = 3
    replication_hot_reads_per_second: float = 1.0
    replication_free_reserve: float = 0.1
    replication_bytes_per_second: int = 256 << 20
    replication_interval_seconds: float = 1.0
    handoff_seconds: float = 10.0
    # Tenants (kvstore/node/tenancy.py): TOML with a [tenants.NAME] table per tenant: its shares per tier
    # (dram_bytes, nvme_bytes, hbm_bytes) and the mTLS subjects bound to it. Tokens name their tenant
    # in the token files; without either, every caller is the default tenant (no change).
    tenants_file: str | None = None
    # KV events for routers (kvstore/node/kv_events.py): vLLM's KV-event format over ZMQ PUB; None = off.
    # Where subscribers connect: tcp://HOST:PORT, ipc://PATH, or just a PORT (or tcp://:PORT): the gRPC host's.
    kv_events_endpoint: str | None = None
    kv_events_topic: str = "kv"  # topics are {kv_events_topic}@{node_id}@{namespace}
    kv_events_hash_format: str = "bytes"  # "bytes": the 32-byte keys; "u64": their last 8 bytes, big-endian
    kv_events_max_queue: int = 100_000  # changes waiting to be sent; beyond it they are dropped and counted
    kv_events_encoding: str = "map"  # "map": vLLM 0.32's events; "array": the older array form (llm-d's decoder)
    # CURVE (ZMQ's authentication and encryption): the node's certificate with its secret key (pyzmq's
    # zmq.auth.create_certificates writes NAME.key_secret; private: mode 0600), and who may subscribe: lines
    # `PUBLIC_KEY` (z85, 40 characters: every topic) or `PUBLIC_KEY TENANT` (that tenant's topics only).
    kv_events_curve_secret_file: str | None = None
    kv_events_subscribers_file: str | None = None
    kv_events_allow_open: bool = False  # a feed without CURVE on an address other hosts reach: refused unless set

    def __post_init__(self) -> None:
        for name in _SIZE_FIELDS:
            setattr(self, name, parse_size(getattr(self, name)))
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_page_bytes <= 0:
            raise ValueError("max_page_bytes must be > 0")
        if not 0 <= int(self.port) <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        self.port = int(self.port)
        if self.nvme_bytes and not self.nvme_path:
            raise ValueError("nvme_bytes > 0 needs nvme_path")
        if self.policy.lower() not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.io_threads < 1 or self.max_pages_per_request < 1:
            raise ValueError("io_threads and max_pages_per_request must be >= 1")
        if self.index_ttl_seconds <= 0 or self.index_max_pending < 1 or self.index_register_wait_seconds < 0:
            raise ValueError("index_ttl_seconds must be > 0, index_max_pending >= 1, index_register_wait_seconds >= 0")
        if not 0 <= int(self.tcp_port) <= 65535:
            raise ValueError(f"tcp_port must be in [0, 65535], got {self.tcp_port}")
        if self.tcp_timeout_seconds <= 0 or self.tcp_max_connections < 1:
            raise ValueError("tcp_timeout_seconds must be > 0 and tcp_max_connections >= 1")
        if self.tcp_hello_timeout_seconds <= 0 or self.tcp_idle_seconds <= 0:
            raise ValueError("tcp_hello_timeout_seconds and tcp_idle_seconds must be > 0")
        if self.tcp_max_connections_per_tenant < 0 or self.tcp_max_handshakes < 0:
            raise ValueError("tcp_max_connections_per_tenant and tcp_max_handshakes must be >= 0 (0: the default)")
        if self.shm_max_connections < 1 or self.shm_max_registrations < 1:
            raise ValueError("shm_max_connections and shm_max_registrations must be >= 1")
        if self.shm_max_connections_per_tenant < 0 or self.shm_max_handshakes < 0:
            raise ValueError("shm_max_connections_per_tenant and shm_max_handshakes must be >= 0 (0: the default)")
        if self.shm_hello_timeout_seconds <= 0 or self.shm_idle_seconds <= 0:
            raise ValueError("shm_hello_timeout_seconds and shm_idle_seconds must be > 0")
        if self.metrics_port is not None and not 0 <= int(self.metrics_port) <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS needs both tls_cert_file and tls_key_file")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        for name in (
            "tls_cert_file",
            "tls_key_file",
            "tls_client_ca_file",
            "auth_tokens_file",
            "auth_read_tokens_file",
            "auth_peer_tokens_file",
            "tenants_file",
        ):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file {path!r}")
        if not 0 <= int(self.ucx_port) <= 65535:
            raise ValueError(f"ucx_port must be in [0, 65535], got {self.ucx_port}")
        if self.ucx_io_timeout_seconds <= 0:
            raise ValueError("ucx_io_timeout_seconds must be > 0")
        if self.read_ahead_pages < 0:
            raise ValueError("read_ahead_pages must be >= 0")
        if not 0.0 <= float(self.retain_fraction) <= 1.0:  # NOTE: NaN fails this test too
            raise ValueError(f"retain_fraction must be in [0, 1], got {self.retain_fraction}")
        self.retain_fraction = float(self.retain_fraction)
        if not 1 <= self.replication_max_copies <= MAX_REPLICAS:
            raise ValueError(
                f"replication_max_copies must be in [1, {MAX_REPLICAS}], got {self.replication_max_copies}"
            )
        if not self.replication_hot_reads_per_second > 0:  # NaN fails too
            raise ValueError(
                f"replication_hot_reads_per_second must be > 0, got {self.replication_hot_reads_per_second}"
            )
        if not 0 <= self.replication_free_reserve < 1:
            raise ValueError(f"replication_free_reserve must be in [0, 1), got {self.replication_free_reserve}")
        if not self.replication_interval_seconds > 0:
            raise ValueError(f"replication_interval_seconds must be > 0, got {self.replication_interval_seconds}")
        if not self.handoff_seconds >= 0:
            raise ValueError(f"handoff_seconds must be >= 0, got {self.handoff_seconds}")
        if self.kv_events_endpoint is not None:
            self.kv_events_endpoint = events_endpoint(self.kv_events_endpoint, self.host)
            check_events_config(
                self.kv_events_endpoint,
                self.kv_events_hash_format,
                self.kv_events_max_queue,
                self.kv_events_topic,
                self.kv_events_encoding,
            )
            check_events_access(
                self.kv_events_endpoint,
                self.kv_events_curve_secret_file,
                self.kv_events_subscribers_file,
                self.kv_events_allow_open,
            )
        if self.nvme_segment_bytes < self.slot_bytes and self.nvme_bytes:
            raise ValueError("nvme_segment_bytes must hold at least one chunk (a 4 KiB header + max_page_bytes)")

    @property
    def slot_bytes(self) -> int:
        """The largest slot, and every tier's chunk: a 4 KiB header block plus max_page_bytes, 4 KiB aligned. A
        smaller page takes a slot of its own size (kvstore/tiers/slots.py), many to a chunk."""
        return slot_bytes_for(self.max_page_bytes)

    @classmethod
    def load(
        cls, file: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None, **overrides: Any
    ) -> NodeConfig:
        """Merge file < environment < overrides (None overrides are ignored) into one config."""
        names = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        if file is not None:
            data = tomllib.loads(Path(file).read_text())
            table = data.get("node", data)
            unknown = set(table) - names
            if unknown:
                raise ValueError(f"{file}: unknown config keys {sorted(unknown)}")
            values.update(table)
        env = os.environ if env is None else env
        for name in names:
            raw = env.get(f"KVSTORE_{name.upper()}")
            if raw is not None:
                values[name] = _coerce(cls, name, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def check_events_config(endpoint: str, hash_format: str, max_queue: int, topic: str, encoding: str = "map") -> None:
    """ValueError naming the kv_events_* field that is wrong."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")) or endpoint.endswith("://"):
        raise ValueError(f"kv_events_endpoint: {endpoint!r} is not a ZMQ endpoint (tcp://HOST:PORT or ipc://PATH)")
    if hash_format not in ("bytes", "u64"):
        raise ValueError(f"kv_events_hash_format must be 'bytes' or 'u64', got {hash_format!r}")
    if int(max_queue) < 1:
        raise ValueError(f"kv_events_max_queue must be >= 1, got {max_queue}")
    if not topic or "@" in topic:
        raise ValueError(f"kv_events_topic must be non-empty and without '@', got {topic!r}")
    if encoding not in ("map", "array"):
        raise ValueError(f"kv_events_encoding must be 'map' or 'array', got {encoding!r}")


def events_endpoint(value: str, grpc_host: str) -> str:
    """The KV-event endpoint `value` names: a bare PORT or tcp://:PORT binds the gRPC host (so the feed is as
    reachable as the node's API, loopback by default); anything else is taken as written."""
    port = value.removeprefix("tcp://:") if value.startswith("tcp://:") else value
    if port.isdigit():
        host = f"[{grpc_host}]" if ":" in grpc_host else grpc_host
        return f"tcp://{host or '0.0.0.0'}:{port}"
    return value


def events_endpoint_is_local(endpoint: str) -> bool:
    """Whether only this host can reach a ZMQ endpoint: ipc:// and inproc://, or tcp:// on a loopback address."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or an interface ("*", "eth0"): other hosts may reach it


def check_events_access(endpoint: str, secret_file: str | None, subscribers_file: str | None, allow_open: bool) -> None:
    """ValueError naming the field unless the feed is authenticated (both CURVE files), or reachable from this
    host only, or opened on purpose (`kv_events_allow_open`): it names tenants, namespaces and the hashes
    they hold, so a subscriber that can compute a prompt's hashes learns whether a tenant cached it."""
    if (secret_file is None) != (subscribers_file is None):
        raise ValueError("kv_events_curve_secret_file and kv_events_subscribers_file go together (CURVE)")
    for name, path in (("kv_events_curve_secret_file", secret_file), ("kv_events_subscribers_file", subscribers_file)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{name}: no such file {path!r}")
    if secret_file is None and not allow_open and not events_endpoint_is_local(endpoint):
        raise ValueError(
            f"kv_events_endpoint: {endpoint} would publish every tenant's namespaces and block hashes to anyone "
            "who reaches it; give the feed CURVE keys (kv_events_curve_secret_file and kv_events_subscribers_file), "
            "bind it to loopback (a bare port binds the gRPC host), or set kv_events_allow_open on a network "
            "only the router's indexer reaches"
        )


def _coerce(cls: type[NodeConfig], name: str, raw: str) -> Any:
    """Turn an environment string into the field's type."""
    if name in _SIZE_FIELDS:
        return parse_size(raw)
    kind = str({f.name: f.type for f in dataclasses.fields(cls)}[name]).removesuffix(" | None")
    if kind == "bool":
        return raw.strip().lower() in {"1", "true", "yes", "on"}
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    return raw
