"""Process-wide allocator tuning for bulk transfer.

Measured (benchmarks/RESULTS-archive.md, the 2026-11-22 store_bench entries): every ~1 MiB chunk buffer
is above glibc's dynamic mmap threshold, so each is mmap'd and unmapped, and freed heap is trimmed back to
the kernel after each call: ~990 page faults and ~5 ms of CPU per 1 MiB get on the node. Raising the mmap
and trim thresholds keeps those buffers in the heap for reuse. The node calls this at start; an engine
process may call it too (it changes the whole process's malloc behaviour, so the client never does on its own).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit: allocations up to 32 MiB come from the heap
TRIM_THRESHOLD = 256 << 20  # keep up to 256 MiB of freed heap instead of returning it after each call


def tune_malloc_for_bulk_io() -> bool:
    """Raise glibc's mmap and trim thresholds; returns False (and changes nothing) off glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.debug("malloc tuned for bulk I/O: %s", ok)
    return ok
