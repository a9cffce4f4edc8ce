"""The fast torch attention backend: the reference, minus its copies and its Python loop.

`ReferenceBackend` (`attention.py`) attends request by request, copying every key and
value into a contiguous block first. On a CPU that copy, not the arithmetic, is most of a
decode step: a decode reads a whole context of keys for a single query. This backend
computes the same result in a few batched calls per layer:

* **Decodes read the pool in place** (float32/float64): a `SparseDecodeGroup`. The page
  table, spelled out slot by slot, becomes the sparsity pattern of a sparse matrix, and
  attention becomes two sparse-dense products that touch each key and value once, where
  it lies.
* **Prefills (and decodes in other dtypes) are padded into one batch**: a `PaddedGroup`.
  Their pages are gathered a page at a time into a reused workspace and one SDPA call
  attends them all with a mask. The copy is small next to the attention of many queries.

Decodes and prefills are padded separately, so a step that mixes a 512-token prefill
chunk with many decodes doesn't pad every decode to 512 queries. The workspace only
grows: allocating tens of megabytes afresh per layer would make the CPU's allocator map
and fault in new memory every time, which costs more than the copy itself.

What it buys, measured on a 2-core CPU in float32 with one thread (the `qwen3-cpu`
benchmark shape, `bench.py --attention-backend reference|torch`): a decode step of 64
requests with 256 tokens of context took 84 ms here against 235 ms with the reference
(2.8×), and a 16-request run with 256-512-token prompts generated 1.8× more tokens per
second.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoqwen.attention import AttentionBackend, AttentionMetadata
from nanoqwen.kv_pool import KVPool


@dataclass
class PaddedGroup:
    """Requests attended by one SDPA call on copies of their pages: queries padded to
    `[B, max_q]`, keys and values to whole pages."""

    query_rows: torch.Tensor  # [B, max_q] the row of q each padded query reads
    kv_pages: torch.Tensor  # [B, max_pages] each request's pages, padded with its last one
    mask: torch.Tensor  # [B, 1, max_q, max_kv] causal by position, hiding padding
    real_queries: torch.Tensor  # [n] which padded queries (flattened) are real tokens
    output_rows: torch.Tensor  # [n] the output row each real query fills


@dataclass
class SparseDecodeGroup:
    """Decodes attended straight from the pool, as two sparse matrix products.

    Flatten a layer's keys to a `[num_slots * kv_heads, D]` matrix `K`: row
    `slot * kv_heads + h` is slot `slot` of KV head `h`. Give every (request, query head)
    one row of a sparse matrix whose nonzero columns are the rows of `K` that query may
    see: its request's slots, in its head's KV head. Then the scores are `Q @ K.T` sampled
    at those nonzeros only (`torch.sparse.sampled_addmm`), and after a softmax along each
    row the output is `weights @ V` (`embedding_bag`: per row, a weighted sum of the
    selected rows of `V`). Both read the pool's pages where they lie, so nothing is
    copied; the CSR pattern is the page table spelled out slot by slot.
    """

    query_rows: torch.Tensor  # [B] the row of q (and of the output) of each request
    pattern: torch.Tensor  # sparse CSR [B * heads, num_slots * kv_heads]; its values unused
    dense_index: torch.Tensor  # [nnz] each nonzero's place in a flat [B * heads, max_kv]
    # Each layer's scores, scattered to [B * heads, max_kv] for the softmax. Only real
    # entries are overwritten per layer, so the padding stays -inf for the whole step.
    dense_scores: torch.Tensor


# torch multiplies sparse CSR matrices with a sampled dense product in these dtypes only.
SPARSE_DTYPES = (torch.float32, torch.float64)


class TorchBackend(AttentionBackend):
    """Batched attention in plain torch; runs anywhere (see the module docstring).

    `plan` turns the CSR page table into index tensors once per step, for up to two groups
    of requests, and `forward` attends each group its own way.
    """

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(pool, num_heads, num_kv_heads, head_dim)
        self.sparse_decodes = pool.kv.dtype in SPARSE_DTYPES
        self.key_workspace = self.value_workspace = pool.kv.new_empty(0)

    def plan(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        page_size = self.pool.page_size
        qo_indptr = metadata.on_host("qo_indptr")
        kv_indptr = metadata.on_host("kv_indptr")
        last_page_len = metadata.on_host("kv_last_page_len")
        q_lens = _lengths(qo_indptr)
        kv_lens = (_lengths(kv_indptr) - 1) * page_size + last_page_len
        is_decode = q_lens == 1
        decodes, prefills = is_decode.nonzero().flatten(), (~is_decode).nonzero().flatten()
        q_starts = qo_indptr[:-1]
        self.groups: list[PaddedGroup | SparseDecodeGroup] = []
        for requests, sparse in ((decodes, self.sparse_decodes), (prefills, False)):
            if not requests.numel():
                continue
            if sparse:
                self.groups.append(self._plan_sparse(metadata, requests, q_starts, kv_lens))
            else:
                group = self._plan_padded(metadata, requests, q_starts, q_lens, kv_lens)
                self.groups.append(group)
        padded_pages = [g.kv_pages.numel() for g in self.groups if isinstance(g, PaddedGroup)]
        self._reserve_workspace(max(padded_pages, default=0))

    def _reserve_workspace(self, num_pages: int) -> None:
        page_shape = self.pool.layer_cache(0)[0].shape[1:]
        if self.key_workspace.shape[0] < num_pages:
            self.key_workspace = self.pool.kv.new_empty(num_pages, *page_shape)
            self.value_workspace = self.pool.kv.new_empty(num_pages, *page_shape)

    def _page_table(
        self, metadata: AttentionMetadata, requests: torch.Tensor, max_kv: int
    ) -> torch.Tensor:
        """The pages of `requests` (device indices) as a `[B, max_pages]` table, each row
        padded with its request's last page."""
        device = metadata.kv_indices.device
        max_pages = -(-max_kv // self.pool.page_size)
        page_index = metadata.kv_indptr[requests, None] + torch.arange(max_pages, device=device)
        last_page = (metadata.kv_indptr[requests + 1] - 1)[:, None]
        return metadata.kv_indices[torch.minimum(page_index, last_page)].long()

    def _plan_sparse(
        self,
        metadata: AttentionMetadata,
        requests: torch.Tensor,
        q_starts: torch.Tensor,
        kv_lens: torch.Tensor,
    ) -> SparseDecodeGroup:
        """The sparse pattern of decode `requests` (host indices into the batch)."""
        page_size, device = self.pool.page_size, metadata.kv_indices.device
        kv_lens = kv_lens[requests]
        max_kv = int(kv_lens.max())
        pages = self._page_table(metadata, requests.to(device, non_blocking=True), max_kv)

        # One row per (request, query head), padded to max_kv columns: the slot holding
        # each of the request's positions, as a row of K in the head's KV head.
        position = torch.arange(max_kv, device=device)
        slots = pages[:, position // page_size] * page_size + position % page_size
        group_size = self.num_heads // self.num_kv_heads
        kv_head = torch.arange(self.num_heads, device=device) // group_size
        columns = slots[:, None, :] * self.num_kv_heads + kv_head[:, None]  # [B, heads, max_kv]
        in_bounds = position < kv_lens.to(device, non_blocking=True)[:, None]
        dense_index = in_bounds[:, None, :].expand_as(columns).flatten().nonzero().flatten()

        row_lengths = kv_lens.repeat_interleave(self.num_heads)
        crow = torch.cat([row_lengths.new_zeros(1), row_lengths.cumsum(0)]).to(device)
        col = columns.flatten()[dense_index]
        num_keys = self.pool.layer_cache(0)[0].numel() // self.head_dim
        pattern = _csr_matrix(
            crow, col, self.pool.kv.new_zeros(col.numel()), (crow.numel() - 1, num_keys)
        )
        return SparseDecodeGroup(
            query_rows=q_starts[requests].long().to(device, non_blocking=True),
            pattern=pattern,
            dense_index=dense_index,
            dense_scores=self.pool.kv.new_full((crow.numel() - 1, max_kv), float("-inf")),
        )

    def _plan_padded(
        self,
        metadata: AttentionMetadata,
        requests: torch.Tensor,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        kv_lens: torch.Tensor,
    ) -> PaddedGroup:
        """Index tensors for `requests` (host indices into the batch, whose host-side query
        starts, query lengths and KV lengths are given)."""
        page_size, device = self.pool.page_size, metadata.kv_indices.device
        q_start, q_lens, kv_lens = q_starts[requests], q_lens[requests], kv_lens[requests]
        max_q, max_kv = int(q_lens.max()), int(kv_lens.max())

        # Keys are gathered a page at a time (one contiguous block each), so a request's
        # keys span whole pages and the mask hides the slots past its length.
        kv_pages = self._page_table(metadata, requests.to(device, non_blocking=True), max_kv)
        kv_pos = torch.arange(kv_pages.shape[1] * page_size, device=device)

        # Query j of request b is row qo_start + j of q, at position kv_len - q_len + j; it
        # sees the keys at or before its position. Padding queries reuse the first row.
        query_offset = torch.arange(max_q)
        is_real = query_offset[None, :] < q_lens[:, None]
        query_rows = torch.where(is_real, q_start[:, None] + query_offset, q_start[:, None])
        q_pos = (kv_lens - q_lens)[:, None] + query_offset
        q_pos, kv_lens = q_pos.to(device, non_blocking=True), kv_lens.to(device, non_blocking=True)
        causal = kv_pos[None, None, :] <= q_pos[:, :, None]
        in_bounds = (kv_pos[None, :] < kv_lens[:, None])[:, None, :]
        return PaddedGroup(
            query_rows=query_rows.to(device, non_blocking=True),
            kv_pages=kv_pages,
            mask=(causal & in_bounds)[:, None],
            real_queries=is_real.flatten().nonzero().flatten().to(device, non_blocking=True),
            output_rows=query_rows[is_real].to(device, non_blocking=True),
        )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.write_kv(layer, k, v, self.metadata.slot_mapping)
        k_cache, v_cache = self.pool.layer_cache(layer)
        out = torch.empty_like(q)
        for group in self.groups:
            if isinstance(group, SparseDecodeGroup):
                self._attend_sparse(group, q, k_cache, v_cache, out)
            else:
                self._attend_padded(group, q, k_cache, v_cache, out)
        return out

    def _attend_sparse(
        self,
        group: SparseDecodeGroup,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        queries = q.index_select(0, group.query_rows).view(-1, self.head_dim)  # [B*heads, D]
        keys, values = k_cache.view(-1, self.head_dim), v_cache.view(-1, self.head_dim)
        scores = torch.sparse.sampled_addmm(
            group.pattern, queries, keys.t(), beta=0.0, alpha=self.head_dim**-0.5
        ).values()
        # Softmax along each row: scatter the scores into a dense matrix padded with -inf,
        # where a row-wise softmax is one call, and read the weights back.
        dense = group.dense_scores
        dense.view(-1).index_copy_(0, group.dense_index, scores)
        weights = dense.softmax(dim=-1).view(-1).index_select(0, group.dense_index)
        attended = F.embedding_bag(
            group.pattern.col_indices(), values, group.pattern.crow_indices()[:-1],
            mode="sum", per_sample_weights=weights,
        )  # [B*heads, D]
        out.index_copy_(0, group.query_rows, attended.view(-1, self.num_heads, self.head_dim))

    def _attend_padded(
        self,
        group: PaddedGroup,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        keys = _gather_pages(k_cache, group.kv_pages, self.key_workspace)
        values = _gather_pages(v_cache, group.kv_pages, self.value_workspace)
        queries = q[group.query_rows].transpose(1, 2)  # [B, heads, max_q, D]
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=group.mask, enable_gqa=True
        )
        attended = attended.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
        out.index_copy_(0, group.output_rows, attended[group.real_queries])


def _csr_matrix(
    crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...]
) -> torch.Tensor:
    """A sparse CSR matrix from indices the backend built itself (so unchecked)."""
    with warnings.catch_warnings():
        # torch warns, once per process, that its sparse CSR support is in beta.
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor:
    """Pages `[B, P]` of a `[num_pages, page_size, kv_heads, D]` cache, copied into the
    front of `workspace` and viewed as `[B, kv_heads, P * page_size, D]`.

    Each page is one contiguous block, so this is one block copy per page.
    """
    batch, num_pages = pages.shape
    gathered = torch.index_select(cache, 0, pages.flatten(), out=workspace[: batch * num_pages])
    return gathered.view(batch, num_pages * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def _lengths(indptr: torch.Tensor) -> torch.Tensor:
    return (indptr[1:] - indptr[:-1]).long()
