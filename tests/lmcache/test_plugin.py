"""The plugin inside LMCache's own StorageManager (RemoteBackend + our connector) against real nodes.

What an engine does through LMCache, minus the GPU: batched_put / batched_contains / batched_get
and the asynchronous lookup-and-prefetch path; then the failures an operator meets: a node restart,
a node that is down, a wrong token, a page of the wrong size, a namespace bound to another layout.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.cli.redis_procs import RedisProcess
from kvstore.cli.waits import free_port
from kvstore.client import KVStoreClient
from kvstore.integrations.lmcache_mapping import page_key
from kvstore.layout import DType, PageLayout
from kvstore.security import ClientSecurity
from kvstore.tiers.base import TierKind
from tests.integration.test_cluster import wait_for  # the suite's bounded poll
from tests.lmcache.conftest import (
    CHUNK,
    CHUNK_BYTES,
    HEAD_DIM,
    HEADS,
    LAYERS,
    MODEL,
    REMOTE,
    Records,
    fill,
    key,
    metadata,
    plugin_config,
    start_node,
)

pytest.importorskip("lmcache", reason="LMCache is an optional extra: ./dev test installs it")

NS = f"lmcache/v1/{MODEL}/ws1/w0/half/kv_2ltd/2x{LAYERS}xTx{HEADS * HEAD_DIM}:half/c{CHUNK}"
LAYOUT = PageLayout(DType.FLOAT16, LAYERS, HEADS, HEAD_DIM, CHUNK)
TOKEN = "t-" + "k" * 30


def chunks(sm: Any, n: int, seed: int, tokens: int = CHUNK) -> tuple[list[Any], list[bytes]]:
    """n MemoryObjs from the storage manager's allocator (LMCache's CPU buffer), filled with known bytes."""
    meta = sm.metadata
    objs = [sm.allocate(meta.get_shapes(tokens), meta.get_dtypes()) for _ in range(n)]
    assert all(o is not None for o in objs), "LMCache's CPU buffer is full"
    return objs, [fill(o, seed * 1000 + i) for i, o in enumerate(objs)]


def put_and_wait(sm: Any, keys: Sequence[Any], objs: Sequence[Any]) -> None:
    """LMCache's RemoteBackend put with a completion callback: returns once the connector is done."""
    done = threading.Semaphore(0)
    sm.storage_backends[REMOTE].batched_submit_put_task(
        list(keys), list(objs), on_complete_callback=lambda _k: done.release()
    )
    for _ in keys:
        assert done.acquire(timeout=20), "the plugin never completed the put"


def release(objs: Sequence[Any]) -> None:
    for o in objs:
        if o is not None:
            o.ref_count_down()


def stats(node: NodeProcess, token: str | None = None) -> Any:
    with KVStoreClient(node.addr, timeout=10, security=ClientSecurity(token=token)) as kv:
        return kv.stats()


def tier(st: Any, kind: TierKind) -> Any:
    return next(t for t in st.tiers if t.tier == kind)


def test_store_and_retrieve_bit_exact_through_lmcaches_storage_manager(
        node: NodeProcess, storage_managers: Callable[..., Any]) -> None:  # fmt: skip
    writer = storage_managers(plugin_config(f"kvstore://{node.addr}"))
    keys = [key(i) for i in range(4)]
    objs, data = chunks(writer, 4, seed=1)
    writer.batched_put(keys, objs)  # the engine's store path (it hands its references over)
    wait_for(lambda: writer.batched_contains(keys)[0] == 4, what="all 4 chunks visible")

    reader = storage_managers(plugin_config(f"kvstore://{node.addr}"))  # another engine: an empty LMCache
    assert reader.batched_contains(keys) == (4, {REMOTE: keys})
    got = reader.batched_get(keys, location=REMOTE)
    assert [bytes(o.byte_array) for o in got] == data
    assert [tuple(o.get_shape()) for o in got] == [(2, LAYERS, CHUNK, HEADS * HEAD_DIM)] * 4
    release(got)

    # a prefix: the chain stops at the first chunk kvstore does not hold
    holey = [keys[0], keys[1], key(99), keys[3]]
    assert reader.batched_contains(holey)[0] == 2
    got = reader.batched_get(holey, location=REMOTE)
    assert [o is not None for o in got] == [True, True, False, False]
    release(got)

    st = stats(node)
    dram = tier(st, TierKind.DRAM)
    assert (dram.pages, dram.counters.bytes_in) == (4, 4 * CHUNK_BYTES)  # LMCache's writes, per tier
    assert dram.counters.hits >= 6 and dram.counters.bytes_out >= 6 * CHUNK_BYTES  # and its reads
    assert (NS, LAYOUT, 4) in st.namespaces


def test_async_lookup_prefetches_from_nvme_and_pins(tmp_path: Path, storage_managers: Callable[..., Any]) -> None:
    node = start_node(tmp_path, dram_pages=4, nvme_pages=32)
    try:
        sm = storage_managers(plugin_config(f"kvstore://{node.addr}"))
        keys = [key(i) for i in range(8)]
        objs, data = chunks(sm, 8, seed=2)
        put_and_wait(sm, keys, objs)
        release(objs)
        wait_for(lambda: tier(stats(node), TierKind.NVME).pages >= 4, what="older chunks demoted to NVMe")
        be = sm.storage_backends[REMOTE]
        run = lambda coro: asyncio.run_coroutine_threadsafe(coro, sm.loop).result(20)  # noqa: E731
        assert run(be.batched_async_contains("lookup-1", keys[:4], pin=True)) == 4
        st = stats(node)
        assert st.prefetch_issued >= 1 and st.pinned_pages == 4  # promoted toward DRAM, pinned by lease
        got = run(be.batched_get_non_blocking("lookup-1", keys[:4]))
        assert [bytes(o.byte_array) for o in got] == data[:4]
        release(got)
    finally:
        node.close()


def test_node_restart_in_the_middle_keeps_pages_on_nvme(
        node: NodeProcess, storage_managers: Callable[..., Any], plugin_log: Records) -> None:  # fmt: skip
    sm = storage_managers(plugin_config(f"kvstore://{node.addr}"))
    keys = [key(i) for i in range(4)]
    objs, data = chunks(sm, 4, seed=3)
    put_and_wait(sm, keys, objs)
    assert node.stop() == 0  # graceful: DRAM pages spill to NVMe

    assert sm.batched_contains(keys)[0] == 0  # down: misses, no exception into LMCache
    assert sm.batched_get(keys, location=REMOTE) == [None] * 4
    more = [key(10 + i) for i in range(2)]
    put_and_wait(sm, more, objs[:2])  # dropped, and LMCache is told the put is over
    release(objs)
    down = [r for r in plugin_log.records if "does not answer" in r.getMessage()]
    assert len(down) == 1 and down[0].levelno == logging.ERROR and node.addr in down[0].getMessage()

    node.start()  # same port, same NVMe files
    wait_for(lambda: sm.batched_contains(keys)[0] == 4, what="the restarted node's pages")
    got = sm.batched_get(keys, location=REMOTE)
    assert [bytes(o.byte_array) for o in got] == data
    release(got)
    nvme = tier(stats(node), TierKind.NVME).counters  # read from the recovered NVMe tier (Lookup's prefetch
    assert nvme.bytes_out >= 4 * CHUNK_BYTES  # promoted them to DRAM just before the Get)
    assert sm.batched_contains(more)[0] == 0  # what was put while it was down was not stored
    assert "answers again" in plugin_log.text(logging.INFO)


def test_a_node_that_is_down_is_a_miss_and_one_log_line(
    storage_managers: Callable[..., Any], plugin_log: Records
) -> None:
    addr = f"127.0.0.1:{free_port()}"  # nobody listens
    sm = storage_managers(plugin_config(f"kvstore://{addr}"))
    assert REMOTE in sm.storage_backends  # LMCache runs, with the tier in place
    keys = [key(i) for i in range(3)]
    objs, _ = chunks(sm, 3, seed=4)
    put_and_wait(sm, keys, objs)
    release(objs)
    for _ in range(5):
        assert sm.batched_contains(keys)[0] == 0
        assert sm.batched_get(keys, location=REMOTE) == [None] * 3
    errors = [r.getMessage() for r in plugin_log.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and f"kvstore node {addr} does not answer" in errors[0], errors


def test_a_wrong_token_is_a_clear_error_and_stores_nothing(
        tmp_path: Path, storage_managers: Callable[..., Any], plugin_log: Records) -> None:  # fmt: skip
    tokens = tmp_path / "rw.tokens"
    tokens.write_text(TOKEN + "\n")
    tokens.chmod(0o600)  # token files must be private
    node = start_node(tmp_path, extra_args=["--auth-tokens-file", str(tokens)])
    try:
        sm = storage_managers(plugin_config(f"kvstore://{node.addr}", token="x" * 32))
        keys = [key(i) for i in range(2)]
        objs, _ = chunks(sm, 2, seed=5)
        put_and_wait(sm, keys, objs)
        release(objs)
        assert sm.batched_contains(keys)[0] == 0
        text = plugin_log.text(logging.ERROR)
        assert "refused" in text and "remote_storage_plugin.kvstore.token" in text, text
        assert stats(node, TOKEN).namespaces == []  # nothing stored

        good = storage_managers(plugin_config(f"kvstore://{node.addr}", token=TOKEN))
        objs, data = chunks(good, 2, seed=6)
        put_and_wait(good, keys, objs)
        release(objs)
        got = good.batched_get(keys, location=REMOTE)
        assert [bytes(o.byte_array) for o in got] == data
        release(got)
    finally:
        node.close()


def test_pages_of_the_wrong_size_are_refused_and_nothing_is_stored(
        tmp_path: Path, storage_managers: Callable[..., Any], plugin_log: Records) -> None:  # fmt: skip
    small = start_node(tmp_path, "small", max_page_bytes=CHUNK_BYTES // 2)  # a node set up for another model
    try:
        sm = storage_managers(plugin_config(f"kvstore://{small.addr}"))
        objs, _ = chunks(sm, 2, seed=7)
        put_and_wait(sm, [key(0), key(1)], objs)
        release(objs)
        assert sm.batched_contains([key(0)])[0] == 0 and stats(small).namespaces == []
        text = plugin_log.text(logging.ERROR)
        assert "rejected put" in text and "max_page_bytes" in text, text
    finally:
        small.close()


def test_chunks_of_another_geometry_or_a_foreign_layout_are_not_stored(
        node: NodeProcess, storage_managers: Callable[..., Any], plugin_log: Records) -> None:  # fmt: skip
    sm = storage_managers(plugin_config(f"kvstore://{node.addr}"))
    other = metadata(model=MODEL)
    other.kv_shape = (LAYERS + 1, 2, CHUNK, HEADS, HEAD_DIM)  # a MemoryObj of another model's shape
    wrong = sm.allocate(other.get_shapes(CHUNK), other.get_dtypes())
    fill(wrong, 8)
    put_and_wait(sm, [key(0)], [wrong])
    release([wrong])
    assert "chunk not stored" in plugin_log.text(logging.ERROR)
    assert stats(node).namespaces == []

    # Someone else bound the namespace to another layout (same bytes per page): the node refuses ours.
    foreign = PageLayout(DType.FLOAT16, 1, 2 * HEADS, HEAD_DIM, CHUNK)
    with KVStoreClient(node.addr) as kv:
        kv.put(NS, foreign, [b"\x01" * 32], [bytes(foreign.page_bytes)])
    objs, _ = chunks(sm, 1, seed=9)
    put_and_wait(sm, [key(1)], objs)
    release(objs)
    assert "rejected put" in plugin_log.text(logging.ERROR) and "holds pages of layout" in plugin_log.text()
    assert stats(node).namespaces == [(NS, foreign, 1)]


def test_partial_last_chunk_round_trips_through_the_tail_namespace(
        node: NodeProcess, storage_managers: Callable[..., Any]) -> None:  # fmt: skip
    sm = storage_managers(plugin_config(f"kvstore://{node.addr}", partial=True))
    full, full_data = chunks(sm, 1, seed=10)
    part, part_data = chunks(sm, 1, seed=11, tokens=5)
    keys = [key(0), key(1)]
    put_and_wait(sm, keys, full + part)
    release(full + part)

    reader = storage_managers(plugin_config(f"kvstore://{node.addr}", partial=True))
    assert reader.batched_contains(keys)[0] == 2
    got = reader.batched_get(keys, location=REMOTE)
    assert [bytes(o.byte_array) for o in got] == full_data + part_data
    assert tuple(got[1].get_shape()) == (2, LAYERS, 5, HEADS * HEAD_DIM)
    release(got)
    assert {(ns, pages) for ns, _, pages in stats(node).namespaces} == {(NS, 1), (NS + "/tail", 1)}


def test_layerwise_chunks_round_trip(node: NodeProcess, storage_managers: Callable[..., Any]) -> None:
    """LMCache's layerwise engines (SGLang's in-process connector; vLLM with use_layerwise) store one
    MemoryObj per layer and chunk, [tokens, 2, hidden] in KV_T2D, under a LayerCacheEngineKey each."""
    import torch
    from lmcache.utils import LayerCacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    sm = storage_managers(plugin_config(f"kvstore://{node.addr}", layerwise=True, partial=True))
    keys = [LayerCacheEngineKey(MODEL, 1, 0, 0xC0FFEE + c, torch.float16, layer_id=layer)
            for c in range(2) for layer in range(LAYERS)]  # fmt: skip
    tokens = [CHUNK] * LAYERS + [7] * LAYERS  # the second chunk is a partial one
    objs = [sm.allocate(torch.Size([t, 2, HEADS * HEAD_DIM]), torch.float16, fmt=MemoryFormat.KV_T2D) for t in tokens]
    data = [fill(o, 20 + i) for i, o in enumerate(objs)]
    put_and_wait(sm, keys, objs)
    release(objs)
    reader = storage_managers(plugin_config(f"kvstore://{node.addr}", layerwise=True, partial=True))
    assert reader.batched_contains(keys)[0] == len(keys)
    got = reader.batched_get(keys, location=REMOTE)
    assert [bytes(o.byte_array) for o in got] == data
    assert [o.get_shape()[0] for o in got] == tokens and {o.get_memory_format() for o in got} == {MemoryFormat.KV_T2D}
    release(got)
    layer_ns = f"lmcache/v1/{MODEL}/ws1/w0/half/kv_t2d/Tx2x{HEADS * HEAD_DIM}:half/c{CHUNK}"
    assert {(ns, pages) for ns, _, pages in stats(node).namespaces} == {
        (layer_ns, LAYERS),
        (layer_ns + "/tail", LAYERS),
    }


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[RedisProcess, list[NodeProcess]]]:
    r = RedisProcess().start()
    nodes: list[NodeProcess] = []
    try:
        for name in ("c0", "c1"):
            nodes.append(start_node(tmp_path, name, redis_url=r.url, extra_args=["--index-ttl", "2"]))
        yield r, nodes
    finally:
        for n in nodes:
            n.close()
        r.close()


def test_a_cluster_through_the_redis_index(cluster: tuple[RedisProcess, list[NodeProcess]],
                                           storage_managers: Callable[..., Any]) -> None:  # fmt: skip
    r, nodes = cluster
    url = "kvstore+" + r.url
    writer = storage_managers(plugin_config(url, local_node="c1"))
    keys = [key(i) for i in range(4)]
    objs, data = chunks(writer, 4, seed=12)
    writer.batched_put(keys, objs)
    reader = storage_managers(plugin_config(url))
    wait_for(lambda: reader.batched_contains(keys)[0] == 4, what="the index to list all 4 chunks")
    got = reader.batched_get(keys, location=REMOTE)
    assert [bytes(o.byte_array) for o in got] == data
    release(got)
    held = {n.args[n.args.index("--node-id") + 1]: tier(stats(n), TierKind.DRAM).pages for n in nodes}
    assert held == {"c0": 0, "c1": 4}  # placed on the writer's local node


@pytest.mark.parametrize(("url", "settings", "named"), [
    ("kvstore://no-port-here", {}, "remote_storage_plugin.kvstore.url"),
    ("kvstore://127.0.0.1:1", {"timeout": "soon"}, "remote_storage_plugin.kvstore.timeout"),
    ("kvstore://127.0.0.1:1", {"token_file": "/nonexistent/kvstore.tokens"}, "/nonexistent/kvstore.tokens"),
])  # fmt: skip
def test_a_bad_plugin_config_leaves_lmcache_running_without_the_tier(
        url: str, settings: dict[str, object], named: str, storage_managers: Callable[..., Any]) -> None:  # fmt: skip
    rec = Records()
    lmc = logging.getLogger("lmcache.v1.storage_backend")  # where LMCache reports a backend that failed to start
    lmc.addHandler(rec)
    try:
        sm = storage_managers(plugin_config(url, **settings))
    finally:
        lmc.removeHandler(rec)
    assert REMOTE not in sm.storage_backends and "LocalCPUBackend" in sm.storage_backends
    assert named in rec.text(logging.ERROR), rec.text()


def test_the_readme_yaml_is_a_working_lmcache_config(node: NodeProcess, tmp_path: Path,
                                                     storage_managers: Callable[..., Any]) -> None:  # fmt: skip
    """The README's LMCache YAML, loaded by LMCache's own loader, puts the engine on kvstore."""
    import json
    import re

    from lmcache.v1.config import LMCacheEngineConfig

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    yaml_text = re.search(r"```yaml\n(.*?)```", readme, re.S).group(1)  # type: ignore[union-attr]
    assert "kvstore://10.0.0.5:50051" in yaml_text
    path = tmp_path / "lmcache-kvstore.yaml"
    path.write_text(yaml_text.replace("10.0.0.5:50051", node.addr).replace("chunk_size: 256", f"chunk_size: {CHUNK}")
                    .replace("max_local_cpu_size: 5", "max_local_cpu_size: 0.05"))  # fmt: skip
    config = LMCacheEngineConfig.from_file(str(path))
    config.validate()
    sm = storage_managers(config)
    conn = sm.storage_backends[REMOTE].connection.getWrappedConnector()
    assert type(conn).__name__ == "KVStoreConnector" and conn.store.where == f"kvstore node {node.addr}"
    objs, data = chunks(sm, 1, seed=30)
    put_and_wait(sm, [key(0)], objs)
    release(objs)
    got = sm.batched_get([key(0)], location=REMOTE)
    assert bytes(got[0].byte_array) == data[0]
    release(got)
    kv_transfer = re.search(r"--kv-transfer-config '([^']+)'", readme).group(1)  # type: ignore[union-attr]
    assert json.loads(kv_transfer) == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


def test_kv_layer_groups_registered_after_start_change_the_geometry(
        tmp_path: Path, storage_managers: Callable[..., Any]) -> None:  # fmt: skip
    """vLLM's V3 GPU connector registers the model's KV layer groups on its first transfer, after
    LMCache built its backends. A hybrid model (here: layers with 2 and with 4 KV heads) then has
    chunks of two groups; the plugin maps those from then on, under a namespace naming both."""
    import torch
    from lmcache.v1.gpu_connector.utils import EngineType, normalize_and_discover_per_layer_formats
    from lmcache.v1.kv_layer_groups import KVLayerGroupsManager

    node = start_node(tmp_path, max_page_bytes=2 * CHUNK_BYTES)
    try:
        meta = metadata()
        writer = storage_managers(plugin_config(f"kvstore://{node.addr}"), meta)
        reader = storage_managers(plugin_config(f"kvstore://{node.addr}"), meta)
        caches = [torch.zeros(2, 8, CHUNK, heads, HEAD_DIM, dtype=torch.float16) for heads in (HEADS, 2 * HEADS)]
        caches, formats = normalize_and_discover_per_layer_formats(caches, [], EngineType.VLLM, {"kv_layout": "NHD"})
        meta.kv_layer_groups_manager = KVLayerGroupsManager(list(caches), engine_kv_formats=formats,
                                                            lmcache_tokens_per_chunk=CHUNK)  # fmt: skip
        assert len(meta.get_shapes(CHUNK)) == 2
        objs = [writer.allocate(meta.get_shapes(CHUNK), meta.get_dtypes()) for _ in range(2)]
        data = [fill(o, 40 + i) for i, o in enumerate(objs)]
        put_and_wait(writer, [key(0), key(1)], objs)
        release(objs)
        got = reader.batched_get([key(0), key(1)], location=REMOTE)
        assert [bytes(o.byte_array) for o in got] == data
        assert [list(o.get_shapes()) for o in got] == [meta.get_shapes(CHUNK)] * 2
        release(got)
        ((ns, layout, pages),) = stats(node).namespaces
        hidden = HEADS * HEAD_DIM
        assert ns.endswith(f"/kv_2ltd/2x1xTx{hidden}:half+2x1xTx{2 * hidden}:half/c{CHUNK}") and pages == 2
        assert layout.page_bytes == 2 * CHUNK * 3 * hidden * 2  # both groups' K and V, fp16
    finally:
        node.close()


def test_a_full_node_keeps_what_it_admits_and_the_plugin_counts_the_rest(
        tmp_path: Path, storage_managers: Callable[..., Any], plugin_log: Records) -> None:  # fmt: skip
    """A DRAM-only node, full, whose policy refuses what it has not seen before (second sight: a deterministic
    pattern). LMCache 0.5.6's batched_put reads no result, so what LMCache sees is its lookups: a chunk the node
    did not keep is a miss; the plugin counts it (`counts`) and logs it, and never claims it."""
    full = start_node(tmp_path, "full", dram_pages=4, nvme_pages=0, extra_args=["--policy", "second-sight"])
    try:
        sm = storage_managers(plugin_config(f"kvstore://{full.addr}"))
        conn = sm.storage_backends[REMOTE].connection.getWrappedConnector()
        objs, _ = chunks(sm, 4, seed=40)
        put_and_wait(sm, [key(i) for i in range(4)], objs)  # DRAM exactly full
        release(objs)
        assert conn.counts == {"stores": 1, "stored_chunks": 4, "unstored_chunks": 0}
        p, q = [key(100 + i) for i in range(3)], [key(200 + i) for i in range(3)]
        objs, _ = chunks(sm, 3, seed=41)
        put_and_wait(sm, p, objs)  # first sight: none admitted
        release(objs)
        assert conn.counts["unstored_chunks"] == 3 and sm.batched_contains(p)[0] == 0
        assert "did not keep 3 of 3 pages" in plugin_log.text()
        mixed = [k for pair in zip(p, q, strict=True) for k in pair]  # p's admitted on second sight, q's refused
        objs, _ = chunks(sm, 6, seed=42)
        put_and_wait(sm, mixed, objs)
        release(objs)
        assert conn.counts == {"stores": 3, "stored_chunks": 7, "unstored_chunks": 6}
        assert sm.batched_contains(p)[0] == 3 and sm.batched_contains(mixed)[0] == 1
        assert all(sm.batched_contains([k])[0] == 0 for k in q)
    finally:
        full.close()


def test_a_weights_revision_is_its_own_namespace(node: NodeProcess, storage_managers: Callable[..., Any]) -> None:
    """LMCache's keys and metadata carry the model's name only: `model_revision` names the weights, so an
    engine on other weights under the same name is a cold miss, never the first one's KV."""
    writer = storage_managers(plugin_config(f"kvstore://{node.addr}", model_revision="0e9e39f"))
    keys = [key(300 + i) for i in range(3)]
    objs, _ = chunks(writer, 3, seed=43)
    put_and_wait(writer, keys, objs)
    release(objs)
    assert writer.batched_contains(keys)[0] == 3
    for other in ({}, {"model_revision": "1f2a3b4"}):
        assert storage_managers(plugin_config(f"kvstore://{node.addr}", **other)).batched_contains(keys)[0] == 0
    names = {ns for ns, _, _ in stats(node).namespaces}
    assert NS.replace(f"/{MODEL}/", f"/{MODEL}@0e9e39f/") in names


def session_key(i: int, **hints: object) -> Any:
    """A key of a request whose kv_transfer_params carried retention hints: LMCache keeps the request's
    `lmcache.*` configs on its keys (they are not part of the key's identity)."""
    import torch
    from lmcache.utils import CacheEngineKey

    configs = {f"lmcache.kvstore.{k}": v for k, v in hints.items()}
    return CacheEngineKey(MODEL, 1, 0, 0x5EED0000 + i, torch.float16, request_configs=configs)


def test_a_requests_session_is_retained_resumed_and_ended(
    tmp_path: Path, storage_managers: Callable[..., Any], plugin_log: Records
) -> None:
    """Retention hints in LMCache's request configs (DESIGN.md §6.5, kvstore/integrations/hints.py)."""
    node = start_node(tmp_path, dram_pages=4, nvme_pages=32)
    try:
        sm = storage_managers(plugin_config(f"kvstore://{node.addr}"))
        hints = {"session": "chat-7", "ttl_s": 60, "priority": 70, "mode": "demote"}
        keys = [session_key(i, **hints) for i in range(4)]
        objs, data = chunks(sm, 4, seed=7)
        put_and_wait(sm, keys, objs)
        release(objs)
        with KVStoreClient(node.addr, timeout=10) as kv:
            state = kv.update_session("chat-7").state
            assert state is not None and (state.pages, state.priority, state.mode.label) == (4, 70, "demote")
            others = [key(100 + i) for i in range(12)]  # pressure: DRAM holds 4
            more, _ = chunks(sm, 12, seed=8)
            put_and_wait(sm, others, more)
            release(more)
            assert {t for t in kv.lookup_detail(NS, [page_key(k.to_string()) for k in keys]).tiers} == {TierKind.NVME}
            be = sm.storage_backends[REMOTE]
            run = lambda coro: asyncio.run_coroutine_threadsafe(coro, sm.loop).result(20)  # noqa: E731
            nxt = [session_key(i, session="chat-7", priority=90) for i in range(4)]  # its next turn
            assert run(be.batched_async_contains("lookup-s", nxt, pin=False)) == 4
            assert kv.update_session("chat-7").state.priority == 90  # type: ignore[union-attr]
            assert kv.stats().retention.resumed == 4
            got = run(be.batched_get_non_blocking("lookup-s", nxt))
            assert [bytes(o.byte_array) for o in got] == data
            release(got)
            last = [session_key(20, session="chat-7", end=True)]  # the last turn ends the session
            objs, _ = chunks(sm, 1, seed=9)
            put_and_wait(sm, last, objs)
            release(objs)
            r = kv.stats().retention
            assert (r.sessions, r.ended, r.retained_pages) == (0, 1, 0)
            bad = [session_key(30, session="b", priority=500)]
            objs, _ = chunks(sm, 1, seed=10)
            put_and_wait(sm, bad, objs)  # stored, without retention, and the log names the key
            release(objs)
            assert sm.batched_contains(bad)[0] == 1 and kv.stats().retention.sessions == 0
        assert "lmcache.kvstore.priority" in plugin_log.text(logging.ERROR)
    finally:
        node.close()
