"""A misfiled page is a miss through SGLang's HiCache door, never another page's KV (DESIGN.md §8: a page's
checksum binds its namespace and key as well as its bytes), through each of the door's calls: the zero-copy
`batch_get_v1` (each SGLang page one kvstore page per region), the flat `batch_get`, and the v2 bundles
(`batch_get_v2`: a page's pools in one kvstore page). SGLang's calls as tests/integration/test_sglang_hicache.py
reproduces them.

- NVMe: engine A stores through the door, the node stops cleanly, two pages' slot headers are rewritten so that
  each claims the other's key (devkit/slot_edits.misfile: re-sealed, both payloads intact), the node restarts on
  the same files and port; a fresh engine B finds both pages listed (the headers say so) and loads each as a
  miss, the node counts both (NVMe `checksum_failures`) and drops them; a page left alone loads bit-exact.
  For the zero-copy call one region of the page is misfiled (the K region for some transports, the V region
  for the others: a page whose first region landed and whose second failed is still a miss).
- DRAM, on a node in this process (tests/integration/conftest.py: InProcessNode): the page table maps a
  region's key to another page's slot, or to another page's record, as a mapping bug would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from devkit.slot_edits import PageId, misfile
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.integrations.sglang_hicache import KVStoreHiCacheStorage, key_bytes, region_hashes
from kvstore.names import TierKind
from kvstore.pageformat import slot_bytes_for
from tests.integration.conftest import InProcessNode
from tests.integration.test_sglang_hicache import (
    PAGE,
    MHAHostPool,
    attach,
    backup,
    create_backend,
    fill,
    indices,
    page_keys,
)
from tests.security.conftest import wait_for

TRANSPORTS = ["auto", "tcp", "shm", "grpc"]  # the door's `transport` setting (auto: its default)
MAX_PAGE = 32 << 10  # a v2 bundle (kv 12 KiB + swa 6 KiB) fits


@dataclass
class PoolTransfer:
    """The fields of SGLang 0.5.23's PoolTransfer that the v2 calls read."""

    name: str
    keys: list[str]
    host_indices: torch.Tensor
    hit_policy: str = "all_pages"


def failures(addr: str, tier: TierKind) -> int:
    with KVStoreClient(addr, timeout=10, transport="grpc") as kv:
        return next(t.counters.checksum_failures for t in kv.stats().tiers if t.tier is tier)


def same_page(a: MHAHostPool, i: int, b: MHAHostPool, j: int) -> bool:
    return torch.equal(a.get_data_page(i * PAGE).view(torch.int16), b.get_data_page(j * PAGE).view(torch.int16))


@dataclass
class Engine:
    """One engine's door (a backend on its host pools), closed by the test."""

    door: KVStoreHiCacheStorage
    kv: MHAHostPool
    swa: MHAHostPool | None = None

    def transfers(self, keys: list[str], pages: list[int]) -> list[PoolTransfer]:
        assert self.swa is not None
        return [PoolTransfer("kv", keys, indices(pages)), PoolTransfer("swa", keys, indices(pages))]

    def listed(self, keys: list[str]) -> int:
        """Leading pages the node lists, as SGLang asks: batch_exists, or for v2 pages batch_exists_v2 (the KV
        prefix its v1 pages give, then the bundles' hit boundary within it)."""
        if self.swa is None:
            return self.door.batch_exists(keys)
        hits = self.door.batch_exists_v2(keys, self.transfers(keys, list(range(len(keys))))).extra_pool_hit_pages
        return hits.get("swa", 0)


@contextlib.contextmanager
def engines() -> Iterator[dict[str, Engine]]:
    made: dict[str, Engine] = {}
    try:
        yield made
    finally:
        for e in made.values():
            e.door.close()


def engine(url: str, *, seed: int | None, v1: bool = True, transport: str = "auto", v2: bool = False) -> Engine:
    """SGLang's factory and registration: the KV host pool (page_first, 8 pages), and for v2 a sliding-window
    pool beside it (SGLang's hybrid controller registers it with register_mem_host_pool_v2)."""
    extra = {"url": url, "transport": transport, **({"interface_v1": 1} if v1 else {})}
    kv = MHAHostPool("page_first", 8)
    swa = MHAHostPool("page_first", 8, heads=1) if v2 else None
    if seed is not None:
        fill(kv, seed)
        if swa is not None:
            fill(swa, seed + 1)
    door = attach(create_backend(extra), kv)
    if swa is not None:
        door.register_mem_host_pool_v2(swa, "swa")
    return Engine(door, kv, swa)


def test_nvme_misfiled_pages_are_misses_through_every_call(tmp_path: Path) -> None:
    nvme, slot = tmp_path / "nvme", slot_bytes_for(MAX_PAGE)
    node = NodeProcess(dram_bytes=8 * slot, nvme_path=nvme, nvme_bytes=64 * slot, max_page_bytes=MAX_PAGE,
                       node_id="sgl-misfile").start()  # fmt: skip
    url = f"kvstore://{node.addr}"
    with contextlib.closing(node), engines() as a, engines() as b:
        # Engine A stores a 3-page prompt through each call: pages 0 and 1 get misfiled, page 2 is left alone.
        prompts = {name: page_keys([100 + n, *range(PAGE * 3)]) for n, name in enumerate([*TRANSPORTS, "flat", "v2"])}
        misfiled: list[tuple[PageId, PageId]] = []
        for n, t in enumerate(TRANSPORTS):
            a[t] = engine(url, seed=n, transport=t)
            assert backup(a[t].door, prompts[t], indices([0, 1, 2]))
            r = n % 2  # the K region (0) or the V region (1)
            ns, (k0, k1) = a[t].door._seg_ns, [region_hashes(k, 2)[r] for k in prompts[t][:2]]
            misfiled.append(((ns, k0), (ns, k1)))
        a["flat"] = engine(url, seed=10, v1=False)
        assert backup(a["flat"].door, prompts["flat"], indices([0, 1, 2]), v1=False)
        a["v2"] = engine(url, seed=20, v2=True)  # a hybrid engine: its KV pages with v1, then the bundles with v2
        assert backup(a["v2"].door, prompts["v2"], indices([0, 1, 2]))
        res = a["v2"].door.batch_set_v2(a["v2"].transfers(prompts["v2"], [0, 1, 2]))
        assert res == {"kv": [True] * 3, "swa": [True] * 3}
        bundle_ns, _ = a["v2"].door._bundle(("kv", "swa"))
        for call, ns in (("flat", a["flat"].door._flat_ns), ("v2", bundle_ns)):
            misfiled.append(((ns, key_bytes(prompts[call][0])), (ns, key_bytes(prompts[call][1]))))

        def edit() -> None:
            for x, y in misfiled:
                misfile(nvme, x, y)

        node.restart(edit=edit)
        assert failures(node.addr, TierKind.NVME) == 0  # counters start at zero: what follows is the loads'

        for name in prompts:  # engine B: a fresh host pool, nothing in it
            b[name] = engine(url, seed=None, v1=name != "flat", v2=name == "v2",
                             transport=name if name in TRANSPORTS else "auto")  # fmt: skip
        for name, keys in prompts.items():
            door, before = b[name].door, failures(node.addr, TierKind.NVME)
            for i in (0, 1):
                assert b[name].listed([keys[i]]) == 1, f"{name}: the recovered index lists page {i}"
                if name == "flat":
                    got = door.batch_get([keys[i]], [b[name].kv.get_dummy_flat_data_page()])
                    assert got == [None], f"flat: page {i} is misfiled, must be a miss"
                elif name == "v2":
                    got2 = door.batch_get_v2(b[name].transfers([keys[i]], [i]))
                    assert got2 == {"kv": [False], "swa": [False]}, f"v2: page {i} is misfiled, must be a miss"
                else:
                    assert door.batch_get_v1([keys[i]], indices([i])) == [False], f"{name}: page {i} must miss"
            wait_for(lambda: failures(node.addr, TierKind.NVME) == before + 2,  # noqa: B023  # waited for here
                     what=f"{name}: both misfiled pages counted by the node")  # fmt: skip
            assert [b[name].listed([k]) for k in keys] == [0, 0, 1], f"{name}: dropped by the node, never found again"

            # The page left alone: bit-exact into B's pool.
            if name == "flat":
                got = door.batch_get(keys[2:], [b[name].kv.get_dummy_flat_data_page()])
                assert got[0] is not None
                b[name].kv.set_from_flat_data_page(5 * PAGE, got[0])
            elif name == "v2":
                assert door.batch_get_v2(b[name].transfers(keys[2:], [5])) == {"kv": [True], "swa": [True]}
                assert b[name].swa is not None and a[name].swa is not None
                assert same_page(a[name].swa, 2, b[name].swa, 5), "v2: the swa part of the page left alone"
            else:
                assert door.batch_get_v1(keys[2:], indices([5])) == [True], name
            assert same_page(a[name].kv, 2, b[name].kv, 5), f"{name}: the page left alone must load bit-exact"
        assert failures(node.addr, TierKind.NVME) == 2 * len(prompts)


@pytest.mark.parametrize("bug", ["slot", "entry"])
def test_dram_pages_mapped_to_another_page_are_misses(tmp_path: Path, bug: str) -> None:
    """`slot`: a region's record points at the same region of another page's slot; `entry`: its place in the page
    table holds the other page's record (a stale or misfiled record, that page's own checksum with it)."""
    node = InProcessNode(tmp_path, dram_slots=64)  # 4 transports x 3 pages x 2 regions, and room to spare
    url = f"kvstore://{node.addr}"
    table = node.node.manager.table
    with contextlib.closing(node), engines() as made:
        for n, t in enumerate(TRANSPORTS):
            e = made[t] = engine(url, seed=30 + n, transport=t)
            keys = page_keys([200 + n, *range(PAGE * 3)])
            assert backup(e.door, keys, indices([0, 1, 2]))
            r = n % 2
            ns, (a, b) = e.door._seg_ns, [region_hashes(k, 2)[r] for k in keys[:2]]

            def corrupt(ns: str = ns, a: bytes = a, b: bytes = b) -> None:
                ea, eb = table.get((ns, a)), table.get((ns, b))  # the default tenant's scope: the namespace
                assert ea is not None and eb is not None and ea.tier is eb.tier is TierKind.DRAM
                if bug == "slot":
                    ea.slot = eb.slot  # both records now name page 1's bytes
                else:
                    table.entries[(ns, a)] = eb  # the bug under test

            before = failures(node.addr, TierKind.DRAM)  # before the bug: the scrubber may be the one to find it
            node.call(corrupt)
            assert e.door.batch_get_v1(keys[:1], indices([4])) == [False], f"{t}: page 0 must be a miss"
            wait_for(lambda: failures(node.addr, TierKind.DRAM) > before,  # noqa: B023  # waited for here
                     what=f"{t}: the node to count the page")  # fmt: skip
            if bug == "slot":  # the record's bytes failed: dropped, never found again
                assert e.door.batch_exists(keys[:1]) == 0, t
            else:  # NOTE: the node leaves a record filed under another key where it is (page 1's, still good)
                assert e.door.batch_get_v1(keys[:1], indices([4])) == [False], f"{t}: page 0 stays a miss"
            intact = [1, 2] if bug == "entry" else [2]  # with the slot bug page 1's slot went with page 0's record
            for i in intact:
                assert e.door.batch_get_v1([keys[i]], indices([4 + i])) == [True], (t, i)
                assert same_page(e.kv, i, e.kv, 4 + i), f"{t}: page {i} must load bit-exact"
