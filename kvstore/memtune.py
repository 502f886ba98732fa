"""Process-wide allocator tuning for bulk transfer, and the bound on what the allocator keeps.

Measured (benchmarks/RESULTS-archive.md, the 2026-11-22 store_bench entries): every ~1 MiB chunk buffer
is above glibc's dynamic mmap threshold, so each is mmap'd and unmapped, and freed heap is trimmed back to
the kernel after each call: ~990 page faults and ~5 ms of CPU per 1 MiB get on the node. Raising the mmap and trim
thresholds keeps those buffers in the heap for reuse. The node calls this at start; an engine process
may call it too (it changes the whole process's malloc behaviour, so the client never does on its own).

The price is memory the node keeps, which even unauthenticated callers can make it take (SECURITY.md):
gRPC receives every request's first window of bytes in its own threads, before the node refuses it,
and each such thread allocates from its own malloc arena. glibc never trims the top of an arena's first
heap (64 MiB) below the trim threshold, and `malloc_trim` trims only the main arena's top: with the raised
threshold, 4,800 unauthenticated 8 MiB Lookups left a node +276 MiB for good, four 64 MiB arena heaps
fully resident (measured 2026-11-28). So the node also
- caps malloc's arenas at `NODE_ARENAS` (`bound_arenas`): what gRPC's threads keep is at most that many
  first heaps, whatever the number of cores and threads;
- runs `HeapTrimmer`: every `HEAP_TRIM_SECONDS` it reads the process's anonymous RSS, and while that is
  `HEAP_TRIM_GROWTH_BYTES` above the lowest it has been, gives malloc's free memory back (`malloc_trim(0)`:
  the main arena's top and every free chunk in every arena). Buffers reused within the interval stay;
  the cost is at most one re-fault of what was returned, per interval.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit: allocations up to 32 MiB come from the heap
TRIM_THRESHOLD = 256 << 20  # keep up to 256 MiB of freed heap instead of returning it after each call
# NOTE: measured with 2,400 unauthenticated 8 MiB Lookups (2 vCPUs, 2026-11-28): glibc's default (8 per
# core) let the node keep +224-299 MiB, 4 arenas +69-88 MiB, 2 arenas +58-105 MiB (with the trimmer).
NODE_ARENAS = 2
HEAP_TRIM_GROWTH_BYTES = 64 << 20  # anonymous RSS above its floor that makes the trimmer trim
HEAP_TRIM_SECONDS = 5.0  # how often the trimmer looks


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _mallopt(param: int, value: int) -> bool:
    fn = getattr(_libc(), "mallopt", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return bool(fn(param, value))


def tune_malloc_for_bulk_io() -> bool:
    """Raise glibc's mmap and trim thresholds; returns False (and changes nothing) off glibc."""
    ok = _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and _mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    log.debug("malloc tuned for bulk I/O: %s", ok)
    return ok


def freeze_startup_objects() -> int:
    """Take every object alive now out of the cyclic garbage collector's walks (`gc.freeze`) and return how
    many: a started node's modules, gRPC and protobuf state, tiers and planes live as long as the process.

    NOTE: measured (perf, 2026-11-28, 16 x 1 MiB TCP gets): the collector's full passes walked those objects
    again and again, ~55 us of the node's CPU per page served (a fifth of it); frozen, they are never walked.
    Objects made later (pages' records, requests) are collected as before."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def bound_arenas(arenas: int = NODE_ARENAS) -> bool:
    """Cap malloc's arenas (threads beyond share them); call before threads start allocating. False off
    glibc. An environment's MALLOC_ARENA_MAX (or GLIBC_TUNABLES) set by the operator wins."""
    if os.environ.get("MALLOC_ARENA_MAX") or "arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    return _mallopt(_M_ARENA_MAX, arenas)


def trim_heap() -> bool:
    """Give malloc's free memory back to the kernel (glibc's malloc_trim(0)); False off glibc."""
    fn = getattr(_libc(), "malloc_trim", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return bool(fn(0))


@functools.cache
def usable_cores() -> int:
    """The cores this process may run on (its affinity; the CPU count where there is none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def anon_rss_bytes() -> int | None:
    """This process's resident anonymous memory (RssAnon: malloc's heaps, not the DRAM tier's shared
    memory); None where /proc/self/status does not say."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class HeapTrimmer:
    """Bounds the freed memory the process keeps: every `interval` seconds, when its anonymous RSS is more
    than `growth` bytes above the lowest it has been (at the start or after a trim), trims malloc's free
    memory (in a worker thread: ctypes releases the GIL, so the loop never waits on malloc's arena locks).
    Off where there is no RssAnon or no malloc_trim.

    NOTE: while the node legitimately holds more than `growth` above that floor (buffers in use), it trims
    every interval; a trim that finds little free memory costs little (malloc walks its free chunks)."""

    def __init__(self, growth: int = HEAP_TRIM_GROWTH_BYTES, interval: float = HEAP_TRIM_SECONDS) -> None:
        self.growth = growth
        self.interval = interval
        self.trims = 0
        self.returned_bytes = 0  # anonymous RSS before minus after each trim, summed

    async def run(self) -> None:
        """Until cancelled."""
        floor = anon_rss_bytes()
        if floor is None or getattr(_libc(), "malloc_trim", None) is None:
            log.debug("no RssAnon or malloc_trim: the heap trimmer is off")
            return
        while True:
            await asyncio.sleep(self.interval)
            now = anon_rss_bytes() or 0
            if now - floor < self.growth:
                continue
            await asyncio.to_thread(trim_heap)
            after = anon_rss_bytes() or now
            floor = min(floor, after)
            self.trims += 1
            self.returned_bytes += max(0, now - after)
            log.debug("heap trimmed: anonymous RSS %d -> %d MiB", now >> 20, after >> 20)
