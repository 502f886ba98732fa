"""Start and stop real `kvstore serve` processes (demo, tests, benchmarks, later `kvstore up`).

Every wait is bounded in time; `stop()` sends SIGTERM, waits for the graceful shutdown, then SIGKILLs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvstore.cli.waits import START_POLL_S


class NodeProcess:
    """One cache node in a child process, bound to loopback on a free port."""

    # keyword-only settings, each with a default
    def __init__(  # noqa: PLR0913
        self,
        *,
        dram_bytes: int | str = "64MiB",
        nvme_path: str | Path | None = None,
        nvme_bytes: int | str = 0,
        max_page_bytes: int | str | None = None,
        node_id: str = "node-0",
        host: str = "127.0.0.1",
        redis_url: str | None = None,
        extra_args: list[str] | None = None,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.host = host
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-node-")
        self.ready_file = Path(self._tmp.name) / "ready.json"
        self.log_path = Path(log_path) if log_path else Path(self._tmp.name) / "node.log"
        args = [
            sys.executable,
            "-m",
            "kvstore.cli.main",
            "serve",
            "--host",
            host,
            "--port",
            "0",
            "--dram-bytes",
            str(dram_bytes),
            "--node-id",
            node_id,
            "--ready-file",
            str(self.ready_file),
        ]
        if nvme_path is not None and nvme_bytes:
            args += ["--nvme-path", str(nvme_path), "--nvme-bytes", str(nvme_bytes)]
        if max_page_bytes is not None:
            args += ["--max-page-bytes", str(max_page_bytes)]
        self.args = args + (extra_args or [])
        self.env = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}
        if redis_url is not None:
            # The environment, not the command line: any local user can read a process's argv.
            self.env["KVSTORE_REDIS_URL"] = redis_url
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.metrics_port: int | None = None  # set when started with --metrics-port

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> NodeProcess:
        self.ready_file.unlink(missing_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                ready = json.loads(self.ready_file.read_text())
                self.port, self.metrics_port = ready["port"], ready.get("metrics_port")
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited with {self.proc.returncode} before serving:\n{self.log_tail()}")
            time.sleep(START_POLL_S)
        self.kill()
        raise TimeoutError(f"node not serving after {timeout}s:\n{self.log_tail()}")

    def restart(self, timeout: float = 30.0, edit: Callable[[], object] | None = None) -> NodeProcess:
        """Stop gracefully (a SIGTERM: DRAM pages spill to NVMe) and start again on the same gRPC port, so
        clients keep their address; what comes back is what the NVMe tier recovers. `edit` runs while the
        node is down (tests and fault runs change its files there)."""
        if self.proc is None or not self.port:
            raise RuntimeError("restart() needs a started node")
        self.stop()
        if edit is not None:
            edit()
        self.args[self.args.index("--port") + 1] = str(self.port)
        return self.start(timeout)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for the graceful shutdown (bounded), SIGKILL if it overruns; returns exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                # Say so loudly: a killed node skipped its shutdown spill, which tests then see as lost pages.
                print(
                    f"kvstore node {self.addr} did not stop within {timeout}s of SIGTERM; killing it. "
                    f"Log tail:\n{self.log_tail()}",
                    file=sys.stderr,
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGABRT)  # faulthandler writes every thread's stack to the log
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
                print(f"node log after SIGABRT:\n{self.log_tail(80)}", file=sys.stderr)
        code = self.proc.returncode
        self.proc = None
        self._log.close()
        return code

    def kill(self) -> None:
        """SIGKILL: a crash, no graceful shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None:
            self.proc = None
            self._log.close()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> NodeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
