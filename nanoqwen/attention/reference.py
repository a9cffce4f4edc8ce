"""The textbook attention backend, and the oracle the fast ones are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoqwen.attention.base import AttentionBackend, AttentionMetadata


class ReferenceBackend(AttentionBackend):
    """Attention as a textbook writes it, one request at a time.

    For each request: read its pages into one contiguous `[kv_len, kv_heads, dim]` block,
    and let its new queries attend causally over it with SDPA. Query `j` of a request with
    `q_len` new tokens sits at position `kv_len - q_len + j`, so it sees keys `0..` that
    position. Simple and exact; a loop in Python per request, and a copy of every key
    (dequantized, from a quantized cache).
    """

    def plan(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        page_size = self.kv_cache.page_size
        qo_indptr = metadata.on_host("qo_indptr").tolist()
        kv_indptr = metadata.on_host("kv_indptr").tolist()
        last_page_len = metadata.on_host("kv_last_page_len").tolist()
        self.requests = [
            (
                slice(qo_indptr[b], qo_indptr[b + 1]),
                metadata.kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long(),
                (kv_indptr[b + 1] - kv_indptr[b] - 1) * page_size + last_page_len[b],
            )
            for b in range(len(last_page_len))
        ]

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.write_kv(layer, k, v, self.metadata.slot_mapping)
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
