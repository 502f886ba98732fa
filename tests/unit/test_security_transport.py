"""Pure parts of the secured plane and of the data-plane choice: token roles, header parsing, targets."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.addresses import is_loopback
from kvstore.client.core import ClientCore, ClientSettings, resolve_transport
from kvstore.client.planes.base import DataPlane, PutResult
from kvstore.client.planes.choice import choose_planes
from kvstore.client.planes.pool import ReceivePool
from kvstore.client.planes.segments import SharedBuffer, SharedBuffers
from kvstore.errors import PermissionDenied, PlaneUnavailable, Unauthenticated
from kvstore.layout import DType, PageLayout
from kvstore.security import ClientSecurity, Role, TokenAuthenticator, read_token_file
from kvstore.stats import PlaneInfo
from kvstore.wire import PutOpen

RW, RO = "rw-token-" + "1" * 20, "ro-token-" + "2" * 20
OPEN, H = PutOpen("ns", PageLayout(DType.UINT8, 1, 1, 1, 1)), b"h" * 32


def private(path: Path, text: str) -> Path:
    """A token file as an operator writes one: mode 0600 (others are refused)."""
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture
def auth(tmp_path: Path) -> TokenAuthenticator:
    private(tmp_path / "rw", f"# writers\n\n{RW}\n")
    private(tmp_path / "ro", f"{RO}\n")
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
    for method in ("Lookup", "Get", "Report", "Stats"):
        auth.check(method, ro)
    for method in ("Put", "Delete", "Pin", "Unpin", "Prefetch"):
        with pytest.raises(PermissionDenied, match=method):
            auth.check(method, ro)
        auth.check(method, [("authorization", f"Bearer {RW}")])


def test_token_files_are_validated(tmp_path: Path) -> None:
    private(tmp_path / "empty", "# nothing\n")
    private(tmp_path / "spaces", "a token with spaces in it\n")
    for name in ("empty", "spaces"):
        with pytest.raises(ValueError):
            read_token_file(tmp_path / name)
    with pytest.raises(ValueError, match="at least one"):
        TokenAuthenticator(None, None)


def test_client_security_from_env(tmp_path: Path) -> None:
    private(tmp_path / "t", f"{RO}\n")
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


ALL_PLANES = {"shm": PlaneInfo("shm"), "tcp": PlaneInfo("tcp", "h:1"), "ucx": PlaneInfo("ucx", "h:2")}
EVERY = {"grpc", "shm", "tcp", "ucx"}


def test_transport_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    # another host, a node with no bulk plane: gRPC streams
    assert choose_planes("auto", same_host=False, advertised={}, client_can=EVERY) == ["grpc"]
    assert choose_planes("auto", same_host=False, advertised=ALL_PLANES, client_can=EVERY) == ["ucx", "tcp", "grpc"]
    assert choose_planes("auto", same_host=False, advertised=ALL_PLANES, client_can={"grpc", "tcp"}) == ["tcp", "grpc"]
    assert choose_planes("auto", same_host=True, advertised=ALL_PLANES, client_can=EVERY) == ["shm", "tcp", "grpc"]
    assert choose_planes("auto", same_host=True, advertised=None, client_can=EVERY) == ["grpc"]  # old node
    assert choose_planes("grpc", same_host=True, advertised=ALL_PLANES, client_can=EVERY) == ["grpc"]
    assert choose_planes("tcp", same_host=True, advertised=ALL_PLANES, client_can=EVERY) == ["tcp"]  # insisted
    monkeypatch.setenv("KVSTORE_TRANSPORT", "grpc")
    assert resolve_transport(None) == "grpc"
    with pytest.raises(ValueError, match="transport must be one of"):
        resolve_transport("carrier-pigeon")
    with pytest.raises(PlaneUnavailable, match="does not serve the tcp"):
        choose_planes("tcp", same_host=False, advertised={}, client_can=EVERY)
    with pytest.raises(ValueError, match="not available in this client"):
        choose_planes("ucx", same_host=False, advertised=ALL_PLANES, client_can={"grpc"})


class _Plane(DataPlane):
    """A plane that refuses (as a node without it does) or answers, to drive ClientCore's fallback."""

    def __init__(self, name: str, refuse: bool) -> None:
        self.name, self.refuse, self.closed = name, refuse, False
        self.pages_per_call = 4

    def put_batch(self, *args: object):  # type: ignore[no-untyped-def, override]
        if self.refuse:
            raise PlaneUnavailable("no")
        return PutResult(0, 0, [False])  # stored nothing, without any operation
        yield

    def get_batch(self, *args: object):  # type: ignore[no-untyped-def, override]
        return []
        yield

    def close(self) -> None:
        self.closed = True


def _run(exchange):  # type: ignore[no-untyped-def]
    try:
        next(exchange)
    except StopIteration as done:
        return done.value
    raise AssertionError("the fake planes yield no operation")


@pytest.mark.parametrize("mode", ["auto", "shm"])
def test_a_refusing_plane_is_given_up_for_good_unless_insisted_on(mode: str) -> None:
    core = ClientCore(ClientSettings("127.0.0.1:5", 4, True, ClientSecurity(), 5.0), "grpc")
    core.transport = mode
    refusing, fallback = _Plane("shm", refuse=True), _Plane("grpc", refuse=False)
    core._planes = (refusing, fallback) if mode == "auto" else (refusing,)
    core._node_checked = True  # no node here to ask for Stats
    if mode == "shm":
        with pytest.raises(PlaneUnavailable):
            _run(core.put(OPEN, [H], [b"x"]))
        return
    assert _run(core.put(OPEN, [H], [b"x"])).stored == 0  # type: ignore[union-attr]
    assert core.plane == "grpc" and refusing.closed and not fallback.closed


def test_receive_pool_blocks_come_back_only_when_nothing_refers_to_them() -> None:
    """The lifetime rule of a plain get's memory: a block is reused only after its last reference is gone."""
    pool = ReceivePool(keep_bytes=0)
    try:
        a = pool.take(10_000)
        a[:] = b"a" * 10_000
        sliced = a[10:20]
        del a
        b = pool.take(10_000)  # `a` is still referred to (by the slice): another block
        b[:] = b"b" * 10_000
        assert bytes(sliced) == b"a" * 10
        mapped = pool.mapped_bytes
        del sliced, b
        for _ in range(100):  # freed blocks are reused: nothing new is mapped
            c = pool.take(10_000)
            c[:1] = b"c"
            del c
        assert pool.mapped_bytes == mapped
        big = pool.take(3 << 20)  # another size class: its own mapping (the free one above may go back)
        assert big.nbytes == 3 << 20 and pool.mapped_bytes >= 3 << 20
    finally:
        pool.close()


def _free_blocks(pool: ReceivePool) -> int:
    return sum(len(a.free) for arenas in pool._arenas.values() for a in arenas)


def test_a_reservation_hands_out_only_the_blocks_claimed() -> None:
    """A same-host get reserves a block per hash; the blocks of pages that did not come back go back at once,
    a claimed one only when nothing refers to it, and every block lies where `placed` says."""
    pool = ReceivePool(keep_bytes=0)
    try:
        with pool.reserve(10_000, 300) as r:
            free_during = _free_blocks(pool)
            assert len(r.placed) == 300 and len({(p.buffer.id, p.offset) for p in r.placed}) == 300
            page = r.claim(5)
            with pytest.raises(ValueError, match="already claimed"):
                r.claim(5)
        assert _free_blocks(pool) == free_during + 299  # all but the claimed one are back
        page[:3] = b"abc"
        spot = r.placed[5]
        assert bytes(spot.buffer.map[spot.offset : spot.offset + 3]) == b"abc"  # `placed` is where it lies
        del page
        assert _free_blocks(pool) == free_during + 300
        r.close()  # idempotent: nothing is given back twice
        assert _free_blocks(pool) == free_during + 300
        with pool.reserve(3 << 20, 30) as big:  # 21 blocks of 3 MiB per 64 MiB arena: two arenas
            assert len({(p.buffer.id, p.offset) for p in big.placed}) == 30
            assert len({p.buffer.id for p in big.placed}) == 2
    finally:
        pool.close()


def test_a_held_reservation_keeps_its_blocks_until_the_node_lets_go() -> None:
    """Blocks lent to a request the node may still be working on stay out of the pool after the call closed
    its reservation (a cancel, a timeout), and come back when the last hold is released (DESIGN.md §8)."""
    pool = ReceivePool(keep_bytes=0)
    try:
        r = pool.reserve(10_000, 8)
        free_during = pool.free_bytes
        release = r.hold()
        release_again = r.hold()
        r.close()  # the call is over, the node is not
        assert pool.free_bytes == free_during
        release()
        release()  # a release runs once
        assert pool.free_bytes == free_during
        release_again()
        assert pool.free_bytes == free_during + 8 * 12_288  # 10,000 bytes round up to 3 pages of 4 KiB
    finally:
        pool.close()


class _OneMapping(SharedBuffers):
    """Registered memory that runs out after one mapping (as memfd_create or mmap do under ENOMEM)."""

    def allocate(self, nbytes: int) -> SharedBuffer:
        if len(self):
            raise OSError(12, "Cannot allocate memory")
        return super().allocate(nbytes)


def test_a_reservation_that_cannot_map_more_gives_back_what_it_took() -> None:
    pool = ReceivePool(_OneMapping(), keep_bytes=0)
    try:
        with pytest.raises(OSError, match="Cannot allocate"):
            pool.reserve(3 << 20, 30)  # 21 blocks fit the first mapping; the second cannot be made
        assert _free_blocks(pool) == 21  # none of the 21 taken is lost
        with pool.reserve(3 << 20, 21) as r:  # and they can all be reserved again
            assert len(r.placed) == 21
    finally:
        pool.close()
