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

- `bundle`: a multi-part page (DESIGN.md §4.3): named parts, each with a layout of its own (a hybrid model's
  KV beside its Mamba state, its sliding-window KV, its indexer), stored back to back under one key:

      [0, part 0 bytes)                 part 0, exactly as its own layout's page
      [part 0 bytes, + part 1 bytes)    part 1, ...                  (no padding: offsets are sums)

  The node stores it as one page (one slot, one header, one checksum over the whole payload, bound to the
  bundle's layout like any page), so its parts commit together and are read together. Its 20-byte packed
  form keeps the fields' places with bundle meanings: dtype uint8 | encoding bundle | layers = parts |
  kv heads = a 32-bit digest of the part table (`part_table`) | head dim = payload bytes | block size. The
  part table itself (names and layouts) travels beside it where it must be named (the proto's
  `PageLayout.parts`, a TCP PUT/GET's table).

The encoding is a property of the page, not of its key: the prefix-hash contract does not change, and
a namespace holds pages of one layout, encoding included. Pure: no I/O, no torch.
"""

from __future__ import annotations

import enum
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

import xxhash


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
    BUNDLE = 2  # a multi-part page (module docstring)

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


_ENCODING_LABELS = {PageEncoding.RAW: "raw", PageEncoding.FP8_E4M3: "fp8-e4m3", PageEncoding.BUNDLE: "bundle"}
_ENCODING_ALIASES = {
    "raw": PageEncoding.RAW,
    "fp8": PageEncoding.FP8_E4M3,
    "fp8-e4m3": PageEncoding.FP8_E4M3,
    "bundle": PageEncoding.BUNDLE,
}
# dtypes an encoding can quantize: fp8 of fp8 (or of opaque bytes) would mean nothing.
_ENCODABLE = {
    PageEncoding.FP8_E4M3: (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32),
    PageEncoding.BUNDLE: (DType.UINT8,),  # the bundle's own dtype field: its parts carry theirs
}
MAX_PARTS = 64  # parts of one bundle (SGLang names about 25 pools; one page rarely carries more than a few)
MAX_PART_NAME_BYTES = 64
_PART_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # SGLang's pool names, vLLM's group ids, LMCache's
_TABLE_TAG = b"kvstore/bundle-parts/v1\0"


@dataclass(frozen=True, slots=True)
class PagePart:
    """One part of a bundle: a name (`kv`, `mamba`, `swa`, `g1`, ...) and the layout of its bytes."""

    name: str
    layout: PageLayout

    def __post_init__(self) -> None:
        raw = self.name.encode() if isinstance(self.name, str) else b""
        if not raw or len(raw) > MAX_PART_NAME_BYTES or not _PART_NAME.fullmatch(self.name):
            raise ValueError(
                f"part name {self.name!r}: 1..{MAX_PART_NAME_BYTES} bytes of letters, digits and _.+- "
                "(starting with a letter or digit)"
            )
        if not isinstance(self.layout, PageLayout):
            raise ValueError(f"part {self.name!r}: its layout must be a PageLayout")
        if self.layout.encoding is PageEncoding.BUNDLE:
            raise ValueError(f"part {self.name!r}: a bundle's part cannot itself be a bundle")


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True, slots=True)
class PageLayout:
    """Shape and encoding of every page of a namespace. Immutable; `page_bytes` > 0 once constructed.

    `dtype` is the element type of the values a page holds when decoded (the engine's KV dtype);
    `encoding` says how they are stored (module docstring). A raw layout is exactly the layout of
    before encodings existed, and packs to the same 20 bytes.

    A bundle (`PageLayout.bundle(parts, block_size)`) also holds its `parts`; equality and hashing go by the
    packed fields alone (their digest covers the part table), so a bundle read back from a page header, which
    carries no part names, equals the one its writer named. `has_parts` says whether the names are known.
    """

    dtype: DType
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    encoding: PageEncoding = PageEncoding.RAW
    parts: tuple[PagePart, ...] = field(default=(), compare=False)

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
        if self.encoding is PageEncoding.BUNDLE:
            self._check_bundle()
        elif self.parts:
            raise ValueError(f"layout.parts: only a bundle has parts, not a {self.encoding.label} layout")

    def _check_bundle(self) -> None:
        """A bundle's packed fields agree with its parts (when it has them)."""
        if not 1 <= self.num_layers <= MAX_PARTS:
            raise ValueError(f"layout.parts: a bundle has 1..{MAX_PARTS} parts, not {self.num_layers}")
        if not self.parts:
            return
        object.__setattr__(self, "parts", tuple(self.parts))
        names = [p.name for p in self.parts]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"layout.parts: part {dup!r} is named twice")
        if len(self.parts) != self.num_layers:
            raise ValueError(f"layout.parts: {len(self.parts)} parts, but the bundle's fields say {self.num_layers}")
        total = sum(p.layout.page_bytes for p in self.parts)
        if total != self.head_dim:
            raise ValueError(f"layout.parts: the parts hold {total} bytes, but the bundle's fields say {self.head_dim}")
        if table_digest(self.parts) != self.num_kv_heads:
            raise ValueError("layout.parts: the part table does not match the bundle's digest of it")

    @classmethod
    def bundle(
        cls, parts: Mapping[str, PageLayout] | list[PagePart] | tuple[PagePart, ...], block_size: int = 1
    ) -> PageLayout:
        """The layout of a multi-part page: `parts` in order (a mapping name -> layout, or PageParts);
        `block_size` is the tokens a page covers (the hash contract's B, and what KV events report)."""
        items = tuple(PagePart(n, lay) for n, lay in parts.items()) if isinstance(parts, Mapping) else tuple(parts)
        if not items:
            raise ValueError("layout.parts: a bundle needs at least one part")
        total = sum(p.layout.page_bytes for p in items)
        if total > _U32_MAX:
            raise ValueError(f"layout.parts: {total} bytes is over a page's limit of 4 GiB")
        return cls(DType.UINT8, len(items), table_digest(items), total, block_size, PageEncoding.BUNDLE, items)

    @property
    def is_bundle(self) -> bool:
        return self.encoding is PageEncoding.BUNDLE

    @property
    def has_parts(self) -> bool:
        """A bundle whose part names and layouts are known (not only its packed digest)."""
        return bool(self.parts)

    @property
    def part_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parts)

    def part_spans(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, bytes) of each part inside the payload, in order."""
        out: dict[str, tuple[int, int]] = {}
        off = 0
        for p in self.parts:
            n = p.layout.page_bytes
            out[p.name] = (off, n)
            off += n
        return out

    def split(self, payload: memoryview | bytes) -> dict[str, memoryview]:
        """A bundle's payload as views of its parts (no copy); ValueError when its size is not the bundle's."""
        view = memoryview(payload).cast("B")
        if view.nbytes != self.page_bytes:
            raise ValueError(f"a {view.nbytes}-byte payload is not a page of {self.describe()}")
        return {name: view[off : off + n] for name, (off, n) in self.part_spans().items()}

    def part_table(self) -> bytes:
        """The parts as bytes (TCP frames): u8 count, then per part u8 name length | name | 20-byte layout."""
        return pack_part_table(self.parts)

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
        if self.encoding is PageEncoding.BUNDLE:
            return self.head_dim  # its parts' bytes, back to back (module docstring)
        return self.values_offset + _align(self.num_values, FP8_ALIGN)  # e4m3: one byte a value

    def with_encoding(self, encoding: PageEncoding | str) -> PageLayout:
        """The same shape and dtype in another encoding."""
        if self.is_bundle or PageEncoding.parse(encoding) is PageEncoding.BUNDLE:
            raise ValueError("with_encoding: a bundle is built with PageLayout.bundle, from its parts")
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
        if self.is_bundle:
            inner = ", ".join(f"{p.name}: {p.layout.describe()}" for p in self.parts) or f"{self.num_layers} parts"
            return f"bundle [{inner}] block={self.block_size} ({self.page_bytes} B/page)"
        enc = "" if self.encoding is PageEncoding.RAW else f" as {self.encoding.label}"
        return (
            f"{self.dtype.name.lower()}{enc} L={self.num_layers} kv_heads={self.num_kv_heads} "
            f"head_dim={self.head_dim} block={self.block_size} ({self.page_bytes} B/page)"
        )


def pack_part_table(parts: tuple[PagePart, ...] | list[PagePart]) -> bytes:
    """u8 count, then per part: u8 name length | name (UTF-8) | its layout's 20 packed bytes."""
    out = bytearray([len(parts)])
    for p in parts:
        name = p.name.encode()
        out += bytes([len(name)]) + name + p.layout.pack()
    return bytes(out)


def part_table_len(raw: bytes | memoryview) -> int:
    """The length of the part table that starts `raw` (pack_part_table's count and name lengths say it; what
    follows is not read); ValueError when `raw` ends before the table does."""
    if not len(raw):
        raise ValueError("empty part table")
    count, off = raw[0], 1
    for i in range(count):
        if off >= len(raw):
            raise ValueError(f"part table ends before part {i}")
        off += 1 + raw[off] + 20
    if off > len(raw):
        raise ValueError(f"part table ends inside part {count - 1}")
    return off


def unpack_part_table(raw: bytes | memoryview) -> tuple[PagePart, ...]:
    """Inverse of pack_part_table; ValueError naming what is malformed (the whole buffer must be the table)."""
    data = bytes(raw)
    if not data:
        raise ValueError("empty part table")
    count, off, parts = data[0], 1, []
    for i in range(count):
        if off >= len(data):
            raise ValueError(f"part table ends before part {i}")
        n = data[off]
        end = off + 1 + n + 20
        if end > len(data):
            raise ValueError(f"part table ends inside part {i}")
        try:
            name = data[off + 1 : off + 1 + n].decode()
        except UnicodeDecodeError:
            raise ValueError(f"part {i}: its name is not UTF-8") from None
        parts.append(PagePart(name, PageLayout.unpack(data[off + 1 + n : end])))
        off = end
    if off != len(data):
        raise ValueError(f"{len(data) - off} bytes after the part table's {count} parts")
    return tuple(parts)


def table_digest(parts: tuple[PagePart, ...] | list[PagePart]) -> int:
    """The 32-bit digest of a part table a bundle's packed form carries (never 0: a layout field is >= 1)."""
    return (xxhash.xxh3_64_intdigest(_TABLE_TAG + pack_part_table(parts)) & _U32_MAX) or 1


def bundle_difference(bound: PageLayout, sent: PageLayout) -> str | None:
    """What differs between two bundles' parts, naming the part (None: the same parts). Pure: the node's one rule
    for a Put's or a Get's bundle against its namespace's (kvstore/manager/state.py)."""
    have, want = bound.part_spans(), sent.part_spans()
    for i, p in enumerate(sent.parts):
        if p.name not in have:
            known = ", ".join(bound.part_names)
            return f"parts[{i}] {p.name!r}: the namespace has no part of that name (it holds {known})"
    for name in bound.part_names:
        if name not in want:
            return f"part {name!r} is missing: the namespace's pages hold it, and a bundle is stored and read whole"
    layouts = {p.name: p.layout for p in bound.parts}
    for i, p in enumerate(sent.parts):
        if layouts[p.name] != p.layout:
            return (
                f"parts[{i}] {p.name!r}: the namespace holds it as {layouts[p.name].describe()}, "
                f"this call sends {p.layout.describe()}"
            )
    if bound.part_names != sent.part_names:
        return f"parts: the namespace holds them in the order {', '.join(bound.part_names)}"
    return None
