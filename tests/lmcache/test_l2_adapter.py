"""kvstore as an L2 adapter of LMCache's multiprocess server, against real nodes (and a real Redis).

The adapter is built the way `lmcache server --l2-adapter JSON` builds it (LMCache's own argument
parser and adapter factory, through its plugin loader) and driven through LMCache's L2 interface:
submit a task, wait on its event fd, pop the result. Memory objects are LMCache TensorMemoryObjs.
The real engine (vLLM -> LMCacheMPConnector -> `lmcache server` -> this adapter) is in tests/engines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from devkit.faults import damage_page
from kvstore.cli.launch import NodeProcess
from kvstore.cli.redis_procs import RedisProcess
from kvstore.cli.waits import free_port
from kvstore.client import KVStoreClient
from kvstore.layout import DType, PageLayout
from kvstore.names import TierKind
from kvstore.security import ClientSecurity
from kvstore.stats import NodeStats
from tests.lmcache.conftest import CHUNK_BYTES, SLOT, Records, captured, start_node
from tests.security.conftest import wait_for

pytest.importorskip("lmcache", reason="LMCache is an optional extra: ./dev test installs it")

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2AdapterListener
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import (
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd

from kvstore.integrations import lanes, lmcache_l2
from kvstore.integrations.lmcache_l2_mapping import l2_layout_tag, l2_namespace, l2_page_key

MODEL = "it/llama-l2"
RANK = 0x1000100  # a kv_rank as LMCache computes it (a bitmap of layers and heads)
SHAPE = (2, 2, 16, 128)  # float16: 16 KiB, one node page (CHUNK_BYTES)
TAG = l2_layout_tag([SHAPE], ["float16"])
NS = l2_namespace("lmcache", MODEL, RANK, 0, salt="", layout_tag=TAG)
DESC = {0: MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.float16])}
TOKEN = "l2-" + "t" * 30
assert CHUNK_BYTES == 2 * 2 * 16 * 128 * 2


def keys(n: int, start: int = 0, *, salt: str = "", group: int = 0, model: str = MODEL) -> list[ObjectKey]:
    return [ObjectKey(chunk_hash=(0xC0FFEE00 + i).to_bytes(16, "big"), model_name=model, kv_rank=RANK,
                      object_group_id=group, cache_salt=salt) for i in range(start, start + n)]  # fmt: skip


def objects(n: int, seed: int | None = None, shape: Sequence[int] = SHAPE) -> list[Any]:
    """LMCache memory objects (as its L1 hands them out: shapes and dtypes set), random bytes when seeded."""
    out = []
    for i in range(n):
        t = torch.zeros(tuple(shape), dtype=torch.float16)
        if seed is not None:
            g = torch.Generator().manual_seed(seed * 1000 + i)
            raw = t.view(torch.uint8).view(-1)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        md = MemoryObjMetadata(shape=torch.Size(shape), dtype=torch.float16, address=0, phy_size=t.nbytes,
                               fmt=MemoryFormat.KV_2LTD, ref_count=1, shapes=[torch.Size(shape)],
                               dtypes=[torch.float16])  # fmt: skip
        out.append(TensorMemoryObj(raw_data=t, metadata=md, parent_allocator=None))
    return out


def raw(objs: Sequence[Any]) -> list[bytes]:
    return [bytes(o.byte_array) for o in objs]


def make(params: dict[str, object]) -> Any:
    """The adapter exactly as `lmcache server --l2-adapter JSON` makes it."""
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    spec = {"type": "plugin", "module_path": "kvstore.integrations.lmcache_l2", "class_name": "KVStoreL2Adapter",
            "adapter_params": {"down_backoff_s": 0.2, **params}}  # fmt: skip
    cfg = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    return create_l2_adapter(cfg.adapters[0])


@pytest.fixture
def adapters() -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def new(**params: object) -> Any:
        a = make(params)
        made.append(a)
        return a

    yield new
    for a in made:
        a.close()


@pytest.fixture
def log() -> Iterator[Records]:
    with captured(lmcache_l2.__name__) as rec:
        yield rec


def _wait(fd: int, timeout: float) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(timeout * 1000), f"no completion signalled within {timeout}s"
    consume_fd(fd)


def store(a: Any, ks: list[ObjectKey], objs: list[Any], timeout: float = 20) -> Any:
    task = a.submit_store_task(ks, objs)
    deadline = time.monotonic() + timeout
    while True:
        _wait(a.get_store_event_fd(), max(0.01, deadline - time.monotonic()))
        done = a.pop_completed_store_tasks()
        if task in done:
            return done[task]


def lookup(a: Any, ks: list[ObjectKey], descs: dict | None = None, timeout: float = 20) -> list[int]:
    task = a.submit_lookup_and_lock_task(ks, DESC if descs is None else descs)
    _wait(a.get_lookup_and_lock_event_fd(), timeout)
    bitmap = a.query_lookup_and_lock_result(task)
    assert bitmap is not None
    return list(bitmap.get_indices_list())


def load(a: Any, ks: list[ObjectKey], objs: list[Any], timeout: float = 20) -> list[int]:
    task = a.submit_load_task(ks, objs)
    _wait(a.get_load_event_fd(), timeout)
    bitmap = a.query_load_result(task)
    assert bitmap is not None
    return list(bitmap.get_indices_list())


def node_stats(node: NodeProcess, token: str | None = None) -> NodeStats:
    with KVStoreClient(node.addr, timeout=10, security=ClientSecurity(token=token), transport="grpc") as kv:
        return kv.stats()


def test_store_lookup_lock_load_round_trip_bit_exact(node: NodeProcess, adapters: Callable[..., Any]) -> None:
    a = adapters(target=node.addr)
    ks, src = keys(6), objects(6, seed=1)
    res = store(a, ks, src)
    assert res.is_successful() and res.bytes_transferred() == 6 * CHUNK_BYTES
    assert node_stats(node).namespaces == [(NS, PageLayout(DType.UINT8, 1, 1, CHUNK_BYTES // 2, 1), 6)]

    # A prefix of each row is found: the 7th key was never stored, and is not reported.
    assert lookup(a, [*ks, *keys(1, 6)]) == list(range(6))
    assert node_stats(node).pinned_pages == 6  # locked until LMCache unlocks them
    dst = objects(6)
    assert load(a, ks, dst) == list(range(6))
    assert raw(dst) == raw(src)  # bit-exact, straight into LMCache's objects
    a.submit_unlock(ks)
    wait_for(lambda: node_stats(node).pinned_pages == 0, what="the unlock to release the pins")

    st = a.report_status()
    assert st["is_healthy"] and st["load_hits"] == 6 and st["bytes_loaded"] == 6 * CHUNK_BYTES
    dram = node_stats(node).tiers[1]
    assert dram.counters.hits >= 6 and dram.counters.bytes_out >= 6 * CHUNK_BYTES


def test_a_row_with_a_gap_reports_and_keeps_pinned_only_its_prefix(node: NodeProcess,
                                                                     adapters: Callable[..., Any]) -> None:  # fmt: skip
    a = adapters(target=node.addr)
    assert store(a, keys(4), objects(4, seed=15)).is_successful()
    assert store(a, keys(1, 6), objects(1, seed=16)).is_successful()  # chunk 6 held, 4 and 5 not
    assert lookup(a, keys(8)) == [0, 1, 2, 3]
    assert node_stats(node).pinned_pages == 4  # chunk 6 was pinned by the first probe, then released
    a.submit_unlock(keys(8))
    wait_for(lambda: node_stats(node).pinned_pages == 0, what="the unlock to release the pins")


def test_a_second_server_process_finds_what_the_first_stored(node: NodeProcess, adapters: Callable[..., Any]) -> None:
    """Keys name the same pages in every process: the point of a shared L2 (no state kept per adapter)."""
    ks, src = keys(4), objects(4, seed=2)
    assert store(adapters(target=node.addr), ks, src).is_successful()
    other = adapters(target=node.addr, transport="grpc")
    assert lookup(other, ks) == [0, 1, 2, 3]
    dst = objects(4)
    assert load(other, ks, dst) == [0, 1, 2, 3] and raw(dst) == raw(src)


def test_rows_salts_and_layouts_get_their_own_namespaces_and_usage(node: NodeProcess,
                                                                    adapters: Callable[..., Any]) -> None:  # fmt: skip
    a = adapters(target=node.addr, usage_interval_s=0.05)
    other_shape = (2, 2, 8, 128)  # another chunk size: another layout tag, so another namespace
    assert store(a, keys(3), objects(3, seed=3)).is_successful()
    assert store(a, keys(2, salt="alice"), objects(2, seed=4)).is_successful()
    assert store(a, keys(1, salt="bob x"), objects(1, seed=5)).is_successful()
    assert store(a, keys(2, group=1), objects(2, seed=6, shape=other_shape)).is_successful()
    names = {ns: n for ns, _, n in node_stats(node).namespaces}
    assert names == {NS: 3, l2_namespace("lmcache", MODEL, RANK, 0, salt="alice", layout_tag=TAG): 2,
                     l2_namespace("lmcache", MODEL, RANK, 0, salt="bob x", layout_tag=TAG): 1,
                     l2_namespace("lmcache", MODEL, RANK, 1, salt="", layout_tag=l2_layout_tag([other_shape], ["float16"])): 2}  # fmt: skip
    bob = l2_namespace("lmcache", MODEL, RANK, 0, salt="bob x", layout_tag=TAG)
    assert bob.split("/")[-1].startswith("s~")  # not plain: a digest
    # The same chunk hash under another salt is another page: salts share nothing.
    assert lookup(a, keys(3, salt="alice")) == [0, 1]

    def usage() -> Any:
        u = a.get_usage()
        return u if u.total_bytes_used == 8 * CHUNK_BYTES - CHUNK_BYTES else None  # 2 of them are half-size

    u = wait_for(usage, what="usage read from the node") or a.get_usage()
    assert dict(u.bytes_by_cache_salt) == {"": 4 * CHUNK_BYTES, "alice": 2 * CHUNK_BYTES, "bob x": CHUNK_BYTES}
    assert u.total_capacity_bytes == 0  # no tenant share, no max_capacity_gb: unknown

    a.delete(keys(3))  # LMCache's L2 eviction, when configured
    assert {ns: n for ns, _, n in node_stats(node).namespaces}.get(NS, 0) == 0
    assert lookup(a, keys(3)) == []


def test_a_tenant_token_maps_usage_and_capacity_onto_the_tenant(tmp_path: Path, adapters: Callable[..., Any]) -> None:
    tokens = tmp_path / "rw.tokens"
    tokens.write_text(f"{TOKEN} team-a\n{'o' * 32}\n")
    tokens.chmod(0o600)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f"[tenants.team-a]\ndram_bytes = {8 * SLOT}\nnvme_bytes = {16 * SLOT}\n")
    tenants.chmod(0o600)
    node = start_node(tmp_path, extra_args=["--auth-tokens-file", str(tokens), "--tenants-file", str(tenants)])
    try:
        token_file = tmp_path / "adapter.token"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
        a = adapters(target=node.addr, token_file=str(token_file), usage_interval_s=0.05)
        ks, src = keys(3), objects(3, seed=7)
        assert store(a, ks, src).is_successful()
        # Until the first Stats arrive, usage is LMCache's own count of what was stored (no capacity).
        u = wait_for(lambda: (x := a.get_usage()).total_capacity_bytes and x, what="usage read from the node")
        assert u.total_bytes_used == 3 * CHUNK_BYTES and dict(u.bytes_by_cache_salt) == {"": 3 * CHUNK_BYTES}
        assert u.total_capacity_bytes == 24 * SLOT and a.tenant == "team-a"  # the tenant's share, DRAM + NVMe
        # The operator (default tenant) does not see team-a's namespace as its own.
        assert node_stats(node, "o" * 32).namespaces == []
        dst = objects(3)
        assert load(a, ks, dst) == [0, 1, 2] and raw(dst) == raw(src)
    finally:
        node.close()


def test_a_node_that_is_down_is_a_miss_within_a_bounded_time(adapters: Callable[..., Any], log: Records) -> None:
    addr = f"127.0.0.1:{free_port()}"  # nobody listens
    a = adapters(target=addr, timeout_s=2, lookup_timeout_s=0.5)
    t0 = time.monotonic()
    assert not store(a, keys(2), objects(2, seed=8)).is_successful()
    for _ in range(5):
        assert lookup(a, keys(2)) == []
        assert load(a, keys(2), objects(2)) == []
    assert time.monotonic() - t0 < 5, "a node that is down must cost misses, not waits"
    errors = [r.getMessage() for r in log.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and f"kvstore node {addr} does not answer" in errors[0], errors
    assert not a.report_status()["is_healthy"]


def test_a_stalled_node_is_a_miss_after_the_timeout_and_serves_again_when_back(
        tmp_path: Path, adapters: Callable[..., Any], log: Records) -> None:  # fmt: skip
    node = start_node(tmp_path)
    try:
        a = adapters(target=node.addr, timeout_s=1.0, lookup_timeout_s=0.5, transport="tcp")
        ks, src = keys(3), objects(3, seed=9)
        assert store(a, ks, src).is_successful()
        assert node.proc is not None
        os.kill(node.proc.pid, signal.SIGSTOP)  # alive, connected, silent: the worst kind of slow
        try:
            t0 = time.monotonic()
            assert lookup(a, ks, timeout=10) == []
            assert load(a, ks, objects(3), timeout=10) == []
            assert time.monotonic() - t0 < 3.5, "each call must end at its deadline"
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
        assert "does not answer" in log.text(logging.ERROR)

        def back() -> bool:
            dst = objects(3)
            return lookup(a, ks) == [0, 1, 2] and load(a, ks, dst) == [0, 1, 2] and raw(dst) == raw(src)

        wait_for(back, timeout=15, what="the node to serve again")
        assert "answers again" in log.text(logging.INFO)
    finally:
        node.close()


def test_a_wrong_token_is_a_logged_miss_and_stores_nothing(tmp_path: Path, adapters: Callable[..., Any],
                                                           log: Records) -> None:  # fmt: skip
    tokens = tmp_path / "rw.tokens"
    tokens.write_text(TOKEN + "\n")
    tokens.chmod(0o600)
    node = start_node(tmp_path, extra_args=["--auth-tokens-file", str(tokens)])
    try:
        bad = tmp_path / "bad.token"
        bad.write_text("x" * 32 + "\n")
        bad.chmod(0o600)
        a = adapters(target=node.addr, token_file=str(bad))
        assert not store(a, keys(2), objects(2, seed=10)).is_successful()
        assert lookup(a, keys(2)) == [] and load(a, keys(2), objects(2)) == []
        text = log.text(logging.ERROR)
        assert "refused" in text and "adapter_params.token_file" in text, text
        assert node_stats(node, TOKEN).namespaces == []  # nothing stored
    finally:
        node.close()


def test_a_wrong_layout_is_a_logged_miss_and_stores_nothing(node: NodeProcess, adapters: Callable[..., Any],
                                                            log: Records) -> None:  # fmt: skip
    """An explicit namespace holds one page size; objects of another layout are refused, never mixed."""
    a = adapters(target=node.addr, namespace="prod/llama")
    ks, src = keys(2), objects(2, seed=11)
    assert store(a, ks, src).is_successful()
    half = (2, 2, 8, 128)
    assert not store(a, keys(2, 10), objects(2, seed=12, shape=half)).is_successful()
    assert "rejected put" in log.text(logging.ERROR)
    assert node_stats(node).namespaces == [("prod/llama", PageLayout(DType.UINT8, 1, 1, CHUNK_BYTES // 2, 1), 2)]
    # Loading the stored pages into objects of another size: a logged miss, not a partial copy.
    assert load(a, ks, objects(2, shape=(2, 2, 32, 128))) == []
    assert "16384-byte pages" in log.text(logging.ERROR)
    dst = objects(2)
    assert load(a, ks, dst) == [0, 1] and raw(dst) == raw(src)


def test_a_damaged_page_on_the_node_is_refused_and_never_served(tmp_path: Path, adapters: Callable[..., Any]) -> None:
    node = start_node(tmp_path, dram_pages=1, nvme_pages=16)  # a one-page DRAM: the chain lives on NVMe
    try:
        a = adapters(target=node.addr)
        ks, src = keys(4), objects(4, seed=13)
        assert store(a, ks, src).is_successful()
        hashes = [l2_page_key(MODEL, RANK, 0, k.chunk_hash) for k in ks]
        with KVStoreClient(node.addr, transport="grpc") as kv:
            tiers = kv.lookup_detail(NS, hashes).tiers
        victim = next(i for i, t in enumerate(tiers) if t == TierKind.NVME)
        damage_page(tmp_path / "nvme-n0", hashes[victim])  # one flipped bit: bit rot
        dst = objects(4)
        assert load(a, ks, dst) == list(range(victim)), "the damaged page and everything after it are a miss"
        assert raw(dst[:victim]) == raw(src[:victim])
        assert node_stats(node).tiers[2].counters.checksum_failures == 1
        assert lookup(a, ks) == list(range(victim))  # dropped by the node: never found, never served again
    finally:
        node.close()


def test_a_cluster_through_the_redis_index_bit_exact(tmp_path: Path, adapters: Callable[..., Any]) -> None:
    r = RedisProcess().start()
    nodes: list[NodeProcess] = []
    try:
        for name in ("c0", "c1"):
            nodes.append(start_node(tmp_path, name, redis_url=r.url, extra_args=["--index-ttl", "2"]))
        writer = adapters(redis_url=r.url, local_node="c1")
        ks, src = keys(5), objects(5, seed=14)
        assert store(writer, ks, src).is_successful()
        reader = adapters(redis_url=r.url)
        wait_for(lambda: lookup(reader, ks) == [0, 1, 2, 3, 4], what="the index to list all 5 pages")
        dst = objects(5)
        assert load(reader, ks, dst) == [0, 1, 2, 3, 4] and raw(dst) == raw(src)
        assert [node_stats(n).tiers[1].pages for n in nodes] == [0, 5]  # on the writer's local node
        reader.submit_unlock(ks)
        wait_for(lambda: node_stats(nodes[1]).pinned_pages == 0, what="the pins to be released")
    finally:
        for n in nodes:
            n.close()
        r.close()


@pytest.mark.parametrize(("params", "named"), [
    ({}, "adapter_params.target / adapter_params.redis_url"),
    ({"target": "127.0.0.1:1", "redis_url": "redis://127.0.0.1:2/0"}, "give exactly one"),
    ({"target": "no-port"}, "adapter_params.target"),
    ({"redis_url": "http://x:1"}, "adapter_params.redis_url"),
    ({"target": "127.0.0.1:1", "timeout_s": "soon"}, "adapter_params.timeout_s"),
    ({"target": "127.0.0.1:1", "transport": "carrier-pigeon"}, "adapter_params.transport"),
    ({"target": "127.0.0.1:1", "namespace": "a\x01b"}, "adapter_params.namespace"),
    ({"target": "127.0.0.1:1", "lock": "maybe"}, "adapter_params.lock"),
    ({"target": "127.0.0.1:1", "max_capacity_gb": -1}, "adapter_params.max_capacity_gb"),
    ({"target": "127.0.0.1:1", "tls_cert": "c.pem"}, "adapter_params.tls_cert / adapter_params.tls_key"),
    ({"target": "127.0.0.1:1", "tokenfile": "x"}, "adapter_params.tokenfile: unknown parameter"),
    ({"target": "127.0.0.1:1", "token_file": "/nonexistent/kvstore.token"}, "/nonexistent/kvstore.token"),
    ({"target": "127.0.0.1:1", "model_revision": ""}, "adapter_params.model_revision"),
    ({"target": "127.0.0.1:1", "model_revision": {"m": 7}}, "adapter_params.model_revision.m"),
])  # fmt: skip
def test_bad_adapter_params_are_refused_naming_the_field(params: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match="kvstore L2 adapter") as err:
        spec = {"type": "plugin", "module_path": "kvstore.integrations.lmcache_l2", "class_name": "KVStoreL2Adapter",
                "adapter_params": params}  # fmt: skip
        parser = add_l2_adapters_args(argparse.ArgumentParser())
        create_l2_adapter(
            parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)])).adapters[0]
        )
    assert named in str(err.value), str(err.value)


class Announced(L2AdapterListener):
    """What LMCache's own listeners (its L2 eviction controller) hear from the adapter."""

    def __init__(self) -> None:
        self.stored: list[ObjectKey] = []

    def on_l2_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        self.stored += keys

    def on_l2_keys_accessed(self, keys: list[ObjectKey]) -> None:
        pass

    def on_l2_keys_deleted(self, keys: list[ObjectKey]) -> None:
        pass


def test_a_full_node_fails_the_store_and_announces_only_what_it_kept(tmp_path: Path, adapters: Callable[..., Any],
                                                                     log: Records) -> None:  # fmt: skip
    """A DRAM-only node, full, whose policy refuses what it has not seen before (second sight: a deterministic
    pattern; the default policy refuses by its learned threshold). A store task succeeds only when the node
    holds every key afterwards (else LMCache would drop its L1 copy of a chunk nobody holds), and only the keys
    it holds reach LMCache's listeners and its usage accounting."""
    n = start_node(tmp_path, "full", dram_pages=8, nvme_pages=0, extra_args=["--policy", "second-sight"])
    try:
        a = adapters(target=n.addr)
        heard = Announced()
        a.register_listener(heard)
        fill = keys(8, 100)
        assert store(a, fill, objects(8, seed=20)).is_successful()  # DRAM exactly full
        assert L2AdapterInterface.get_usage(a).total_bytes_used == 8 * CHUNK_BYTES
        p, q = keys(3, 200), keys(3, 300)
        res = store(a, p, objects(3, seed=21))  # first sight: none admitted
        assert not res.is_successful()
        assert a.report_status()["unstored_pages"] == 3
        assert lookup(a, p) == [] and heard.stored == fill
        assert "did not keep 3 of 3 pages" in log.text()
        # Second sight admits p's pages; q's are new and refused. Interleaved in one task, one Put.
        heard.stored.clear()
        mixed = [k for pair in zip(p, q, strict=True) for k in pair]
        res = store(a, mixed, objects(6, seed=22))
        assert not res.is_successful()  # before: a success, and all six announced as stored
        assert heard.stored == p, "exactly the keys the node holds are announced"
        assert lookup(a, p) == [0, 1, 2] and lookup(a, mixed) == [0]
        assert [lookup(a, [k]) for k in q] == [[], [], []]
        assert L2AdapterInterface.get_usage(a).total_bytes_used == 11 * CHUNK_BYTES
    finally:
        n.close()


def test_a_weights_revision_is_its_own_namespace(node: NodeProcess, adapters: Callable[..., Any]) -> None:
    """LMCache's ObjectKey carries the model's name only: `adapter_params.model_revision` (one for every model,
    or per model) names the weights, so a server on other weights under the same name is a cold miss."""
    ks, src = keys(3, 400), objects(3, seed=30)
    assert store(adapters(target=node.addr, model_revision="0e9e39f"), ks, src).is_successful()
    same = adapters(target=node.addr, model_revision={MODEL: "0e9e39f", "other/model": "x"})
    assert lookup(same, ks) == [0, 1, 2]
    for other in ({}, {"model_revision": "1f2a3b4"}, {"model_revision": {"other/model": "0e9e39f"}}):
        assert lookup(adapters(target=node.addr, **other), ks) == [], other
    names = {ns for ns, _, _ in node_stats(node).namespaces}
    assert l2_namespace("lmcache", f"{MODEL}@0e9e39f", RANK, 0, salt="", layout_tag=TAG) in names


def test_a_chunks_object_groups_are_one_bundle_stored_and_loaded_together(
    tmp_path: Path, adapters: Callable[..., Any]
) -> None:
    """LMCache's object groups (a hybrid model's full-attention and sliding-window KV of one chunk, each its own
    ObjectKey and MemoryObj) that one task carries are one page on the node, stored and loaded together; a task
    asking for one group alone is a miss, never one group of a chunk without the other."""
    node = start_node(tmp_path, max_page_bytes=2 * CHUNK_BYTES)  # a bundle holds both groups' bytes
    try:
        a = adapters(target=node.addr)
        small = (2, 1, 16, 128)  # the second group's objects: another shape, another size
        ks = keys(4, 40, group=0) + keys(4, 40, group=1)  # group-major, as LMCache orders a task's keys
        src = objects(4, seed=7) + objects(4, seed=8, shape=small)
        res = store(a, ks, src)
        assert res.is_successful() and res.bytes_transferred() == 4 * (CHUNK_BYTES + CHUNK_BYTES // 2)
        bundles = [(ns, lay, n) for ns, lay, n in node_stats(node).namespaces if lay.is_bundle]
        assert len(bundles) == 1 and bundles[0][2] == 4  # one page per chunk, both groups in it
        assert bundles[0][0].startswith(NS) and "/g0+g1~" in bundles[0][0]

        descs = {**DESC, 1: MemoryLayoutDesc(shapes=[torch.Size(small)], dtypes=[torch.float16])}
        assert lookup(a, ks, descs) == list(range(8))
        assert node_stats(node).pinned_pages == 4  # one pin per chunk
        dst = objects(4) + objects(4, shape=small)
        assert load(a, ks, dst) == list(range(8))
        assert raw(dst) == raw(src)
        a.submit_unlock(ks)
        wait_for(lambda: node_stats(node).pinned_pages == 0, what="the unlock to release the bundles' pins")
        assert lookup(a, ks[:4], descs) == []  # group 0 alone: not stored as a page of its own
    finally:
        node.close()


def test_a_task_in_several_calls_in_flight_is_bit_exact_and_stops_at_a_gap(
    node: NodeProcess, adapters: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task's pages move as several calls, two in flight (integrations/lanes.py): here two chunks per call. What
    lands is bit-exact, and a load reports the row's prefix only: the calls past its first gap are not counted."""
    monkeypatch.setattr(lanes, "SLICE_BYTES", 2 * CHUNK_BYTES)
    a = adapters(target=node.addr)
    ks, src = keys(7), objects(7, seed=30)
    res = store(a, ks, src)
    assert res.is_successful() and res.bytes_transferred() == 7 * CHUNK_BYTES
    assert a.report_status()["stored_pages"] == 7
    dst = objects(7)
    assert load(a, ks, dst) == list(range(7)) and raw(dst) == raw(src)

    a.delete([ks[3]])  # a gap in the second call: the third and fourth calls are past it
    dst = objects(7)
    assert load(a, ks, dst) == [0, 1, 2]
    assert raw(dst)[:3] == raw(src)[:3]
    assert a.report_status()["load_hits"] == 7 + 3


def test_the_plane_and_receive_memory_are_set_up_before_the_first_store(
    node: NodeProcess, adapters: Callable[..., Any]
) -> None:
    """The first store pays no set-up of its own (RemoteStore.warm): the adapter negotiates its plane and opens its
    connection at start, and maps receive memory for a size once a lookup names it (LMCache looks up first)."""
    a = adapters(target=node.addr)
    wait_for(lambda: a.store.plane is not None, what="the data plane negotiated at start")
    assert lookup(a, keys(2)) == []  # nothing stored yet; the layout names the objects' size
    if a.store.plane == "shm":  # receive memory is the same-host plane's; TCP receives into the objects
        pool = a.store._data.receive_pool
        wait_for(lambda: pool.mapped_bytes >= CHUNK_BYTES, what="receive memory mapped for the objects' size")
    assert node_stats(node).namespaces == []  # warming stored nothing
    ks, src = keys(2), objects(2, seed=40)
    assert store(a, ks, src).is_successful()
    dst = objects(2)
    assert load(a, ks, dst) == [0, 1] and raw(dst) == raw(src)
