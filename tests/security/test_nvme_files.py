"""Suspicions about the NVMe tier, settled against real nodes:
- segment files are opened with O_NOFOLLOW and the tier directory must not be writable by other users,
  so nobody can make the node write through a planted symlink;
- recovery ignores a slot whose payload length is not its layout's page size (a Put never stores one),
  instead of serving a page of the wrong size after a restart."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient
from kvstore.pageformat import HEADER_BYTES, PageHeader, payload_checksum
from tests.integration.conftest import LAYOUT, NS, PAGE, key, page, start_node


def test_a_symlink_planted_as_a_segment_file_is_not_followed(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme-sym"
    nvme.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (nvme / "seg-00000.kvs").symlink_to(victim)
    with pytest.raises(RuntimeError) as err:
        start_node(tmp_path, name="sym").close()  # close(): only if it started, which is the bug
    assert "symbolic link" in " ".join(str(err.value).split())
    assert victim.read_text() == "precious\n"  # neither extended nor written


def test_a_tier_directory_other_users_may_write_is_refused(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme-open"
    nvme.mkdir()
    nvme.chmod(0o777)
    with pytest.raises(RuntimeError) as err:
        start_node(tmp_path, name="open").close()
    message = " ".join(str(err.value).split())
    assert "writable by other users (mode 0777)" in message and "chmod go-w" in message
    assert not any(nvme.iterdir())  # nothing was created there


def test_recovery_skips_a_slot_whose_payload_does_not_fit_its_layout(tmp_path: Path) -> None:
    node = start_node(tmp_path, name="rec")  # formats the tier (metadata, segment files)
    node.close()
    h = key(0, "short")
    short = page(h)[: PAGE // 2]  # half a page under a header that validates
    hdr = PageHeader(NS, h, LAYOUT, len(short), payload_checksum(short), generation=1)
    fd = os.open(tmp_path / "nvme-rec" / "seg-00000.kvs", os.O_RDWR)
    try:
        os.pwrite(fd, hdr.pack() + short, 0)  # slot 0: header block, then the payload
        os.fsync(fd)
    finally:
        os.close(fd)
    assert len(hdr.pack()) == HEADER_BYTES
    node = start_node(tmp_path, name="rec")
    try:
        with KVStoreClient(node.addr, timeout=10) as kv:
            assert kv.lookup(NS, [h]) == 0  # not recovered: never served
    finally:
        node.close()
