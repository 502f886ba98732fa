"""The secured cache plane on real nodes: bearer tokens with two roles, TLS and mutual TLS."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import KVStoreClient
from kvstore.config import NodeConfig
from kvstore.errors import PermissionDenied, Unauthenticated, Unavailable
from kvstore.launch import NodeProcess
from kvstore.security import ClientSecurity, TokenAuthenticator
from tests.integration.conftest import LAYOUT, NS, key, page, start_node

WRITE = "w-" + "a" * 30
READ = "r-" + "b" * 30
OPEN = ClientSecurity()  # explicitly nothing, whatever the environment says


def write_tokens(path: Path, *tokens: str) -> Path:
    path.write_text("# kvstore tokens\n" + "\n".join(tokens) + "\n")
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


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, issuer_key: ec.EllipticCurvePrivateKey,
          *, ca: bool, san: list[x509.GeneralName] | None = None) -> x509.Certificate:  # fmt: skip
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))  # fmt: skip
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> tuple[Path, Path]:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip
    return path.with_suffix(".crt"), path.with_suffix(".key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_key, rogue_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca, _ = _write(d / "ca", _cert("kvstore test CA", ca_key, "kvstore test CA", ca_key, ca=True))
    rogue, _ = _write(d / "rogue", _cert("rogue CA", rogue_key, "rogue CA", rogue_key, ca=True))
    skey, ckey = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    san: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    scrt, skey_p = _write(d / "server", _cert("kvstore node", skey, "kvstore test CA", ca_key, ca=False, san=san), skey)
    ccrt, ckey_p = _write(d / "client", _cert("prefill-worker", ckey, "kvstore test CA", ca_key, ca=False), ckey)
    return Pki(ca, scrt, skey_p, ccrt, ckey_p, rogue)


def test_tls_node_serves_clients_that_trust_its_ca_only(tmp_path: Path, pki: Pki) -> None:
    node = start_node(tmp_path, name="tls", extra_args=["--tls-cert", str(pki.server_cert),
                                                        "--tls-key", str(pki.server_key)])  # fmt: skip
    try:
        chain = [key(i, "tls") for i in range(2)]
        with client(node, ca_file=str(pki.ca)) as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
            assert [bytes(p) for p in kv.get(NS, chain)] == [page(h) for h in chain]
        for wrong in ({}, {"ca_file": str(pki.rogue_ca)}):  # plaintext, then a CA that did not sign it
            with client(node, **wrong) as kv, pytest.raises(Unavailable):
                kv.lookup(NS, chain)
    finally:
        node.close()


def test_mutual_tls_requires_a_client_certificate_from_the_ca(tmp_path: Path, pki: Pki) -> None:
    node = start_node(tmp_path, name="mtls", extra_args=["--tls-cert", str(pki.server_cert), "--tls-key",
                                                         str(pki.server_key), "--tls-client-ca", str(pki.ca)])  # fmt: skip
    try:
        with client(node, ca_file=str(pki.ca)) as kv, pytest.raises(Unavailable):
            kv.stats()  # TLS, but no client certificate
        with client(node, ca_file=str(pki.ca), cert_file=str(pki.client_cert), key_file=str(pki.client_key)) as kv:
            assert kv.stats().node_id == "mtls"
    finally:
        node.close()


# -- bad configuration: a clear error, no node --------------------------------------------------------


def test_bad_security_config_is_refused_with_a_clear_error(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(ValueError, match="both tls_cert_file and tls_key_file"):
        NodeConfig(tls_cert_file=str(pki.server_cert))
    with pytest.raises(ValueError, match="no such file"):
        NodeConfig(auth_tokens_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="needs ca_file"):
        ClientSecurity(cert_file=str(pki.client_cert), key_file=str(pki.client_key))
    short = write_tokens(tmp_path / "short.tokens", "secret")
    with pytest.raises(ValueError, match=">= 16 characters"):
        TokenAuthenticator(str(short), None)
    with pytest.raises(RuntimeError, match="16 characters"):
        start_node(tmp_path, name="bad", extra_args=["--auth-tokens-file", str(short)])
