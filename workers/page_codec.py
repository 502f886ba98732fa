"""Page encodings on the workers' side: encode the model's pages for a Put, decode fetched pages.

A worker's model holds its KV in its own dtype; the cache stores pages in the deployment's encoding
(kvstore/layout.py, `PageEncoding`):

- `raw`: the pages' bytes as they are (exact both ways).
- `fp8-e4m3`: `kernels.quantize_fp8` writes straight into packed pages (scales, then e4m3 values, at the
  offsets the layout gives) on the pages' device, the CUDA kernel on a GPU and the torch reference on
  CPU; only the packed, half-size bytes then cross to the host. Decoding moves the packed bytes to the
  model's device first (half the transfer) and dequantizes there with `kernels.dequantize_fp8`. A
  decoded value is within the bound of kernels/README.md ("Numerics") of the original. Pages holding NaN
  or inf are refused when encoded, and stored pages whose scales are not finite when decoded
  (`kernels.NonFiniteKV`, which names the first such page: the pages before it are usable).

Invariant: `encode` then `decode` gives the input exactly for raw, within that bound for fp8, and the
bytes `encode` produces are a function of the pages alone (padding is zero), so equal pages give equal
bytes and checksums on every worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

import kernels
from kvstore.layout import PageEncoding, PageLayout
from workers.paged_cache import Buffer, torch_dtype

__all__ = ["PageCodec"]


class PageCodec:
    """Encodes pages `[n, *layout.page_shape]` of a model's raw layout into the bytes of `stored`, and back."""

    def __init__(self, layout: PageLayout, encoding: PageEncoding | str = PageEncoding.RAW) -> None:
        if layout.encoding is not PageEncoding.RAW:
            raise ValueError(f"layout must be the model's raw layout, got {layout.describe()}")
        self.layout = layout
        self.stored = layout.with_encoding(PageEncoding.parse(encoding))
        self.dtype = torch_dtype(layout.dtype)

    @property
    def encoding(self) -> PageEncoding:
        return self.stored.encoding

    def encode(self, pages: torch.Tensor) -> torch.Tensor:
        """uint8 `[n, stored.page_bytes]` in host memory, contiguous: one row per page."""
        self._check_pages(pages)
        n = pages.shape[0]
        if self.encoding is PageEncoding.RAW:
            return pages.detach().contiguous().view(torch.uint8).reshape(n, -1).cpu()
        # NOTE: zeros, not empty: the padding between and after the parts is part of the payload, and
        # must not depend on what the allocator left there (checksums, dedup of equal pages).
        packed = torch.zeros((n, self.stored.page_bytes), dtype=torch.uint8, device=pages.device)
        q, scales = self._views(packed)
        kernels.quantize_fp8(pages.detach().contiguous(), out=q, out_scales=scales)
        return packed.cpu()

    def encode_buffers(self, pages: torch.Tensor) -> list[memoryview]:
        """One read-only byte view per encoded page (for `put`)."""
        rows = self.encode(pages).numpy()
        return [memoryview(row).toreadonly() for row in rows]

    def decode(self, buffers: Sequence[Buffer], device: torch.device | str = "cpu") -> torch.Tensor:
        """Pages `[len(buffers), *layout.page_shape]` in the model's dtype on `device`."""
        size = self.stored.page_bytes
        rows = []
        for i, buf in enumerate(buffers):
            view = memoryview(buf).cast("B")
            if view.nbytes != size:
                raise ValueError(f"page {i} is {view.nbytes} bytes; layout {self.stored.describe()} needs {size}")
            rows.append(np.frombuffer(view, dtype=np.uint8))
        # One copy into a fresh host tensor (the received buffers may be read-only or reused), then one
        # transfer of the stored bytes to the device: for fp8 half of what the raw pages would move.
        packed = torch.from_numpy(np.stack(rows)) if rows else torch.empty((0, size), dtype=torch.uint8)
        return self.decode_tensor(packed.to(device))

    def decode_tensor(self, packed: torch.Tensor) -> torch.Tensor:
        """`decode` of uint8 `[n, stored.page_bytes]` already on the target device."""
        if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != self.stored.page_bytes:
            raise ValueError(
                f"packed pages must be uint8 [n, {self.stored.page_bytes}], got {packed.dtype} {tuple(packed.shape)}"
            )
        n = packed.shape[0]
        if self.encoding is PageEncoding.RAW:
            return packed.contiguous().view(self.dtype).reshape(n, *self.layout.page_shape)
        q, scales = self._views(packed.contiguous())
        return kernels.dequantize_fp8(q, scales, self.dtype)

    def _views(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values e4m3 [n, *page_shape], scales fp32 [n, *scales_shape]): views into packed pages."""
        s, n = self.stored, packed.shape[0]
        q = packed[:, s.values_offset : s.values_offset + s.num_values].view(torch.float8_e4m3fn)
        scales = packed[:, : s.scales_bytes].view(torch.float32)
        return q.view(n, *s.page_shape), scales.view(n, *s.scales_shape)

    def _check_pages(self, pages: torch.Tensor) -> None:
        if not isinstance(pages, torch.Tensor):
            raise TypeError(f"pages must be a torch.Tensor, got {type(pages).__name__}")
        if pages.dim() != 6 or tuple(pages.shape[1:]) != self.layout.page_shape:
            raise ValueError(
                f"pages has shape {tuple(pages.shape)}; expected [n, *{self.layout.page_shape}] "
                f"({self.layout.describe()})"
            )
        if pages.dtype != self.dtype:
            raise TypeError(f"pages have dtype {pages.dtype}; the layout's is {self.dtype}")
