"""Finding 1: the Redis password never leaves the node, never reaches a log or a command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvstore.cli.redis_procs import RedisProcess
from kvstore.client import KVStoreClient
from kvstore.security import ClientSecurity
from tests.integration.conftest import LAYOUT, NS, key, page, start_node
from tests.security.conftest import READ, WRITE, token_args, wait_for

PASSWORD = "S3cret-" + "p" * 24


def test_stats_logs_and_argv_never_carry_the_redis_password(tmp_path: Path) -> None:
    redis = RedisProcess(password=PASSWORD).start()
    node = None
    try:
        # Unreachable first (a wrong port), so the node logs its "index not reachable" warning with the URL.
        dead = f"redis://:{PASSWORD}@127.0.0.1:1/0"
        node = start_node(tmp_path, name="red0", redis_url=dead, log_path=tmp_path / "red0.log",
                          extra_args=[*token_args(tmp_path), "--index-register-wait", "0.2"])  # fmt: skip
        node.close()
        node = start_node(tmp_path, name="red", redis_url=redis.url, log_path=tmp_path / "red.log",
                          extra_args=token_args(tmp_path))  # fmt: skip
        with KVStoreClient(node.addr, timeout=10, security=ClientSecurity(token=WRITE)) as rw:
            chain = [key(i, "red") for i in range(2)]
            rw.put(NS, LAYOUT, chain, [page(h) for h in chain])
        with KVStoreClient(node.addr, timeout=10, security=ClientSecurity(token=READ)) as ro:
            index = wait_for(lambda: (s := ro.stats().index) is not None and s.connected and s, what="index link")
        assert PASSWORD not in index.url and index.url == f"redis://:***@127.0.0.1:{redis.port}/0"
        cmdline = Path(f"/proc/{node.proc.pid}/cmdline").read_bytes()  # type: ignore[union-attr]
        assert PASSWORD.encode() not in cmdline  # argv is readable by every local user
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        out = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "stats", "--addr", node.addr, "--json"],
                             capture_output=True, text=True, timeout=60, check=True,
                             env={**env, "KVSTORE_TOKEN": READ})  # fmt: skip
        assert "***@127.0.0.1" in out.stdout and PASSWORD not in out.stdout
    finally:
        if node is not None:
            node.close()
        redis.close()
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*.log"))
    assert "index at redis://:***@127.0.0.1:1/0 not reachable" in logs  # the warning is there, redacted
    assert PASSWORD not in logs


def test_redact_url_hides_every_credential_form() -> None:
    from kvstore.security import redact_url

    cases = {
        f"redis://:{PASSWORD}@h:6379/0": "redis://:***@h:6379/0",
        f"redis://kvnode-n0:{PASSWORD}@h:6379/0": "redis://kvnode-n0:***@h:6379/0",
        f"rediss://{PASSWORD}@h/0": "rediss://***@h/0",
        f"redis://h:6379/0?password={PASSWORD}&db=1": "redis://h:6379/0?password=***&db=1",
        "redis://h:6379/0": "redis://h:6379/0",
    }
    for url, shown in cases.items():
        assert redact_url(url) == shown
