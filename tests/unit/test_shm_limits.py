"""The same-host plane's shares (kvstore/node/planes/shm_limits.py) and the node's descriptor budget
(kvstore/node/fds.py): pure rules, checked without sockets."""

from __future__ import annotations

import pytest

from kvstore.node.fds import FD_RESERVE, fit_caps, reserve_for
from kvstore.node.planes.shm_limits import Holder, Share, ShmLimits, share
from kvstore.scoping import DEFAULT_TENANT
from kvstore.stats import PlaneInfo, planes_from_json, planes_to_json

READER = Holder("alice", "token:r")
WRITER = Holder("alice", "token:w")
BOB = Holder("bob", "token:b")


def test_one_caller_and_one_tenant_hold_at_most_their_share() -> None:
    s = share("registered buffers", "shm_max_registrations", 8, 0, shared=True)
    assert (s.per_caller, s.per_tenant) == (4, 4)
    for _ in range(4):
        s.take(READER)
    assert "this caller's share" in (s.refusal(READER) or "")
    assert "tenant 'alice'" in (s.refusal(WRITER) or "")  # the same tenant's other caller: its tenant is full
    for _ in range(4):
        s.take(BOB)
    assert "shm_max_registrations (8)" in (s.refusal(Holder("carol", "token:c")) or "")  # node-wide
    s.give(READER, 4)
    assert s.refusal(WRITER) is None and s.held == 4
    with pytest.raises(RuntimeError, match="does not hold"):
        s.give(READER)


def test_the_default_tenant_is_held_to_its_callers_shares_only() -> None:
    s = share("mapped bytes", "shm_max_mapped_bytes", 100, 0, shared=True)
    reader, writer = Holder(DEFAULT_TENANT, "token:r"), Holder(DEFAULT_TENANT, "token:w")
    s.take(reader, 50)
    assert s.refusal(reader, 1) is not None
    assert s.refusal(writer, 50) is None  # a node without tenants: the writer keeps the other half


def test_a_node_without_tokens_shares_nothing_out() -> None:
    s = share("same-host plane connections", "shm_max_connections", 10, 0, shared=False)
    anyone = Holder(DEFAULT_TENANT, "")
    for _ in range(10):
        s.take(anyone)
    assert s.refusal(anyone) is not None
    with pytest.raises(RuntimeError, match="over the limit"):
        s.take(anyone)


def test_handshakes_have_a_room_of_their_own() -> None:
    lim = ShmLimits.build(max_connections=64, per_tenant_connections=0, max_handshakes=0, max_registrations=8,
                          max_mapped_bytes=1 << 30, shared=True)  # fmt: skip
    assert lim.max_handshakes == 8 and lim.connections.per_caller == 32
    for _ in range(8):
        lim.start_handshake()
    assert not lim.can_start_handshake() and lim.connections.refusal(READER) is None
    for _ in range(8):
        lim.end_handshake()
    with pytest.raises(RuntimeError):
        lim.end_handshake()
    assert isinstance(lim.mapped, Share) and lim.mapped.per_tenant == 1 << 29


def test_connection_caps_fit_under_the_descriptor_limit_less_its_reserve() -> None:
    caps = {"tcp_max_connections": 1024, "tcp_max_handshakes": 128, "shm_max_connections": 1024,
            "shm_max_handshakes": 128}  # fmt: skip
    assert fit_caps(1 << 20, caps) == caps  # fits: unchanged
    fitted = fit_caps(1024, caps)
    assert sum(fitted.values()) <= 1024 - reserve_for(1024) and reserve_for(1024) == FD_RESERVE
    assert fitted["tcp_max_connections"] == fitted["shm_max_connections"] > fitted["shm_max_handshakes"] >= 1
    assert all(v >= 1 for v in fit_caps(10, caps).values())  # never zero, however low the limit
    assert reserve_for(100_000) == 25_000


def test_the_advertised_uid_travels_in_the_index_record() -> None:
    planes = [PlaneInfo("shm", "/run/kvstore/node.sock", uid=0), PlaneInfo("tcp", "h:1")]
    assert planes_from_json(planes_to_json(planes)) == planes
    assert planes_from_json('[{"name": "shm", "address": "/x"}]') == [PlaneInfo("shm", "/x")]  # older record
