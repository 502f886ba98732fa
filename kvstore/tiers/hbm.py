"""HBM tier: one CUDA allocation cut into chunks (of slots of one size each), through CuPy.

Exists only when CuPy imports and a CUDA device is present and `hbm_bytes > 0`; otherwise the tier
reports capacity 0 with the reason, and is never silently backed by host memory (DESIGN.md §5).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore.names import TierKind
from kvstore.pointers import buffer_address
from kvstore.tiers.base import Medium, SlotIO

log = logging.getLogger(__name__)


def cuda_unavailable_reason() -> str | None:
    """None when a CUDA device can be used through CuPy, else a one-line reason."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'kvstore[gpu]')"
    try:
        if not cupy.cuda.is_available():
            return "no CUDA device on this host"
    except Exception as exc:
        return f"CUDA unusable: {exc}"
    return None


class HbmMedium(Medium):
    """`num_chunks` device chunks of `chunk_bytes`; offset o is byte o of the allocation. Copies to and from
    host buffers on one CUDA stream.

    Host buffers passed in should be the pinned DRAM slab (DramMedium.try_pin) for full PCIe bandwidth.
    Batched transfers are queued on the stream together and synchronised once.
    """

    kind = TierKind.HBM

    def __init__(self, capacity_bytes: int, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.chunk_classes = {}
        reason = cuda_unavailable_reason() if capacity_bytes > 0 else "hbm_bytes is 0"
        self.available = reason is None
        self.detail = reason or ""
        self.num_chunks = 0
        self._mem = None
        if not self.available:
            return
        import cupy

        self.num_chunks = capacity_bytes // chunk_bytes
        self._mem = cupy.cuda.alloc(self.num_chunks * chunk_bytes)
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self.detail = f"CUDA device {cupy.cuda.Device().id}, one {self.num_chunks * chunk_bytes} B allocation"

    def device_pointer(self, offset: int) -> int:
        """Device address of the byte at `offset` (for transports that send from device memory)."""
        self.check_range(offset, 1)
        return self._mem.ptr + offset

    def _enqueue(self, ops: Sequence[SlotIO], to_device: bool) -> None:
        import cupy

        rt = cupy.cuda.runtime
        for offset, buf in ops:
            self.check_range(offset, len(buf))
            dev, host = self.device_pointer(offset), buffer_address(buf)
            if to_device:
                rt.memcpyAsync(dev, host, len(buf), rt.memcpyHostToDevice, self._stream.ptr)
            else:
                rt.memcpyAsync(host, dev, len(buf), rt.memcpyDeviceToHost, self._stream.ptr)
        self._stream.synchronize()

    def read(self, offset: int, into: memoryview) -> None:
        self._enqueue([(offset, into)], to_device=False)

    def write(self, offset: int, src: memoryview) -> None:
        self._enqueue([(offset, src)], to_device=True)

    def read_many(self, ops: Sequence[SlotIO]) -> None:
        self._enqueue(ops, to_device=False)

    def write_many(self, ops: Sequence[SlotIO]) -> None:
        self._enqueue(ops, to_device=True)

    def close(self) -> None:
        self._mem = None
