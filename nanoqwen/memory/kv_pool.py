"""The paged KV pool: all attention keys and values live in one preallocated tensor.

A transformers model grows a fresh KV tensor per request and per step. A server cannot
afford that: requests come and go, lengths are unknown in advance, and allocating on
every step fragments memory. Instead, like an operating system's virtual memory, we cut
one big buffer into fixed-size *pages* of `page_size` token slots and give each request a
*page table*: the list of page numbers that hold its tokens, in order. Token `i` of a
request lives in page `pages[i // page_size]`, slot `i % page_size`.

Data structure: `kv[layer, 0 or 1 (K or V), page, slot, kv_head, head_dim]`, allocated
once; a free list of page numbers; a reference count per page. A page can have several
holders at once (two requests sharing a prompt prefix, or a request and the prefix
cache), so it returns to the free list only when its last holder releases it.

Page 0 is the *scratch page*: never handed out, it absorbs the writes of padding rows
when a decode batch is padded up to a CUDA-graph bucket.

The pool also counts the pages whose only holder is the prefix cache ("cached" pages,
the evictable ones), updating the count as references come and go, so that reading it
costs nothing however large the cache grows.

A *quantized* pool (`kv_cache_dtype` "int8" or "fp8_e4m3") stores every key and value
vector in one byte per number, with a float32 scale per (token, KV head) kept beside the
pages in `scales[layer, 0 or 1, page, slot, kv_head]`: the vector is about `code * scale`.
The scale maps the vector's largest magnitude to the code type's largest value, so each
vector keeps its own range. `write` quantizes as the keys and values are stored, `gather`
dequantizes the pages attention reads; a page costs a bit over a quarter of its float32
bytes (half its bfloat16 ones), so the same memory holds about four (two) times the pages.
flashinfer's kernels read fp8 pages themselves and take one scale per tensor instead (all
of a layer's keys, all its values): such a pool (`per_vector_scales=False`) keeps no
scales, and stores each number at scale 1, saturating at fp8's largest, ±448 (vLLM's
default too when a checkpoint ships no calibrated scales).

Invariant: a page is in the free list exactly when its reference count is 0.
"""

from __future__ import annotations

import torch

SCRATCH_PAGE = 0
# The one-byte storage types of a quantized pool, and the largest magnitude each holds.
QUANTIZED_DTYPES = {torch.int8: 127.0, torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max}
SCALE_DTYPE = torch.float32
# The scale of every number in a pool without per-vector scales (see above).
TENSOR_SCALE = 1.0


class KVPool:
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
            raise ValueError(f"the KV pool needs at least 2 pages (one is scratch), got {num_pages}")
        if storage_dtype == torch.int8 and not per_vector_scales:
            raise ValueError("an int8 KV pool needs a scale per vector: integers at scale 1 lose all")
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
        self.ref_counts = [0] * num_pages
        self.in_cache = [False] * num_pages  # does the prefix cache hold a reference?
        self.num_cache_only_pages = 0
        # Popping from the end hands out low page numbers first, which keeps tests readable.
        self.free_pages = list(range(num_pages - 1, SCRATCH_PAGE, -1))

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

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

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

    def allocate(self, count: int) -> list[int]:
        """Take `count` free pages, each with one holder (the caller)."""
        if count > len(self.free_pages):
            raise RuntimeError(f"asked for {count} pages, only {len(self.free_pages)} free")
        pages = [self.free_pages.pop() for _ in range(count)]
        for page in pages:
            self.ref_counts[page] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        """Add one holder to each page (it must already be held by someone)."""
        for page in pages:
            assert self.ref_counts[page] > 0, f"retain of free page {page}"
            self._add_holder(page)

    def release(self, pages: list[int]) -> None:
        """Drop one holder from each page; pages nobody holds go back to the free list."""
        for page in pages:
            assert self.ref_counts[page] > 0, f"release of free page {page}"
            self._drop_holder(page)

    def cache_retain(self, pages: list[int]) -> None:
        """The prefix cache becomes a holder of these pages."""
        for page in pages:
            assert not self.in_cache[page], f"page {page} is cached twice"
            self._add_holder(page)
            self.in_cache[page] = True
            self.num_cache_only_pages += self.ref_counts[page] == 1

    def cache_release(self, pages: list[int]) -> None:
        """The prefix cache lets go of these pages."""
        for page in pages:
            assert self.in_cache[page], f"page {page} is not cached"
            self.num_cache_only_pages -= self.ref_counts[page] == 1
            self.in_cache[page] = False
            self._drop_holder(page)

    def _add_holder(self, page: int) -> None:
        self.ref_counts[page] += 1
        if self.ref_counts[page] == 2 and self.in_cache[page]:
            self.num_cache_only_pages -= 1  # a request now uses a cached page

    def _drop_holder(self, page: int) -> None:
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 1 and self.in_cache[page]:
            self.num_cache_only_pages += 1  # the last request let go of a cached page
        elif self.ref_counts[page] == 0:
            self.free_pages.append(page)


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
