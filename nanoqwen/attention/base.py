"""Attention over a paged KV cache: one metadata format, one interface, one reference.

A step's keys and values are scattered over pages of the KV cache (`memory/kv_cache.py`),
and its requests are ragged. Every backend reads one description of the step,
flashinfer's CSR page table, for `B` requests and `T` new tokens:

* `qo_indptr[B+1]`: request `b`'s new tokens are rows `qo_indptr[b]:qo_indptr[b+1]`;
* `kv_indptr[B+1]`, `kv_indices`: its pages are `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`;
* `kv_last_page_len[B]`: slots filled in its last page (1..page_size), this step's tokens
  included, so its KV length is `(num_pages - 1) * page_size + last`;
* `positions[T]` (for RoPE) and `slot_mapping[T]` (where each new K/V is written).

A decode, a prefill chunk and a prefill after a prefix hit are all a request whose last
`q_len` tokens are new and attend causally to everything before them. A backend plans once
per step (`plan`), then attends once per layer (`forward`: write the new K/V, attend).
`ReferenceBackend` below is the textbook one; the others (`torch_backend.py`,
`flashinfer_backend.py`) compute the same thing faster, and `registry.py` picks one.

Invariant: every backend computes the same causal attention from the same metadata; the
tests hold the torch backend and flashinfer to the reference. The story:
docs/learn/04-attention-backends.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoqwen.memory.kv_cache import KVCache


@dataclass(frozen=True)
class AttentionShape:
    """What the KV cache and an attention backend must know of a model: its layers with
    K/V and, on this rank when the model is split, its query and KV heads."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


# The page table's tensors on the device (what a CUDA graph keeps in static buffers).
PAGE_TABLE_TENSORS = (
    "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "positions", "slot_mapping"
)


@dataclass
class AttentionMetadata:
    """The page table of one step, on the model's device (see the module docstring)."""

    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int32 [num_pages_in_batch]
    kv_last_page_len: torch.Tensor  # int32 [B]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    # Host-side sizes, so backends can shape their buffers without asking the device.
    max_q_len: int
    max_kv_len: int
    # The same CSR arrays on the host (pinned on CUDA): backends plan from these, sparing a
    # device-to-host wait.
    qo_indptr_host: torch.Tensor
    kv_indptr_host: torch.Tensor
    kv_last_page_len_host: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.kv_last_page_len.shape[0]

    def q_lens(self) -> torch.Tensor:
        return self.qo_indptr[1:] - self.qo_indptr[:-1]


class AttentionBackend(ABC):
    """Plan once per step from the page table, then attend once per layer."""

    # Can a decode step's kernels be recorded in a CUDA graph? Only if `plan` writes the
    # step's page table into buffers that stay put (see `runner/cuda_graph.py`).
    supports_cuda_graphs = False
    # Does it read a quantized cache's scales per (token, KV head)? Else one per tensor.
    per_vector_kv_scales = True

    def __init__(self, kv_cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @classmethod
    def step_memory(
        cls, shape: AttentionShape, page_size: int, dtype: torch.dtype, kv_dtype: torch.dtype,
        q_lens: list[int], kv_lens: list[int], num_graph_buckets: int = 0,
    ) -> int | None:
        """At most how many bytes this backend allocates beside the KV cache for a model of
        `shape` (one rank's heads) to run a step of these query and KV lengths, its kept
        buffers included (with `num_graph_buckets` decode graphs' plans); None where that
        is not known."""
        return None

    @abstractmethod
    def plan(self, metadata: AttentionMetadata) -> None: ...

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q `[T, heads, dim]`, k and v `[T, kv_heads, dim]` → output `[T, heads, dim]`."""

    def bind_graph_buffers(
        self,
        batch_size: int,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
    ) -> None:
        """Plan decode steps of `batch_size` requests into these fixed page-table buffers
        (called once per CUDA-graph bucket, before capture)."""
        raise NotImplementedError(f"{type(self).__name__} cannot run inside a CUDA graph")


class ReferenceBackend(AttentionBackend):
    """Attention as a textbook writes it, one request at a time, and the oracle.

    For each request: read its pages into one contiguous `[kv_len, kv_heads, dim]` block,
    and let its new queries attend causally over it with SDPA. Query `j` of a request with
    `q_len` new tokens sits at position `kv_len - q_len + j`, so it sees keys `0..` that
    position. Simple and exact; a loop in Python per request, and a copy of every key.
    """

    def plan(self, metadata: AttentionMetadata) -> None:
        self.slots = metadata.slot_mapping
        page_size, pages = self.kv_cache.page_size, metadata.kv_indices.long()
        qo_indptr = metadata.qo_indptr_host.tolist()
        kv_indptr = metadata.kv_indptr_host.tolist()
        last_page_len = metadata.kv_last_page_len_host.tolist()
        self.requests = []  # (its query rows, its pages, its KV length)
        for b, last in enumerate(last_page_len):
            num_pages = kv_indptr[b + 1] - kv_indptr[b]
            self.requests.append((slice(qo_indptr[b], qo_indptr[b + 1]),
                                  pages[kv_indptr[b] : kv_indptr[b + 1]],
                                  (num_pages - 1) * page_size + last))

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.kv_cache.write(layer, k, v, self.slots)
        out = torch.empty_like(q)
        for rows, pages, kv_len in self.requests:
            # [kv_len, kv_heads, dim]
            keys = self.kv_cache.gather(layer, 0, pages).flatten(0, 1)[:kv_len]
            values = self.kv_cache.gather(layer, 1, pages).flatten(0, 1)[:kv_len]
            queries = q[rows]  # [q_len, heads, dim]
            q_positions = torch.arange(kv_len - len(queries), kv_len, device=q.device)
            causal = torch.arange(kv_len, device=q.device) <= q_positions[:, None]
            attended = F.scaled_dot_product_attention(
                queries.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=causal, enable_gqa=True,
            )
            out[rows] = attended.transpose(0, 1)
        return out
