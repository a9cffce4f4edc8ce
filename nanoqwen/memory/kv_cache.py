"""The KV cache on the device: every layer's keys and values, in pages, in one tensor.

`kv[layer, 0 or 1 (K or V), page, slot, kv_head, head_dim]`, allocated once at start-up.
Which page belongs to which request is the host's business (`page_allocator.py`); this
module only stores and reads: `write` puts a step's new keys and values into their flat
slots (`page * page_size + slot`), `gather` reads whole pages back, and `layer_cache` gives
kernels that read pages themselves (flashinfer, the torch backend's sparse decodes) the
layer's tensors. Other ranks of a split model, and a second model keeping K/V for the same
tokens, have caches of their own with the same pages and no allocator.

A quantized cache ("int8" or "fp8_e4m3") stores one byte per number with a float32 scale
per (token, KV head) in `scales[layer, 0 or 1, page, slot, kv_head]`: the vector is about
`code * scale`, its largest magnitude mapped to the code type's largest. `write`
quantizes, `gather` dequantizes. flashinfer takes one scale per tensor instead, so such a
cache (`per_vector_scales=False`) keeps no scales and stores numbers at scale 1,
saturating at fp8's ±448.

Invariant: the cache decides nothing: a slot holds what the last `write` to it stored,
and only the host's page tables say whose it is. The story: docs/learn/03-paged-kv-cache.md
and docs/learn/12-quantization.md.
"""

from __future__ import annotations

import torch

# The one-byte storage types of a quantized cache, and the largest magnitude each holds.
QUANTIZED_DTYPES = {torch.int8: 127.0, torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max}
SCALE_DTYPE = torch.float32
# The scale of every number in a cache without per-vector scales (see above).
TENSOR_SCALE = 1.0


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device,
        storage_dtype: torch.dtype | None = None,  # int8 or float8_e4m3fn: quantized
        per_vector_scales: bool = True,  # else one scale per tensor, TENSOR_SCALE
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages (one is scratch), got {num_pages}")
        if storage_dtype == torch.int8 and not per_vector_scales:
            raise ValueError("an int8 KV cache needs a scale per vector: integers at scale 1 lose all")
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype  # what attention reads and writes
        shape = (num_layers, 2, num_pages, page_size, num_kv_heads)
        self.kv = torch.zeros(*shape, head_dim, dtype=storage_dtype or dtype, device=device)
        self.scales = (
            torch.zeros(shape, dtype=SCALE_DTYPE, device=device)
            if self.is_quantized and per_vector_scales
            else None
        )

    @staticmethod
    def bytes_per_page(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        per_vector_scales: bool = True,
    ) -> int:
        """Bytes of one page stored in `dtype`, its scales included when it is quantized."""
        has_scales = dtype in QUANTIZED_DTYPES and per_vector_scales
        scale_bytes = SCALE_DTYPE.itemsize if has_scales else 0
        return 2 * num_layers * page_size * num_kv_heads * (head_dim * dtype.itemsize + scale_bytes)

    @property
    def is_quantized(self) -> bool:
        return self.kv.dtype in QUANTIZED_DTYPES

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V caches, each `[num_pages, page_size, kv_heads, head_dim]`."""
        return self.kv[layer, 0], self.kv[layer, 1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store keys and values `[T, kv_heads, dim]` in the flat pool slots `slots` `[T]`."""
        for kind, vectors in enumerate((k, v)):
            cache = self.kv[layer, kind].flatten(0, 1)  # [num_slots, kv_heads, dim]
            if not self.is_quantized:
                cache.index_copy_(0, slots, vectors)
                continue
            if self.scales is None:
                codes = vectors.to(self.kv.dtype)  # at TENSOR_SCALE, 1; torch's cast saturates
            else:
                codes, scales = quantize(vectors, self.kv.dtype)
                self.scales[layer, kind].flatten(0, 1).index_copy_(0, slots, scales)
            # As raw bytes: the CPU has no index_copy_ for float8.
            cache.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))

    def gather(
        self, layer: int, kind: int, pages: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pages `[n]` of this layer's keys (`kind` 0) or values (1), `[n, page_size,
        kv_heads, dim]` in `self.dtype`: written into the front of `out` when given."""
        cache = self.kv[layer, kind]
        if out is not None:
            out = out[: pages.numel()]
        if not self.is_quantized:
            return torch.index_select(cache, 0, pages, out=out)
        if self.scales is None:
            values = cache[pages].to(self.dtype)  # at TENSOR_SCALE, 1
        else:
            values = dequantize(cache[pages], self.scales[layer, kind][pages], self.dtype)
        return values if out is None else out.copy_(values)

def quantize(vectors: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectors `[..., dim]` as codes in `dtype` and one float32 scale per vector `[...]`."""
    largest = vectors.abs().amax(dim=-1).to(SCALE_DTYPE)
    # An all-zero vector still gets a positive scale, so dividing by it stays finite.
    scales = largest.clamp(min=torch.finfo(SCALE_DTYPE).tiny) / QUANTIZED_DTYPES[dtype]
    scaled = vectors.to(SCALE_DTYPE) / scales[..., None]
    if dtype == torch.int8:
        scaled = scaled.round()  # float8 rounds to its nearest value by itself
    return scaled.to(dtype), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The vectors `quantize` turned into `codes` and `scales`, in `dtype`."""
    return (codes.to(SCALE_DTYPE) * scales[..., None]).to(dtype)
