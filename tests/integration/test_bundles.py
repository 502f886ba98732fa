"""Multi-part pages (bundles, DESIGN.md §4.3) on every data plane of a real node: parts come back bit-exact, a
page is one page in Stats, and the bad inputs of the rule (parts that disagree with the namespace's, a part
left out of a get, a part the node never held) are refused naming the part, with nothing stored."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.errors import LayoutMismatch
from kvstore.layout import DType, PageLayout
from kvstore.wire.ucx import ucxx_installed
from tests.integration.conftest import key, start_node

KV = PageLayout(DType.FLOAT16, num_layers=2, num_kv_heads=2, head_dim=32, block_size=16)  # 8 KiB
MAMBA = PageLayout(DType.UINT8, 1, 1, 1500, 1)  # 3000 B: a state whose size is no power of two
SWA = PageLayout(DType.BFLOAT16, 2, 1, 32, 16)  # 4 KiB
BUNDLE = PageLayout.bundle({"kv": KV, "mamba": MAMBA, "swa": SWA}, block_size=16)
PLANES = ["grpc", "shm", "tcp", *(["ucx"] if ucxx_installed() else [])]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    n = start_node(tmp_path_factory.mktemp("bundles"), dram_pages=64, extra_args=["--ucx"] if "ucx" in PLANES else [])
    try:
        yield n
    finally:
        n.close()


def parts_of(h: bytes, layout: PageLayout = BUNDLE) -> dict[str, bytes]:
    rng = random.Random(h)
    return {p.name: rng.randbytes(p.layout.page_bytes) for p in layout.parts}


def stored_pages(kv: KVStoreClient, ns: str) -> int:
    return next((n for name, _, n in kv.stats().namespaces if name == ns), 0)


@pytest.mark.parametrize("plane", PLANES)
def test_bundles_round_trip_whole_on_every_plane(node: NodeProcess, plane: str) -> None:
    ns = f"bundles/{plane}"
    hashes = [key(i, ns) for i in range(6)]
    with KVStoreClient(node.addr, timeout=30, transport=plane) as kv:
        # a part given as several regions, as engines' pools hold them (a Mamba state's conv and temporal tensors)
        pages = []
        for h in hashes:
            p = parts_of(h)
            m = p["mamba"]
            pages.append({"kv": p["kv"], "mamba": [m[:1000], m[1000:]], "swa": bytearray(p["swa"])})
        res = kv.put_bundle(ns, BUNDLE, hashes, pages)
        assert (res.stored, res.already_present) == (6, 0)
        assert stored_pages(kv, ns) == 6  # one page per bundle: its parts are not pages of their own
        assert kv.lookup(ns, hashes) == 6

        got = kv.get_bundle(ns, BUNDLE, hashes)
        assert [{n: bytes(v) for n, v in g.items()} for g in got] == [parts_of(h) for h in hashes]

        # into the caller's own buffers, one part split over two regions
        dest = [{p.name: np.zeros(p.layout.page_bytes, np.uint8) for p in BUNDLE.parts} for _ in hashes]
        into = [{**d, "kv": [d["kv"][:100], d["kv"][100:]]} for d in dest]
        refs = kv.get_bundle_into(
            ns, BUNDLE, [*hashes, key(99, ns)], [*into, {n: bytearray(v) for n, v in parts_of(b"x").items()}]
        )
        assert len(refs) == 6  # the stored prefix: the 7th page is not stored
        assert [{n: a.tobytes() for n, a in d.items()} for d in dest] == [parts_of(h) for h in hashes]


@pytest.mark.parametrize("plane", PLANES)
def test_a_bundle_whose_parts_disagree_is_refused_naming_the_part(node: NodeProcess, plane: str) -> None:
    ns = f"bundles-bad/{plane}"
    hashes = [key(i, ns) for i in range(3)]
    with KVStoreClient(node.addr, timeout=30, transport=plane) as kv:
        kv.put_bundle(ns, BUNDLE, hashes[:1], [parts_of(hashes[0])])
        before = kv.stats().namespaces

        other_mamba = PageLayout.bundle({"kv": KV, "mamba": PageLayout(DType.UINT8, 1, 1, 1501, 1), "swa": SWA}, 16)
        with pytest.raises(LayoutMismatch, match="'mamba'"):
            kv.put_bundle(ns, other_mamba, hashes[1:], [parts_of(h, other_mamba) for h in hashes[1:]])
        unknown = PageLayout.bundle({"kv": KV, "mamba": MAMBA, "indexer": SWA}, 16)
        with pytest.raises(LayoutMismatch, match="'indexer'"):
            kv.put_bundle(ns, unknown, hashes[1:], [parts_of(h, unknown) for h in hashes[1:]])
        fewer = PageLayout.bundle({"kv": KV, "mamba": MAMBA}, 16)
        with pytest.raises(LayoutMismatch, match="'swa' is missing"):
            kv.put_bundle(ns, fewer, hashes[1:], [parts_of(h, fewer) for h in hashes[1:]])
        assert kv.stats().namespaces == before  # nothing stored
        assert kv.lookup(ns, hashes) == 1

        # a get names the layout it splits pages by: a part never held, or one left out, is refused before any page
        with pytest.raises(LayoutMismatch, match="'indexer'"):
            kv.get_bundle(ns, unknown, hashes[:1])
        with pytest.raises(LayoutMismatch, match="'swa' is missing"):
            kv.get_bundle(ns, fewer, hashes[:1])
        # the client's own check: a part missing from the caller's buffers, before anything is sent
        with pytest.raises(ValueError, match=r"pages\[0\]\['swa'\]: missing"):
            kv.get_bundle_into(ns, BUNDLE, hashes[:1], [{"kv": bytearray(KV.page_bytes), "mamba": bytearray(3000)}])
        with pytest.raises(ValueError, match=r"pages\[0\]\['mamba'\]: 2999 bytes"):
            kv.put_bundle(ns, BUNDLE, hashes[1:2], [{**parts_of(hashes[1]), "mamba": bytes(2999)}])
        assert kv.lookup(ns, hashes) == 1


def test_plain_pages_and_bundles_do_not_mix_in_a_namespace(node: NodeProcess) -> None:
    ns = "bundles-mixed"
    h = [key(i, ns) for i in range(2)]
    with KVStoreClient(node.addr, timeout=30) as kv:
        kv.put(ns, KV, h[:1], [bytes(KV.page_bytes)])
        with pytest.raises(LayoutMismatch, match="bundle"):
            kv.put_bundle(ns, BUNDLE, h[1:], [parts_of(h[1])])
        with pytest.raises(LayoutMismatch):
            kv.get_bundle(ns, BUNDLE, h[:1])
        assert kv.lookup(ns, h) == 1


def test_a_restarted_node_recovers_bundles_from_nvme_and_learns_their_parts(tmp_path: Path) -> None:
    """NVMe headers carry a bundle's packed layout (its parts' digest), not the names: the recovered namespace
    serves its bundles whole, and the first call that names the same parts is accepted (another is refused)."""
    ns = "bundles-warm"
    hashes = [key(i, ns) for i in range(4)]
    n = start_node(tmp_path, dram_pages=16)
    try:
        with KVStoreClient(n.addr, timeout=30) as kv:
            kv.put_bundle(ns, BUNDLE, hashes, [parts_of(h) for h in hashes])
    finally:
        n.close()  # SIGTERM: the shutdown spill writes DRAM pages to NVMe
    n = start_node(tmp_path, dram_pages=16)
    try:
        with KVStoreClient(n.addr, timeout=30) as kv:
            assert kv.lookup(ns, hashes) == 4
            got = kv.get_bundle(ns, BUNDLE, hashes)
            assert [{k: bytes(v) for k, v in g.items()} for g in got] == [parts_of(h) for h in hashes]
            other = PageLayout.bundle({"kv": KV, "mamba": MAMBA, "indexer": SWA}, 16)
            with pytest.raises(LayoutMismatch, match="'indexer'"):
                kv.get_bundle(ns, other, hashes[:1])
    finally:
        n.close()
