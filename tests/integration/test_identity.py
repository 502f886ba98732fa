"""A valid page served under any other identity is a miss, on every plane (DESIGN.md §8: the checksum binds a
page's namespace, key, tenant and layout, not only its bytes).

- NVMe: two pages' slot headers get each other's keys (each header re-sealed, as a metadata bug would write
  them), the node restarts: each key is a miss, counted as a checksum failure, and stays one;
- DRAM, on a node running in this process: the page table maps a key to another page's slot, or to another
  page's entry (a stale record): a miss on every plane, counted;
- pages an older build wrote (header formats 1 and 2, payload-only checksums) recover and verify.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.names import TierKind
from kvstore.pageformat import HEADER_BYTES, PageHeader, identity_digest
from kvstore.tiers.nvme_meta import META_NAME, SEGMENT_RE, SlotState, classify, decode_meta
from kvstore.wire.ucx import ucxx_installed
from tests.integration.conftest import LAYOUT, NS, PAGE, SLOT, InProcessNode, key, page

PLANES = ["grpc", "shm", "tcp", *(["ucx"] if ucxx_installed() else [])]


# -- NVMe files, as a test (or a metadata bug) may rewrite them


def _slots(nvme: Path) -> dict[bytes, tuple[Path, int, PageHeader]]:
    """Every page header in the tier's segment files: key -> (file, offset, header)."""
    geom = decode_meta((nvme / META_NAME).read_bytes())
    out = {}
    for seg in sorted(p for p in nvme.iterdir() if SEGMENT_RE.fullmatch(p.name)):
        data = seg.read_bytes()
        for off in range(0, len(data) - HEADER_BYTES + 1, geom.chunk_bytes):  # pages of one size: a chunk each
            state, hdr, _ = classify(data[off : off + HEADER_BYTES])
            if state is SlotState.PAGE and hdr is not None:
                out[hdr.hash] = (seg, off, hdr)
    return out


def _write_header(path: Path, off: int, hdr: PageHeader) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(hdr.pack())


def _nvme_node(nvme: Path, name: str) -> NodeProcess:
    return NodeProcess(dram_bytes=4 * SLOT, nvme_path=nvme, nvme_bytes=64 * SLOT, max_page_bytes=PAGE,
                       node_id=name, extra_args=["--ucx"]).start()  # fmt: skip


def _filled(nvme: Path, hashes: list[bytes]) -> None:
    """Put `hashes` to NVMe on a node that is then stopped cleanly."""
    node = _nvme_node(nvme, "fill")
    try:
        with KVStoreClient(node.addr, timeout=30) as kv:
            kv.put(NS, LAYOUT, hashes, [page(h) for h in hashes], target_tier=TierKind.NVME, chain=False)
    finally:
        assert node.stop() == 0
        node.close()


def _nvme_failures(kv: KVStoreClient) -> int:
    return next(t.counters.checksum_failures for t in kv.stats().tiers if t.tier is TierKind.NVME)


def test_nvme_pages_whose_headers_were_swapped_are_misses_on_every_plane(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    pairs = [(key(2 * i, "swap"), key(2 * i + 1, "swap")) for i in range(len(PLANES))]
    kept = key(99, "swap")
    _filled(nvme, [h for pair in pairs for h in pair] + [kept])
    slots = _slots(nvme)
    for a, b in pairs:  # each slot's header now names the other key; each header's own checksum re-sealed
        (fa, oa, ha), (fb, ob, hb) = slots[a], slots[b]
        _write_header(fa, oa, PageHeader(ha.namespace, b, ha.layout, ha.payload_len, ha.checksum, ha.generation))
        _write_header(fb, ob, PageHeader(hb.namespace, a, hb.layout, hb.payload_len, hb.checksum, hb.generation))
    with contextlib.closing(_nvme_node(nvme, "swapped")) as node:
        for plane, (a, b) in zip(PLANES, pairs, strict=True):
            with KVStoreClient(node.addr, timeout=30, transport=plane) as kv:
                before = _nvme_failures(kv)
                assert kv.lookup(NS, [a]) == 1  # the index believes the headers...
                assert kv.get(NS, [a], promote=False) == [], plane  # ...the checksum does not
                assert kv.get(NS, [b]) == [], plane  # with promotion to DRAM too
                assert _nvme_failures(kv) == before + 2, plane
                assert kv.lookup(NS, [a, b]) == 0  # dropped: a miss from now on
        with KVStoreClient(node.addr, timeout=30) as kv:
            assert [bytes(p) for p in kv.get(NS, [kept])] == [page(kept)]  # the untouched page is served


def test_pages_an_older_build_wrote_recover_and_verify(tmp_path: Path) -> None:
    """Headers of formats 1 (raw) and 2 carry the payload's checksum alone: such pages recover, are verified
    (a damaged one is a miss), and are written anew in format 3 by the next move (pageformat)."""
    nvme = tmp_path / "nvme"
    old = [key(i, "old") for i in range(4)]
    _filled(nvme, old)
    slots = _slots(nvme)
    for i, h in enumerate(old):  # rewrite each header as the older builds wrote it
        f, off, hdr = slots[h]
        legacy = hdr.bound_checksum() ^ identity_digest(hdr.namespace, hdr.hash, hdr.layout)
        version = 1 if i % 2 else 2
        _write_header(
            f, off, PageHeader(hdr.namespace, h, hdr.layout, hdr.payload_len, legacy, hdr.generation, version)
        )
    f, off, _ = slots[old[3]]
    with open(f, "r+b") as fh:  # and damage one old page's payload
        fh.seek(off + HEADER_BYTES + 100)
        fh.write(b"\xff" * 8)
    assert {_slots(nvme)[h][2].version for h in old} == {1, 2}
    check = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "nvme", "check", "--nvme-path", str(nvme),
                            "--json"], capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    formats = [seg["page_formats"] for seg in json.loads(check.stdout)["segments"]]
    assert sum(f.get("1", 0) + f.get("2", 0) for f in formats) == 4  # `kvstore nvme check` tells how many
    with contextlib.closing(_nvme_node(nvme, "old")) as node:
        for plane in PLANES:
            with KVStoreClient(node.addr, timeout=30, transport=plane) as kv:
                assert [bytes(p) for p in kv.get(NS, old[:3], promote=False)] == [page(h) for h in old[:3]]
        with KVStoreClient(node.addr, timeout=30) as kv:
            assert kv.get(NS, old[3:]) == []  # the damaged old page: a miss
            assert len(kv.get(NS, old[:3])) == 3  # promoted: its DRAM copy carries a format 3 header
        assert node.stop() == 0  # the graceful stop spills DRAM pages: written anew
    versions = {h: s[2].version for h, s in _slots(nvme).items() if h in old}
    assert versions and all(v == 3 for h, v in versions.items() if h != old[3]), versions


# -- DRAM, on a node in this process, whose page table a test can corrupt as a mapping bug would


def _dram_failures(kv: KVStoreClient) -> int:
    return next(t.counters.checksum_failures for t in kv.stats().tiers if t.tier is TierKind.DRAM)


@pytest.mark.parametrize("bug", ["slot", "entry"])
def test_dram_pages_mapped_to_another_page_are_misses_on_every_plane(inproc: InProcessNode, bug: str) -> None:
    """`slot`: key A's record points at page B's slot (the bytes of another page); `entry`: key A's place in
    the table holds page B's record (a stale or misfiled record, B's own checksum with it)."""
    table = inproc.node.manager.table
    for plane in PLANES:
        a, b = key(0, f"dram-{bug}-{plane}"), key(1, f"dram-{bug}-{plane}")
        with KVStoreClient(inproc.addr, timeout=30, transport=plane) as kv:
            kv.put(NS, LAYOUT, [a, b], [page(a), page(b)], chain=False)

            def misfile(a: bytes = a, b: bytes = b) -> None:
                ea, eb = table.get((NS, a)), table.get((NS, b))  # the default tenant's scope: NS
                assert ea is not None and eb is not None and ea.tier is eb.tier is TierKind.DRAM
                if bug == "slot":
                    ea.slot = eb.slot  # both records now name B's bytes
                else:
                    table.entries[(NS, a)] = eb  # the bug under test

            before = _dram_failures(kv)  # before the bug: the scrubber may be the one that finds it
            inproc.call(misfile)
            assert kv.get(NS, [a]) == [], plane
            buf = kv.shared_buffer(PAGE)
            assert kv.get_into(NS, [a], buf.pages(PAGE, 1)) == [], plane
            buf.close()
            assert _dram_failures(kv) > before, plane  # counted where it was found (a client's report, a read)
            if bug == "entry":  # B itself is intact (with the slot bug its slot went with A's record)
                assert [bytes(p) for p in kv.get(NS, [b])] == [page(b)], plane
