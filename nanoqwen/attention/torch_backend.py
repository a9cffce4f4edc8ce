"""The fast torch attention backend: the reference, minus its copies and its Python loop.

`ReferenceBackend` (`base.py`) attends request by request, copying every key and
value into a contiguous block first. On a CPU that copy, not the arithmetic, is most of a
decode step: a decode reads a whole context of keys for a single query. This backend
computes the same result with a few batched calls per layer, each kind of request its
own way:

* **Decodes read the KV cache where it lies**: a `SparseDecodeGroup`. The page table, spelled
  out slot by slot, becomes the sparsity pattern of a sparse matrix, and attention becomes
  two sparse-dense products that touch each key and value once. torch has those products
  in float32/float64 only, so a bfloat16 (or float16) cache first has the decodes' pages
  gathered, a page at a time, into a float32 workspace: scores and weights are computed
  in float32 from the exact low-precision values, and only the output is rounded.
* **Fresh prompts attend to their own new keys**: a prompt with nothing cached sees only
  this step's keys and values, so it needs no page at all. SDPA runs on its rows with
  `is_causal`, which also skips the masked half of the score matrix.
* **Prefills with cached keys are padded into batches**: `PaddedGroup`s (prompts
  continuing a chunk or hitting the prefix cache, rows verifying proposed tokens). Their
  pages are gathered into a reused workspace and one SDPA call per group attends them
  with a mask.

A quantized cache (`kv_cache_dtype` int8 or fp8, see `memory/kv_quant.py`) has no sparse product
in its storage type, so its decodes are padded too, in a group of their own: their pages
are gathered and dequantized like a continuing prefill's. Fresh prompts still attend their
own keys as computed, which are at hand before they are quantized.

Which request goes where, and how the padded ones are grouped and sliced so that no call
outgrows a fixed share of memory however large the step, is decided on the host from the
step's lengths alone (`torch_layout.py`), which also says what a step can need at most.

The workspaces only grow: allocating tens of megabytes afresh per layer would make the
CPU's allocator map and fault in new memory every time, which costs more than the copy.

What it buys against the reference, with the command that measures it:
docs/learn/04-attention-backends.md.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoqwen.attention.base import AttentionBackend, AttentionMetadata, AttentionShape
from nanoqwen.attention.torch_layout import (
    MAX_CALL_BYTES,
    AttentionCosts,
    PaddedSlice,
    lay_out,
    step_bytes,
)
from nanoqwen.memory.kv_cache import ONE_BYTE_DTYPES, KVCache

# torch multiplies sparse CSR matrices with a sampled dense product in these dtypes only.
SPARSE_DTYPES = (torch.float32, torch.float64)


@dataclass
class SparseDecodeGroup:
    """Decodes attended straight from the cache, as two sparse matrix products.

    Flatten a layer's keys to a `[num_slots * kv_heads, D]` matrix `K`: row
    `slot * kv_heads + h` is slot `slot` of KV head `h`. Give every (request, query head)
    one row of a sparse matrix whose nonzero columns are the rows of `K` that query may
    see: its request's slots, in its head's KV head. Then the scores are `Q @ K.T` sampled
    at those nonzeros only (`torch.sparse.sampled_addmm`), and after a softmax along each
    row the output is `weights @ V` (`embedding_bag`: per row, a weighted sum of the
    selected rows of `V`). Both read the keys and values where they lie, so nothing is
    copied; the CSR pattern is the page table spelled out slot by slot.
    """

    query_rows: torch.Tensor  # [B] the row of q (and of the output) of each request
    pattern: torch.Tensor  # sparse CSR [B * heads, num_slots * kv_heads]; values: the scores
    dense_index: torch.Tensor  # [nnz] each nonzero's place in a flat [B * heads, max_kv]
    # Each layer's scores, scattered to [B * heads, max_kv] for the softmax. Only real
    # entries are overwritten per layer, so the padding stays -inf for the whole step.
    dense_scores: torch.Tensor
    # Each nonzero's row of `V`: the cache's values are always read where they lie.
    value_columns: torch.Tensor  # [nnz]
    # Pool pages whose keys are gathered into a float32 copy first, whose slots `pattern`
    # then addresses; None when the cache's own dtype has the sampled product.
    gathered_pages: torch.Tensor | None


@dataclass
class PaddedGroup:
    """Requests attended by one SDPA call on copies of their pages: a range of their
    queries (all of them, unless one request is sliced), padded to `[B, max_q]`; keys and
    values padded to whole pages."""

    query_rows: torch.Tensor  # [B, max_q] the row of q each padded query reads
    kv_pages: torch.Tensor  # [B, max_pages] each request's pages, padded with its last one
    mask: torch.Tensor  # [B, 1, max_q, max_kv] causal by position, hiding padding
    real_queries: torch.Tensor  # [n] which padded queries (flattened) are real tokens
    output_rows: torch.Tensor  # [n] the output row each real query fills


class TorchBackend(AttentionBackend):
    """Batched attention in plain torch; runs anywhere (see the module docstring).

    `plan` lays the step out (`torch_layout.py`) and turns the CSR page table into index
    tensors once per step, and `forward` attends each kind of request its own way.
    """

    max_call_bytes = MAX_CALL_BYTES  # what one call may allocate (see `torch_layout.py`)

    def __init__(self, kv_cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim)
        num_layers = kv_cache.kv.shape[0]
        self.costs = attention_costs(
            AttentionShape(num_layers, num_heads, num_kv_heads, head_dim), kv_cache.page_size,
            kv_cache.dtype, kv_cache.kv.dtype,
        )
        # Gathered pages in the dtype attention computes in: keys (of decodes, then copied
        # to float32, or of padded groups) and values (of padded groups only).
        self.key_workspace = self.value_workspace = kv_cache.kv.new_empty(0, dtype=kv_cache.dtype)
        self.float_key_workspace = kv_cache.kv.new_empty(0, dtype=torch.float32)

    @classmethod
    def step_memory(
        cls, shape: AttentionShape, page_size: int, dtype: torch.dtype, kv_dtype: torch.dtype,
        q_lens: list[int], kv_lens: list[int], num_graph_buckets: int = 0,
    ) -> int:
        costs = attention_costs(shape, page_size, dtype, kv_dtype)
        return step_bytes(costs, q_lens, kv_lens, cls.max_call_bytes)

    def plan(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        page_size = self.kv_cache.page_size
        qo_indptr = metadata.qo_indptr_host
        kv_indptr = metadata.kv_indptr_host
        q_lens = _lengths(qo_indptr)
        kv_lens = (_lengths(kv_indptr) - 1) * page_size + metadata.kv_last_page_len_host
        layout = lay_out(self.costs, q_lens.tolist(), kv_lens.tolist(), self.max_call_bytes)
        q_starts = qo_indptr[:-1]
        self.fresh_rows = [
            slice(int(q_starts[b]), int(q_starts[b] + q_lens[b])) for b in layout.fresh
        ]
        self.decodes = None
        sparse_pages = 0
        if layout.sparse:
            decodes = torch.tensor(layout.sparse)
            self.decodes = self._plan_sparse(metadata, decodes, kv_lens)
            if self.decodes.gathered_pages is not None:
                sparse_pages = self.decodes.gathered_pages.numel()
        self.padded = [
            self._plan_padded(metadata, piece, q_starts, q_lens, kv_lens)
            for piece in layout.padded
        ]
        padded_pages = max((group.kv_pages.numel() for group in self.padded), default=0)
        self._reserve_workspaces(sparse_pages, padded_pages)

    def _reserve_workspaces(self, sparse_pages: int, padded_pages: int) -> None:
        """Room for the decodes' gathered keys (also in float32) and a padded group's keys
        and values: decodes read their values where they lie."""
        page_shape = self.kv_cache.layer_cache(0)[0].shape[1:]

        def at_least(workspace: torch.Tensor, num_pages: int) -> torch.Tensor:
            return workspace if workspace.shape[0] >= num_pages else workspace.new_empty(
                num_pages, *page_shape
            )

        self.key_workspace = at_least(self.key_workspace, max(sparse_pages, padded_pages))
        self.value_workspace = at_least(self.value_workspace, padded_pages)
        self.float_key_workspace = at_least(self.float_key_workspace, sparse_pages)

    def _plan_sparse(
        self, metadata: AttentionMetadata, decodes: torch.Tensor, kv_lens: torch.Tensor
    ) -> SparseDecodeGroup:
        """The sparse pattern of `decodes` (host indices into the batch)."""
        page_size, device = self.kv_cache.page_size, metadata.kv_indices.device
        kv_lens = kv_lens[decodes]
        max_kv = int(kv_lens.max())
        max_pages = -(-max_kv // page_size)
        rows = decodes.to(device, non_blocking=True)

        # One row per (request, query head), padded to max_kv columns: the slot holding
        # each of the request's positions, as a row of K in the head's KV head.
        position = torch.arange(max_kv, device=device)
        group_size = self.num_heads // self.num_kv_heads
        kv_head = torch.arange(self.num_heads, device=device) // group_size
        in_bounds = position < kv_lens.to(device, non_blocking=True)[:, None]
        dense_index = in_bounds[:, None, :].expand(-1, self.num_heads, -1).flatten()
        dense_index = dense_index.nonzero().flatten()

        def columns(pages: torch.Tensor) -> torch.Tensor:
            """Each nonzero's column, for the page table `pages` `[B, max_pages]`."""
            slots = pages[:, position // page_size] * page_size + position % page_size
            all_columns = slots[:, None, :] * self.num_kv_heads + kv_head[:, None]
            return all_columns.flatten()[dense_index]

        value_columns = columns(_page_table(metadata.kv_indptr, metadata.kv_indices, rows, max_pages))
        key_columns, num_key_pages, gathered_pages = value_columns, self.kv_cache.num_pages, None
        if self.costs.gathers_keys:
            # Gather the decodes' key pages, each once, and address the gathered copy: the
            # same page table, renumbered to the copy's pages 0, 1, 2, ...
            kv_indptr, entries = _select_rows(metadata.kv_indptr_host, decodes)
            gathered_pages = metadata.kv_indices[entries.to(device, non_blocking=True)].long()
            num_key_pages = gathered_pages.numel()
            copy_pages = _page_table(
                kv_indptr.to(device, non_blocking=True),
                torch.arange(num_key_pages, device=device),
                torch.arange(len(decodes), device=device),
                max_pages,
            )
            key_columns = columns(copy_pages)

        row_lengths = kv_lens.repeat_interleave(self.num_heads)
        crow = torch.cat([row_lengths.new_zeros(1), row_lengths.cumsum(0)]).to(device)
        num_rows = crow.numel() - 1
        dtype = torch.float32 if self.costs.gathers_keys else self.kv_cache.dtype
        num_key_rows = num_key_pages * page_size * self.num_kv_heads
        return SparseDecodeGroup(
            query_rows=metadata.qo_indptr[:-1][rows].long(),
            pattern=_csr_matrix(
                crow, key_columns, torch.zeros(key_columns.numel(), dtype=dtype, device=device),
                (num_rows, num_key_rows),
            ),
            value_columns=value_columns,
            dense_index=dense_index,
            dense_scores=torch.full((num_rows, max_kv), float("-inf"), dtype=dtype, device=device),
            gathered_pages=gathered_pages,
        )

    def _plan_padded(
        self,
        metadata: AttentionMetadata,
        piece: PaddedSlice,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        kv_lens: torch.Tensor,
    ) -> PaddedGroup:
        """Index tensors for the requests and queries of `piece`, given the batch's
        host-side query starts, query lengths and KV lengths."""
        page_size, device = self.kv_cache.page_size, metadata.kv_indices.device
        requests = torch.tensor(piece.requests)
        q_start, q_lens, kv_lens = q_starts[requests], q_lens[requests], kv_lens[requests]

        # Keys are gathered a page at a time (one contiguous block each), so a request's
        # keys span whole pages and the mask hides the slots past its length.
        kv_pages = _page_table(
            metadata.kv_indptr, metadata.kv_indices, requests.to(device, non_blocking=True),
            piece.num_pages,
        )
        kv_pos = torch.arange(piece.num_pages * page_size, device=device)

        # Query j of request b is row qo_start + j of q, at position kv_len - q_len + j; it
        # sees the keys at or before its position. Padding queries reuse the first row.
        query_offset = torch.arange(piece.first_query, piece.first_query + piece.num_queries)
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
        self.kv_cache.write(layer, k, v, self.metadata.slot_mapping)
        out = torch.empty_like(q)
        if self.decodes is not None:
            self._attend_sparse(self.decodes, layer, q, out)
        for rows in self.fresh_rows:
            # Nothing cached: the prompt's keys are this step's, and top-left causal
            # alignment is its own positions.
            # [1, heads, q_len, D]: SDPA's fused CPU kernel takes batched inputs only.
            queries, keys, values = (x[None, rows].transpose(1, 2) for x in (q, k, v))
            attended = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, enable_gqa=True
            )
            out[rows] = attended[0].transpose(0, 1)
        for group in self.padded:
            self._attend_padded(group, layer, q, out)
        return out

    def _attend_sparse(
        self,
        group: SparseDecodeGroup,
        layer: int,
        q: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        keys, v_cache = self.kv_cache.layer_cache(layer)
        if group.gathered_pages is not None:
            gathered = self.kv_cache.gather(layer, 0, group.gathered_pages, self.key_workspace)
            keys = self.float_key_workspace[: gathered.shape[0]].copy_(gathered)  # exact
        keys = keys.view(-1, self.head_dim)
        queries = q.index_select(0, group.query_rows).view(-1, self.head_dim)  # [B*heads, D]
        # The scores land in the pattern's own values (zeroed, since beta scales them), so
        # torch neither copies the pattern nor allocates a new one per layer.
        group.pattern.values().zero_()
        scores = torch.sparse.sampled_addmm(
            group.pattern, queries.to(keys.dtype), keys.t(), beta=0.0,
            alpha=self.head_dim**-0.5, out=group.pattern,
        ).values()
        # Softmax along each row: scatter the scores into a dense matrix padded with -inf,
        # where a row-wise softmax is one call, and read the weights back.
        dense = group.dense_scores
        dense.view(-1).index_copy_(0, group.dense_index, scores)
        weights = dense.softmax(dim=-1).view(-1).index_select(0, group.dense_index)
        # Values are read in place in any dtype; in low precision the weights are rounded
        # to it first, as SDPA rounds them before multiplying by the values.
        attended = F.embedding_bag(
            group.value_columns, v_cache.view(-1, self.head_dim), group.pattern.crow_indices()[:-1],
            mode="sum", per_sample_weights=weights.to(v_cache.dtype),
        )  # [B*heads, D]
        attended = attended.view(-1, self.num_heads, self.head_dim).to(out.dtype)
        out.index_copy_(0, group.query_rows, attended)

    def _attend_padded(
        self,
        group: PaddedGroup,
        layer: int,
        q: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        batch, pages = group.kv_pages.shape[0], group.kv_pages.flatten()
        # [B * P, page_size, kv_heads, D] → [B, kv_heads, P * page_size, D]
        keys = self.kv_cache.gather(layer, 0, pages, self.key_workspace)
        keys = keys.view(batch, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        values = self.kv_cache.gather(layer, 1, pages, self.value_workspace)
        values = values.view(batch, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        queries = q[group.query_rows].transpose(1, 2)  # [B, heads, max_q, D]
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=group.mask, enable_gqa=True
        )
        attended = attended.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
        out.index_copy_(0, group.output_rows, attended[group.real_queries])


def attention_costs(
    shape: AttentionShape, page_size: int, dtype: torch.dtype, kv_dtype: torch.dtype
) -> AttentionCosts:
    """What attention costs the torch backend for a model of `shape` (this rank's heads),
    computing in `dtype` on pages stored in `kv_dtype`."""
    return AttentionCosts(
        shape.num_heads, shape.num_kv_heads, shape.head_dim, page_size, dtype.itemsize,
        gathers_keys=dtype not in SPARSE_DTYPES, quantized=kv_dtype in ONE_BYTE_DTYPES,
    )


def _page_table(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, requests: torch.Tensor, max_pages: int
) -> torch.Tensor:
    """The pages of `requests` (indices into the CSR page table `kv_indptr`, `kv_indices`)
    as a `[B, max_pages]` table, each row padded with its request's last page."""
    page_index = kv_indptr[requests, None] + torch.arange(max_pages, device=kv_indices.device)
    last_page = (kv_indptr[requests + 1] - 1)[:, None]
    return kv_indices[torch.minimum(page_index, last_page)].long()


def _select_rows(indptr: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `rows` of a CSR array, as their own CSR: its indptr, and where each of its
    entries sits in the original array."""
    starts, lengths = indptr[rows], indptr[rows + 1] - indptr[rows]
    new_indptr = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    shift = torch.repeat_interleave(starts - new_indptr[:-1], lengths)
    return new_indptr, torch.arange(int(new_indptr[-1])) + shift


def _csr_matrix(
    crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...]
) -> torch.Tensor:
    """A sparse CSR matrix from indices the backend built itself (so unchecked)."""
    with warnings.catch_warnings():
        # torch warns, once per process, that its sparse CSR support is in beta.
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


def _lengths(indptr: torch.Tensor) -> torch.Tensor:
    return (indptr[1:] - indptr[:-1]).long()
