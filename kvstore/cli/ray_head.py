"""A local Ray head for `kvstore up --values` (workers on): `ray start --head --block` in a process group
of its own, on a fresh loopback port, retried when that port was taken before Ray's GCS bound it."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from kvstore.cli.waits import free_port, retry_if_port_taken, tail, wait_port

# What Ray's GCS writes to <temp-dir>/session_*/logs/gcs_server.out when its port is taken. `ray start` itself
# says so only after ~40 s of retrying its GCS client; the GCS log says it within a second.
_GCS_BIND_FAILED = "Failed to start the grpc server"


def _gcs_logs(temp_dir: str) -> set[Path]:
    return set(Path(temp_dir).glob("session_*/logs/gcs_server.out"))


def _gcs_bind_failed(temp_dir: str, earlier: set[Path]) -> str | None:
    """Why this try's GCS failed, read from a GCS log that is not one of `earlier` tries'; None if it did not."""
    for out in _gcs_logs(temp_dir) - earlier:
        with contextlib.suppress(OSError):
            if _GCS_BIND_FAILED in out.read_text(errors="replace"):
                return f"{_GCS_BIND_FAILED} (see {out})"
    return None


def start_ray_head(
    env: dict[str, str],
    resources: str,
    temp_dir: str,
    log_path: Path,
    *,
    ports: Callable[[], int] = free_port,
    say: Callable[[str], None] = print,
) -> tuple[subprocess.Popen[bytes], int]:
    """`ray start --head --block` listening on 127.0.0.1:<port> when this returns (proc, port). A start whose
    GCS port was taken meanwhile (`ports()` handed it out a moment before) is retried on fresh ports
    (waits.retry_if_port_taken; `say` tells the user), each failed try's process group killed; any other
    failure is raised."""

    def once() -> tuple[subprocess.Popen[bytes], int]:
        port = ports()
        args = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--num-cpus={max(2, os.cpu_count() or 2)}",
            "--num-gpus=0",
            f"--resources={resources}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            f"--dashboard-agent-listen-port={ports()}",
            f"--ray-client-server-port={ports()}",
            f"--object-store-memory={256 << 20}",
        ]
        earlier = _gcs_logs(temp_dir)  # before the start: this try's GCS log is the one not in it
        log = open(log_path, "ab")  # noqa: SIM115 - closed right after the child has it
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        try:
            failed = functools.partial(_gcs_bind_failed, temp_dir, earlier)
            wait_port("127.0.0.1", port, 60.0, proc, log_path, what="ray start", failed=failed)
        except RuntimeError:  # it exited or its GCS could not bind (a timeout is raised as it is)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the whole try: ray start, its GCS, a raylet
            proc.wait(10.0)
            raise
        return proc, port

    return retry_if_port_taken(
        once,
        taken=lambda e: _GCS_BIND_FAILED in f"{e}{tail(log_path, 80)}",
        before_retry=lambda: say("ray start: its port was taken meanwhile; trying fresh ports"),
    )
