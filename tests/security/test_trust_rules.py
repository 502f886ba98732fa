"""Pure rules of the trust model: where a client may send its token, which name a node's certificate
must carry, and the index's ACL rules (no I/O)."""

from __future__ import annotations

import pytest

from kvstore.index.acl import CLIENT_RULES, acl_line, index_acl, node_rules
from kvstore.security import ClientSecurity, InsecureChannel

pytestmark = pytest.mark.fast  # pure: no process, node or network (tests/conftest.py)

TOKEN = "t" * 24


@pytest.mark.parametrize(
    ("security", "target", "allowed"),
    [
        (ClientSecurity(), "10.0.0.5:50051", True),  # no token: nothing to leak
        (ClientSecurity(token=TOKEN), "127.0.0.1:50051", True),  # a loopback address the caller gave
        (ClientSecurity(token=TOKEN), "10.0.0.5:50051", False),
        (ClientSecurity(token=TOKEN).for_node("n0"), "127.0.0.1:50051", False),  # from the index: even loopback
        (ClientSecurity(token=TOKEN), None, False),  # "any address from the index"
        (ClientSecurity(token=TOKEN, ca_file="ca.pem").for_node("n0"), "10.0.0.5:50051", True),
        (ClientSecurity(token=TOKEN, allow_plaintext_token=True).for_node("n0"), "10.0.0.5:50051", True),
    ],
)  # fmt: skip
def test_where_a_token_may_go(security: ClientSecurity, target: str | None, allowed: bool) -> None:
    if allowed:
        security.check_target(target)
    else:
        with pytest.raises(InsecureChannel, match="KVSTORE_ALLOW_PLAINTEXT_TOKEN"):
            security.check_target(target)


def test_the_name_a_node_certificate_must_carry() -> None:
    tls = ClientSecurity(ca_file="ca.pem")
    assert tls.expected_name() is None and tls.channel_options() == []  # a direct target: its own host
    assert tls.for_node("n0").expected_name() == "n0"
    per_node = ClientSecurity(ca_file="ca.pem", server_name="{node_id}.kv.svc")
    assert per_node.for_node("gpu-7").channel_options() == [("grpc.ssl_target_name_override", "gpu-7.kv.svc")]
    assert per_node.expected_name() is None  # a template means nothing without a node id
    shared = ClientSecurity(ca_file="ca.pem", server_name="kv-node.kv.svc")
    assert shared.for_node("n0").expected_name() == shared.expected_name() == "kv-node.kv.svc"
    assert ClientSecurity(server_name="x").for_node("n0").channel_options() == []  # no TLS, no override


def test_allow_plaintext_token_is_an_explicit_environment_opt_in() -> None:
    assert not ClientSecurity.from_env({"KVSTORE_TOKEN": TOKEN}).allow_plaintext_token
    for on in ("1", "true", "YES"):
        assert ClientSecurity.from_env(
            {"KVSTORE_TOKEN": TOKEN, "KVSTORE_ALLOW_PLAINTEXT_TOKEN": on}
        ).allow_plaintext_token


def test_acl_rules_confine_each_node_to_its_own_keys() -> None:
    rules = node_rules("gpu-host-3")
    assert "~kvs:v2:{n}:alive:gpu-host-3 " in rules and "~kvs:v2:{n}:node:gpu-host-3 " in rules
    assert "+flushall" not in rules and "+del " in rules and "+del" not in rules.split("(", 1)[1]  # own keys only
    assert "+set" not in CLIENT_RULES and "+eval" not in CLIENT_RULES and "+script" not in CLIENT_RULES  # no Lua
    for bad in ("a*", "n[0]", "n 0", "", "x?"):  # glob characters would widen the key patterns
        with pytest.raises(ValueError, match="node id"):
            node_rules(bad)
    lines = index_acl("admin-pw", "client-pw", {"n1": "pw1", "n0": "pw0"})
    assert [ln.split()[1] for ln in lines] == ["default", "kvclient", "kvnode-n0", "kvnode-n1"]
    assert all("pw" not in ln.split()[3] for ln in lines)  # only hashes are written
    assert acl_line("u", "p", "on").startswith("user u on #")
