"""A node killed (SIGKILL) while it writes multi-part pages (bundles) through to NVMe: after a restart on the same
NVMe directory every bundle is there whole, every part bit-exact, or not there at all; never some parts of it
(DESIGN.md §4.3: a bundle is one page, one slot, one header and one checksum)."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
from pathlib import Path

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.layout import DType, PageLayout
from kvstore.names import TierKind
from kvstore.pageformat import slot_bytes_for

KV = PageLayout(DType.FLOAT16, num_layers=8, num_kv_heads=2, head_dim=64, block_size=16)  # 64 KiB
BUNDLE = PageLayout.bundle(
    {"kv": KV, "mamba": PageLayout(DType.UINT8, 1, 1, 50_000, 1), "swa": PageLayout(DType.BFLOAT16, 4, 1, 64, 16)},
    block_size=16,
)
NS = "faults/kill-mid-bundle"
PER_PUT = 8
ROUNDS = 40  # at most this many Puts before the kill (bounded)


def parts(h: bytes) -> dict[str, bytes]:
    return {p.name: hashlib.shake_256(p.name.encode() + h).digest(p.layout.page_bytes) for p in BUNDLE.parts}


def node(tmp_path: Path) -> NodeProcess:
    slot = slot_bytes_for(BUNDLE.page_bytes)
    return NodeProcess(dram_bytes=32 * slot, nvme_path=tmp_path / "nvme", nvme_bytes=(ROUNDS * PER_PUT + 32) * slot,
                       max_page_bytes=BUNDLE.page_bytes, node_id="victim").start()  # fmt: skip


def test_a_node_killed_mid_bundle_keeps_each_bundle_whole_or_absent(tmp_path: Path) -> None:
    tried: list[bytes] = []
    acked: list[bytes] = []
    n = node(tmp_path)
    stop = threading.Event()
    some_done = threading.Event()
    try:
        with KVStoreClient(n.addr, timeout=10) as kv:

            def writer() -> None:
                for r in range(ROUNDS):
                    if stop.is_set():
                        return
                    hs = [hashlib.sha256(f"bundle-{r}-{i}".encode()).digest() for i in range(PER_PUT)]
                    tried.extend(hs)
                    try:
                        kv.put_bundle(NS, BUNDLE, hs, [parts(h) for h in hs], target_tier=TierKind.NVME, chain=False)
                    except KVStoreError:
                        return  # the node is gone
                    acked.extend(hs)
                    if r == 2:
                        some_done.set()  # three Puts durable; the next one starts at once

            t = threading.Thread(target=writer)
            t.start()
            assert some_done.wait(60), "no Put finished"
            assert n.proc is not None
            os.kill(n.proc.pid, signal.SIGKILL)
            stop.set()
            t.join(30)
            assert not t.is_alive(), "a put outlived its timeout after the node died"
    finally:
        stop.set()
        n.close()
    assert acked

    n = node(tmp_path)  # warm restart on the same NVMe directory
    try:
        with KVStoreClient(n.addr, timeout=30) as kv:
            whole = 0
            for h in tried:
                got = kv.get_bundle(NS, BUNDLE, [h])
                if got:
                    assert {k: bytes(v) for k, v in got[0].items()} == parts(h), "a bundle came back with wrong parts"
                    whole += 1
            assert kv.lookup(NS, acked) == len(acked)  # every acknowledged (durable) bundle survived whole
            assert whole >= len(acked)
            ns_pages = next(p for name, _, p in kv.stats().namespaces if name == NS)
            assert ns_pages == whole  # nothing else of a bundle is visible: one page per bundle
    finally:
        n.close()
