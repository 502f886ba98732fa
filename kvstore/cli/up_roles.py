"""The chart's roles beside the nodes and the index, as local processes of one `kvstore up --values` (up.py):
the token files when auth.enabled (`write_tokens`), the workers (`Workers`: a local Ray head with the chart's
slots, then `kvstore pd-serve` against it) and the engines (`Engines`: `lmcache server` with kvstore's L2
adapter aimed at node-0, then vLLM's OpenAI server with LMCacheMPConnector), each as the chart runs them.

Invariants: every token file is private (0600) from its creation, and a tenant's token is bound to its tenant
by its rw.tokens line, as in the chart; every child is held as soon as it is started, so `close` stops it
whatever failed after (by PID: SIGTERM, a grace period, SIGKILL; an engine's or the Ray head's whole process
group); every wait for a child is bounded in time and ends early when the child exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from kvstore.cli.waits import POLL_S, tail, wait_http, wait_port

console = Console()


def terminate(proc: subprocess.Popen[bytes], grace: float) -> int:
    """SIGTERM, up to `grace` seconds for a clean exit, then SIGKILL; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    if proc.poll() is None:
        proc.kill()
    return proc.wait(10)


def write_tokens(root: Path, tenants: tuple[str, ...], tenants_toml: str) -> tuple[dict[str, str], list[str]]:
    """The token files of an authenticated stack in `root` (read-write, read-only, one per tenant, the nodes'
    peer token, the tenants file): the environment every client of the stack needs and the nodes' arguments."""
    env: dict[str, str] = {}
    # Local nodes serve plaintext (no certificates here): an explicit opt-in, see SECURITY.md. The
    # index cannot be used to redirect tokens: only each node's own Redis user writes its record.
    env["KVSTORE_ALLOW_PLAINTEXT_TOKEN"] = "1"
    rw, ro = root / "rw.tokens", root / "ro.tokens"
    for f in (rw, ro):
        f.write_text(secrets.token_urlsafe(32) + "\n")
        f.chmod(0o600)
    for name in tenants:  # as the chart: each tenant's token bound by its rw.tokens line, and alone
        token, own = secrets.token_urlsafe(32), root / f"tenant-{name}.token"
        own.touch(mode=0o600)
        own.write_text(token + "\n")
        rw.write_text(rw.read_text() + f"{token} {name}\n")
        console.print(f"tenant {name}: token in {own}")
    # The nodes' own token, for the copies they make of each other's pages (DESIGN.md §7.3), as the chart.
    peer = root / "peer.tokens"
    peer.touch(mode=0o600)
    peer.write_text(secrets.token_urlsafe(32) + "\n")
    args = ["--auth-tokens-file", str(rw), "--auth-read-tokens-file", str(ro), "--auth-peer-tokens-file", str(peer)]
    if tenants_toml:
        tf = root / "tenants.toml"
        tf.touch(mode=0o600)
        tf.write_text(tenants_toml)
        args += ["--tenants-file", str(tf)]
    env["KVSTORE_TOKEN_FILE"] = str(rw)
    console.print(f"tokens: read-write {rw}, read-only {ro}")
    return env, args


@dataclass
class Workers:
    """The workers of a stack: a local Ray head with the chart's slots and `kvstore pd-serve` against it."""

    root: Path
    ray_head: subprocess.Popen[bytes] | None = None
    ray_tmp: tempfile.TemporaryDirectory[str] | None = None
    address: str = ""
    driver: subprocess.Popen[bytes] | None = None
    ready: dict = field(default_factory=dict)  # pd-serve's ready file

    def start(self, w: object, env: dict[str, str], redis_url: str) -> None:
        """The Ray head, then `kvstore pd-serve` against it (as in the chart); `env`: the stack's clients'."""
        from kvstore.cli.ray_head import start_ray_head
        from kvstore.cli.values import WorkersPlan

        assert isinstance(w, WorkersPlan)
        token = self.root / "ray_auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        env = {
            **os.environ,
            **env,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            "KVSTORE_REDIS_URL": redis_url,
            "KVSTORE_LOCAL_NODE": "node-0",
        }
        # NOTE: Ray's unix socket paths must stay under 107 bytes: its temp dir is short, not under root.
        self.ray_tmp = tempfile.TemporaryDirectory(prefix="kvray-", dir="/tmp")
        resources = json.dumps({"kvstore_prefill": w.prefill_slots, "kvstore_decode": w.decode_slots})
        self.ray_head, port = start_ray_head(
            env, resources, self.ray_tmp.name, self.root / "ray-head.log", say=console.print
        )
        self.address = f"127.0.0.1:{port}"
        ready = self.root / "pd-serve.json"
        cmd = [
            sys.executable,
            "-m",
            "kvstore.cli.main",
            "pd-serve",
            f"--ray-address={self.address}",
            f"--model={w.model_path}",
            f"--dtype={w.dtype}",
            f"--block-size={w.block_size}",
            f"--num-blocks={w.num_blocks}",
            f"--max-inflight={w.max_inflight}",
            f"--min-prefill={w.prefill_slots}",
            f"--min-decode={w.decode_slots}",
            "--worker-wait=120",
            f"--ready-file={ready}",
            f"--kv-encoding={w.kv_encoding}",
        ]
        log = open(self.root / "pd-serve.log", "ab")  # noqa: SIM115
        self.driver = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + 300.0
        while not ready.exists():
            if self.driver.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvstore pd-serve did not come up:\n{tail(self.root / 'pd-serve.log')}")
            time.sleep(POLL_S)
        self.ready = json.loads(ready.read_text())
        console.print(
            f"ray: {self.address} (token {token}); {w.prefill_slots} prefill + {w.decode_slots} decode "
            f"workers; router {self.ready['router']!r} in Ray namespace "
            f"{self.ready['ray_namespace']!r}  (log {self.root / 'pd-serve.log'})"
        )

    def describe(self) -> dict[str, object]:
        """The ready file's "ray" entry (none before pd-serve started)."""
        if self.driver is None:
            return {}
        return {"ray": {"address": self.address, "auth_token_path": str(self.root / "ray_auth_token"), **self.ready}}

    def dead(self) -> str | None:
        for name, proc in (("ray head", self.ray_head), ("pd-serve", self.driver)):
            if proc is not None and proc.poll() is not None:
                return f"{name} exited with {proc.returncode}; see {self.root}"
        return None

    def close(self) -> None:
        for proc in (self.driver, self.ray_head):
            if proc is not None:
                terminate(proc, 60.0)
        if self.ray_head is not None:
            # `ray start --block` stops its raylet and GCS on SIGTERM; anything left in the session it was
            # started in (its own process group, id = its pid) goes too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.ray_head.pid, signal.SIGKILL)
        if self.ray_tmp is not None:
            self.ray_tmp.cleanup()


@dataclass
class Engines:
    """The engines of a stack: `lmcache server` and vLLM's OpenAI server, each in its own process group."""

    root: Path
    lmcache: subprocess.Popen[bytes] | None = None
    vllm: subprocess.Popen[bytes] | None = None
    urls: dict[str, str] = field(default_factory=dict)

    def start(self, e: object, env: dict[str, str], node_addr: str) -> None:
        """`lmcache server` (kvstore's L2 adapter aimed at `node_addr`), then vLLM's OpenAI server with
        LMCacheMPConnector, as the chart's engine pod runs them; each waited for, bounded in time."""
        from kvstore.cli.engines import CPU_ENGINE_ENV, EnginesPlan
        from kvstore.cli.waits import free_port

        assert isinstance(e, EnginesPlan)
        token_file = env.get("KVSTORE_TOKEN_FILE")
        env = {**os.environ, **env, **CPU_ENGINE_ENV}
        if token_file and e.tenant:  # as the chart: the engine presents its tenant's token only
            token_file = env["KVSTORE_TOKEN_FILE"] = str(self.root / f"tenant-{e.tenant}.token")
        lm_port, port = free_port(), e.vllm_port or free_port()
        log = open(self.root / "lmcache.log", "ab")  # noqa: SIM115 - closed right after the child has it
        argv = e.lmcache_argv(lm_port, node_addr, token_file, f"kvstore-up-{os.getpid()}")
        self.lmcache = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        wait_port("127.0.0.1", lm_port, 120.0, self.lmcache, self.root / "lmcache.log", what="lmcache server")
        log = open(self.root / "vllm.log", "ab")  # noqa: SIM115
        self.vllm = subprocess.Popen(
            e.vllm_argv(port, lm_port), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        wait_http(f"http://127.0.0.1:{port}/health", 900.0, self.vllm, self.root / "vllm.log", "vllm")
        self.urls = {"openai": f"http://127.0.0.1:{port}/v1", "lmcache": f"127.0.0.1:{lm_port}"}
        console.print(
            f"engine: vLLM {self.urls['openai']} (log {self.root / 'vllm.log'}), LMCache "
            f"{self.urls['lmcache']} -> kvstore node-0 (log {self.root / 'lmcache.log'})"
        )

    def describe(self) -> dict[str, object]:
        """The ready file's "engines" entry (none before both answered)."""
        return {"engines": dict(self.urls)} if self.urls else {}

    def dead(self) -> str | None:
        for name, proc in (("lmcache server", self.lmcache), ("vllm", self.vllm)):
            if proc is not None and proc.poll() is not None:
                return f"{name} exited with {proc.returncode}; see {self.root}"
        return None

    def close(self) -> None:
        # An engine's process group goes whole: vLLM's workers outlive a killed parent.
        for proc in (self.vllm, self.lmcache):
            if proc is not None:
                terminate(proc, 30.0)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
