from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]

class PageEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAGE_ENCODING_RAW: _ClassVar[PageEncoding]
    PAGE_ENCODING_FP8_E4M3: _ClassVar[PageEncoding]
    PAGE_ENCODING_BUNDLE: _ClassVar[PageEncoding]

class ChecksumForm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_FORM_PAYLOAD: _ClassVar[ChecksumForm]
    CHECKSUM_FORM_KEYED: _ClassVar[ChecksumForm]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_NVME: _ClassVar[Tier]

class RetainMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETAIN_MODE_UNSPECIFIED: _ClassVar[RetainMode]
    RETAIN_MODE_HOLD: _ClassVar[RetainMode]
    RETAIN_MODE_DEMOTE: _ClassVar[RetainMode]

class RetainOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETAIN_OP_RETAIN: _ClassVar[RetainOp]
    RETAIN_OP_UPDATE: _ClassVar[RetainOp]
    RETAIN_OP_RELEASE: _ClassVar[RetainOp]
    RETAIN_OP_END: _ClassVar[RetainOp]
    RETAIN_OP_RESUME: _ClassVar[RetainOp]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT8_E4M3: DType
DTYPE_UINT8: DType
PAGE_ENCODING_RAW: PageEncoding
PAGE_ENCODING_FP8_E4M3: PageEncoding
PAGE_ENCODING_BUNDLE: PageEncoding
CHECKSUM_FORM_PAYLOAD: ChecksumForm
CHECKSUM_FORM_KEYED: ChecksumForm
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_DRAM: Tier
TIER_NVME: Tier
RETAIN_MODE_UNSPECIFIED: RetainMode
RETAIN_MODE_HOLD: RetainMode
RETAIN_MODE_DEMOTE: RetainMode
RETAIN_OP_RETAIN: RetainOp
RETAIN_OP_UPDATE: RetainOp
RETAIN_OP_RELEASE: RetainOp
RETAIN_OP_END: RetainOp
RETAIN_OP_RESUME: RetainOp

class PageLayout(_message.Message):
    __slots__ = ("dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "encoding", "parts")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    encoding: PageEncoding
    parts: _containers.RepeatedCompositeFieldContainer[PagePart]
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., encoding: _Optional[_Union[PageEncoding, str]] = ..., parts: _Optional[_Iterable[_Union[PagePart, _Mapping]]] = ...) -> None: ...

class PagePart(_message.Message):
    __slots__ = ("name", "layout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    layout: PageLayout
    def __init__(self, name: _Optional[str] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "prefetch")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    prefetch: bool
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., prefetch: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("matched_blocks", "tiers", "namespace_known", "fetch", "fetch_ms")
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_KNOWN_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    FETCH_MS_FIELD_NUMBER: _ClassVar[int]
    matched_blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    namespace_known: bool
    fetch: _containers.RepeatedCompositeFieldContainer[TierFetch]
    fetch_ms: float
    def __init__(self, matched_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., namespace_known: _Optional[bool] = ..., fetch: _Optional[_Iterable[_Union[TierFetch, _Mapping]]] = ..., fetch_ms: _Optional[float] = ...) -> None: ...

class TierFetch(_message.Message):
    __slots__ = ("tier", "pages", "bytes", "expected_ms", "measured", "rate_bytes_per_second")
    TIER_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    RATE_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    pages: int
    bytes: int
    expected_ms: float
    measured: bool
    rate_bytes_per_second: float
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., pages: _Optional[int] = ..., bytes: _Optional[int] = ..., expected_ms: _Optional[float] = ..., measured: _Optional[bool] = ..., rate_bytes_per_second: _Optional[float] = ...) -> None: ...

class PutOpen(_message.Message):
    __slots__ = ("namespace", "layout", "target_tier", "parent_hash", "chain", "checksum_form", "replicas")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TARGET_TIER_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FORM_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout: PageLayout
    target_tier: Tier
    parent_hash: bytes
    chain: bool
    checksum_form: ChecksumForm
    replicas: int
    def __init__(self, namespace: _Optional[str] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ..., target_tier: _Optional[_Union[Tier, str]] = ..., parent_hash: _Optional[bytes] = ..., chain: _Optional[bool] = ..., checksum_form: _Optional[_Union[ChecksumForm, str]] = ..., replicas: _Optional[int] = ...) -> None: ...

class PutPage(_message.Message):
    __slots__ = ("hash", "payload_bytes", "checksum")
    HASH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    payload_bytes: int
    checksum: int
    def __init__(self, hash: _Optional[bytes] = ..., payload_bytes: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("open", "page", "chunk")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    open: PutOpen
    page: PutPage
    chunk: bytes
    def __init__(self, open: _Optional[_Union[PutOpen, _Mapping]] = ..., page: _Optional[_Union[PutPage, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "already_present", "held")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_present: int
    held: bytes
    def __init__(self, stored: _Optional[int] = ..., already_present: _Optional[int] = ..., held: _Optional[bytes] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "no_promote", "checksum_form", "layout")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    NO_PROMOTE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FORM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    no_promote: bool
    checksum_form: ChecksumForm
    layout: PageLayout
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., no_promote: _Optional[bool] = ..., checksum_form: _Optional[_Union[ChecksumForm, str]] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ...) -> None: ...

class GetPage(_message.Message):
    __slots__ = ("hash", "payload_bytes", "checksum", "tier")
    HASH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    payload_bytes: int
    checksum: int
    tier: Tier
    def __init__(self, hash: _Optional[bytes] = ..., payload_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("page", "chunk")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    page: GetPage
    chunk: bytes
    def __init__(self, page: _Optional[_Union[GetPage, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted", "not_found", "busy")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    NOT_FOUND_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    not_found: int
    busy: int
    def __init__(self, deleted: _Optional[int] = ..., not_found: _Optional[int] = ..., busy: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "ttl_seconds")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_seconds: float
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pinned", "not_found")
    PINNED_FIELD_NUMBER: _ClassVar[int]
    NOT_FOUND_FIELD_NUMBER: _ClassVar[int]
    pinned: int
    not_found: int
    def __init__(self, pinned: _Optional[int] = ..., not_found: _Optional[int] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("namespace", "hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("unpinned", "not_pinned")
    UNPINNED_FIELD_NUMBER: _ClassVar[int]
    NOT_PINNED_FIELD_NUMBER: _ClassVar[int]
    unpinned: int
    not_pinned: int
    def __init__(self, unpinned: _Optional[int] = ..., not_pinned: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "target_tier")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TARGET_TIER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    target_tier: Tier
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., target_tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("scheduled", "already_resident", "missing")
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    scheduled: int
    already_resident: int
    missing: int
    def __init__(self, scheduled: _Optional[int] = ..., already_resident: _Optional[int] = ..., missing: _Optional[int] = ...) -> None: ...

class RetainRequest(_message.Message):
    __slots__ = ("session", "op", "namespace", "hashes", "ttl_seconds", "priority", "mode")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    session: str
    op: RetainOp
    namespace: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_seconds: float
    priority: int
    mode: RetainMode
    def __init__(self, session: _Optional[str] = ..., op: _Optional[_Union[RetainOp, str]] = ..., namespace: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., ttl_seconds: _Optional[float] = ..., priority: _Optional[int] = ..., mode: _Optional[_Union[RetainMode, str]] = ...) -> None: ...

class RetainResponse(_message.Message):
    __slots__ = ("retained", "pending", "released", "prefetching", "state", "displaced")
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    PREFETCHING_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DISPLACED_FIELD_NUMBER: _ClassVar[int]
    retained: int
    pending: int
    released: int
    prefetching: int
    state: SessionState
    displaced: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, retained: _Optional[int] = ..., pending: _Optional[int] = ..., released: _Optional[int] = ..., prefetching: _Optional[int] = ..., state: _Optional[_Union[SessionState, _Mapping]] = ..., displaced: _Optional[_Iterable[str]] = ...) -> None: ...

class SessionState(_message.Message):
    __slots__ = ("session", "priority", "mode", "ttl_seconds", "pages", "pending", "unheld")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    UNHELD_FIELD_NUMBER: _ClassVar[int]
    session: str
    priority: int
    mode: RetainMode
    ttl_seconds: float
    pages: int
    pending: int
    unheld: int
    def __init__(self, session: _Optional[str] = ..., priority: _Optional[int] = ..., mode: _Optional[_Union[RetainMode, str]] = ..., ttl_seconds: _Optional[float] = ..., pages: _Optional[int] = ..., pending: _Optional[int] = ..., unheld: _Optional[int] = ...) -> None: ...

class RetentionStats(_message.Message):
    __slots__ = ("sessions", "tiers", "calls", "refused", "expired", "ended", "displaced", "unheld", "pending", "resumed", "retained_pages", "cap_pages")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    DISPLACED_FIELD_NUMBER: _ClassVar[int]
    UNHELD_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    RETAINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    CAP_PAGES_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierRetention]
    calls: int
    refused: int
    expired: int
    ended: int
    displaced: int
    unheld: int
    pending: int
    resumed: int
    retained_pages: int
    cap_pages: int
    def __init__(self, sessions: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierRetention, _Mapping]]] = ..., calls: _Optional[int] = ..., refused: _Optional[int] = ..., expired: _Optional[int] = ..., ended: _Optional[int] = ..., displaced: _Optional[int] = ..., unheld: _Optional[int] = ..., pending: _Optional[int] = ..., resumed: _Optional[int] = ..., retained_pages: _Optional[int] = ..., cap_pages: _Optional[int] = ...) -> None: ...

class TierRetention(_message.Message):
    __slots__ = ("tier", "pages", "held_pages", "hold_cap_pages")
    TIER_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    HELD_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOLD_CAP_PAGES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    pages: int
    held_pages: int
    hold_cap_pages: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., pages: _Optional[int] = ..., held_pages: _Optional[int] = ..., hold_cap_pages: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "available", "detail", "capacity_bytes", "used_bytes", "slot_bytes", "slots_total", "slots_used", "pages", "hits", "misses", "evictions", "promotions", "demotions", "bytes_in", "bytes_out", "checksum_failures", "dropped", "not_admitted")
    TIER_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    NOT_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    available: bool
    detail: str
    capacity_bytes: int
    used_bytes: int
    slot_bytes: int
    slots_total: int
    slots_used: int
    pages: int
    hits: int
    misses: int
    evictions: int
    promotions: int
    demotions: int
    bytes_in: int
    bytes_out: int
    checksum_failures: int
    dropped: int
    not_admitted: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., available: _Optional[bool] = ..., detail: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., slots_total: _Optional[int] = ..., slots_used: _Optional[int] = ..., pages: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., dropped: _Optional[int] = ..., not_admitted: _Optional[int] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace", "layout", "pages", "page_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout: PageLayout
    pages: int
    page_bytes: int
    def __init__(self, namespace: _Optional[str] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ..., pages: _Optional[int] = ..., page_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node_id", "uptime_seconds", "max_page_bytes", "tiers", "namespaces", "lookups", "lookup_blocks", "lookup_matched", "prefetch_issued", "prefetch_completed", "pinned_pages", "put_rejected", "version", "index", "prefetch_used", "prefetch_wasted", "planes", "host_id", "tenants", "corrupt_reports", "corrupt_confirmed", "scrubbed_bytes", "kv_events", "checksum_form", "corrupt_unconfirmed", "corrupt_unchecked", "retention", "replication", "max_pages_per_request")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MATCHED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_ISSUED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PUT_REJECTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_USED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_WASTED_FIELD_NUMBER: _ClassVar[int]
    PLANES_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_REPORTS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    SCRUBBED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FORM_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_UNCONFIRMED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_UNCHECKED_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    MAX_PAGES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    uptime_seconds: float
    max_page_bytes: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    lookups: int
    lookup_blocks: int
    lookup_matched: int
    prefetch_issued: int
    prefetch_completed: int
    pinned_pages: int
    put_rejected: int
    version: str
    index: IndexStats
    prefetch_used: int
    prefetch_wasted: int
    planes: _containers.RepeatedCompositeFieldContainer[DataPlaneInfo]
    host_id: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    corrupt_reports: int
    corrupt_confirmed: int
    scrubbed_bytes: int
    kv_events: KvEventsStats
    checksum_form: ChecksumForm
    corrupt_unconfirmed: int
    corrupt_unchecked: int
    retention: RetentionStats
    replication: ReplicationStats
    max_pages_per_request: int
    def __init__(self, node_id: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., max_page_bytes: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., lookups: _Optional[int] = ..., lookup_blocks: _Optional[int] = ..., lookup_matched: _Optional[int] = ..., prefetch_issued: _Optional[int] = ..., prefetch_completed: _Optional[int] = ..., pinned_pages: _Optional[int] = ..., put_rejected: _Optional[int] = ..., version: _Optional[str] = ..., index: _Optional[_Union[IndexStats, _Mapping]] = ..., prefetch_used: _Optional[int] = ..., prefetch_wasted: _Optional[int] = ..., planes: _Optional[_Iterable[_Union[DataPlaneInfo, _Mapping]]] = ..., host_id: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., corrupt_reports: _Optional[int] = ..., corrupt_confirmed: _Optional[int] = ..., scrubbed_bytes: _Optional[int] = ..., kv_events: _Optional[_Union[KvEventsStats, _Mapping]] = ..., checksum_form: _Optional[_Union[ChecksumForm, str]] = ..., corrupt_unconfirmed: _Optional[int] = ..., corrupt_unchecked: _Optional[int] = ..., retention: _Optional[_Union[RetentionStats, _Mapping]] = ..., replication: _Optional[_Union[ReplicationStats, _Mapping]] = ..., max_pages_per_request: _Optional[int] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "source", "layout", "replicas")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    source: str
    layout: PageLayout
    replicas: int
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., source: _Optional[str] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ..., replicas: _Optional[int] = ...) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ("copied", "already_present", "refused", "failed")
    COPIED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    copied: int
    already_present: int
    refused: int
    failed: int
    def __init__(self, copied: _Optional[int] = ..., already_present: _Optional[int] = ..., refused: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class ReplicationStats(_message.Message):
    __slots__ = ("enabled", "hot_pages", "copies_in", "copy_bytes_in", "copies_out", "copy_bytes_out", "copy_requests", "copies_refused", "copy_failures", "copy_corrupt", "handoff_pages", "served_bytes", "served_pages")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    HOT_PAGES_FIELD_NUMBER: _ClassVar[int]
    COPIES_IN_FIELD_NUMBER: _ClassVar[int]
    COPY_BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    COPIES_OUT_FIELD_NUMBER: _ClassVar[int]
    COPY_BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    COPY_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COPIES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    COPY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    COPY_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_PAGES_FIELD_NUMBER: _ClassVar[int]
    SERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVED_PAGES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    hot_pages: int
    copies_in: int
    copy_bytes_in: int
    copies_out: int
    copy_bytes_out: int
    copy_requests: int
    copies_refused: int
    copy_failures: int
    copy_corrupt: int
    handoff_pages: int
    served_bytes: int
    served_pages: int
    def __init__(self, enabled: _Optional[bool] = ..., hot_pages: _Optional[int] = ..., copies_in: _Optional[int] = ..., copy_bytes_in: _Optional[int] = ..., copies_out: _Optional[int] = ..., copy_bytes_out: _Optional[int] = ..., copy_requests: _Optional[int] = ..., copies_refused: _Optional[int] = ..., copy_failures: _Optional[int] = ..., copy_corrupt: _Optional[int] = ..., handoff_pages: _Optional[int] = ..., served_bytes: _Optional[int] = ..., served_pages: _Optional[int] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("namespace", "hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("dropped", "intact", "unchecked")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    INTACT_FIELD_NUMBER: _ClassVar[int]
    UNCHECKED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    intact: int
    unchecked: int
    def __init__(self, dropped: _Optional[int] = ..., intact: _Optional[int] = ..., unchecked: _Optional[int] = ...) -> None: ...

class KvEventsStats(_message.Message):
    __slots__ = ("endpoint", "queued", "sent_events", "sent_batches", "dropped_events", "snapshots", "subscribers", "send_errors", "refused", "curve")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    SENT_EVENTS_FIELD_NUMBER: _ClassVar[int]
    SENT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBERS_FIELD_NUMBER: _ClassVar[int]
    SEND_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    CURVE_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    queued: int
    sent_events: int
    sent_batches: int
    dropped_events: int
    snapshots: int
    subscribers: int
    send_errors: int
    refused: int
    curve: bool
    def __init__(self, endpoint: _Optional[str] = ..., queued: _Optional[int] = ..., sent_events: _Optional[int] = ..., sent_batches: _Optional[int] = ..., dropped_events: _Optional[int] = ..., snapshots: _Optional[int] = ..., subscribers: _Optional[int] = ..., send_errors: _Optional[int] = ..., refused: _Optional[int] = ..., curve: _Optional[bool] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "tiers", "lookups", "lookup_blocks", "lookup_matched", "get_pages", "get_served", "cross_tenant_misses", "retention")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MATCHED_FIELD_NUMBER: _ClassVar[int]
    GET_PAGES_FIELD_NUMBER: _ClassVar[int]
    GET_SERVED_FIELD_NUMBER: _ClassVar[int]
    CROSS_TENANT_MISSES_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    tiers: _containers.RepeatedCompositeFieldContainer[TenantTier]
    lookups: int
    lookup_blocks: int
    lookup_matched: int
    get_pages: int
    get_served: int
    cross_tenant_misses: int
    retention: RetentionStats
    def __init__(self, tenant: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TenantTier, _Mapping]]] = ..., lookups: _Optional[int] = ..., lookup_blocks: _Optional[int] = ..., lookup_matched: _Optional[int] = ..., get_pages: _Optional[int] = ..., get_served: _Optional[int] = ..., cross_tenant_misses: _Optional[int] = ..., retention: _Optional[_Union[RetentionStats, _Mapping]] = ...) -> None: ...

class TenantTier(_message.Message):
    __slots__ = ("tier", "pages", "quota_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    pages: int
    quota_bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., pages: _Optional[int] = ..., quota_bytes: _Optional[int] = ...) -> None: ...

class DataPlaneInfo(_message.Message):
    __slots__ = ("name", "address", "tls", "uid")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    tls: bool
    uid: int
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., tls: _Optional[bool] = ..., uid: _Optional[int] = ...) -> None: ...

class IndexStats(_message.Message):
    __slots__ = ("url", "connected", "epoch", "queued", "lag_seconds", "flushed", "resyncs", "overflows", "errors", "resync_pending")
    URL_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FLUSHED_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    OVERFLOWS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_PENDING_FIELD_NUMBER: _ClassVar[int]
    url: str
    connected: bool
    epoch: int
    queued: int
    lag_seconds: float
    flushed: int
    resyncs: int
    overflows: int
    errors: int
    resync_pending: bool
    def __init__(self, url: _Optional[str] = ..., connected: _Optional[bool] = ..., epoch: _Optional[int] = ..., queued: _Optional[int] = ..., lag_seconds: _Optional[float] = ..., flushed: _Optional[int] = ..., resyncs: _Optional[int] = ..., overflows: _Optional[int] = ..., errors: _Optional[int] = ..., resync_pending: _Optional[bool] = ...) -> None: ...

class BulkPage(_message.Message):
    __slots__ = ("hash", "offset", "payload_bytes", "checksum", "tier", "buffer")
    HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    offset: int
    payload_bytes: int
    checksum: int
    tier: Tier
    buffer: int
    def __init__(self, hash: _Optional[bytes] = ..., offset: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., buffer: _Optional[int] = ...) -> None: ...

class BulkPutRequest(_message.Message):
    __slots__ = ("open", "pages")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    open: PutOpen
    pages: _containers.RepeatedCompositeFieldContainer[BulkPage]
    def __init__(self, open: _Optional[_Union[PutOpen, _Mapping]] = ..., pages: _Optional[_Iterable[_Union[BulkPage, _Mapping]]] = ...) -> None: ...

class BulkGetRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "no_promote", "targets", "checksum_form", "layout")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    NO_PROMOTE_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FORM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    no_promote: bool
    targets: _containers.RepeatedCompositeFieldContainer[BulkTarget]
    checksum_form: ChecksumForm
    layout: PageLayout
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., no_promote: _Optional[bool] = ..., targets: _Optional[_Iterable[_Union[BulkTarget, _Mapping]]] = ..., checksum_form: _Optional[_Union[ChecksumForm, str]] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ...) -> None: ...

class BulkTarget(_message.Message):
    __slots__ = ("offset", "size", "buffer")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    offset: int
    size: int
    buffer: int
    def __init__(self, offset: _Optional[int] = ..., size: _Optional[int] = ..., buffer: _Optional[int] = ...) -> None: ...

class BulkGetResponse(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[BulkPage]
    def __init__(self, pages: _Optional[_Iterable[_Union[BulkPage, _Mapping]]] = ...) -> None: ...
