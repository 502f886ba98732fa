"""HBM tier: one CUDA allocation cut into fixed-size slots, through CuPy.

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


class HbmTier(Medium):
    """`num_slots` device slots of `slot_bytes`; copies to and from host buffers on one CUDA stream.

    Host buffers passed in should be the pinned DRAM slab (DramTier.try_pin) for full PCIe bandwidth.
    Batched transfers are queued on the stream together and synchronised once.
    """

    kind = TierKind.HBM

    def __init__(self, capacity_bytes: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        reason = cuda_unavailable_reason() if capacity_bytes > 0 else "hbm_bytes is 0"
        self.available = reason is None
        self.detail = reason or ""
        self.num_slots = 0
        self._mem = None
        if not self.available:
            return
        import cupy

        self.num_slots = capacity_bytes // slot_bytes
        self._mem = cupy.cuda.alloc(self.num_slots * slot_bytes)
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self.detail = f"CUDA device {cupy.cuda.Device().id}, one {self.num_slots * slot_bytes} B allocation"

    def device_pointer(self, slot: int) -> int:
        """Device address of a slot's first byte (for transports that send from device memory)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"HBM slot {slot} out of range")
        return self._mem.ptr + slot * self.slot_bytes

    def _enqueue(self, ops: Sequence[SlotIO], to_device: bool) -> None:
        import cupy

        rt = cupy.cuda.runtime
        for slot, buf in ops:
            dev, host = self.device_pointer(slot), buffer_address(buf)
            if to_device:
                rt.memcpyAsync(dev, host, len(buf), rt.memcpyHostToDevice, self._stream.ptr)
            else:
                rt.memcpyAsync(host, dev, len(buf), rt.memcpyDeviceToHost, self._stream.ptr)
        self._stream.synchronize()

    def read(self, slot: int, into: memoryview) -> None:
        self._enqueue([(slot, into)], to_device=False)

    def write(self, slot: int, src: memoryview) -> None:
        self._enqueue([(slot, src)], to_device=True)

    def read_many(self, ops: Sequence[SlotIO]) -> None:
        self._enqueue(ops, to_device=False)

    def write_many(self, ops: Sequence[SlotIO]) -> None:
        self._enqueue(ops, to_device=True)

    def close(self) -> None:
        self._mem = None
