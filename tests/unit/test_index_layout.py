"""The index's key layout, entry format, lookup rule and URL forms (pure: no Redis)."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from kvstore.index.acl import CLIENT_RULES, node_rules, tenant_client_rules
from kvstore.index.connect import is_cluster, is_sentinel, parse_cluster_url
from kvstore.index.keys import (
    FIELD_HEX,
    NODES_KEY,
    STRIPES,
    alive_key,
    check_node_id,
    entry_of,
    epoch_key,
    holder,
    holders_of,
    node_key,
    stripe_key,
)
from kvstore.index.lookup import from_entries
from kvstore.names import TierKind
from kvstore.scoping import scope


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def slot_tag(key: str) -> str:
    """The Redis Cluster hash tag of a key (what its slot is computed from)."""
    lo = key.index("{")
    return key[lo + 1 : key.index("}", lo)]


def test_a_namespace_spreads_over_its_stripes_and_node_records_share_one_slot() -> None:
    keys = Counter(entry_of("ns", h(i))[0] for i in range(32_000))
    assert len(keys) == STRIPES and max(keys.values()) < 1.15 * 32_000 / STRIPES  # even, from the hash
    assert len({slot_tag(k) for k in keys}) == STRIPES  # each stripe a slot of its own
    assert {slot_tag(k) for k in (alive_key("n0"), node_key("n1"), epoch_key("n2"), NODES_KEY)} == {"n"}
    key, field = entry_of("ns", h(1))
    assert field == h(1).hex()[:FIELD_HEX] and key == stripe_key("ns", h(1)[0] % STRIPES)
    # A tenant's stripes live under its own prefix (what its ACL user may read), the default's do not.
    assert entry_of(scope("ns", "alice"), h(1))[0].startswith("kvs:v2:t:alice:b:{")
    assert entry_of("ns", h(1))[0].startswith("kvs:v2:b:{") and entry_of("other", h(1))[0] != key


def test_entries_list_every_holder_and_malformed_ones_are_skipped() -> None:
    value = ",".join([holder("n0", 3, 2), holder("gpu-7.rack:a", 12, 3), "junk", "x=1", "=2:2", "y=a:1"])
    assert list(holders_of(value.encode())) == [("n0", 3, 2), ("gpu-7.rack:a", 12, 3)]
    for bad in ("", "a,b", "a=b", "a b", "x" * 201, "tab\there"):
        with pytest.raises(ValueError, match="node_id"):
            check_node_id(bad)
    assert check_node_id("kvstore-node-0.kvstore.svc") == "kvstore-node-0.kvstore.svc"


def test_a_lookup_counts_live_holders_at_their_current_epoch_and_stops_at_the_first_gap() -> None:
    live = {"n0": 3, "n1": 7}
    values = [
        f"{holder('n0', 3, 2)},{holder('n1', 7, 3)}".encode(),  # both count
        f"{holder('n0', 2, 2)},{holder('n1', 7, 3)}".encode(),  # n0's epoch is stale
        f"{holder('dead', 1, 2)},{holder('n0', 3, 9)}".encode(),  # a dead node, an unknown tier: no holder
        holder("n0", 3, 2).encode(),  # after the gap: not matched
    ]
    found = from_entries(values, live)
    assert found.matched == 2
    assert found.holders == [{"n0": TierKind.DRAM, "n1": TierKind.NVME}, {"n1": TierKind.NVME}]
    assert (found.nodes["n0"].leading, found.nodes["n1"].leading, found.nodes["n1"].blocks) == (1, 2, 2)
    assert from_entries([None, values[0]], live).matched == 0
    assert from_entries(values, {}).matched == 0


def test_clients_run_no_lua_and_every_user_may_use_a_cluster() -> None:
    for rules in (CLIENT_RULES, tenant_client_rules("alice")):
        assert "+eval" not in rules and "+script" not in rules and "+set" not in rules
        assert all(c in rules.split() for c in ("+hmget", "+mget", "+cluster|slots", "+command", "+asking"))
    node = node_rules("n0")
    assert all(c in node.split() for c in ("+cluster|slots", "+command", "+asking", "+info", "+script|load"))
    assert "(~kvs:v2:b:* +evalsha +hget +hset +hdel)" in node  # scripts write stripes, nothing deletes one


def test_url_forms() -> None:
    assert (
        is_cluster("rediss+cluster://h:1/") and not is_cluster("redis://h:1/0") and not is_sentinel("redis+cluster://h")
    )
    for url, words in (
        ("redis+cluster:///", "at least one server"),
        ("redis+cluster://h:1/3", "only database 0"),
        ("redis+cluster://h:x", "is not host:port"),
        ("redis+cluster://h:1/?ssl_ca_cert=/ca", "unknown Redis Cluster URL parameters"),
        ("redis://h:1/0", "not a Redis Cluster URL"),
    ):
        with pytest.raises(ValueError, match=words):
            parse_cluster_url(url)
    t = parse_cluster_url("rediss+cluster://u:p%40ss@a:1,[::1]:2,b/?ssl_ca_certs=/ca")
    assert t.nodes == (("a", 1), ("::1", 2), ("b", 6379)) and t.tls and t.ssl_ca_certs == "/ca"
    assert (t.username, t.password) == ("u", "p@ss")
    assert parse_cluster_url("redis+cluster://h:7000").nodes == (("h", 7000),)
    assert parse_cluster_url("redis+cluster://h:7000?ssl_ca_certs=/x").ssl_ca_certs == "/x"
