"""Findings 4 and 6 and a suspicion about the same-host plane, against a real node:
- any file a local user creates in /dev/shm leaves loopback clients working (4);
- every segment the node will not use gets one and the same reply, so a read-token holder cannot probe
  which kvstore-* names exist (6);
- the node refuses segments other users may access: the nonce then proves nothing (suspicion)."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.security import ClientSecurity
from kvstore.wire import shm
from tests.integration.conftest import LAYOUT, NS, PAGE, key, page
from tests.security.conftest import READ, WRITE

HEADER = 64  # segment header bytes (kvstore.wire.shm.HEADER_BYTES)
MAGIC = b"KVSHM001"


@contextlib.contextmanager
def planted(paths: dict[str, str]) -> Iterator[None]:
    """Files (kind "file"), directories ("dir") and dangling symlinks ("link") in /dev/shm, removed after."""
    made: list[Path] = []
    try:
        for name, kind in paths.items():
            p = shm.SHM_DIR / name
            if kind == "dir":
                p.mkdir()
            elif kind == "link":
                p.symlink_to("/nonexistent/kvstore-target")
            else:
                p.write_bytes(b"x")
            made.append(p)
        yield
    finally:
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()


def test_odd_names_in_dev_shm_do_not_break_loopback_clients(secured_node: NodeProcess) -> None:
    node = secured_node
    tag = secrets.token_hex(4)
    odd = {f"kvstore-99999999999999999999-{tag}": "file", f"kvstore--{tag}": "file", f"kvstore-0-{tag}": "file",
           f"kvstore-abc-{tag}": "file", f"kvstore-12345678901-{tag}": "dir", f"kvstore-4000000-{tag}": "link"}  # fmt: skip
    chain = [key(i, "odd") for i in range(3)]
    with planted(odd):
        with KVStoreClient(node.addr, timeout=30, transport="auto", security=ClientSecurity(token=WRITE)) as kv:
            kv.put(NS, LAYOUT, chain, [page(h) for h in chain])
            assert [bytes(p) for p in kv.get(NS, chain)] == [page(h) for h in chain]
            assert kv.plane == "shm"  # the same-host plane still works: nothing fell back
        assert all((shm.SHM_DIR / n).exists() or (shm.SHM_DIR / n).is_symlink() for n in odd)  # not ours to remove


def segment_file(name: str, mode: int, nonce: bytes, size: int = HEADER + 4 * PAGE) -> Path:
    p = shm.SHM_DIR / name
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, MAGIC + nonce, 0)
    finally:
        os.close(fd)
    p.chmod(mode)
    return p


def test_unusable_segments_all_get_one_reply_and_open_ones_are_refused(secured_node: NodeProcess) -> None:
    node = secured_node
    tag = secrets.token_hex(6)
    nonce = secrets.token_bytes(16)
    chain = [key(0, "probe")]
    with KVStoreClient(node.addr, timeout=30, transport="grpc", security=ClientSecurity(token=WRITE)) as kv:
        kv.put(NS, LAYOUT, chain, [page(chain[0])])
    mine = segment_file(f"kvstore-1-mine{tag}", 0o600, nonce)  # a real segment, asked with another nonce
    shared = segment_file(f"kvstore-1-open{tag}", 0o666, nonce)  # the right nonce, but anyone may open it
    small = segment_file(f"kvstore-1-tiny{tag}", 0o600, nonce, size=HEADER)
    cases = {f"kvstore-1-none{tag}": nonce, f"kvstore-1-adir{tag}": nonce, mine.name: b"\x00" * 16,
             shared.name: nonce, small.name: nonce}  # fmt: skip
    before = shared.read_bytes()
    replies = set()
    with planted({f"kvstore-1-adir{tag}": "dir"}), grpc.insecure_channel(node.addr) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        md = (("authorization", f"Bearer {READ}"),)  # a read-only token may call GetShm
        for name, n in cases.items():
            req = pb.GetShmRequest(namespace=NS, hashes=chain, region=pb.ShmRegion(name=name, nonce=n),
                                   offset=HEADER, size=2 * PAGE)  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                stub.GetShm(req, timeout=30, metadata=md)
            replies.add((err.value.code(), (err.value.details() or "").replace(name, "NAME")))
    try:
        assert len(replies) == 1, replies  # missing, a directory, wrong nonce, open to all, too small: alike
        assert shared.read_bytes() == before  # the node wrote nothing into a segment others may read
    finally:
        for p in (mine, shared, small):
            p.unlink()
