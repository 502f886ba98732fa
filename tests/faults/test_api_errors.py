"""Regression tests for what was found from outside (DESIGN.md §8.6): status codes of bad requests, Pin NaN,
the Redis-outage error class, and CLI help text that rich markup swallowed. Real nodes, real Redis."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import redis
import typer
from typer.testing import CliRunner

from devkit.faults import LAYOUT, NS, key, put_chain
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.cli.kvctl import app as kvctl_app
from kvstore.cli.launch import NodeProcess
from kvstore.cli.main import app as kvstore_app
from kvstore.cli.redis_procs import RedisProcess
from kvstore.client import KVStoreClient
from kvstore.client.cluster import ClusterClient
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.index import NODES_KEY, IndexFailure, IndexUnavailable
from kvstore.index.reader import LIVE_REFRESH_S
from kvstore.wire.streams import layout_to_pb

SERVICE = "/kvstore.v1.KVStore/"


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    n = NodeProcess(dram_bytes="8MiB", max_page_bytes=LAYOUT.page_bytes, node_id="api-errors").start()
    try:
        with KVStoreClient(n.addr, timeout=30) as kv:
            put_chain(kv, [key(i, "api") for i in range(4)])
        yield n
    finally:
        n.close()


def _raw(node: NodeProcess, method: str, raw: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(node.addr) as ch:
        call = ch.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            call(raw, timeout=30)
    return info.value  # type: ignore[return-value]


def test_unknown_target_tier_is_invalid_argument(node: NodeProcess) -> None:
    req = pb.PrefetchRequest(namespace=NS, hashes=[key(0, "api")], target_tier=99).SerializeToString()
    err = _raw(node, "Prefetch", req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "target_tier: 99 is not a tier" in err.details()
    opener = pb.PutRequest(open=pb.PutOpen(namespace=NS, layout=layout_to_pb(LAYOUT), target_tier=99))
    with grpc.insecure_channel(node.addr) as ch:
        put = ch.stream_unary(SERVICE + "Put", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            put(iter([opener.SerializeToString()]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "open.target_tier" in info.value.details()


@pytest.mark.parametrize("method", ["Lookup", "Delete", "Pin", "Unpin", "Prefetch", "Stats", "Report"])
def test_undecodable_unary_request_is_invalid_argument(node: NodeProcess, method: str) -> None:
    err = _raw(node, method, b"\x0f garbage")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "request" in err.details() and "do not parse" in err.details()


def test_namespace_that_is_not_utf8_is_invalid_argument(node: NodeProcess) -> None:
    raw = b"\x0a\x02\xff\xfe"  # LookupRequest.namespace = b"\xff\xfe"
    err = _raw(node, "Lookup", raw)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.details()
    with grpc.insecure_channel(node.addr) as ch:  # the server-streaming Get too
        get = ch.unary_stream(SERVICE + "Get", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            list(get(raw, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("ttl", [math.nan, math.inf, -1.0])
def test_pin_ttl_must_be_finite(node: NodeProcess, ttl: float) -> None:
    with KVStoreClient(node.addr, timeout=30) as kv:
        with pytest.raises(InvalidArgument, match="ttl_seconds"):
            kv.pin(NS, [key(0, "api")], ttl_seconds=ttl)
        assert kv.stats().pinned_pages == 0


def test_cluster_lookup_during_redis_outage_raises_a_kvstore_error() -> None:
    with RedisProcess() as redis_proc, ClusterClient(redis_proc.url, timeout=10) as cc:
        assert cc.lookup(NS, [key(0)]).matched == 0
        redis_proc.kill()
        time.sleep(LIVE_REFRESH_S + 0.1)  # the view of who is alive (empty here) is kept that long
        with pytest.raises(IndexUnavailable, match="unreachable") as info:
            cc.lookup(NS, [key(0)])
        assert isinstance(info.value, Unavailable)
        assert f":{redis_proc.port}" in str(info.value)
        redis_proc.start()
        assert cc.lookup(NS, [key(0)]).matched == 0  # back without a new client


def test_an_index_in_a_state_it_cannot_read_raises_a_kvstore_error_not_redis_s() -> None:
    """The reader is the edge between Redis and kvstore: a kvstore key of another type (WRONGTYPE from Redis)
    leaves as IndexFailure, a KVStoreError naming the index, never as redis-py's ResponseError."""
    with RedisProcess() as redis_proc, ClusterClient(redis_proc.url, timeout=10) as cc:
        with redis.Redis.from_url(redis_proc.url) as r:
            r.set(NODES_KEY, b"not a set")
        with pytest.raises(IndexFailure, match=f"index at .*:{redis_proc.port}.*WRONGTYPE") as info:
            cc.index.nodes()
        assert isinstance(info.value, KVStoreError) and not isinstance(info.value, redis.RedisError)


def _commands(app: typer.Typer) -> Iterator[tuple[list[str], Any]]:
    """(argv path, command) of every leaf command (typer's click is its own: duck-typed)."""

    def walk(cmd: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                yield from walk(sub, [*path, name])
        else:
            yield path, cmd

    yield from walk(typer.main.get_command(app), [])


@pytest.mark.parametrize("app", [kvstore_app, kvctl_app], ids=["kvstore", "kvctl"])
def test_cli_help_shows_every_bracketed_word(app: typer.Typer) -> None:
    """Rich markup swallows "[node]"-like words unless escaped: every bracketed word in an option's help
    must reach the rendered --help (the outside report: "--config TOML file with a  table")."""
    runner = CliRunner()
    checked = 0
    for path, cmd in _commands(app):
        texts = [p.help or "" for p in cmd.params] + [cmd.help or ""]  # type: ignore[attr-defined]
        words = {w for t in texts for w in re.findall(r"\\?\[[a-z][a-z_.-]*\]", t)}
        if not words:
            continue
        out = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "400"}, terminal_width=400).output
        for w in words:
            assert w.lstrip("\\") in out, f"{' '.join(path)} --help lost {w!r}"
            checked += 1
    if app is kvstore_app:
        assert checked >= 1  # serve's --config at least
