"""A KV cache that stores one byte per number: twice the pages of bfloat16 in the same memory.

A quantized cache ("int8" or "fp8_e4m3") stores each number as a one-byte code with a
float32 scale per (token, KV head) in `scales[layer, 0 or 1, page, slot, kv_head]`: the
vector is about `code * scale`, its largest magnitude mapped to the code type's largest.
`write` quantizes, `gather` dequantizes. flashinfer takes one scale per tensor instead, so
such a cache (`per_vector_scales=False`) keeps no scales and stores numbers at scale 1,
clamped to fp8's ±448 (casting a larger value is undefined on some torch versions).

Invariant: `gather` of a page returns, for every vector `write` stored there, its codes
times its scale: within half a code step of the vector written. The story:
docs/learn/14-quantization.md.
"""

from __future__ import annotations

import torch

from nanoqwen.memory.kv_cache import KVCache

# The largest magnitude each one-byte storage type holds.
QUANTIZED_DTYPES = {torch.int8: 127.0, torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max}
SCALE_DTYPE = torch.float32
# The scale of every number in a cache without per-vector scales (see above).
TENSOR_SCALE = 1.0


class QuantizedKVCache(KVCache):
    is_quantized = True
    tensor_scale = TENSOR_SCALE  # what a cache without per-vector scales stores numbers at

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, num_pages: int,
        dtype: torch.dtype, device: torch.device, storage_dtype: torch.dtype,
        per_vector_scales: bool = True,
    ) -> None:
        if storage_dtype == torch.int8 and not per_vector_scales:
            raise ValueError("an int8 KV cache needs a scale per vector: integers at scale 1 lose all")
        super().__init__(num_layers, num_kv_heads, head_dim, page_size, num_pages, dtype, device,
                         storage_dtype)
        if per_vector_scales:
            self.scales = torch.zeros(self.shape, dtype=SCALE_DTYPE, device=device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        for kind, vectors in enumerate((k, v)):
            if self.scales is None:  # at TENSOR_SCALE, saturating at the code type's largest
                largest = QUANTIZED_DTYPES[self.kv.dtype]
                codes = vectors.clamp(-largest, largest).to(self.kv.dtype)
            else:
                codes, scales = quantize(vectors, self.kv.dtype)
                self.scales[layer, kind].flatten(0, 1).index_copy_(0, slots, scales)
            # As raw bytes: the CPU has no index_copy_ for float8.
            cache = self.kv[layer, kind].flatten(0, 1)
            cache.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))

    def gather(
        self, layer: int, kind: int, pages: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        codes = self.kv[layer, kind][pages]
        if self.scales is None:
            values = codes.to(self.dtype)  # at TENSOR_SCALE, 1
        else:
            values = dequantize(codes, self.scales[layer, kind][pages], self.dtype)
        return values if out is None else out[: pages.numel()].copy_(values)


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
