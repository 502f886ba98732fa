"""Finding 2: a Redis writer cannot make cluster clients send their token to it, nor break their reads;
`kvstore up` starts Redis with a password, protected mode and per-node ACL users."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
import redis

from devkit.pki import DevPki
from kvstore.cli.launch import NodeProcess
from kvstore.cli.redis_procs import RedisProcess
from kvstore.cli.up import terminate
from kvstore.client import KVStoreClient
from kvstore.client.cluster import ClusterClient
from kvstore.index import NODES_KEY, alive_key, entry_of, node_key
from kvstore.index import holder as entry_holder
from kvstore.security import ClientSecurity
from tests.integration.conftest import LAYOUT, NS, key, page, start_node
from tests.security.conftest import READ, WRITE, FakeNode, token_args, wait_for


def register_fake(url: str, node_id: str, addr: str, hashes: list[bytes]) -> None:
    """What anyone who can write the index can do: announce a live node holding `hashes` in HBM."""
    r = redis.Redis.from_url(url)
    r.set(alive_key(node_id), "1", px=120_000)
    r.hset(node_key(node_id), mapping={"addr": addr, "epoch": 1})
    r.sadd(NODES_KEY, node_id)
    for h in hashes:
        key, field = entry_of(NS, h)
        others = (r.hget(key, field) or b"").decode()  # the holders already listed stay listed
        r.hset(key, field, ",".join(x for x in (others, entry_holder(node_id, 1, 1)) if x))
    r.close()


@pytest.fixture
def index(tmp_path: Path) -> Iterator[RedisProcess]:
    r = RedisProcess().start()  # open on purpose: the attacker here is anyone who can write it
    try:
        yield r
    finally:
        r.close()


def holder(tmp_path: Path, url: str, name: str, chain: list[bytes], extra: list[str], token: str | None = None,
           **tls: str) -> NodeProcess:  # fmt: skip
    """A real node holding `chain`, registered in the index."""
    node = start_node(tmp_path, name=name, redis_url=url, extra_args=[*extra, "--index-ttl", "30"])
    try:
        sec = ClientSecurity(token=token, **tls)
        with KVStoreClient(node.addr, timeout=10, security=sec) as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
        with redis.Redis.from_url(url) as r:
            wait_for(lambda: all(f"{name}=".encode() in (r.hget(*entry_of(NS, h)) or b"") for h in chain),
                     what="index entries")  # fmt: skip
    except BaseException:
        node.close()
        raise
    return node


def test_no_token_in_clear_to_an_address_read_from_the_index(tmp_path: Path, index: RedisProcess,
                                                              cleanup: ExitStack) -> None:  # fmt: skip
    chain = [key(i, "leak") for i in range(3)]
    node = holder(tmp_path, index.url, "n0", chain, token_args(tmp_path), token=WRITE)
    cleanup.callback(node.close)
    fake = FakeNode("unimplemented")
    cleanup.callback(fake.stop)
    register_fake(index.url, "evil", fake.addr, chain)
    refused: Exception | None = None
    try:
        with ClusterClient(index.url, timeout=10, security=ClientSecurity(token=READ)) as cc:
            cc.get_pages(NS, chain)
    except Exception as exc:  # whatever happened, the token must not have left
        refused = exc
    assert fake.tokens_seen() == []
    # Refused before anything was sent (kvstore.security.InsecureChannel), saying how to proceed.
    assert isinstance(refused, ValueError) and "KVSTORE_ALLOW_PLAINTEXT_TOKEN" in str(refused)
    # The explicit opt-in for a trusted network works against the real node.
    with KVStoreClient(node.addr, timeout=10, security=ClientSecurity(token=READ, allow_plaintext_token=True)) as kv:
        assert kv.lookup(NS, chain) == 3


def test_over_tls_only_the_node_named_in_the_index_gets_the_token(tmp_path: Path, index: RedisProcess,
                                                                   pki: DevPki, cleanup: ExitStack) -> None:  # fmt: skip
    chain = [key(i, "tls-trust") for i in range(3)]
    cert, pkey = pki.node_certs["n0"]
    tls = ["--tls-cert", str(cert), "--tls-key", str(pkey)]
    node = holder(tmp_path, index.url, "n0", chain, tls + token_args(tmp_path), token=WRITE,
                  ca_file=str(pki.ca), server_name="n0")  # fmt: skip
    cleanup.callback(node.close)
    n1_cert, n1_key = pki.node_certs["n1"]
    rogue_cert, rogue_key = pki.rogue  # type: ignore[misc]
    # One impostor holds a certificate of the right CA but for another node; one a look-alike from another CA.
    impostors = {}
    for name, (crt, k) in (("evil", (n1_cert, n1_key)), ("evil2", (rogue_cert, rogue_key))):
        impostors[name] = fake = FakeNode(
            "wrong-hash", grpc.ssl_server_credentials([(k.read_bytes(), crt.read_bytes())])
        )
        cleanup.callback(fake.stop)
        register_fake(index.url, name, fake.addr, chain)
    with ClusterClient(index.url, timeout=10, security=ClientSecurity(token=READ, ca_file=str(pki.ca))) as cc:
        assert set(cc.lookup(NS, chain).holders[0]) == {"n0", "evil", "evil2"}
        got = cc.get_pages(NS, chain)
    assert [bytes(p.data) for p in got] == [page(h) for h in chain]  # from n0, verified as n0
    assert all(f.calls == [] for f in impostors.values())  # no TLS handshake succeeded: nothing was sent


@pytest.mark.parametrize("mode", ["unimplemented", "garbage", "wrong-hash"])
def test_a_misbehaving_node_is_a_miss_never_an_error(tmp_path: Path, index: RedisProcess, mode: str,
                                                     monkeypatch: pytest.MonkeyPatch, cleanup: ExitStack) -> None:  # fmt: skip
    monkeypatch.setenv("KVSTORE_TRANSPORT", "auto" if mode != "wrong-hash" else "grpc")
    chain = [key(i, f"bad-{mode}") for i in range(3)]
    only_fake = [key(i, f"fake-only-{mode}") for i in range(2)]
    cleanup.callback(holder(tmp_path, index.url, "n0", chain, []).close)
    fake = FakeNode(mode)
    cleanup.callback(fake.stop)
    register_fake(index.url, "evil", fake.addr, chain + only_fake)
    with ClusterClient(index.url, timeout=10, security=ClientSecurity()) as cc:
        got = cc.get_pages(NS, chain)
        assert [bytes(p.data) for p in got] == [page(h) for h in chain]  # the fake failed: n0 served
        assert cc.get_pages(NS, only_fake) == []  # nobody else holds these: a miss
    assert fake.calls, "the fake node was never asked (the test proves nothing)"


def test_kvstore_up_runs_redis_with_a_password_and_read_only_clients(tmp_path: Path) -> None:
    ready = tmp_path / "up.json"
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli.main", "up", "--nodes", "2", "--ready-file", str(ready),
                             "--nvme-root", str(tmp_path / "nvme"), "--dram-bytes", "8MiB", "--nvme-bytes", "0",
                             "--max-page-bytes", "64KiB", "--no-metrics"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_for(ready.exists, timeout=60, what="kvstore up")
        info = json.loads(ready.read_text())
        url = info["redis_url"]
        host, port = url.rsplit("@", 1)[-1].split("/")[0].rsplit(":", 1)
        anonymous = redis.Redis(host=host, port=int(port), socket_timeout=5)
        with pytest.raises(redis.AuthenticationError):  # any local user: no password, no index writes
            anonymous.set(alive_key("evil"), "1")
        client = redis.Redis.from_url(url, socket_timeout=5)  # what workers and kvctl get: read-only
        for write in (lambda: client.set(alive_key("evil"), "1"), lambda: client.sadd(NODES_KEY, "evil"),
                      lambda: client.hset(node_key("node-0"), "addr", "127.0.0.1:1"),
                      lambda: client.eval("return 1", 0)):  # fmt: skip
            with pytest.raises(redis.exceptions.NoPermissionError):
                write()
        assert sorted(x.decode() for x in client.smembers(NODES_KEY)) == ["node-0", "node-1"]
        admin = redis.Redis.from_url((tmp_path / "nvme" / "redis-admin.url").read_text().strip(), socket_timeout=5)
        assert admin.config_get("protected-mode") == {"protected-mode": "yes"}
        admin.close()
        anonymous.close()
        client.close()
    finally:
        terminate(proc, 60.0)


def test_a_node_user_writes_only_its_own_records(tmp_path: Path, cleanup: ExitStack) -> None:
    from kvstore.index.acl import CLIENT_RULES, CLIENT_USER, node_rules, node_user

    users = {CLIENT_USER: ("c" * 24, CLIENT_RULES), **{node_user(n): (n * 12, node_rules(n)) for n in ("n0", "n1")}}
    r = RedisProcess(password="admin-" + "a" * 20, users=users).start()
    cleanup.callback(r.close)
    chain = [key(i, "acl") for i in range(2)]
    # A real node publishes as itself, a client reads as the read-only user.
    cleanup.callback(holder(tmp_path, r.url_for(node_user("n0")), "n0", chain, []).close)
    with ClusterClient(r.url_for(CLIENT_USER), timeout=10, security=ClientSecurity()) as cc:
        assert [bytes(p.data) for p in cc.get_pages(NS, chain)] == [page(h) for h in chain]
    n1 = redis.Redis.from_url(r.url_for(node_user("n1")), socket_timeout=5)
    cleanup.callback(n1.close)
    for write in (lambda: n1.set(alive_key("n0"), "1"), lambda: n1.hset(node_key("n0"), "addr", "127.0.0.1:1"),
                  lambda: n1.delete(entry_of(NS, chain[0])[0]), lambda: n1.srem(NODES_KEY, "n0"),
                  n1.flushall, lambda: n1.config_set("protected-mode", "no")):  # fmt: skip
        with pytest.raises(redis.exceptions.NoPermissionError):
            write()
