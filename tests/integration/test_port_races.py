"""A port taken between free_port() and a child's bind is retried on fresh ports (CI once lost a run to exactly
that race): `kvstore up`'s Ray head (any other failure raised at once), redis-server and Redis Sentinel, including
when the port's new holder is itself a Redis that answers (CI lost a second run to a sentinel taken that way).
Real processes, loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib

from kvstore.cli.ray_head import start_ray_head
from kvstore.cli.redis_procs import RedisProcess, SentinelGroup
from kvstore.cli.up import terminate
from kvstore.cli.waits import PORT_TRIES, free_port

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """Ray's unix socket paths must stay under 107 bytes: a short temp dir, not pytest's."""
    with tempfile.TemporaryDirectory(prefix="kvray-", dir="/tmp") as d:
        yield Path(d)


@contextlib.contextmanager
def _head(tmp: Path, ports: Iterator[int], resources: str = '{"kvstore_prefill": 1}') -> Iterator[tuple[object, int]]:
    proc = None
    try:
        proc, port = start_ray_head(dict(os.environ), resources, str(tmp), tmp / "head.log", ports=lambda: next(ports))
        yield proc, port
    finally:
        if proc is not None:
            terminate(proc, 60.0)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


def test_a_port_taken_before_ray_binds_it_is_retried_on_fresh_ports(short_tmp: Path) -> None:
    with socket.socket() as taken:
        # Bound on every address and not listening: Ray's bind fails, and nothing answers a connect on it.
        taken.bind(("0.0.0.0", 0))
        busy = taken.getsockname()[1]
        handed: list[int] = []

        def ports() -> Iterator[int]:
            yield busy  # the GCS port of the first try: someone holds it
            for _ in range(3 * PORT_TRIES):
                handed.append(free_port())
                yield handed[-1]

        with _head(short_tmp, ports()) as (proc, port):
            assert port != busy and port in handed
            assert proc.poll() is None  # type: ignore[attr-defined]
            socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_failure_that_is_not_a_port_race_is_raised_at_once(short_tmp: Path) -> None:
    asked = 0

    def ports() -> Iterator[int]:
        nonlocal asked
        for _ in range(3 * PORT_TRIES):
            asked += 1
            yield free_port()

    with pytest.raises(RuntimeError, match="ray start exited"), _head(short_tmp, ports(), resources="not json"):
        pass
    assert asked == 3  # one attempt: the GCS port and the two others


def test_redis_whose_port_was_taken_starts_on_a_fresh_one_and_a_restart_keeps_its_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        redis = RedisProcess()
        redis.port = taken.getsockname()[1]  # as if someone bound it after free_port() handed it out
        try:
            redis.start()
            assert redis.port != taken.getsockname()[1]
            r = redis_lib.Redis.from_url(redis.url)
            assert r.ping()
            port = redis.port
            redis.restart()
            assert redis.port == port and r.ping()
            r.close()
        finally:
            redis.close()


def test_a_port_taken_by_another_answering_redis_is_not_mistaken_for_ours() -> None:
    """The squatter answers PING like any Redis; only our child's PID (and password) counts as ready."""
    with RedisProcess() as squatter:
        mine = RedisProcess()
        mine.port = squatter.port
        try:
            mine.start()
            assert mine.port != squatter.port and mine.proc is not None
            assert redis_lib.Redis(port=mine.port).info("server")["process_id"] == mine.proc.pid
        finally:
            mine.close()


def test_a_sentinel_whose_port_another_redis_took_starts_on_a_fresh_one() -> None:
    with RedisProcess() as squatter:
        group = SentinelGroup("admin-" + "a" * 20, replicas=1, sentinels=2)
        group.sentinels[1].port = squatter.port
        try:
            group.start(timeout=60)
            assert group.sentinels[1].port != squatter.port
            assert group.master_now() is group.master
        finally:
            group.close()


def test_a_group_that_never_settles_says_what_each_sentinel_sees() -> None:
    group = SentinelGroup("admin-" + "a" * 20, replicas=1, sentinels=2)
    try:
        for p in group.processes():
            p.start()
        group.sentinels[1].kill()
        with pytest.raises(TimeoutError, match=r"0/1 other sentinels, 1/1 replicas in sync|not running") as e:
            group.wait_ready(timeout=3)
        assert f"sentinel :{group.sentinels[1].port} not running" in str(e.value)
    finally:
        group.close()


def test_free_port_never_hands_out_one_of_its_last_256_ports_again() -> None:
    ports = [free_port() for _ in range(256)]
    assert len(set(ports)) == 256
