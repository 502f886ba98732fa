"""A namespace's page size, on the planes that size their receives before a Get (same-host, UCX): both ask the
node through the one rule (`kvstore.client.planes.base.page_size`: the page-size ask, answered by
`kvstore.node.drivers.answer_page_size`), once per namespace, never guessing; a UCX client whose remembered size
went stale (the namespace laid out anew, as after a node restart) asks again and gets its pages.

The node runs in this process (InProcessNode) so the stale case can lay a namespace out anew as a restart would;
the ask is observed by wrapping the real rule in each plane's module (every call goes through to the node)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest

from kvstore.client import KVStoreClient
from kvstore.client.planes import base
from kvstore.errors import NamespaceNotFound
from kvstore.layout import DType, PageLayout
from kvstore.wire import page_size_ask
from kvstore.wire.ucx import ucxx_installed
from tests.integration.conftest import LAYOUT, PAGE, InProcessNode, key, page

SIZED = ["shm", *(["ucx"] if ucxx_installed() else [])]  # the planes that size their receives first
SMALL = PageLayout(DType.FLOAT16, num_layers=2, num_kv_heads=2, head_dim=64, block_size=8)  # half of LAYOUT's
Asked = list[tuple[str, bytes, int]]  # (plane, the ask's body, the node's answer)


def record_asks(monkeypatch: pytest.MonkeyPatch) -> Asked:
    """Every page-size ask the planes in SIZED send through the shared rule, with the node's answer."""
    asked: Asked = []
    for name in SIZED:

        def rule(
            known: dict[str, int], namespace: str, first: bytes, ask: Callable[[bytes], int], plane: str = name
        ) -> int:
            def asking(body: bytes) -> int:
                n = ask(body)
                asked.append((plane, body, n))
                return n

            return base.page_size(known, namespace, first, asking)

        monkeypatch.setattr(importlib.import_module(f"kvstore.client.planes.{name}"), "page_size", rule)
    return asked


def test_same_host_and_ucx_ask_a_namespaces_page_size_alike_once(
    inproc: InProcessNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert SMALL.page_bytes == PAGE // 2  # smaller than the node's largest page: nothing to guess it from
    ns = "ps/small"
    hashes = [key(i, "small") for i in range(3)]
    with KVStoreClient(inproc.addr, timeout=30, transport="grpc") as kv:
        kv.put(ns, SMALL, hashes, [page(h, SMALL.page_bytes) for h in hashes])
    asked = record_asks(monkeypatch)
    for plane in SIZED:
        with KVStoreClient(inproc.addr, timeout=30, transport=plane) as kv:
            for _ in range(2):  # asked the first time only
                got = kv.get(ns, hashes)
                assert [bytes(p) for p in got] == [page(h, SMALL.page_bytes) for h in hashes], plane
            with pytest.raises(NamespaceNotFound):  # the ask is refused as the Get would be
                kv.get("ps/never-stored", hashes)
    assert asked == [(plane, page_size_ask(ns, hashes[0]), SMALL.page_bytes) for plane in SIZED]


@pytest.mark.skipif(not ucxx_installed(), reason="ucxx is not installed")
def test_a_ucx_client_asks_again_when_a_namespace_was_laid_out_anew(
    inproc: InProcessNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = "ps/relaid"
    old = [key(i, "old") for i in range(2)]
    new = [key(i, "new") for i in range(2)]
    asked = record_asks(monkeypatch)
    with KVStoreClient(inproc.addr, timeout=30, transport="ucx") as kv:
        kv.put(ns, SMALL, old, [page(h, SMALL.page_bytes) for h in old])
        assert len(kv.get(ns, old)) == 2  # the client now remembers SMALL's page size
        kv.delete(ns, old)
        table = inproc.node.manager.table

        def relay() -> None:  # what a node restart does to a namespace of volatile pages: its layout is gone
            table.layouts[ns] = LAYOUT  # the default tenant's scope of `ns` is `ns`

        inproc.call(relay)
        kv.put(ns, LAYOUT, new, [page(h) for h in new])
        assert [bytes(p) for p in kv.get(ns, new)] == [page(h) for h in new]
    assert [n for _, _, n in asked] == [SMALL.page_bytes, LAYOUT.page_bytes]
