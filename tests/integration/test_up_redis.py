"""`kvstore up` keeps its Redis (SECURITY.md, round 3, finding 7b): a redis-server killed under it used to stay defunct,
unnoticed, and the index stayed empty. Now `kvstore up` reaps it, starts it again on the same port with
the same users (every URL stays valid), and the nodes republish their pages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvstore.cli.up import terminate
from kvstore.client import KVStoreClient
from kvstore.index import IndexReader
from tests.integration.conftest import LAYOUT, NS, key, page
from tests.security.conftest import wait_for


def _zombie_or_alive(pid: int) -> str | None:
    """The process's state letter (Z: defunct), None once it is gone and reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def start_up(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """`kvstore up FLAGS` in a child process (stopped by the test): the process, its ready file, its log."""
    ready_file, log = tmp_path / "ready.json", tmp_path / "up.log"
    args = [sys.executable, "-m", "kvstore.cli.main", "up", *flags, "--nvme-root", str(tmp_path / "nvme"),
            "--ready-file", str(ready_file)]  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT), ready_file, log


def test_up_restarts_a_killed_redis_and_the_nodes_republish(tmp_path: Path) -> None:
    up, ready_file, log = start_up(tmp_path, "--nodes", "1", "--index-ttl", "3", "--no-metrics", "--dram-bytes",
                                   "16MiB", "--nvme-bytes", "0")  # fmt: skip
    try:
        ready = wait_for(lambda: ready_file.exists() and json.loads(ready_file.read_text()), timeout=90,
                         what=f"kvstore up ready:\n{log.read_text()}")  # fmt: skip
        chain = [key(i, "up-redis") for i in range(3)]
        with KVStoreClient(ready["nodes"]["node-0"], timeout=30) as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
        with IndexReader(ready["redis_url"], socket_timeout=2) as index:
            wait_for(lambda: index.lookup(NS, chain).matched == 3, what="the pages in the index")
        old = ready["redis_pid"]
        os.kill(old, signal.SIGKILL)
        renewed = wait_for(lambda: (r := json.loads(ready_file.read_text()))["redis_pid"] != old and r,
                           timeout=30, what=f"a restarted redis-server:\n{log.read_text()}")  # fmt: skip
        assert _zombie_or_alive(old) is None  # reaped, not left defunct
        assert renewed["redis_url"] == ready["redis_url"]  # the same URL (port, users) for every client
        with IndexReader(ready["redis_url"], socket_timeout=2) as index:

            def republished() -> bool:
                try:
                    return index.lookup(NS, chain).matched == 3
                except Exception:  # the restarted Redis may still be starting
                    return False

            wait_for(republished, timeout=30, what=f"the node's republish:\n{log.read_text()}")
        assert up.poll() is None and "restarted" in log.read_text()
    finally:
        code = terminate(up, 120.0)
    assert code == 0, log.read_text()


def test_up_values_with_sentinel_survives_a_killed_master(tmp_path: Path) -> None:
    """redis.sentinel in the chart's values: `kvstore up --values` runs the same group locally (a master,
    replicas, as many sentinels); every URL is a redis+sentinel:// one; a SIGKILLed master is failed over,
    the node republishes there, and `kvstore up` restarts the killed process (the sentinels make it a
    replica)."""
    import yaml

    from kvstore.index.connect import is_sentinel, sync_client

    values = tmp_path / "sentinel.yaml"
    values.write_text(yaml.safe_dump({
        "local": {"nodes": 1, "scale": 0.002},
        "redis": {"sentinel": {"enabled": True, "downAfterMilliseconds": 1000, "failoverTimeoutMilliseconds": 2000}},
    }))  # fmt: skip
    up, ready_file, log = start_up(tmp_path, "--values", str(values))
    try:
        ready = wait_for(lambda: ready_file.exists() and json.loads(ready_file.read_text()), timeout=180,
                         what=f"kvstore up ready:\n{log.read_text()}")  # fmt: skip
        assert is_sentinel(ready["redis_url"]) and len(ready["redis_pids"]) == 3 and len(ready["sentinel_pids"]) == 3
        admin_url = (tmp_path / "nvme" / "redis-admin.url").read_text().strip()
        chain = [key(i, "up-sentinel") for i in range(3)]
        with KVStoreClient(ready["nodes"]["node-0"], timeout=30) as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
        with IndexReader(ready["redis_url"], socket_timeout=2) as index:

            def indexed() -> bool:
                try:
                    return index.lookup(NS, chain).matched == 3
                except Exception:  # during the failover: no master named yet
                    return False

            wait_for(indexed, timeout=30, what="the pages in the index")
            admin = sync_client(admin_url, 2)
            master_pid = int(admin.info("server")["process_id"])
            admin.close()
            assert master_pid in ready["redis_pids"]
            os.kill(master_pid, signal.SIGKILL)
            time.sleep(1.0)
            wait_for(indexed, timeout=90, what=f"the pages in the index after the failover:\n{log.read_text()}")
        renewed = wait_for(lambda: (r := json.loads(ready_file.read_text()))["redis_pids"] != ready["redis_pids"] and r,
                           timeout=30, what=f"the killed Redis restarted:\n{log.read_text()}")  # fmt: skip
        assert master_pid not in renewed["redis_pids"] and _zombie_or_alive(master_pid) is None
        assert up.poll() is None
    finally:
        code = terminate(up, 120.0)
    assert code == 0, log.read_text()


def test_up_with_a_redis_cluster_survives_a_killed_master(tmp_path: Path) -> None:
    """`kvstore up --redis-cluster 3`: a local Redis Cluster (3 masters, a replica each, every server with
    the ACL users), every URL a redis+cluster:// one; a SIGKILLed master is failed over by the cluster,
    the nodes republish, and `kvstore up` restarts the killed server once the cluster had time to fail
    it over (it rejoins as a replica)."""
    from redis.crc import key_slot

    from kvstore.index.connect import is_cluster, sync_cluster
    from kvstore.index.keys import stripe_key, stripe_of

    up, ready_file, log = start_up(tmp_path, "--nodes", "2", "--redis-cluster", "3", "--index-ttl", "3",
                                   "--no-metrics", "--dram-bytes", "16MiB", "--nvme-bytes", "0", "--max-page-bytes", "64KiB")  # fmt: skip
    try:
        ready = wait_for(lambda: ready_file.exists() and json.loads(ready_file.read_text()), timeout=120,
                         what=f"kvstore up ready:\n{log.read_text()}")  # fmt: skip
        assert is_cluster(ready["redis_url"]) and len(ready["redis_pids"]) == 6
        admin = sync_cluster((tmp_path / "nvme" / "redis-admin.url").read_text().strip(), 2)
        chain = [key(i, "up-cluster") for i in range(16)]
        with KVStoreClient(ready["nodes"]["node-1"], timeout=30) as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
        with IndexReader(ready["redis_url"], socket_timeout=2) as index:
            wait_for(lambda: index.lookup(NS, chain).matched == 16, what="the pages in the index")
            node = admin.nodes_manager.get_node_from_slot(key_slot(stripe_key(NS, stripe_of(chain[0])).encode()))
            master_pid = int(admin.info("server", target_nodes=node)["process_id"])
            admin.close()
            assert master_pid in ready["redis_pids"]
            os.kill(master_pid, signal.SIGKILL)
            wait_for(lambda: index.lookup(NS, chain).matched == 16, timeout=60,
                     what=f"the pages in the index after the failover:\n{log.read_text()}")  # fmt: skip
        renewed = wait_for(lambda: (r := json.loads(ready_file.read_text()))["redis_pids"] != ready["redis_pids"] and r,
                           timeout=60, what=f"the killed Redis restarted:\n{log.read_text()}")  # fmt: skip
        assert master_pid not in renewed["redis_pids"] and _zombie_or_alive(master_pid) is None
        assert up.poll() is None
    finally:
        code = terminate(up, 120.0)
    assert code == 0, log.read_text()
