"""The NVMe tier's directory, taken before any slot is touched: private to the node's user, locked by one node,
its metadata file checked against this node's geometry, and room for the segment files found on its
filesystem (kvstore/tiers/nvme_meta.py owns the metadata file's format).

Invariant: a tier directory other users may write, one another node holds, one formatted for smaller pages
than this node takes, or one whose filesystem cannot hold the tier is refused at start with an error naming
it and the fix; nothing in it is written before these checks pass but a new directory's metadata file.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from kvstore.pageformat import HEADER_BYTES
from kvstore.tiers.nvme_meta import (
    META_NAME,
    REPAIR_HINT,
    SEGMENT_FMT,
    Geometry,
    MetaDamaged,
    NvmeFormatError,
    decode_meta,
    segment_names,
    write_meta,
)

# NOTE: the tier's log keeps its medium's name (nvme.py), so one logger says everything the tier did.
log = logging.getLogger("kvstore.tiers.nvme")


class NvmeSpaceError(RuntimeError):
    """The NVMe directory's filesystem cannot hold the tier asked for (checked and reserved at start)."""


def check_private_dir(path: Path) -> None:
    """Refuse a tier directory other users may write into: they could plant a symlink where a segment
    or the metadata file is about to be created and have the node write through it (SECURITY.md, "The host"). Group
    write is accepted for the node's own group (Kubernetes fsGroup volumes)."""
    st = os.stat(path)
    if st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != os.getegid()):
        raise PermissionError(
            f"--nvme-path {path} is writable by other users (mode {st.st_mode & 0o7777:04o}): "
            f"use a directory only the node's user can write (chmod go-w {path})"
        )


LOCK_NAME = ".lock"  # held (flock) by the one node using the directory


def lock_dir(path: Path) -> int:
    """Take the tier directory for this process, or refuse: two nodes writing one directory's segment
    files would overwrite each other's pages. The lock goes with the process (kill -9 included)."""
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(
            f"--nvme-path {path} is in use by another kvstore node on this host: give each node its own directory"
        ) from None
    return fd


def check_meta(path: Path, want: Geometry) -> tuple[Geometry, str | None]:
    """The geometry to run with, and None when the metadata file is sound (or the directory new), else
    what is wrong with it: the scan at recovery then checks the segment files against `want` and
    rewrites it (refusing files that are not ours). An older build's file (format 1, 2) is sound: its
    geometry comes back `legacy`, and the scan adopts it."""
    meta_path = path / META_NAME
    if not meta_path.exists():
        if not segment_names(path):
            write_meta(path, want)
            return want, None
        log.warning("NVMe metadata %s is missing; rebuilding it from the segment files", meta_path)
        return want, "missing"
    try:
        have = decode_meta(meta_path.read_bytes())
    except MetaDamaged as exc:
        log.warning(
            "NVMe metadata %s is damaged: %s; rebuilding it from the segment files and page "
            "headers (this node's geometry: %s)",
            meta_path,
            exc,
            want,
        )
        return want, str(exc)
    except OSError as exc:
        raise NvmeFormatError(
            f"{meta_path}: unreadable ({exc}); fix the file's permissions or disk, "
            f"or run `{REPAIR_HINT.format(path=path)}`"
        ) from None
    if have.chunk_bytes < want.chunk_bytes:
        raise NvmeFormatError(
            f"{path} was formatted with chunks of {have.chunk_bytes} B ({have.as_dict()}): pages up to "
            f"{have.chunk_bytes - HEADER_BYTES} B; this node takes pages up to "
            f"{want.chunk_bytes - HEADER_BYTES} B. Start with --max-page-bytes {have.chunk_bytes - HEADER_BYTES} "
            "or less, or point --nvme-path at an empty directory"
        )
    if not have.same_layout(want):
        log.info("NVMe tier %s keeps its own geometry %s (this node's would be %s)", path, have, want)
    return have, None


def check_space(path: Path, sizes: list[int], chunk_bytes: int) -> None:
    """Refuse to start when the filesystem cannot hold the segment files: better now, with the numbers,
    than ENOSPC on every demotion later."""
    need = 0
    for seg, size in enumerate(sizes):
        try:
            st = (path / SEGMENT_FMT.format(seg)).stat()
            need += max(0, size - st.st_blocks * 512)
        except FileNotFoundError:
            need += size
    vfs = os.statvfs(path)
    free = vfs.f_bavail * vfs.f_frsize
    if need > free:
        have = sum(sizes) - need + free
        raise NvmeSpaceError(
            f"--nvme-bytes {sum(sizes)} does not fit in {path}: its filesystem has {free} bytes free and "
            f"the segment files need {need} more. Lower --nvme-bytes to at most {have} ({have // chunk_bytes} "
            "chunks), or free space there"
        )
