"""Pure parts of the secured plane and of the data-plane choice: token roles, header parsing, targets."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.client.core import is_loopback, plane_names, transport_mode
from kvstore.errors import PermissionDenied, Unauthenticated
from kvstore.security import ClientSecurity, Role, TokenAuthenticator, read_token_file
from kvstore.transport import shm
from kvstore.transport.shm.client import SegmentPool

RW, RO = "rw-token-" + "1" * 20, "ro-token-" + "2" * 20


@pytest.fixture
def auth(tmp_path: Path) -> TokenAuthenticator:
    (tmp_path / "rw").write_text(f"# writers\n\n{RW}\n")
    (tmp_path / "ro").write_text(f"{RO}\n")
    return TokenAuthenticator(str(tmp_path / "rw"), str(tmp_path / "ro"))


def test_roles_from_bearer_metadata(auth: TokenAuthenticator) -> None:
    assert auth.role_of([("authorization", f"Bearer {RW}")]) is Role.WRITE
    assert auth.role_of([("Authorization", f"bearer  {RO} ".encode())]) is Role.READ  # case, bytes, spaces
    for md in (None, [], [("authorization", RW)], [("authorization", "Basic abc")], [("x-token", RW)]):
        with pytest.raises(Unauthenticated):
            auth.role_of(md)
    with pytest.raises(Unauthenticated, match="unknown"):
        auth.role_of([("authorization", "Bearer " + "9" * 30)])


def test_read_tokens_may_not_write(auth: TokenAuthenticator) -> None:
    ro = [("authorization", f"Bearer {RO}")]
    for method in ("Lookup", "Get", "GetShm", "Prefetch", "Stats"):
        auth.check(method, ro)
    for method in ("Put", "PutShm", "Delete", "Pin", "Unpin"):
        with pytest.raises(PermissionDenied, match=method):
            auth.check(method, ro)
        auth.check(method, [("authorization", f"Bearer {RW}")])


def test_token_files_are_validated(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("# nothing\n")
    (tmp_path / "spaces").write_text("a token with spaces in it\n")
    for name in ("empty", "spaces"):
        with pytest.raises(ValueError):
            read_token_file(tmp_path / name)
    with pytest.raises(ValueError, match="at least one"):
        TokenAuthenticator(None, None)


def test_client_security_from_env(tmp_path: Path) -> None:
    (tmp_path / "t").write_text(f"{RO}\n")
    sec = ClientSecurity.from_env({"KVSTORE_TOKEN_FILE": str(tmp_path / "t"), "KVSTORE_TLS_CA": "ca.pem"})
    assert sec.token == RO and sec.tls and sec.metadata() == (("authorization", f"Bearer {RO}"),)
    assert ClientSecurity.from_env({}).metadata() is None and not ClientSecurity.from_env({}).tls
    with pytest.raises(ValueError, match="both"):
        ClientSecurity(ca_file="ca.pem", cert_file="c.pem")


@pytest.mark.parametrize(
    ("target", "loopback"),
    [("127.0.0.1:5", True), ("localhost:5", True), ("[::1]:5", True), ("127.8.9.10:5", True),
     ("10.0.0.3:5", False), ("node-0.kvstore:5", False), ("ipv4:127.0.0.1:5", True)],
)  # fmt: skip
def test_loopback_targets(target: str, loopback: bool) -> None:
    assert is_loopback(target) is loopback


def test_transport_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plane_names("10.0.0.3:5", transport_mode(None)) == ["grpc"]  # another host: gRPC streams
    assert plane_names("127.0.0.1:5", transport_mode("grpc")) == ["grpc"]
    monkeypatch.setenv("KVSTORE_TRANSPORT", "grpc")
    assert plane_names("127.0.0.1:5", transport_mode(None)) == ["grpc"]
    with pytest.raises(ValueError, match="transport must be one of"):
        transport_mode("ucx")
    if shm.shm_available():
        assert plane_names("127.0.0.1:5", transport_mode("auto")) == ["shm", "grpc"]  # shm, then the fallback


def test_segment_pool_reuses_and_grows() -> None:
    if not shm.shm_available():
        pytest.skip("needs /dev/shm")
    pool = SegmentPool()
    try:
        a = pool.acquire(10_000)
        assert a.data_bytes >= 10_000 and a.view[: len(shm.MAGIC)] == shm.MAGIC
        pool.release(a)
        assert pool.acquire(5_000) is a  # big enough: reused
        pool.release(a)
        b = pool.acquire(10 * a.data_bytes)  # too small: replaced by a bigger one
        assert b is not a and b.data_bytes >= 10 * a.data_bytes and not a.path.exists()
        pool.release(b)
    finally:
        pool.close()
    assert not b.path.exists()
