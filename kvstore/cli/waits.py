"""Ports and waits for child processes (`kvstore up`, kvstore/cli/launch.py and redis_procs.py): a free
port, never one handed out lately; waiting until a port listens or a URL answers, bounded in time, failing
early when the child exits; and the one rule for a port taken between free_port() and the child's own bind
(the OS may hand a free port out again)."""

from __future__ import annotations

import collections
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.2  # how often a wait looks again
START_POLL_S = 0.05  # the same for the quick children of tests and the demo (a node, a Redis: well under 1 s)
PORT_TRIES = 3  # a child started on a free_port() port tries at most this many ports


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=256)  # the ports free_port() gave lately


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS may hand it out again; callers retry on conflict), and
    not one of the last 256 this process was given: a caller that picks several ports before starting
    anything on them (a Sentinel group picks six) never gets the same one twice."""
    for _ in range(64):  # bounded: the OS picks at random from thousands of ports
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            break
    _HANDED_OUT.append(port)
    return port


def retry_if_port_taken(
    start: Callable[[], T], taken: Callable[[RuntimeError], bool], before_retry: Callable[[], None]
) -> T:
    """start() until it returns. A RuntimeError that `taken(error)` says came from a port taken after
    free_port() handed it out is retried (before_retry() in between: a fresh port), at most PORT_TRIES
    starts in all; any other failure, and the last one, is raised."""
    for attempt in range(1, PORT_TRIES + 1):
        try:
            return start()
        except RuntimeError as e:
            if attempt == PORT_TRIES or not taken(e):
                raise
            before_retry()
    raise AssertionError("unreachable")


def wait_port(  # noqa: PLR0913 - a wait for any child: where, how long, whose, how told
    host: str,
    port: int,
    timeout: float,
    proc: subprocess.Popen[bytes],
    log: Path,
    *,
    what: str,
    failed: Callable[[], str | None] = lambda: None,
    answers: Callable[[], bool] = lambda: True,
    poll: float = POLL_S,
) -> None:
    """Until host:port accepts a connection and then `answers()` (by default: any connection); RuntimeError
    when `proc` exits or `failed()` says why it will, TimeoutError after `timeout` seconds (each with the tail
    of its log). A port that does not answer (no connection, or answers() False: another process on the
    port) is tried again after `poll` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} (port {port} taken?):\n{tail(log)}")
        if (why := failed()) is not None:
            raise RuntimeError(f"{what} failed: {why}")
        try:
            socket.create_connection((host, port), timeout=0.5).close()
        except OSError:
            pass
        else:
            if answers():
                return
        time.sleep(poll)
    raise TimeoutError(f"{what} not answering on {host}:{port} after {timeout}s:\n{tail(log)}")


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes], log: Path, what: str) -> None:
    """Until `url` answers 200 (vLLM's /health once the model is loaded), the process dies, or timeout."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2.0) as r:  # our own loopback server
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{what} not healthy at {url} after {timeout}s:\n{tail(log)}")


def tail(path: Path, n: int = 30) -> str:
    """The last `n` lines of a log ('' when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
