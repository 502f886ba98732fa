"""Same-host shared-memory data plane: pages cross through client-owned shared memory.

Protocol (proto: ShmRegion, PutShm, GetShm). The client creates a segment `kvstore-<pid>-<random>` and
writes a 64-byte header: MAGIC, then a random 16-byte nonce. A PutShm names the segment, repeats the
nonce and lists (hash, offset, length, checksum) slices holding the pages; the node opens the segment,
checks the nonce and the bounds, and reads each slice into its own slot (one copy, by preadv) under the
same atomic transaction as a Put stream, computing each page's checksum from its slot. A GetShm names
the segment and a window; the node copies each verified page into the window (one copy, by pwrite)
and answers with where it put them.

Why a nonce: the node opens segments by name, so without it any local client could make the node
write into another process's segment. Only a process that can read the segment knows its nonce, and
such a process could write it anyway. Segments are created 0600, so that means the same user.

Ownership: the client creates, grows (a new segment) and unlinks its segments (`segments.py`); the
node only opens them, never maps them, keeps a bounded number open, and closes one when its file is
gone or was replaced (`node.py`).

Zero-copy (`get_into` / `put_from`): the caller's registered buffers (`SharedBuffer`) are memfds with
the same header, sealed so they can never shrink or grow. A GetShm with `targets` or a PutShm naming
one (ShmRegion.pid and .fd) has the node open it as /proc/<pid>/fd/<fd>, check the seal and the nonce,
map it, and copy each page straight between its slot and the caller's buffer with memcpy. On a get the
node's reader copies each page in the pass that verifies it (one copy, one checksum); nothing crosses
a network here, so the client verifies nothing again (the rule: kvstore/README.md, "Checksums").

This module holds what both sides must agree on.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")
MAGIC = b"KVSHM001"
NONCE_BYTES = 16
HEADER_BYTES = 64  # segment header: MAGIC, nonce, zero padding; slices start after it
NAME_RE = re.compile(r"^kvstore-[A-Za-z0-9_-]{8,64}$")


def shm_available() -> bool:
    """Whether this host has a POSIX shared-memory directory we can use."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK | os.X_OK)
