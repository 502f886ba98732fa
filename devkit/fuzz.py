"""Fuzzing the node's wire API with Hypothesis: strategies over the proto messages and raw frames, per
data plane (tests/faults/test_fuzz.py drives them against a real node).

A *plane* (`FuzzPlane`) contributes a strategy of `Case`s: one request (or one Put stream) to send, the
status codes it may get, and whether it may change the node's state. Most cases are a valid request
with at most one field broken, so the expected code is exact; raw-bytes cases expect INVALID_ARGUMENT
when the bytes do not parse and, when they happen to parse, any code but INTERNAL or UNKNOWN. The
invariants the runner checks after every case: the node answers, the code is one expected, and Stats
(less uptime and the count of rejected Puts) is unchanged after every request that may not change state.

The node under test has no background work to change Stats between two reads: DRAM only, large
enough never to evict, and no lease outlives its case (see GrpcUnaryPlane._pin_unpin).

Planes plug in: `default_planes()` gives gRPC unary, gRPC Put streams and raw frames; a data plane adds a
FuzzPlane whose cases speak its own frames (the TCP plane's: devkit/fuzz_tcp.py, the same-host plane's:
devkit/fuzz_shm.py).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.hashing import HASH_BYTES, MAX_NAMESPACE_BYTES
from kvstore.layout import DType, PageLayout
from kvstore.pageformat import payload_checksum
from kvstore.stats import stats_as_dict
from kvstore.wire.answers import stats_from_pb
from kvstore.wire.streams import CHUNK_BYTES, PUT_CHUNK_TAG, frame_chunk, layout_to_pb

SERVICE = "/kvstore.v1.KVStore/"
OK, INVALID, NOT_FOUND = "OK", "INVALID_ARGUMENT", "NOT_FOUND"
# Codes a request may legitimately get; INTERNAL and UNKNOWN mean an unhandled exception on the node.
ANY_HANDLED = frozenset({OK, INVALID, NOT_FOUND, "FAILED_PRECONDITION", "DATA_LOSS", "RESOURCE_EXHAUSTED",
                         "UNIMPLEMENTED", "UNAVAILABLE"})  # fmt: skip
UNPARSEABLE = b"\x0f"  # field 1 with wire type 7: no protobuf message parses it

Send = Callable[["FuzzTarget"], str]


@dataclass(frozen=True, slots=True)
class Case:
    """One fuzzed request: how to send it, the codes it may get, whether it may change node state."""

    plane: str
    label: str
    send: Send
    expect: frozenset[str]
    may_change: bool


class FuzzPlane(Protocol):
    """A data plane's contribution: a strategy of cases against `target` (built once per node)."""

    name: str

    def cases(self, target: FuzzTarget) -> st.SearchStrategy[Case]: ...


@dataclass
class FuzzTarget:
    """A running node, a namespace with stored pages, and raw access to its gRPC methods."""

    addr: str
    ns: str
    layout: PageLayout
    stored: list[bytes]
    channel: grpc.Channel = field(init=False)
    sent: int = 0

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.addr, options=[("grpc.max_receive_message_length", 64 << 20)])

    def close(self) -> None:
        self.channel.close()

    def unary(self, method: str, raw: bytes) -> str:
        self.sent += 1
        call = self.channel.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)
        try:
            call(raw, timeout=30)
            return OK
        except grpc.RpcError as exc:
            return exc.code().name  # type: ignore[no-any-return]

    def stream_out(self, method: str, raw: bytes) -> str:
        self.sent += 1
        call = self.channel.unary_stream(SERVICE + method, request_serializer=None, response_deserializer=None)
        try:
            for _ in call(raw, timeout=30):
                pass
            return OK
        except grpc.RpcError as exc:
            return exc.code().name  # type: ignore[no-any-return]

    def put(self, frames: list[bytes]) -> str:
        self.sent += 1
        call = self.channel.stream_unary(SERVICE + "Put", request_serializer=None, response_deserializer=None)
        try:
            call(iter(frames), timeout=30)
            return OK
        except grpc.RpcError as exc:
            return exc.code().name  # type: ignore[no-any-return]

    def state(self) -> dict[str, object]:
        """What must not change after an invalid request: Stats less uptime and rejected-Put count."""
        raw = self.channel.unary_unary(SERVICE + "Stats", request_serializer=None, response_deserializer=None)(
            b"", timeout=30
        )
        d = stats_as_dict(stats_from_pb(pb.StatsResponse.FromString(raw)))
        for k in ("uptime_seconds", "put_rejected", "scrubbed_bytes"):  # the scrubber runs on its own clock
            d.pop(k)
        return d


def content(h: bytes, n: int) -> bytes:
    return hashlib.shake_256(h).digest(n)


# ------------------------------------------------------------------ value strategies

_text = st.characters(exclude_categories=("Cs",))
bad_namespaces = st.one_of(
    st.just(""),
    st.text(_text, min_size=1, max_size=8).map(lambda s: s + "\x00"),
    st.just("\x7f"),
    st.text(st.characters(min_codepoint=0x61, max_codepoint=0x7A), min_size=MAX_NAMESPACE_BYTES + 1,
            max_size=MAX_NAMESPACE_BYTES + 8),
)  # fmt: skip
_ns_tail = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=24)
fresh_namespaces = _ns_tail.map(lambda s: f"fuzz/unknown/{s}")  # never stored: NOT_FOUND where it matters
new_namespaces = _ns_tail.map(lambda s: f"fuzz/new/{s}")  # a Put may bind it (then it is known)
bad_hashes = st.binary(max_size=HASH_BYTES + 8).filter(lambda b: len(b) != HASH_BYTES)
random_hashes = st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES)
bad_tiers = st.one_of(st.integers(4, 2**31 - 1), st.integers(-(2**31), -1))
bad_ttls = st.one_of(st.just(math.nan), st.just(math.inf), st.just(-math.inf),
                     st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False))  # fmt: skip


def _hashes(t: FuzzTarget) -> st.SearchStrategy[list[bytes]]:
    return st.lists(st.one_of(st.sampled_from(t.stored), random_hashes), max_size=8)


def _with_bad_hash(t: FuzzTarget) -> st.SearchStrategy[list[bytes]]:
    return st.tuples(_hashes(t), bad_hashes, st.integers(0, 8)).map(lambda x: [*x[0][: x[2]], x[1], *x[0][x[2] :]])


# ------------------------------------------------------------------ planes


class GrpcUnaryPlane:
    """Lookup, Get, Delete, Pin, Unpin, Prefetch and Stats as messages, one field broken at most."""

    name = "grpc-unary"

    def cases(self, t: FuzzTarget) -> st.SearchStrategy[Case]:
        ns = st.just(t.ns)

        def unary(method: str, label: str, expect: str, may_change: bool = False) -> Callable[[Message], Case]:
            def make(msg: Message) -> Case:
                raw = msg.SerializeToString()
                send: Send = (
                    (lambda tg: tg.stream_out(method, raw)) if method == "Get" else (lambda tg: tg.unary(method, raw))
                )
                return Case(self.name, f"{method}: {label}", send, frozenset({expect}), may_change)

            return make

        L, G, D, P, U, F = (
            pb.LookupRequest,
            pb.GetRequest,
            pb.DeleteRequest,
            pb.PinRequest,
            pb.UnpinRequest,
            pb.PrefetchRequest,
        )
        return st.one_of(
            st.builds(L, namespace=st.one_of(ns, fresh_namespaces), hashes=_hashes(t), prefetch=st.booleans()).map(unary("Lookup", "valid", OK, True)),
            st.builds(L, namespace=bad_namespaces, hashes=_hashes(t)).map(unary("Lookup", "bad namespace", INVALID)),
            st.builds(L, namespace=ns, hashes=_with_bad_hash(t)).map(unary("Lookup", "bad hash", INVALID)),
            st.builds(G, namespace=ns, hashes=_hashes(t), no_promote=st.booleans()).map(unary("Get", "valid", OK, True)),
            st.builds(G, namespace=fresh_namespaces, hashes=_hashes(t)).map(unary("Get", "unknown namespace", NOT_FOUND)),
            st.builds(G, namespace=bad_namespaces, hashes=_hashes(t)).map(unary("Get", "bad namespace", INVALID)),
            st.builds(G, namespace=ns, hashes=_with_bad_hash(t)).map(unary("Get", "bad hash", INVALID)),
            st.builds(D, namespace=ns, hashes=st.lists(random_hashes, max_size=4)).map(unary("Delete", "valid", OK, True)),
            st.builds(D, namespace=ns, hashes=_with_bad_hash(t)).map(unary("Delete", "bad hash", INVALID)),
            st.builds(D, namespace=fresh_namespaces, hashes=_hashes(t)).map(unary("Delete", "unknown namespace", NOT_FOUND)),
            _hashes(t).map(lambda hs: self._pin_unpin(t.ns, hs)),
            st.builds(P, namespace=ns, hashes=_hashes(t), ttl_seconds=bad_ttls).map(unary("Pin", "bad ttl", INVALID)),
            st.builds(P, namespace=ns, hashes=_with_bad_hash(t), ttl_seconds=st.just(0.1)).map(unary("Pin", "bad hash", INVALID)),
            st.builds(U, namespace=ns, hashes=st.lists(random_hashes, max_size=4)).map(unary("Unpin", "valid", OK, True)),
            st.builds(U, namespace=bad_namespaces, hashes=_hashes(t)).map(unary("Unpin", "bad namespace", INVALID)),
            st.builds(F, namespace=ns, hashes=_hashes(t), target_tier=st.sampled_from([0, pb.TIER_HBM, pb.TIER_DRAM])).map(unary("Prefetch", "valid", OK, True)),
            st.builds(F, namespace=ns, hashes=_hashes(t), target_tier=st.just(pb.TIER_NVME)).map(unary("Prefetch", "target NVMe", INVALID)),
            st.builds(F, namespace=ns, hashes=_hashes(t), target_tier=bad_tiers).map(unary("Prefetch", "unknown target_tier", INVALID)),
            st.builds(F, namespace=fresh_namespaces, hashes=_hashes(t)).map(unary("Prefetch", "unknown namespace", NOT_FOUND)),
            st.just(pb.StatsRequest()).map(unary("Stats", "valid", OK)),
        )  # fmt: skip

    def _pin_unpin(self, ns: str, hashes: list[bytes]) -> Case:
        """A valid Pin and its Unpin in one case: pins (and leases, which expire on the node's own clock)
        must not outlive the case, or Stats would change under the next one."""
        pin = pb.PinRequest(namespace=ns, hashes=hashes).SerializeToString()
        unpin = pb.UnpinRequest(namespace=ns, hashes=hashes).SerializeToString()

        def send(tg: FuzzTarget) -> str:
            code = tg.unary("Pin", pin)
            return code if code != OK else tg.unary("Unpin", unpin)

        return Case(self.name, "Pin+Unpin: valid", send, frozenset({OK}), True)


PUT_MUTATIONS = ("none", "fresh namespace", "no open", "open twice", "bad target_tier", "bad namespace",
                 "dtype unset", "other layout", "oversize layout", "bad hash", "wrong payload_bytes",
                 "wrong checksum", "truncated", "extra byte", "chunk first", "empty message", "unparseable frame")  # fmt: skip
_PUT_EXPECT = {"none": OK, "fresh namespace": OK, "other layout": "FAILED_PRECONDITION", "wrong checksum": "DATA_LOSS"}


class GrpcPutPlane:
    """Put streams: a valid stream of 1-3 new pages with at most one framing or field error."""

    name = "grpc-put"

    def cases(self, t: FuzzTarget) -> st.SearchStrategy[Case]:
        return st.builds(self._case, st.just(t), st.sampled_from(PUT_MUTATIONS), st.lists(random_hashes, min_size=1, max_size=3),
                         new_namespaces, bad_namespaces, bad_tiers, bad_hashes)  # fmt: skip

    def _case(self, t: FuzzTarget, mut: str, hashes: list[bytes], fresh: str, bad_ns: str, bad_tier: int,
              bad_hash: bytes) -> Case:  # fmt: skip
        n = t.layout.page_bytes
        ns = fresh if mut == "fresh namespace" else bad_ns if mut == "bad namespace" else t.ns
        layout = layout_to_pb(t.layout)
        if mut == "dtype unset":
            layout.dtype = 0
        elif mut == "other layout":
            layout.num_layers += 1
        elif mut == "oversize layout":
            layout.num_layers = 4096
        opener = pb.PutRequest(open=pb.PutOpen(namespace=ns, layout=layout,
                                               target_tier=bad_tier if mut == "bad target_tier" else 0))  # fmt: skip
        expect = _PUT_EXPECT.get(mut, INVALID)

        def send(tg: FuzzTarget) -> str:
            # Fresh keys at every send: a page stored already is accepted without its bytes (first writer
            # wins), which would make a wrong checksum OK; drawn hashes repeat, above all when shrinking.
            # Distinct within the stream too: a repeated page is "already present" and its bytes unchecked.
            fresh = [
                hashlib.sha256(h + tg.sent.to_bytes(8, "little") + bytes([i])).digest() for i, h in enumerate(hashes)
            ]
            return tg.put(self._frames(opener, mut, fresh, bad_hash, n))

        return Case(self.name, f"Put: {mut}", send, frozenset({expect}), expect == OK)

    @staticmethod
    def _frames(opener: pb.PutRequest, mut: str, hashes: list[bytes], bad_hash: bytes, n: int) -> list[bytes]:
        frames = [opener.SerializeToString()]
        if mut == "open twice":
            frames.append(frames[0])
        for i, h in enumerate(hashes):
            data = content(h, n)
            last = i == len(hashes) - 1
            csum = payload_checksum(data) ^ (1 if mut == "wrong checksum" and last else 0)
            hh = bad_hash if mut == "bad hash" and last else h
            size = n + 1 if mut == "wrong payload_bytes" and last else n
            frames.append(
                pb.PutRequest(page=pb.PutPage(hash=hh, payload_bytes=size, checksum=csum)).SerializeToString()
            )
            body = data[:-1] if mut == "truncated" and last else data + b"x" if mut == "extra byte" and last else data
            frames += [frame_chunk(PUT_CHUNK_TAG, body[o : o + CHUNK_BYTES]) for o in range(0, len(body), CHUNK_BYTES)]
        if mut == "no open":
            frames = frames[1:]
        elif mut == "chunk first":
            frames.insert(1, frame_chunk(PUT_CHUNK_TAG, b"x"))
        elif mut == "empty message":
            frames.insert(1, b"")
        elif mut == "unparseable frame":
            frames.insert(len(frames) // 2 + 1, UNPARSEABLE)
        return frames


_MESSAGES: dict[str, type[Message]] = {
    "Lookup": pb.LookupRequest, "Get": pb.GetRequest, "Delete": pb.DeleteRequest, "Pin": pb.PinRequest,
    "Unpin": pb.UnpinRequest, "Prefetch": pb.PrefetchRequest, "Stats": pb.StatsRequest,
    "Report": pb.ReportRequest, "Put": pb.PutRequest,
}  # fmt: skip


def _parses(cls: type[Message], raw: bytes) -> bool:
    try:
        cls.FromString(raw)
        return True
    except DecodeError:
        return False


def _no_lease(x: tuple[str, bytes]) -> bool:
    """Not a Pin that parses with a lease: a lease expires on the node's clock, changing Stats later."""
    method, raw = x
    if method != "Pin" or not _parses(pb.PinRequest, raw):
        return True
    return pb.PinRequest.FromString(raw).ttl_seconds == 0


class RawFramePlane:
    """Arbitrary bytes as any request message (and as Put stream frames), and strings that are not UTF-8."""

    name = "raw-frames"

    def cases(self, t: FuzzTarget) -> st.SearchStrategy[Case]:
        valid = pb.GetRequest(namespace=t.ns, hashes=t.stored[:2]).SerializeToString()  # a shape most messages share
        mutated = st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)).map(
            lambda x: valid[: x[0]] + bytes([x[1]]) + valid[x[0] + 1 :]
        )
        raw = st.one_of(st.binary(max_size=96), mutated,
                        st.binary(max_size=8).map(lambda b: b"\x0a\x04\xff\xfe\xfd\xfc" + b))  # fmt: skip
        return st.tuples(st.sampled_from(sorted(_MESSAGES)), raw).filter(_no_lease).map(lambda x: self._case(*x))

    def _case(self, method: str, raw: bytes) -> Case:
        cls = _MESSAGES[method]
        expect = frozenset({INVALID}) if not _parses(cls, raw) else ANY_HANDLED
        if method == "Put":
            return Case(self.name, "Put: raw frame", lambda tg: tg.put([raw]), expect, expect is ANY_HANDLED)
        if method == "Get":
            return Case(self.name, "Get: raw", lambda tg: tg.stream_out("Get", raw), expect, expect is ANY_HANDLED)
        return Case(self.name, f"{method}: raw", lambda tg: tg.unary(method, raw), expect, expect is ANY_HANDLED)


def default_planes() -> list[FuzzPlane]:
    """The gRPC planes every node serves; the data planes append theirs (devkit/fuzz_tcp.py, fuzz_shm.py)."""
    return [GrpcUnaryPlane(), GrpcPutPlane(), RawFramePlane()]


def setup_target(addr: str, ns: str = "fuzz/base", pages: int = 8) -> FuzzTarget:
    """A target with `pages` stored pages under `ns` (so known-namespace cases have something to hit)."""
    # 2 KiB pages, half the fuzz node's max_page_bytes (4 KiB): one layer more is another valid layout.
    layout = PageLayout(DType.FLOAT16, num_layers=1, num_kv_heads=1, head_dim=32, block_size=16)
    stored = [hashlib.sha256(f"fuzz-base-{i}".encode()).digest() for i in range(pages)]
    t = FuzzTarget(addr, ns, layout, stored)
    frames = [pb.PutRequest(open=pb.PutOpen(namespace=ns, layout=layout_to_pb(layout))).SerializeToString()]
    for h in stored:
        data = content(h, layout.page_bytes)
        frames.append(pb.PutRequest(page=pb.PutPage(hash=h, payload_bytes=len(data))).SerializeToString())
        frames.append(frame_chunk(PUT_CHUNK_TAG, data))
    if (code := t.put(frames)) != OK:
        raise RuntimeError(f"fuzz setup Put failed: {code}")
    return t


@dataclass
class FuzzLog:
    """What a fuzz run saw: requests per plane and label, and every violation."""

    by_label: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    requests: int = 0

    def check(self, t: FuzzTarget, case: Case, before: dict[str, object] | None) -> dict[str, object] | None:
        """Send one case and check the invariants (violations are appended to `violations`); returns the
        state to compare the next case against."""
        if before is None and not case.may_change:
            before = t.state()
        code = case.send(t)
        self.requests += 1
        key = f"{case.plane} | {case.label} -> {code}"
        self.by_label[key] = self.by_label.get(key, 0) + 1
        if code not in case.expect:
            self.violations.append(f"{case.plane} {case.label}: got {code}, expected {sorted(case.expect)}")
        if case.may_change and code == OK:
            return None
        after = t.state()
        if before is not None and after != before:
            diff = {k: (before.get(k), after.get(k)) for k in after if before.get(k) != after.get(k)}
            self.violations.append(f"{case.plane} {case.label} ({code}) changed Stats: {diff}")
        return after


def run_fuzz(
    target: FuzzTarget, requests: int, planes: list[FuzzPlane] | None = None, per_example: int = 10
) -> FuzzLog:
    """Send at least `requests` fuzzed cases, each plane equally often, `per_example` per Hypothesis
    example; raises (with Hypothesis's shrunk example) at the first batch that breaks an invariant."""
    planes = default_planes() if planes is None else planes
    per_plane = [p.cases(target) for p in planes]
    cases = st.integers(0, len(planes) - 1).flatmap(lambda i: per_plane[i])
    log = FuzzLog()

    @settings(max_examples=-(-requests // per_example), deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.lists(cases, min_size=per_example, max_size=per_example))
    def run(batch: list[Case]) -> None:
        before = None
        seen = len(log.violations)
        for case in batch:
            before = log.check(target, case, before)
        assert len(log.violations) == seen, log.violations[seen:]

    run()
    return log
