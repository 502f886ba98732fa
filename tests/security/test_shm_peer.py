"""Who answers on the same-host socket (SECURITY.md, round 4, finding 1), with real nodes and a squatter running
as another user (devkit/shm_squatter.py).

Before: clients trusted whoever listened at the socket's path. (A) After a node's SIGTERM removed its socket at the
default path (/tmp/kvstore-node-PORT.sock), uid 65534 bound the path first; (B) in a group-writable socket
directory, a client of another tenant renamed the running node's socket and bound its own. Either way the
victim sent its token and its receive-pool memfd to the squatter, and in (A) the real node then refused to
restart ("another node serves this socket"). Now a client compares the socket's peer (SO_PEERCRED) with the
user the node says over gRPC it runs as, and sends nothing to anyone else (it falls back to the next plane);
a node's default socket lives in a directory only its user may write; and a node restarts past a socket
squatted at its path, naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.cli.waits import free_port
from kvstore.client import KVStoreClient
from kvstore.client.planes.pool import ReceivePool
from kvstore.client.planes.segments import SharedBuffers
from kvstore.client.planes.shm import ShmPlane
from kvstore.errors import PlaneUnavailable
from kvstore.security import ClientSecurity
from kvstore.wire import shm
from kvstore.wire.shm import Kind
from tests.integration.conftest import LAYOUT, NS, PAGE, key, page, start_node
from tests.security.conftest import WRITE, token_args

pytestmark = [
    pytest.mark.skipif(not shm.shm_available(), reason="needs memfd_create and Unix sockets"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the squatter as another user (CI runs as root)"),
]

ROOT = Path(__file__).resolve().parents[2]
SQUATTER = ROOT / "devkit" / "shm_squatter.py"
PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3"  # one another user may run
NOBODY = 65534
TENANT_UID = 20002  # another tenant's client, a member of the socket directory's group
SOCKET_GROUP = 3456
WELCOME = shm.frame(Kind.WELCOME, 0, shm.WELCOME.pack(PAGE, 64, 2))  # a reply that lures a client on


@dataclass
class Squatter:
    """A squatter process and what it saw: `events` is filled once it stopped."""

    proc: subprocess.Popen[str]
    ready: bool
    events: list[dict[str, object]] = field(default_factory=list)

    def messages(self) -> list[dict[str, object]]:
        return [e for e in self.events if e["event"] == "message"]


@contextlib.contextmanager
def squatter(path: Path, uid: int = NOBODY, groups: tuple[int, ...] = ()) -> Iterator[Squatter]:
    """Run devkit/shm_squatter.py as `uid` at `path`; stopped (by its pid) when the block ends."""
    proc = subprocess.Popen(
        [PYTHON, str(SQUATTER), str(path), WELCOME.hex(), "120"],
        user=uid,
        group=uid,
        extra_groups=list(groups),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # "ready", or nothing when it could not bind (it exits)
    s = Squatter(proc, ready=bool(first) and json.loads(first)["event"] == "ready")
    try:
        yield s
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate(timeout=10)
        s.events = [json.loads(line) for line in out.splitlines() if line.strip()]


def as_user(uid: int, groups: tuple[int, ...], code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-c", code, *args], user=uid, group=uid, extra_groups=list(groups), cwd="/",
                          check=False, capture_output=True, text=True, timeout=30)  # fmt: skip


@pytest.fixture
def shared_tmp(request: pytest.FixtureRequest) -> Path:
    """A directory like /tmp (mode 1777) that other users can reach (pytest's tmp_path is root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="kvs-peer-", dir="/tmp"))
    base.chmod(0o1777)
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    return base


def shm_path(node: NodeProcess) -> str:
    with KVStoreClient(node.addr, security=ClientSecurity(token=WRITE)) as kv:
        return next(p.address for p in kv.stats().planes if p.name == "shm")


def round_trip(node: NodeProcess, tag: str, transport: str = "auto") -> str:
    """A put and a get of a few pages; the plane that served them."""
    hs = [key(i, tag) for i in range(3)]
    with KVStoreClient(node.addr, transport=transport, security=ClientSecurity(token=WRITE)) as kv:
        kv.put(NS, LAYOUT, hs, [page(h) for h in hs])
        assert [bytes(p) for p in kv.get(NS, hs)] == [page(h) for h in hs]
        return kv.plane or ""


def no_token_reached(s: Squatter) -> None:
    assert not s.messages(), f"the squatter was sent {len(s.messages())} message(s): {s.messages()[:2]}"
    assert WRITE.encode().hex() not in json.dumps(s.events)


def test_a_client_sends_nothing_to_a_socket_another_user_serves(
    tmp_path: Path, shared_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client side of both cases: whatever socket a client is pointed at (here KVSTORE_LOCAL_SOCKET, as a pod
    is told), it checks who serves it before it sends its token or a descriptor."""
    node = start_node(tmp_path, name="victim", extra_args=token_args(tmp_path))
    try:
        fake = shared_tmp / "fake.sock"
        with squatter(fake) as s:
            assert s.ready
            monkeypatch.setenv("KVSTORE_LOCAL_SOCKET", str(fake))
            assert round_trip(node, "peer-auto") == "tcp"  # auto mode: the next plane, nothing lost
            with pytest.raises(PlaneUnavailable, match=rf"{fake}.*uid {NOBODY}.*uid {os.geteuid()}"):
                round_trip(node, "peer-shm", transport="shm")
        no_token_reached(s)
        assert any(e["event"] == "connection" for e in s.events)  # it was reached, and told nothing
    finally:
        node.close()


def test_case_a_the_default_socket_cannot_be_squatted_and_a_restart_gets_past_it(
    tmp_path: Path, shared_tmp: Path
) -> None:
    """(A): the node stops (SIGTERM removes its socket), another user binds the path the node advertised, the
    node restarts on the same port. Its default socket lives in a directory only the node's user may write,
    so the bind fails; and the restarted node serves, its clients on the same-host plane."""
    port = free_port()
    env = {"TMPDIR": str(shared_tmp), "XDG_RUNTIME_DIR": ""}
    args = [*token_args(tmp_path), "--port", str(port)]
    first = start_node(tmp_path, name="restart", extra_args=args, env=env)
    try:
        path = Path(shm_path(first))
        assert path.is_relative_to(shared_tmp)
    finally:
        first.close()
    assert not path.exists()  # SIGTERM removed it
    with squatter(path) as s:
        again = start_node(tmp_path, name="restart", extra_args=args, env=env)
        try:
            assert round_trip(again, "restart") == "shm"
        finally:
            again.close()
    assert not s.ready, "another user could bind the node's default socket path"
    no_token_reached(s)


def test_a_squatted_default_directory_is_not_used(tmp_path: Path, shared_tmp: Path) -> None:
    """Another user created the node's default socket directory before the node ever ran, with a socket of its
    own in it: the node serves elsewhere, saying which directory it would not use."""
    port = free_port()
    env = {"TMPDIR": str(shared_tmp), "XDG_RUNTIME_DIR": ""}
    expected = Path(shm.default_socket_path(port, env=env))
    made = as_user(NOBODY, (), "import os, sys; os.makedirs(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)",
                   str(expected.parent))  # fmt: skip
    assert made.returncode == 0, made.stderr
    with squatter(expected) as s:
        assert s.ready
        node = start_node(tmp_path, name="dir", extra_args=[*token_args(tmp_path), "--port", str(port)], env=env)
        try:
            served = Path(shm_path(node))
            assert served.parent != expected.parent and served.parent.stat().st_uid == os.geteuid()
            assert str(expected.parent) in node.log_tail(200)
            assert round_trip(node, "dir") == "shm"
        finally:
            node.close()
    no_token_reached(s)


@pytest.fixture
def group_dir(shared_tmp: Path) -> Path:
    """A socket directory as the chart made it before: mode 2770, the clients' group may write it."""
    d = shared_tmp / "hostdir"
    d.mkdir()
    os.chown(d, 0, SOCKET_GROUP)
    d.chmod(0o2770)
    return d


def test_case_b_a_tenant_that_renames_the_socket_and_binds_its_own_gets_nothing(
    tmp_path: Path, group_dir: Path
) -> None:
    """(B): another tenant's client, a member of the socket group, renames the running node's socket in a
    group-writable directory and binds its own: the node's clients check who answers and fall back."""
    sock = group_dir / "node.sock"
    node = start_node(tmp_path, name="renamed", extra_args=[*token_args(tmp_path), "--local-socket", str(sock)])
    try:
        assert round_trip(node, "before") == "shm"
        moved = as_user(TENANT_UID, (SOCKET_GROUP,), "import os, sys; os.rename(sys.argv[1], sys.argv[2])",
                        str(sock), str(group_dir / "moved.sock"))  # fmt: skip
        assert moved.returncode == 0, moved.stderr  # a group-writable directory lets it
        with squatter(sock, TENANT_UID, (SOCKET_GROUP,)) as s:
            assert s.ready
            assert round_trip(node, "after") == "tcp"
            with pytest.raises(PlaneUnavailable, match=f"uid {TENANT_UID}"):
                round_trip(node, "after-shm", transport="shm")
        no_token_reached(s)
    finally:
        node.close()


def test_a_node_restarts_past_a_socket_another_user_squats_naming_it(tmp_path: Path, group_dir: Path) -> None:
    """A socket another user serves at the node's configured path while the node is down: the node replaces it
    at start (it may: it owns the directory, or is root) and says so, naming the path and who served it."""
    sock = group_dir / "node.sock"
    with squatter(sock, TENANT_UID, (SOCKET_GROUP,)) as s:
        assert s.ready
        node = start_node(tmp_path, name="past", extra_args=[*token_args(tmp_path), "--local-socket", str(sock)])
        try:
            log = node.log_tail(200)
            assert str(sock) in log and f"uid {TENANT_UID}" in log
            assert round_trip(node, "past") == "shm"
        finally:
            node.close()
    no_token_reached(s)


def test_the_uid_a_client_expects_can_be_told_and_a_node_that_says_none_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVSTORE_LOCAL_SOCKET_UID overrides what the node advertises (a client in a user namespace sees the node's
    user under another id); a node that advertises no uid (an older release) gets nothing sent on this plane."""
    node = start_node(tmp_path, name="uidenv", extra_args=token_args(tmp_path))
    try:
        monkeypatch.setenv("KVSTORE_LOCAL_SOCKET_UID", str(NOBODY))
        assert round_trip(node, "uid-other") == "tcp"
        monkeypatch.setenv("KVSTORE_LOCAL_SOCKET_UID", str(os.geteuid()))
        assert round_trip(node, "uid-same") == "shm"
        monkeypatch.setenv("KVSTORE_LOCAL_SOCKET_UID", "root")
        with pytest.raises(ValueError, match="KVSTORE_LOCAL_SOCKET_UID"):
            round_trip(node, "uid-bad")
    finally:
        node.close()
    buffers = SharedBuffers()
    with pytest.raises(PlaneUnavailable, match="does not say which user"):
        ShmPlane(
            "/run/some.sock", 64, buffers=buffers, received=ReceivePool(buffers), token=WRITE, timeout=10.0, uid=None
        )
