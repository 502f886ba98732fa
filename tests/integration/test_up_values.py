"""`kvstore up --values FILE`: the chart's roles from the chart's values, as real local processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

from kvstore.cli.up import terminate
from kvstore.client import KVStoreClient
from kvstore.errors import Unauthenticated
from kvstore.index import IndexReader
from kvstore.index.keys import entry_of
from kvstore.names import TierKind
from kvstore.security import ClientSecurity
from workers.tiny import TinyLlamaSpec, make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "deploy" / "values"


class Up:
    """`kvstore up --values ...` in a child process, stopped (SIGTERM, bounded) by the test."""

    def __init__(self, tmp_path: Path, files: list[Path]) -> None:
        self.ready = tmp_path / "ready.json"
        self.log = tmp_path / "up.log"
        args = [sys.executable, "-m", "kvstore.cli.main", "up", "--nvme-root", str(tmp_path / "nvme"),
                "--ready-file", str(self.ready)]  # fmt: skip
        for f in files:
            args += ["--values", str(f)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            assert self.proc.poll() is None, f"kvstore up exited:\n{self.log.read_text()}"
            assert time.monotonic() < deadline, f"kvstore up not ready in {timeout}s:\n{self.log.read_text()}"
            time.sleep(0.2)
        return json.loads(self.ready.read_text())

    def stop(self) -> int:
        return terminate(self.proc, 120.0)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def override(tmp_path: Path, values: dict) -> Path:
    f = tmp_path / "override.yaml"
    f.write_text(yaml.safe_dump(values))
    return f


def test_up_values_starts_the_chart_roles_with_redis_auth_and_tokens(tmp_path: Path) -> None:
    # small-cluster.yaml: 2 nodes, tokens on; scaled further down so 2 nodes fit any CI box.
    # With a tenant (auth.tenants): its own token and index user, and a DRAM share scaled like the budgets.
    tenants = {"auth": {"tenants": [{"name": "alice", "dramBytes": "32Gi"}]}}
    up = Up(tmp_path, [PROFILES / "small-cluster.yaml", override(tmp_path, {"local": {"scale": 0.0002}, **tenants})])
    try:
        ready = up.wait_ready(90)
        url = ready["redis_url"]
        assert "@" in url  # Redis runs with a password, as the chart's does
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url.replace(url[url.index("//") + 2 : url.index("@") + 1], "")).set("k", "v")
        with IndexReader(url) as index:
            live = {n.node_id: n.addr for n in index.nodes() if n.alive}
        assert live == ready["nodes"] and sorted(live) == ["node-0", "node-1"]
        with KVStoreClient(live["node-0"], transport="grpc") as kv, pytest.raises(Unauthenticated):
            kv.stats()  # auth.enabled: tokens required
        env = {**os.environ, **ready["env"]}  # KVSTORE_TOKEN_FILE: the read-write token
        r = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "top", "--once", "--json", "--interval", "0.3",
                            "--min-nodes", "2", "--redis-url", url], capture_output=True, text=True, env=env,
                           timeout=60, check=False)  # fmt: skip
        assert r.returncode == 0, r.stderr
        stats = json.loads(r.stdout)["nodes"][0]
        dram = next(t for t in stats["tiers"] if t["tier"] == "dram")
        assert dram["capacity_bytes"] <= int(64 * (1 << 30) * 0.0002)  # budgets scaled by local.scale
        # The tenant's token reaches its own scope only; its index user reads its own entries only.
        alice = (tmp_path / "nvme" / "tenant-alice.token").read_text().strip()
        with KVStoreClient(live["node-0"], transport="grpc", security=ClientSecurity(token=alice)) as kv:
            (row,) = kv.stats().tenants
        assert row.tenant == "alice" and row.quota_bytes[TierKind.DRAM] >= int(32 * (1 << 30) * 0.0002) - (3 << 20)
        alice_url = (tmp_path / "nvme" / "redis-tenant-alice.url").read_text().strip()
        with redis.Redis.from_url(alice_url) as r, pytest.raises(redis.exceptions.NoPermissionError):
            r.hmget(*entry_of("ns", b"\0" * 32))  # the default tenant's entries
    finally:
        code = up.stop()
    assert code == 0, up.log.read_text()
    assert all(gone(p) for p in [ready["pid"]])


@pytest.mark.parametrize("encoding", ["raw", "fp8"])
def test_up_values_with_workers_serves_through_the_named_router(tmp_path: Path, encoding: str) -> None:
    model = make_tiny_llama(
        tmp_path / "tiny", TinyLlamaSpec(hidden=64, layers=2, heads=4, kv_heads=2, vocab=512, seed=3)
    )
    local = {"local": {"nodes": 1, "scale": 0.0002, "workers": True, "modelPath": str(model)},
             "workers": {"model": {"dtype": "float32"}, "blockSize": 8, "numBlocks": 256, "kvEncoding": encoding,
                         "prefill": {"gpusPerPod": 0}, "decode": {"gpusPerPod": 0}},
             "node": {"budgets": {"maxPageBytes": "64Ki"}}}  # fmt: skip
    up = Up(tmp_path, [PROFILES / "single-node.yaml", override(tmp_path, local)])
    try:
        ready = up.wait_ready(240)
        ray_info = ready["ray"]
        assert (ray_info["prefill"], ray_info["decode"], ray_info["router"]) == (1, 1, "router")
        # An engine: another Ray driver that finds the router by name and sends the same prompt twice.
        client = f"""
import json, ray
ray.init(address={ray_info["address"]!r}, namespace="kvstore", log_to_driver=False)
router = ray.get_actor("router", namespace="kvstore")
prompt = list(range(3, 40))
a = ray.get(router.generate.remote("r1", prompt, 3), timeout=120)
b = ray.get(router.generate.remote("r2", prompt, 3), timeout=120)
print(json.dumps({{"a": a.tokens, "b": b.tokens, "cached": b.cached_blocks}}))
ray.shutdown()
"""
        env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": ray_info["auth_token_path"]}
        r = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, env=env, timeout=240,
                           check=False)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["a"] == out["b"] and len(out["a"]) == 3
        assert out["cached"] == (37 - 1) // 8  # the second prefill fetched every usable block from the cache
        # The workers stored their pages in the chosen encoding: kvctl shows it per namespace.
        r = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "stats", "--json", "--addr",
                            ready["nodes"]["node-0"]], capture_output=True, text=True,
                           env={**os.environ, **ready["env"]}, timeout=60, check=False)  # fmt: skip
        assert r.returncode == 0, r.stderr
        spaces = {n["namespace"]: n["encoding"] for n in json.loads(r.stdout)["namespaces"]}
        assert spaces == {ray_info["namespace"]: {"raw": "raw", "fp8": "fp8-e4m3"}[encoding]}
        driver_pid = ray_info["pid"]
    finally:
        code = up.stop()
    assert code == 0, up.log.read_text()
    assert gone(driver_pid)


def test_up_values_refuses_bad_values_and_starts_nothing(tmp_path: Path) -> None:
    bad = override(tmp_path, {"node": {"budgets": {"dram": "64Gi"}, "resources": {"limits": {"memory": "32Gi"}}}})
    r = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "up", "--values", str(bad)], capture_output=True,
                       text=True, timeout=60, check=False)  # fmt: skip
    assert r.returncode == 1
    assert "node.resources.limits.memory" in r.stderr and "redis index" not in r.stdout


def test_up_values_refuses_engines_without_vllm_and_starts_nothing(tmp_path: Path) -> None:
    f = override(tmp_path, {"engines": {"enabled": True},
                            "local": {"scale": 0.0005, "engines": {"python": str(tmp_path / "no-python")}}})  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "up", "--values", str(f)], capture_output=True,
                       text=True, timeout=120, check=False)  # fmt: skip
    assert r.returncode == 1
    assert "local.engines.python" in r.stderr and "redis index" not in r.stdout


def test_up_values_production_serves_ucx_and_says_what_it_leaves_out(tmp_path: Path) -> None:
    """production.yaml locally: its nodes serve the UCX plane (node.dataPlanes.ucx), the engines and TLS
    are left out out loud, and the clients' environment names node-0 as their local node where this
    `kvstore serve` can serve the same-host socket."""
    import inspect

    from kvstore.cli.serve import serve

    up = Up(tmp_path, [PROFILES / "production.yaml"])
    try:
        ready = up.wait_ready(180)
        token = Path(ready["env"]["KVSTORE_TOKEN_FILE"]).read_text().split()[0]
        for addr in ready["nodes"].values():
            with KVStoreClient(addr, transport="grpc", security=ClientSecurity(token=token)) as kv:
                assert {"ucx", "tcp"} <= {p.name for p in kv.stats().planes}
        if "local_socket" in inspect.signature(serve).parameters:
            assert (
                ready["env"]["KVSTORE_LOCAL_NODE"] == "node-0" and Path(ready["env"]["KVSTORE_LOCAL_SOCKET"]).exists()
            )
        else:
            assert "KVSTORE_LOCAL_SOCKET" not in ready["env"]
    finally:
        code = up.stop()
    log = up.log.read_text()
    assert code == 0, log
    assert "engines: not started locally" in log and "tls.enabled: not reproduced locally" in log
