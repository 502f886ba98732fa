"""Page layout: the shape of one KV page and its size in bytes (DESIGN.md §4).

A page is the KV of one block for all layers, `[num_layers, 2 (K, V), block_size, num_kv_heads,
head_dim]`, contiguous, in `dtype`. Pure: no I/O, no torch.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass


class DType(enum.IntEnum):
    """Element types; values equal the proto's `kvstore.v1.DType` numbers."""

    FLOAT16 = 1
    BFLOAT16 = 2
    FLOAT32 = 3
    FLOAT8_E4M3 = 4
    UINT8 = 5

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @classmethod
    def parse(cls, name: str | int | DType) -> DType:
        """Accept a DType, its number, or a name such as "float16", "bf16", "fp8"."""
        if isinstance(name, DType):
            return name
        if isinstance(name, int):
            return cls(name)
        key = name.strip().lower()
        if key in _ALIASES:
            return _ALIASES[key]
        raise ValueError(f"unknown dtype {name!r}; one of {sorted(_ALIASES)}")


_ITEMSIZE = {DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.FLOAT32: 4, DType.FLOAT8_E4M3: 1, DType.UINT8: 1}
# One line per dtype: its names read as a table (hence the formatter is told to leave it).
_ALIASES = {
    "float16": DType.FLOAT16, "fp16": DType.FLOAT16, "half": DType.FLOAT16,
    "bfloat16": DType.BFLOAT16, "bf16": DType.BFLOAT16,
    "float32": DType.FLOAT32, "fp32": DType.FLOAT32,
    "float8_e4m3": DType.FLOAT8_E4M3, "float8_e4m3fn": DType.FLOAT8_E4M3, "fp8": DType.FLOAT8_E4M3,
    "uint8": DType.UINT8, "bytes": DType.UINT8,
}  # fmt: skip

_U32_MAX = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class PageLayout:
    """Shape of every page of a namespace. Immutable; `page_bytes` > 0 once constructed."""

    dtype: DType
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            object.__setattr__(self, "dtype", DType.parse(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= _U32_MAX:
                raise ValueError(f"layout.{name} must be an int in [1, 2^32), got {value!r}")

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Payload size of one page."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def pack(self) -> bytes:
        """20-byte little-endian encoding used in page headers."""
        return struct.pack(
            "<IIIII", int(self.dtype), self.num_layers, self.num_kv_heads, self.head_dim, self.block_size
        )

    @classmethod
    def unpack(cls, raw: bytes) -> PageLayout:
        dtype, layers, heads, dim, block = struct.unpack("<IIIII", raw)
        return cls(DType(dtype), layers, heads, dim, block)

    def describe(self) -> str:
        return (
            f"{self.dtype.name.lower()} L={self.num_layers} kv_heads={self.num_kv_heads} "
            f"head_dim={self.head_dim} block={self.block_size} ({self.page_bytes} B/page)"
        )
