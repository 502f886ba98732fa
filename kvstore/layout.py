"""Page layout: the shape of one KV page, its encoding and its size in bytes (DESIGN.md §4).

A page is the KV of one block for all layers, `[num_layers, 2 (K, V), block_size, num_kv_heads,
head_dim]` of `dtype` values, stored in one of two encodings:

- `raw`: those values, contiguous, in `dtype` (what engines hold; every page before encodings existed).
- `fp8-e4m3`: the same values quantized to float8 e4m3 ("fn": finite, max 448) with one fp32 scale per
  (layer, K/V, kv head), both inside the page (little endian, offsets from the payload's start):

      [0, scales_bytes)                 scales  fp32 [num_layers, 2, num_kv_heads], scale = absmax / 448
      [scales_bytes, values_offset)     zero padding to a 16-byte boundary
      [values_offset, + values_bytes)   values  e4m3 [num_layers, 2, block_size, num_kv_heads, head_dim]
      [.., page_bytes)                  zero padding to a 16-byte boundary

  Decoding gives `float(q) * scale`, rounded to `dtype`, within |x' - x| <= 2^-4 |x| + 2^-10 scale
  of the original (kernels/README.md, "Numerics"). Every scale is finite and >= 0: the encoder refuses
  pages holding NaN or inf (kernels.NonFiniteKV) rather than clamp them, and decoders refuse a page
  whose scale is not (it is no page of this format). The 16-byte boundaries let the CUDA kernels read
  and write encoded pages in place with vector loads; they cost at most 30 bytes a page.

The encoding is a property of the page, not of its key: the prefix-hash contract does not change, and
a namespace holds pages of one layout, encoding included. Pure: no I/O, no torch.
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
_ALIASES = {
    "float16": DType.FLOAT16,
    "fp16": DType.FLOAT16,
    "half": DType.FLOAT16,
    "bfloat16": DType.BFLOAT16,
    "bf16": DType.BFLOAT16,
    "float32": DType.FLOAT32,
    "fp32": DType.FLOAT32,
    "float8_e4m3": DType.FLOAT8_E4M3,
    "float8_e4m3fn": DType.FLOAT8_E4M3,
    "fp8": DType.FLOAT8_E4M3,
    "uint8": DType.UINT8,
    "bytes": DType.UINT8,
}

_U32_MAX = 0xFFFFFFFF
FP8_ALIGN = 16  # bytes: boundaries inside an fp8-e4m3 page (see the module docstring)
SCALE_BYTES = 4  # one fp32 scale


class PageEncoding(enum.IntEnum):
    """How a page's values are stored; values equal the proto's `kvstore.v1.PageEncoding` numbers."""

    RAW = 0
    FP8_E4M3 = 1

    @property
    def label(self) -> str:
        """The name in flags, values files, Stats and error messages: "raw", "fp8-e4m3"."""
        return _ENCODING_LABELS[self]

    @classmethod
    def parse(cls, name: str | int | PageEncoding) -> PageEncoding:
        """Accept a PageEncoding, its number, or a name such as "raw", "fp8", "fp8-e4m3"."""
        if isinstance(name, PageEncoding):
            return name
        if isinstance(name, int):
            return cls(name)
        key = name.strip().lower().replace("_", "-")
        if key in _ENCODING_ALIASES:
            return _ENCODING_ALIASES[key]
        raise ValueError(f"unknown page encoding {name!r}; one of {sorted(_ENCODING_ALIASES)}")


_ENCODING_LABELS = {PageEncoding.RAW: "raw", PageEncoding.FP8_E4M3: "fp8-e4m3"}
_ENCODING_ALIASES = {"raw": PageEncoding.RAW, "fp8": PageEncoding.FP8_E4M3, "fp8-e4m3": PageEncoding.FP8_E4M3}
# dtypes an encoding can quantize: fp8 of fp8 (or of opaque bytes) would mean nothing.
_ENCODABLE = {PageEncoding.FP8_E4M3: (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32)}


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True, slots=True)
class PageLayout:
    """Shape and encoding of every page of a namespace. Immutable; `page_bytes` > 0 once constructed.

    `dtype` is the element type of the values a page holds when decoded (the engine's KV dtype);
    `encoding` says how they are stored (module docstring). A raw layout is exactly the layout of
    before encodings existed, and packs to the same 20 bytes.
    """

    dtype: DType
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    encoding: PageEncoding = PageEncoding.RAW

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            object.__setattr__(self, "dtype", DType.parse(self.dtype))
        if not isinstance(self.encoding, PageEncoding):
            object.__setattr__(self, "encoding", PageEncoding.parse(self.encoding))
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= _U32_MAX:
                raise ValueError(f"layout.{name} must be an int in [1, 2^32), got {value!r}")
        allowed = _ENCODABLE.get(self.encoding)
        if allowed is not None and self.dtype not in allowed:
            names = ", ".join(d.name.lower() for d in allowed)
            raise ValueError(
                f"layout.encoding {self.encoding.label} encodes {names} values, not {self.dtype.name.lower()}"
            )

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of a page's values: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def scales_shape(self) -> tuple[int, int, int]:
        """Shape of an fp8-e4m3 page's scales: [num_layers, 2, num_kv_heads]."""
        return (self.num_layers, 2, self.num_kv_heads)

    @property
    def num_values(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def raw_page_bytes(self) -> int:
        """Size of one page's values in `dtype`: the raw page, and what an encoded page decodes to."""
        return self.num_values * self.dtype.itemsize

    @property
    def scales_bytes(self) -> int:
        """Bytes of an encoded page's scales (0 for raw)."""
        if self.encoding is PageEncoding.RAW:
            return 0
        return self.num_layers * 2 * self.num_kv_heads * SCALE_BYTES

    @property
    def values_offset(self) -> int:
        """Where a page's values start inside its payload (0 for raw)."""
        if self.encoding is PageEncoding.RAW:
            return 0
        return _align(self.scales_bytes, FP8_ALIGN)

    @property
    def page_bytes(self) -> int:
        """Payload size of one stored page (what a Put sends and a tier slot holds)."""
        if self.encoding is PageEncoding.RAW:
            return self.raw_page_bytes
        return self.values_offset + _align(self.num_values, FP8_ALIGN)  # e4m3: one byte a value

    def with_encoding(self, encoding: PageEncoding | str) -> PageLayout:
        """The same shape and dtype in another encoding."""
        return PageLayout(
            self.dtype, self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, PageEncoding.parse(encoding)
        )

    def pack(self) -> bytes:
        """20-byte little-endian encoding used in page headers and TCP frames:
        dtype u16 | encoding u16 | layers u32 | kv heads u32 | head dim u32 | block size u32.

        NOTE: the first word was `dtype u32` before encodings; a raw layout (encoding 0) packs to the
        very same bytes, so raw pages and frames of older builds read unchanged."""
        return struct.pack(
            "<HHIIII",
            int(self.dtype),
            int(self.encoding),
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
        )

    @classmethod
    def unpack(cls, raw: bytes) -> PageLayout:
        """Inverse of pack; ValueError for an unknown dtype or encoding, or a bad field."""
        dtype, encoding, layers, heads, dim, block = struct.unpack("<HHIIII", raw)
        try:
            enc = PageEncoding(encoding)
        except ValueError:
            raise ValueError(f"unknown page encoding {encoding}") from None
        return cls(DType(dtype), layers, heads, dim, block, enc)

    def describe(self) -> str:
        enc = "" if self.encoding is PageEncoding.RAW else f" as {self.encoding.label}"
        return (
            f"{self.dtype.name.lower()}{enc} L={self.num_layers} kv_heads={self.num_kv_heads} "
            f"head_dim={self.head_dim} block={self.block_size} ({self.page_bytes} B/page)"
        )
