"""Encoded pages through a real node: every data plane stores and returns them byte for byte, a
namespace holds one encoding (a Put of another is FAILED_PRECONDITION naming both, like any other layout
mismatch, and changes nothing),
the encoding survives a restart from NVMe, and `kvctl stats` shows it per namespace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.client import KVStoreClient
from kvstore.errors import LayoutMismatch
from kvstore.layout import PageEncoding
from kvstore.wire.streams import layout_to_pb
from tests.integration.conftest import LAYOUT, key, page, start_node

FP8 = LAYOUT.with_encoding(PageEncoding.FP8_E4M3)


def test_fp8_pages_round_trip_and_one_encoding_per_namespace(kv: KVStoreClient) -> None:
    ns = "it/enc/fp8"
    hs = [key(i, "enc") for i in range(6)]
    pages = [page(h, FP8.page_bytes) for h in hs]
    assert kv.put(ns, FP8, hs[:4], pages[:4]).stored == 4
    assert [bytes(p) for p in kv.get(ns, hs[:4])] == pages[:4]

    with pytest.raises(LayoutMismatch) as info:
        kv.put(ns, LAYOUT, hs[4:], [page(h) for h in hs[4:]])
    assert "encoding" in str(info.value) and "fp8-e4m3" in str(info.value) and "raw" in str(info.value)
    assert kv.lookup(ns, hs) == 4  # nothing of the refused Put was stored

    # The other way round: a raw namespace refuses fp8 pages.
    raw_ns = "it/enc/raw"
    kv.put(raw_ns, LAYOUT, hs[:1], [page(hs[0])])
    with pytest.raises(LayoutMismatch, match=r"holds raw pages; this Put sends fp8-e4m3"):
        kv.put(raw_ns, FP8, hs[1:2], pages[1:2])
    assert kv.lookup(raw_ns, hs[:2]) == 1


def test_mismatched_encoding_is_failed_precondition_and_unknown_invalid_on_the_wire(tmp_path: Path) -> None:
    n = start_node(tmp_path, nvme_pages=0)
    try:
        with KVStoreClient(n.addr) as kv:
            kv.put("it/enc/wire", FP8, [key(0)], [page(key(0), FP8.page_bytes)])
        with grpc.insecure_channel(n.addr) as ch:
            stub = pb_grpc.KVStoreStub(ch)
            msgs = [
                pb.PutRequest(open=pb.PutOpen(namespace="it/enc/wire", layout=layout_to_pb(LAYOUT))),
                pb.PutRequest(page=pb.PutPage(hash=key(1), payload_bytes=LAYOUT.page_bytes)),
                pb.PutRequest(chunk=page(key(1))),
            ]
            with pytest.raises(grpc.RpcError) as info:
                stub.Put(iter(msgs), timeout=30)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # as for any other layout mismatch
            assert "open.layout.encoding" in info.value.details() and "fp8-e4m3" in info.value.details()
            bad = layout_to_pb(LAYOUT)
            bad.encoding = 9  # an encoding this node does not know
            with pytest.raises(grpc.RpcError) as info:
                stub.Put(iter([pb.PutRequest(open=pb.PutOpen(namespace="it/enc/new", layout=bad))]), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "open.layout.encoding: unknown page encoding 9" in info.value.details()
    finally:
        n.close()


def test_encoding_survives_restart_and_shows_in_kvctl(tmp_path: Path) -> None:
    n = start_node(tmp_path)
    try:
        hs = [key(i, "restart") for i in range(5)]
        pages = [page(h, FP8.page_bytes) for h in hs]
        with KVStoreClient(n.addr) as kv:
            kv.put("it/enc/fp8", FP8, hs, pages)
            kv.put("it/enc/raw", LAYOUT, hs[:2], [page(h) for h in hs[:2]])
        assert n.stop() == 0  # DRAM pages spill to NVMe
        n.start()
        with KVStoreClient(n.addr) as kv:
            assert [bytes(p) for p in kv.get("it/enc/fp8", hs)] == pages
            with pytest.raises(LayoutMismatch, match="encoding"):  # the recovered namespace is bound to fp8
                kv.put("it/enc/fp8", LAYOUT, [key(99)], [page(key(99))])
        out = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "stats", "--addr", n.addr, "--json"],
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        spaces = {s["namespace"]: s for s in json.loads(out.stdout)["namespaces"]}
        assert spaces["it/enc/fp8"]["encoding"] == "fp8-e4m3" and spaces["it/enc/fp8"]["pages"] == 5
        assert spaces["it/enc/fp8"]["page_bytes"] == FP8.page_bytes
        assert spaces["it/enc/raw"]["encoding"] == "raw"
        table = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "stats", "--addr", n.addr],
                               capture_output=True, text=True, timeout=60, check=True,
                               env={"COLUMNS": "200", "PATH": ""})  # fmt: skip
        assert "encoding fp8-e4m3" in table.stdout and "encoding raw" in table.stdout
    finally:
        n.close()
