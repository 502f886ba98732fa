"""Damaged NVMe metadata and segment files: the node rebuilds what the segment and page headers prove,
refuses what they cannot (naming the file, what is wrong and the command that fixes it), and never
fails with a bare decoder exception. Real node processes; `kvstore nvme check|repair` as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.faults import CHAIN, PAGE, SLOT, check_pages, key, put_chain
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.pageformat import slot_bytes_for
from kvstore.tiers.nvme_meta import META_NAME, Geometry, MetaDamaged, decode_meta, encode_meta

PAGES = 24


def _node(nvme: Path) -> NodeProcess:
    return NodeProcess(dram_bytes=4 * SLOT, nvme_path=nvme, nvme_bytes=64 * SLOT, max_page_bytes=PAGE,
                       node_id="damage", env={"COLUMNS": "400"})  # fmt: skip


def _filled(tmp_path: Path) -> tuple[Path, list[bytes]]:
    """An NVMe directory holding PAGES pages (stopped cleanly: every page on NVMe)."""
    nvme = tmp_path / "nvme"
    keys = [key(i, "damage") for i in range(PAGES)]
    node = _node(nvme).start()
    try:
        with KVStoreClient(node.addr, timeout=30) as kv:
            for i in range(0, PAGES, CHAIN):
                put_chain(kv, keys[i : i + CHAIN])
    finally:
        assert node.stop() == 0
        node.close()
    return nvme, keys


def _kvstore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.cli.main", *args], capture_output=True, text=True, check=False,
                          timeout=120, env={**os.environ, "COLUMNS": "400"})  # fmt: skip


def test_metadata_checksum_round_trip_and_damage_is_named() -> None:
    geom = Geometry(slot_bytes_for(PAGE), 64)
    assert decode_meta(encode_meta(geom)) == geom
    raw = bytearray(encode_meta(geom))
    raw[3] = 0xF6  # the byte of the outside report: was a bare UnicodeDecodeError
    with pytest.raises(MetaDamaged, match="not UTF-8"):
        decode_meta(bytes(raw))
    tampered = encode_meta(geom).replace(b'"chunks_per_segment": 64', b'"chunks_per_segment": 65')
    with pytest.raises(MetaDamaged, match="checksum"):
        decode_meta(tampered)
    legacy = json.dumps({"format": 1, "slot_bytes": geom.chunk_bytes, "slots_per_segment": 64}).encode()
    # format 1 (no checksum) is still read: an older build's fixed slots, a chunk each (adopted at start)
    assert decode_meta(legacy) == Geometry(geom.chunk_bytes, 64, legacy=True)


def test_damaged_metadata_is_rebuilt_and_every_page_served(tmp_path: Path) -> None:
    nvme, keys = _filled(tmp_path)
    meta = nvme / META_NAME
    raw = bytearray(meta.read_bytes())
    raw[10] ^= 0xA6
    meta.write_bytes(bytes(raw))
    assert _kvstore("nvme", "check", "--nvme-path", str(nvme), "--max-page-bytes", str(PAGE)).returncode == 1
    node = _node(nvme).start()
    try:
        with KVStoreClient(node.addr, timeout=30) as kv:
            present, missing, corrupt = check_pages(kv, keys)
        assert (len(present), missing, corrupt) == (PAGES, [], 0)
        assert "rebuilt" in node.log_tail(200)
    finally:
        node.close()
    decode_meta(meta.read_bytes())  # rewritten, checksum and all
    assert _kvstore("nvme", "check", "--nvme-path", str(nvme)).returncode == 0


def test_foreign_segment_is_refused_with_file_and_command_then_repaired(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    node = _node(nvme).start()  # formats the directory
    node.close()
    seg = nvme / "seg-00000.kvs"
    seg.write_bytes(os.urandom(seg.stat().st_size))  # another program's data under our name
    node = _node(nvme)
    try:
        with pytest.raises(RuntimeError) as info:
            node.start(timeout=60)
        msg = str(info.value)
        assert "seg-00000.kvs" in msg and "not a segment of this NVMe tier" in msg and "kvstore nvme repair" in msg
        assert "Traceback" not in msg
    finally:
        node.close()
    check = _kvstore("nvme", "check", "--nvme-path", str(nvme), "--json")
    assert check.returncode == 1 and json.loads(check.stdout)["segments"][0]["foreign_file"] is True
    refused = _kvstore("nvme", "repair", "--nvme-path", str(nvme), "--max-page-bytes", str(PAGE))
    assert refused.returncode == 1 and "--discard-foreign" in refused.stderr
    fixed = _kvstore("nvme", "repair", "--nvme-path", str(nvme), "--max-page-bytes", str(PAGE), "--discard-foreign")
    assert fixed.returncode == 0, fixed.stderr
    node = _node(nvme).start()  # reformatted: serves again
    node.close()


def test_truncated_segment_keeps_whole_pages_and_never_serves_the_cut_one(tmp_path: Path) -> None:
    nvme, keys = _filled(tmp_path)
    seg = nvme / "seg-00000.kvs"
    cut = 10 * SLOT + SLOT // 2  # inside slot 10: slots 0..9 whole
    os.truncate(seg, cut)
    node = _node(nvme).start()
    try:
        with KVStoreClient(node.addr, timeout=30) as kv:
            present, _, corrupt = check_pages(kv, keys)
        assert corrupt == 0
        assert len(present) == 10  # the pages wholly before the cut
        assert "truncated" in node.log_tail(200)
    finally:
        node.close()
