"""The secured cache plane on real nodes: bearer tokens with two roles, TLS and mutual TLS."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devkit.pki import DevPki, make_dev_pki
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.config import NodeConfig
from kvstore.errors import PermissionDenied, Unauthenticated, Unavailable
from kvstore.security import ClientSecurity, TokenAuthenticator
from tests.integration.conftest import LAYOUT, NS, key, page, start_node

WRITE = "w-" + "a" * 30
READ = "r-" + "b" * 30
OPEN = ClientSecurity()  # explicitly nothing, whatever the environment says


def write_tokens(path: Path, *tokens: str) -> Path:
    path.write_text("# kvstore tokens\n" + "\n".join(tokens) + "\n")
    path.chmod(0o600)  # a node refuses token files other users can read
    return path


@pytest.fixture
def auth_node(tmp_path: Path) -> Iterator[NodeProcess]:
    w = write_tokens(tmp_path / "write.tokens", WRITE)
    r = write_tokens(tmp_path / "read.tokens", READ)
    node = start_node(
        tmp_path, name="sec", extra_args=["--auth-tokens-file", str(w), "--auth-read-tokens-file", str(r)]
    )
    try:
        yield node
    finally:
        node.close()


def client(node: NodeProcess, token: str | None = None, **tls: str) -> KVStoreClient:
    return KVStoreClient(node.addr, timeout=10, security=ClientSecurity(token=token, **tls))


def test_tokens_gate_every_call_and_a_rejected_call_changes_nothing(auth_node: NodeProcess) -> None:
    chain = [key(i, "sec") for i in range(3)]
    pages = [page(h) for h in chain]
    for who in (None, "x" * 40):  # no token, then an unknown one
        with client(auth_node, who) as kv:
            for call in (lambda kv=kv: kv.put(NS, LAYOUT, chain, pages), lambda kv=kv: kv.lookup(NS, chain),
                         lambda kv=kv: kv.get(NS, chain), lambda kv=kv: kv.stats()):  # fmt: skip
                with pytest.raises(Unauthenticated):
                    call()
    with client(auth_node, READ) as ro:
        with pytest.raises(PermissionDenied, match="read-write token"):
            ro.put(NS, LAYOUT, chain, pages)
        assert ro.stats().put_rejected == 0 and all(t.pages == 0 for t in ro.stats().tiers)  # nothing stored
    with client(auth_node, WRITE) as rw:
        assert rw.put(NS, LAYOUT, chain, pages).stored == 3
    with client(auth_node, READ) as ro:
        assert ro.lookup(NS, chain) == 3
        assert [bytes(p) for p in ro.get(NS, chain)] == pages
        for write in (lambda: ro.delete(NS, chain), lambda: ro.pin(NS, chain), lambda: ro.unpin(NS, chain)):
            with pytest.raises(PermissionDenied):
                write()
        assert ro.lookup(NS, chain) == 3  # the refused delete removed nothing


def test_health_stays_open_and_reflection_is_off_on_a_secured_node(auth_node: NodeProcess) -> None:
    with grpc.insecure_channel(auth_node.addr) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        with pytest.raises(grpc.RpcError) as err:
            list(refl(iter([b""]), timeout=10))
        assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED


def test_token_files_are_reread_so_tokens_rotate_without_a_restart(tmp_path: Path, auth_node: NodeProcess) -> None:
    new = "w2-" + "c" * 30
    write_tokens(tmp_path / "write.tokens", WRITE, new)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # the node checks its files at most once a second
        try:
            with client(auth_node, new) as kv:
                kv.stats()
            break
        except Unauthenticated:
            time.sleep(0.2)
    else:
        raise AssertionError("the added token was never accepted")
    write_tokens(tmp_path / "write.tokens", new)  # retire the old one
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            with client(auth_node, WRITE) as kv:
                kv.stats()
            time.sleep(0.2)
        except Unauthenticated:
            break
    else:
        raise AssertionError("the retired token was still accepted")


def test_clients_and_kvctl_take_credentials_from_the_environment(auth_node: NodeProcess) -> None:
    sec = ClientSecurity.from_env({"KVSTORE_TOKEN": READ})
    with KVStoreClient(auth_node.addr, timeout=10, security=sec) as kv:
        assert kv.stats().node_id == "sec"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    cmd = [sys.executable, "-m", "kvstore.cli.kvctl", "stats", "--addr", auth_node.addr, "--json"]
    denied = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60, env=env)
    assert denied.returncode != 0 and "KVSTORE_TOKEN" in denied.stderr
    ok = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60, env={**env, "KVSTORE_TOKEN": READ})
    assert ok.returncode == 0 and '"node_id": "sec"' in ok.stdout


# -- TLS ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return make_dev_pki(tmp_path_factory.mktemp("pki"))


def test_tls_node_serves_clients_that_trust_its_ca_only(tmp_path: Path, pki: DevPki) -> None:
    node = start_node(tmp_path, name="tls", extra_args=["--tls-cert", str(pki.node_cert),
                                                        "--tls-key", str(pki.node_key)])  # fmt: skip
    try:
        chain = [key(i, "tls") for i in range(2)]
        with client(node, ca_file=str(pki.ca)) as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
            assert [bytes(p) for p in kv.get(NS, chain)] == [page(h) for h in chain]
        for wrong in ({}, {"ca_file": str(pki.other_ca)}):  # plaintext, then a CA that did not sign it
            with client(node, **wrong) as kv, pytest.raises(Unavailable):
                kv.lookup(NS, chain)
    finally:
        node.close()


def test_mutual_tls_requires_a_client_certificate_from_the_ca(tmp_path: Path, pki: DevPki) -> None:
    node = start_node(tmp_path, name="mtls", extra_args=["--tls-cert", str(pki.node_cert), "--tls-key",
                                                         str(pki.node_key), "--tls-client-ca", str(pki.ca)])  # fmt: skip
    try:
        with client(node, ca_file=str(pki.ca)) as kv, pytest.raises(Unavailable):
            kv.stats()  # TLS, but no client certificate
        with client(node, ca_file=str(pki.ca), cert_file=str(pki.client_cert), key_file=str(pki.client_key)) as kv:
            assert kv.stats().node_id == "mtls"
    finally:
        node.close()


# -- bad configuration: a clear error, no node --------------------------------------------------------


def test_bad_security_config_is_refused_with_a_clear_error(tmp_path: Path, pki: DevPki) -> None:
    with pytest.raises(ValueError, match="both tls_cert_file and tls_key_file"):
        NodeConfig(tls_cert_file=str(pki.node_cert))
    with pytest.raises(ValueError, match="no such file"):
        NodeConfig(auth_tokens_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="needs ca_file"):
        ClientSecurity(cert_file=str(pki.client_cert), key_file=str(pki.client_key))
    short = write_tokens(tmp_path / "short.tokens", "secret")
    with pytest.raises(ValueError, match=">= 16 characters"):
        TokenAuthenticator(str(short), None)
    with pytest.raises(RuntimeError, match="16 characters"):
        start_node(tmp_path, name="bad", extra_args=["--auth-tokens-file", str(short)])
