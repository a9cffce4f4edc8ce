"""The KV cache on the device: every layer's keys and values, in pages, in one tensor.

`kv[layer, 0 or 1 (K or V), page, slot, kv_head, head_dim]`, allocated once at start-up.
Which page belongs to which request is the host's business (`page_allocator.py`); this
module only stores and reads: `write` puts a step's new keys and values into their flat
slots (`page * page_size + slot`), `gather` reads whole pages back, and `layer_cache` gives
kernels that read pages themselves (flashinfer, the torch backend's sparse decodes) the
layer's tensors. Other ranks of a split model, and a second model keeping K/V for the same
tokens, have caches of their own with the same pages and no allocator. A cache that stores
one byte per number is `kv_quant.py`'s `QuantizedKVCache`.

Invariant: the cache decides nothing: a slot holds what the last `write` to it stored,
and only the host's page tables say whose it is. The story: docs/learn/03-paged-kv-cache.md.
"""

from __future__ import annotations

import torch

# The one-byte storage types of a quantized cache (`kv_quant.py`).
ONE_BYTE_DTYPES = (torch.int8, torch.float8_e4m3fn)


class KVCache:
    is_quantized = False

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device,
        storage_dtype: torch.dtype | None = None,  # what pages are stored in (default: dtype)
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages (one is scratch), got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype  # what attention reads and writes
        self.shape = (num_layers, 2, num_pages, page_size, num_kv_heads)
        self.kv = torch.zeros(*self.shape, head_dim, dtype=storage_dtype or dtype, device=device)
        self.scales: torch.Tensor | None = None

    @staticmethod
    def bytes_per_page(
        num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
        per_vector_scales: bool = True,
    ) -> int:
        """Bytes of one page stored in `dtype`, a one-byte cache's scales included."""
        scale_bytes = 4 if dtype in ONE_BYTE_DTYPES and per_vector_scales else 0
        return 2 * num_layers * page_size * num_kv_heads * (head_dim * dtype.itemsize + scale_bytes)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V caches, each `[num_pages, page_size, kv_heads, head_dim]`."""
        return self.kv[layer, 0], self.kv[layer, 1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store keys and values `[T, kv_heads, dim]` in the flat pool slots `slots` `[T]`."""
        self.kv[layer, 0].flatten(0, 1).index_copy_(0, slots, k)
        self.kv[layer, 1].flatten(0, 1).index_copy_(0, slots, v)

    def gather(
        self, layer: int, kind: int, pages: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pages `[n]` of this layer's keys (`kind` 0) or values (1), `[n, page_size,
        kv_heads, dim]` in `self.dtype`: written into the front of `out` when given."""
        return torch.index_select(self.kv[layer, kind], 0, pages,
                                  out=None if out is None else out[: pages.numel()])
