"""The same-host plane across namespaces, as between two pods of one Kubernetes node (DESIGN.md §8.1): the cache node
runs in its own PID and mount namespaces, with a /dev/shm of its own, so it can neither see the client's
processes (/proc/<pid>/fd) nor its shared-memory files; the client reaches it only through the socket they
both see. Pages still cross with one copy, through memory the client passed by descriptor."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.names import TierKind
from tests.integration.conftest import LAYOUT, NS, PAGE, key, page, start_node


def _can_unshare() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare binary (util-linux)"
    probe = subprocess.run(
        ["unshare", "--pid", "--mount", "--fork", "true"], check=False, capture_output=True, timeout=30
    )
    return None if probe.returncode == 0 else f"unshare is not permitted here: {probe.stderr.decode().strip()}"


REASON = _can_unshare()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_zero_copy_works_from_another_pid_and_mount_namespace(tmp_path: Path) -> None:
    sock = tmp_path / "node.sock"  # on a filesystem both namespaces see, as a hostPath both pods mount
    node = NodeProcess(
        dram_bytes=16 * (PAGE + 4096),
        max_page_bytes=PAGE,
        node_id="isolated",
        extra_args=["--local-socket", str(sock)],
    )
    # The node's namespaces: its own PIDs (it is pid 1 there), its own mounts with a private /dev/shm.
    isolate = 'mount -t tmpfs tmpfs /dev/shm && exec "$@"'
    node.args = ["unshare", "--pid", "--mount", "--fork", "--kill-child=SIGTERM", "sh", "-c", isolate, "sh", *node.args]
    node.start()
    try:
        ready = json.loads(node.ready_file.read_text())
        assert node.proc is not None and ready["pid"] != node.proc.pid  # a pid of another namespace
        hs = [key(i, "isolated") for i in range(6)]
        os.environ.pop("KVSTORE_LOCAL_SOCKET", None)
        with KVStoreClient(node.addr) as kv:
            staging = kv.shared_buffer(6 * PAGE)
            views = staging.pages(PAGE, 6)
            for v, h in zip(views, hs, strict=True):
                v[:] = page(h)
            assert kv.put_from(NS, LAYOUT, hs, views).stored == 6
            assert kv.plane == "shm"  # the zero-copy path, not a fallback
            for v in views:
                v[:] = bytes(PAGE)
            refs = kv.get_into(NS, hs, views)
            assert [r.tier for r in refs] == [TierKind.DRAM] * 6
            assert [bytes(v) for v in views] == [page(h) for h in hs]
            assert [bytes(p) for p in kv.get(NS, hs)] == [page(h) for h in hs]  # plain gets too
            assert kv.plane == "shm"
    finally:
        # unshare waits for its child without passing signals on: SIGTERM the node itself (by its pid on this
        # side), then unshare exits with it.
        if node.proc is not None:
            children = Path(f"/proc/{node.proc.pid}/task/{node.proc.pid}/children").read_text().split()
            for pid in children:
                os.kill(int(pid), signal.SIGTERM)
        node.close()


def test_a_client_told_where_the_socket_is_uses_that_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVSTORE_LOCAL_SOCKET: a pod may mount the node's socket at a path of its own."""
    real = tmp_path / "real.sock"
    node = start_node(tmp_path, name="elsewhere", extra_args=["--local-socket", str(real)])
    try:
        alias = tmp_path / "alias"
        alias.mkdir()
        (alias / "node.sock").symlink_to(real)
        monkeypatch.setenv("KVSTORE_LOCAL_SOCKET", str(alias / "node.sock"))
        h = key(0, "alias")
        with KVStoreClient(node.addr, transport="shm") as kv:
            kv.put(NS, LAYOUT, [h], [page(h)])
            assert bytes(kv.get(NS, [h])[0]) == page(h)
        monkeypatch.setenv("KVSTORE_LOCAL_SOCKET", str(tmp_path / "nowhere.sock"))
        with KVStoreClient(node.addr) as kv:  # a wrong path: auto mode falls back, never fails
            assert bytes(kv.get(NS, [h])[0]) == page(h) and kv.plane == "tcp"
    finally:
        node.close()
