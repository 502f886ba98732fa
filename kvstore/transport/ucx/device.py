"""Where a leased page leaves the node from on the UCX plane: host memory, or the GPU's own memory.

On a GPU host whose UCX has CUDA support, a page held in the HBM tier is sent from its device slot, so
UCX can move it with GPUDirect RDMA (or CUDA IPC on one host) with no host staging on the network path.
Lease semantics are the manager's: a leased page is never moved, evicted or freed, so its HBM slot and
device pointer stay valid and unchanged until the lease is released, after the send completed.

NOTE: the Reader still copies an HBM page into a host bounce buffer to verify its checksum (every tier
read is verified, DESIGN.md §4); dropping that copy needs a checksum kernel on the GPU. The receiver
verifies the bytes it got against the same checksum, so a device-sent page is checked end to end.
Not run here: this host has no GPU; `send_from_device` (pure) is what CPU tests cover.
"""

from __future__ import annotations

from typing import Any

from kvstore.names import TierKind
from kvstore.pageformat import HEADER_BYTES


def send_from_device(enabled: bool, held_in: TierKind, entry_tier: TierKind | None, readers: int) -> bool:
    """Whether a leased page goes out of device memory: the plane can send CUDA memory, the lease reads
    the page from HBM, the page is still in HBM, and it is leased (readers > 0 keeps the slot fixed)."""
    return enabled and held_in is TierKind.HBM and entry_tier is TierKind.HBM and readers > 0


class DeviceSender:
    """Builds the buffer a GET sends for a lease (a ucxx Array over host or device memory)."""

    def __init__(self, manager: Any, cuda_support: bool) -> None:
        self.manager = manager
        medium = manager.medium(TierKind.HBM) if TierKind.HBM in manager.table.tiers else None
        self.hbm = medium if medium is not None and getattr(medium, "available", False) else None
        self.enabled = bool(cuda_support and self.hbm is not None and hasattr(self.hbm, "device_ptr"))

    def source(self, lease: Any) -> Any:
        from ucxx._lib.arr import Array

        if self.enabled:
            entry = self.manager.entry(*lease.key)
            if send_from_device(True, lease.held_in, entry.tier if entry else None, entry.readers if entry else 0):
                assert self.hbm is not None and entry is not None
                return Array(_device_bytes(self.hbm.device_ptr(entry.slot) + HEADER_BYTES, len(lease.payload), entry))
        return Array(lease.payload)


def _device_bytes(ptr: int, nbytes: int, owner: object) -> Any:
    """A CuPy uint8 array over device memory we do not own (UCX reads it via __cuda_array_interface__)."""
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner)
    return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
