"""Mapping v1 (LMCache keys and chunks -> kvstore namespaces, layouts, keys), pinned by fixed vectors.

Pure: needs neither LMCache nor a node. Changing any expected value here changes every key a deployed
plugin ever wrote: bump MAPPING_VERSION instead.
"""

from __future__ import annotations

import pytest

from kvstore.integrations import lmcache_mapping as v1
from kvstore.integrations.health import LogLimiter, Outage
from kvstore.layout import DType, PageLayout

pytestmark = pytest.mark.fast  # pure: no process, node or network (tests/conftest.py)

LLAMA = v1.chunked_geometry("KV_2LTD", [(2, 32, 256, 1024)], ["bfloat16"], [2], 256, kv_heads=8, head_dim=128)
P = "remote_storage_plugin.kvstore."


def test_key_vectors() -> None:
    assert v1.page_key("meta-llama/Llama-3.1-8B-Instruct@2@1@1f2e3d4c5b6a7980@bfloat16").hex() == (
        "4b6a2c576c40618dc0670d370676ef3e1fe87638ece4533eb1fd20948b592e0e"
    )
    # request tags and (layerwise) layer ids are part of LMCache's key string, so of ours
    assert v1.page_key("m@1@0@ff@half@42").hex() == "971d3eafab060478ae55d8577b10e1a77a138331b1150d4dfbd9b282da35b4b2"
    assert v1.page_key("m@1@0@ff@half") != v1.page_key("m@1@1@ff@half")


def test_namespace_vectors_carry_everything_that_makes_pages_incompatible() -> None:
    ns = v1.namespace_for("lmcache", "meta-llama/Llama-3.1-8B-Instruct", 2, 1, "bfloat16", geometry=LLAMA)
    assert ns == "lmcache/v1/meta-llama/Llama-3.1-8B-Instruct/ws2/w1/bfloat16/kv_2ltd/2x32xTx1024:bfloat16/c256"
    assert (
        v1.namespace_for("lmcache", "meta-llama/Llama-3.1-8B-Instruct", 2, 1, "bfloat16", geometry=LLAMA, tail=True)
        == ns + "/tail"
    )
    variants = {
        v1.namespace_for("lmcache", "meta-llama/Llama-3.1-8B-Instruct", 4, 1, "bfloat16", geometry=LLAMA),  # TP size
        v1.namespace_for("lmcache", "meta-llama/Llama-3.1-8B-Instruct", 2, 0, "bfloat16", geometry=LLAMA),  # TP rank
        v1.namespace_for("lmcache", "meta-llama/Llama-3.1-8B-Instruct", 2, 1, "half", geometry=LLAMA),  # KV dtype
        v1.namespace_for("tenant-b", "meta-llama/Llama-3.1-8B-Instruct", 2, 1, "bfloat16", geometry=LLAMA),  # salt
        v1.namespace_for(
            "lmcache",
            "meta-llama/Llama-3.1-8B-Instruct",
            2,
            1,
            "bfloat16",
            geometry=v1.chunked_geometry("KV_2LTD", [(2, 32, 128, 1024)], ["bfloat16"], [2], 128),
        ),  # chunk size
    }
    assert len(variants) == 5 and ns not in variants


def test_a_weights_revision_joins_the_model_and_none_changes_nothing() -> None:
    assert v1.model_part("m/x") == "m/x" and v1.model_part("m/x", None) == "m/x"  # the v1 vectors above hold
    assert v1.model_part("meta-llama/Llama-3.1-8B-Instruct", "0e9e39f") == "meta-llama/Llama-3.1-8B-Instruct@0e9e39f"
    # Not plain (a path, a long digest): 16 hex of its SHA-256, so still one namespace component.
    assert v1.model_part("m", "sha256:" + "ab" * 32) == "m@~7b28e61bc1d29223"
    assert v1.model_part("m", "refs/pr/1") == "m@~da766fe49863bbae" != v1.model_part("m", "refs/pr/2")
    ns = v1.namespace_for("lmcache", v1.model_part("meta-llama/Llama-3.1-8B-Instruct", "0e9e39f"), 2, 1, "bfloat16",
                          geometry=LLAMA)  # fmt: skip
    assert ns == "lmcache/v1/meta-llama/Llama-3.1-8B-Instruct@0e9e39f/ws2/w1/bfloat16/kv_2ltd/2x32xTx1024:bfloat16/c256"
    s = v1.parse_settings({P + "url": "kvstore://h:1", P + "model_revision": "0e9e39f"}, "kvstore", 1.0)
    assert s.model_revision == "0e9e39f"


def test_layouts_real_dims_when_known_else_bytes_of_the_same_size() -> None:
    assert LLAMA.page_layout() == PageLayout(DType.BFLOAT16, 32, 8, 128, 256)
    assert LLAMA.page_layout().page_bytes == LLAMA.chunk_bytes == 32 << 20
    mla = v1.chunked_geometry("KV_MLA_FMT", [(1, 61, 256, 576)], ["bfloat16"], [2], 256)
    assert v1.namespace_for("lmcache", "deepseek-ai/DeepSeek-V3", 8, 0, "bfloat16", geometry=mla) == (
        "lmcache/v1/deepseek-ai/DeepSeek-V3/ws8/w0/bfloat16/kv_mla_fmt/1x61xTx576:bfloat16/c256"
    )
    assert mla.page_layout() == PageLayout(DType.UINT8, 1, 1, 61 * 576, 256)
    assert mla.page_layout().page_bytes == mla.chunk_bytes
    # SGLang / vLLM layerwise
    lw = v1.layerwise_geometry("KV_T2D", 2, 1024, "bfloat16", 2, chunk_size=256, kv_heads=8, head_dim=128)
    assert lw.shapes(7) == [(7, 2, 1024)] and lw.shape_tag() == "Tx2x1024:bfloat16"
    assert lw.page_layout() == PageLayout(DType.BFLOAT16, 1, 8, 128, 256)
    odd = v1.chunked_geometry("KV_2LTD", [(2, 2, 16, 64)], ["int8"], [1], 16)  # no kvstore dtype: bytes
    assert odd.page_layout() == PageLayout(DType.UINT8, 1, 1, 128, 16)
    with pytest.raises(v1.MappingError, match="layerwise memory format"):
        v1.layerwise_geometry("KV_2LTD", 2, 1024, "bfloat16", 2, chunk_size=256)


def test_long_model_names_are_shortened_with_their_digest() -> None:
    ns = v1.namespace_for("lmcache", "x" * 300, 1, 0, "half", geometry=LLAMA)
    assert ns == "lmcache/v1/" + "x" * 48 + "~0d4e2ca9e9cbced7/ws1/w0/half/kv_2ltd/2x32xTx1024:bfloat16/c256"
    assert v1.namespace_for("lmcache", "x" * 299, 1, 0, "half", geometry=LLAMA) != ns
    with pytest.raises(v1.MappingError, match="namespace"):
        v1.namespace_for("lmcache", "model\nwith a newline", 1, 0, "half", geometry=LLAMA)


def test_tokens_of_accepts_only_this_geometry() -> None:
    assert LLAMA.tokens_of([(2, 32, 256, 1024)], ["bfloat16"], "KV_2LTD") == 256
    assert LLAMA.tokens_of([(2, 32, 17, 1024)], ["bfloat16"], "KV_2LTD") == 17  # a partial chunk
    bad = [
        ([(2, 32, 256, 1024)], ["half"], "KV_2LTD", "dtypes"),
        ([(2, 32, 256, 1024)], ["bfloat16"], "KV_T2D", "memory format"),
        ([(2, 16, 256, 1024)], ["bfloat16"], "KV_2LTD", "shape"),
        ([(2, 32, 257, 1024)], ["bfloat16"], "KV_2LTD", "chunk_size"),
        ([(2, 32, 256, 1024)] * 2, ["bfloat16"] * 2, "KV_2LTD", "dtypes|groups"),
    ]
    for shapes, dtypes, fmt, what in bad:
        with pytest.raises(v1.MappingError, match=what):
            LLAMA.tokens_of(shapes, dtypes, fmt)


def test_tail_pages_keep_the_true_length() -> None:
    data = memoryview(bytes(range(256)) * 3)
    page = v1.pack_tail(data, 3, 4096)
    assert len(page) == 4096 and page[:768] == data and not any(page[768 : -v1.TAIL_TRAILER.size])
    assert v1.tail_tokens(page, 16) == 3
    with pytest.raises(v1.MappingError, match="trailer"):
        v1.tail_tokens(bytes(4096), 16)  # a page without the trailer
    with pytest.raises(v1.MappingError, match="trailer"):
        v1.tail_tokens(page, 3)  # as many tokens as a full chunk: not a tail
    with pytest.raises(v1.MappingError, match="no room"):
        v1.pack_tail(memoryview(bytes(4090)), 15, 4096)


def test_urls() -> None:
    assert v1.parse_url("kvstore://10.0.0.5:50051") == v1.Target(addr="10.0.0.5:50051")
    assert v1.parse_url("kvstore://[::1]:50051") == v1.Target(addr="[::1]:50051")
    assert v1.parse_url("kvstore+redis://10.0.0.9:6379/0") == v1.Target(redis_url="redis://10.0.0.9:6379/0")
    sentinel = "kvstore+redis+sentinel://10.0.0.9:26379,10.0.0.10:26379/kvstore/0"
    assert v1.parse_url(sentinel) == v1.Target(redis_url=sentinel.removeprefix("kvstore+"))
    for bad in (
        "kvstore://host",
        "lm://127.0.0.1:1",
        "kvstore://h:1/path",
        "kvstore+redis:///0",
        "10.0.0.5:50051",
        "kvstore+redis+sentinel:///kvstore/0",
    ):
        with pytest.raises(v1.MappingError, match="url"):
            v1.parse_url(bad)


def test_settings_validation_names_the_key() -> None:
    s = v1.parse_settings({P + "url": "kvstore://h:1", P + "timeout": "2.5", P + "prefetch": "false", P + "threads": 2,
                        P + "transport": "GRPC", P + "module_path": "x", "unrelated": 1}, "kvstore", 10.0)  # fmt: skip
    assert (s.target.addr, s.timeout, s.prefetch, s.threads, s.transport) == ("h:1", 2.5, False, 2, "grpc")
    for plane in ("tcp", "ucx", "shm", "auto"):  # every plane a client speaks
        assert (
            v1.parse_settings({P + "url": "kvstore://h:1", P + "transport": plane}, "kvstore", 1.0).transport == plane
        )
    assert v1.parse_settings({P + "url": "kvstore://h:1"}, "kvstore", 7.0).timeout == 7.0  # LMCache's blocking timeout
    inst = "remote_storage_plugin.kvstore.a."
    assert v1.parse_settings({inst + "url": "kvstore://h:2"}, "kvstore.a", 1.0).target.addr == "h:2"
    bad = [
        ({}, P + "url: required"),
        ({P + "url": "kvstore://h:1", P + "timeout": "soon"}, P + "timeout"),
        ({P + "url": "kvstore://h:1", P + "threads": 0}, P + "threads"),
        ({P + "url": "kvstore://h:1", P + "prefetch": "maybe"}, P + "prefetch"),
        ({P + "url": "kvstore://h:1", P + "transport": "udp"}, P + "transport"),
        ({P + "url": "kvstore://h:1", P + "namespace_prefix": "a b"}, P + "namespace_prefix"),
        ({P + "url": "kvstore://h:1", P + "tls_cert": "c.pem"}, P + "tls_cert"),
        ({P + "url": "kvstore://h:1", P + "tokne": "x"}, P + "tokne: unknown setting"),
        ({P + "url": "kvstore://h:1", P + "model_revision": ""}, P + "model_revision"),
        ({P + "url": "kvstore://h:1", P + "model_revision": "a\nb"}, P + "model_revision"),
    ]
    for extra, what in bad:
        with pytest.raises(v1.MappingError) as err:
            v1.parse_settings(extra, "kvstore", 10.0)
        assert what in str(err.value)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_outage_logs_each_edge_once_and_probes_once_per_backoff() -> None:
    clock = Clock()
    o = Outage(2.0, clock)
    assert o.allow() and o.succeeded() is None
    assert o.failed("refused") is not None and o.failed("refused") is None  # one line per edge
    assert [o.allow() for _ in range(3)] == [False] * 3
    clock.now += 2.0
    assert o.allow() and not o.allow()  # one probe per backoff period
    back = o.succeeded()
    assert back is not None and "4 call(s)" in back and o.allow()


def test_log_limiter_counts_what_it_held_back() -> None:
    clock = Clock()
    lim = LogLimiter(30.0, clock)
    assert lim.admit("auth") == 0 and lim.admit("auth") is None and lim.admit("auth") is None
    assert lim.admit("full") == 0  # kinds are independent
    clock.now += 30.0
    assert lim.admit("auth") == 2


def test_long_chains_are_sliced_to_bounded_calls() -> None:
    from kvstore.integrations.remote import CALL_BYTES, call_slices

    assert call_slices(5, CALL_BYTES // 2) == [(0, 2), (2, 4), (4, 5)]
    assert call_slices(3, 1 << 20) == [(0, 3)]
    assert call_slices(2, 2 * CALL_BYTES) == [(0, 1), (1, 2)]  # a page larger than the budget: one per call
    assert call_slices(0, 1 << 20) == []
