"""Where a leased page leaves the node from on the UCX plane: host memory, or the GPU's own memory.

On a GPU host whose UCX has CUDA support, a page held in the HBM tier is sent from its device slot (the
lease says where: `ReadLease.device`, supplied by the HBM medium), so UCX can move it with GPUDirect
RDMA (or CUDA IPC on one host) with no host staging on the network path. Lease semantics are the
manager's: a leased page is never moved, evicted or freed, so its device address stays valid and its
bytes unchanged until the lease is released, after the send completed. The receiver verifies the bytes
it got against the page's checksum, so a device-sent page is checked end to end.

Covered without a GPU by the pure `send_from_device`; the device path runs only where CUDA and a
CUDA-enabled UCX exist (tests/gpu).
"""

from __future__ import annotations

from typing import Any

from kvstore.manager.reads import ReadLease


def send_from_device(cuda_support: bool, lease: ReadLease) -> bool:
    """Whether a lease goes out of device memory: UCX can send CUDA memory and the page is held there."""
    return cuda_support and lease.device is not None


def source(cuda_support: bool, lease: ReadLease) -> Any:
    """The buffer a GET sends for a lease: a ucxx Array over its device bytes or its host payload."""
    from ucxx._lib.arr import Array

    if send_from_device(cuda_support, lease):
        assert lease.device is not None
        return Array(_device_bytes(lease.device.pointer, lease.device.nbytes, lease))
    return Array(lease.payload)


def _device_bytes(ptr: int, nbytes: int, owner: object) -> Any:
    """A CuPy uint8 array over device memory we do not own (UCX reads it via __cuda_array_interface__)."""
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner)
    return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
