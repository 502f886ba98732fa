"""Finding 5: token files fail closed (removing or emptying one revokes its tokens) and files other
users can read are refused with a clear message, at start and on reload. Real nodes."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient
from kvstore.errors import Unauthenticated
from kvstore.security import ClientSecurity
from tests.integration.conftest import start_node
from tests.security.conftest import READ, WRITE, private_file, token_args


def accepted(addr: str, token: str) -> bool:
    try:
        with KVStoreClient(addr, timeout=10, security=ClientSecurity(token=token)) as kv:
            kv.stats()
        return True
    except Unauthenticated:
        return False


def eventually(cond: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout  # the node re-checks its files at most once a second
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out: {what}")


@pytest.mark.parametrize("damage", ["remove", "empty", "world-readable"])
def test_a_damaged_token_file_revokes_its_tokens_until_fixed(tmp_path: Path, damage: str) -> None:
    node = start_node(tmp_path, name="tok", extra_args=token_args(tmp_path))
    rw = tmp_path / "write.tokens"
    try:
        assert accepted(node.addr, WRITE) and accepted(node.addr, READ)
        if damage == "remove":
            rw.unlink()
        elif damage == "empty":
            private_file(rw, "")
        else:
            rw.chmod(0o644)
        eventually(lambda: not accepted(node.addr, WRITE), f"a {damage} token file to revoke its tokens")
        assert accepted(node.addr, READ)  # the other role's file is fine: its tokens still work
        private_file(rw, WRITE + "\n")
        eventually(lambda: accepted(node.addr, WRITE), "the repaired file to be trusted again")
    finally:
        node.close()


def test_a_token_file_other_users_can_read_is_refused_at_start(tmp_path: Path) -> None:
    args = token_args(tmp_path)
    (tmp_path / "read.tokens").chmod(0o644)
    with pytest.raises(RuntimeError) as err:
        start_node(tmp_path, name="open", extra_args=args).close()  # only if it started: the bug
    message = " ".join(str(err.value).split())  # the CLI wraps long lines
    assert "read.tokens: accessible to every user (mode 0644)" in message and "chmod 600" in message
    (tmp_path / "read.tokens").chmod(0o640)  # group-readable is fine for the node's own group (fsGroup)
    assert os.stat(tmp_path / "read.tokens").st_gid == os.getegid()
    start_node(tmp_path, name="grp", extra_args=args).close()
