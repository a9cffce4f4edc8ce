"""Attention over a paged KV cache, behind one interface fed by one metadata format.

In transformers each request has its own contiguous KV tensor. Here the keys and values
of a whole batch live scattered across pages of the shared pool (`kv_pool.py`), so an
attention kernel needs to know, for each request, which query tokens are new this step
and which pages hold its keys. We describe that with flashinfer's CSR page table, for a
batch of `B` requests and `T` new tokens:

* `qo_indptr[B+1]`: request `b`'s new tokens are rows `qo_indptr[b]:qo_indptr[b+1]`.
* `kv_indptr[B+1]`, `kv_indices`: request `b`'s pages are
  `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`, in token order.
* `kv_last_page_len[B]`: how many slots of its last page are filled (1..page_size),
  counting this step's new tokens. So its KV length is `(num_pages - 1) * page_size + last`.
* `positions[T]`: each new token's position in its sequence (RoPE uses it).
* `slot_mapping[T]`: the flat pool slot (`page * page_size + offset`) each new token's
  K/V is written to.

A prefill with a cached prefix, a decode, and any mix of them in one batch are all the
same thing in this format: a request whose last `q_len` tokens are new and attend
causally to everything before them.

Each backend does two things per step: `plan(metadata)` once (shared by every layer),
then `forward(layer, q, k, v)` per layer, which stores the new K/V in their slots and
attends. `TorchBackend` is the readable reference and runs anywhere; `FlashInferBackend`
runs the same metadata through flashinfer's CUDA kernels. `attention_backend_class`
picks flashinfer on CUDA whenever it can run the model, and the torch backend otherwise.
"""

from __future__ import annotations

import logging
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoqwen.kv_pool import KVPool

logger = logging.getLogger(__name__)


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
    # The same CSR arrays on the host (pinned on CUDA). flashinfer plans its kernels on the
    # host; handing it these instead of the device tensors spares a device-to-host wait.
    qo_indptr_host: torch.Tensor | None = None
    kv_indptr_host: torch.Tensor | None = None
    kv_last_page_len_host: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.kv_last_page_len.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.max_q_len == 1

    def q_lens(self) -> torch.Tensor:
        return self.qo_indptr[1:] - self.qo_indptr[:-1]


class AttentionBackend(ABC):
    """Plan once per step from the page table, then attend once per layer."""

    # Can a decode step's kernels be recorded in a CUDA graph? Only if `plan` writes the
    # step's page table into buffers that stay put (see `cuda_graph.py`).
    supports_cuda_graphs = False

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @abstractmethod
    def plan(self, metadata: AttentionMetadata) -> None: ...

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q `[T, heads, dim]`, k and v `[T, kv_heads, dim]` → output `[T, heads, dim]`."""

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store this step's keys and values in their pool slots."""
        k_cache, v_cache = self.pool.layer_cache(layer)
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)

    def bind_graph_buffers(
        self,
        batch_size: int,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
    ) -> None:
        """Plan decode steps of `batch_size` requests into these fixed page-table buffers."""
        raise NotImplementedError(f"{type(self).__name__} cannot run inside a CUDA graph")


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
    """Reference attention in plain torch.

    `plan` turns the CSR page table into index tensors once per step, for two groups of
    requests, each attended its own way by `forward`:

    * Decodes (one new token each) in float32/float64: a `SparseDecodeGroup`, which reads
      every key and value once, in place. A decode's cost is reading its KV, so not
      copying it first is what matters.
    * Prefills (several new tokens), and decodes in other dtypes: a `PaddedGroup`. Keys and
      values are gathered into a padded batch, a page per contiguous block copy, and SDPA
      attends with a mask. The copy is small next to the attention of many queries.

    Decodes and prefills are padded separately, so a step that mixes a 512-token prefill
    chunk with many decodes doesn't pad every decode to 512 queries. The gathered keys
    and values land in two workspace tensors that every layer and group reuses, grown when
    a step needs more: allocating tens of megabytes afresh per layer would make the CPU's
    allocator map and fault in new memory pages every time, which costs more than the copy.
    """

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(pool, num_heads, num_kv_heads, head_dim)
        self.sparse_decodes = pool.kv.dtype in SPARSE_DTYPES
        self.key_workspace = self.value_workspace = pool.kv.new_empty(0)

    def plan(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        page_size = self.pool.page_size
        qo_indptr = _on_host(metadata.qo_indptr_host, metadata.qo_indptr)
        kv_indptr = _on_host(metadata.kv_indptr_host, metadata.kv_indptr)
        last_page_len = _on_host(metadata.kv_last_page_len_host, metadata.kv_last_page_len)
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


def _on_host(host: torch.Tensor | None, device_tensor: torch.Tensor) -> torch.Tensor:
    # Metadata built without host copies still works, at the price of a device round trip.
    return host if host is not None else device_tensor.cpu()


# flashinfer's prebuilt kernels cover these; other sizes need a JIT build that may fail.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
# flashinfer's examples use 128 MiB; serving engines give it more, as a large prefill
# split into many pieces keeps their partial results there. One buffer serves every
# wrapper, since a step runs only one of them.
FLASHINFER_WORKSPACE_BYTES = 256 << 20
# With at least this many query heads per KV head, decode is faster on tensor cores: the
# kernel stacks a group's heads into the rows of one matrix multiply (flashinfer's advice).
TENSOR_CORE_MIN_GROUP_SIZE = 4


def flashinfer_unsupported_reason(head_dim: int, dtype: torch.dtype) -> str | None:
    """Why flashinfer cannot run a model of this head size and dtype, or None if it can."""
    if dtype not in FLASHINFER_DTYPES:
        return f"flashinfer runs float16 and bfloat16 only, not {dtype}"
    if head_dim not in FLASHINFER_HEAD_DIMS:
        supported = ", ".join(map(str, FLASHINFER_HEAD_DIMS))
        return f"flashinfer has no kernels for head_dim {head_dim} (it supports {supported})"
    try:
        import flashinfer  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name != "flashinfer":
            return f"flashinfer failed to import: {error}"
        return "flashinfer is not installed (pip install -e \".[cuda]\")"
    # An extension built for another torch or CUDA can fail to load in other ways too.
    except (ImportError, OSError, RuntimeError) as error:
        return f"flashinfer failed to import: {error}"
    return None


def attention_backend_class(
    device: torch.device, head_dim: int, dtype: torch.dtype
) -> type[AttentionBackend]:
    """flashinfer on CUDA when it can run the model, the torch reference otherwise."""
    if device.type != "cuda":
        return TorchBackend
    reason = flashinfer_unsupported_reason(head_dim, dtype)
    if reason is None:
        return FlashInferBackend
    logger.warning("%s; falling back to the slower torch attention backend", reason)
    return TorchBackend


class FlashInferBackend(AttentionBackend):
    """flashinfer's paged-attention CUDA kernels, fed the same page table as `TorchBackend`.

    flashinfer splits attention into `plan` (on the host: read the page table, split the
    work across thread blocks, write that schedule to the device) and `run` (the kernels).
    Each step is planned once into one wrapper, and every layer then calls its `run`:

    * the prefill wrapper when some request has more than one new token: causal attention
      of the new tokens over the cached prefix and themselves (decodes in a mixed step are
      just one-token rows of it);
    * the decode wrapper when every request has one new token, on tensor cores for large
      query groups;
    * for a CUDA-graph bucket, that bucket's own decode wrapper, whose page-table buffers
      are fixed (`bind_graph_buffers`), so a replayed graph finds each step's plan where
      the captured kernels look for it.

    All wrappers share one workspace buffer, allocated here. New keys and values are stored
    with the same indexed copy into `slot_mapping` as the torch backend uses, which a CUDA
    graph replays like any other kernel.
    """

    supports_cuda_graphs = True

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(pool, num_heads, num_kv_heads, head_dim)
        device, dtype = pool.kv.device, pool.kv.dtype
        if device.type != "cuda":
            raise ValueError(f"flashinfer needs a CUDA device, the KV pool is on {device}")
        reason = flashinfer_unsupported_reason(head_dim, dtype)
        if reason is not None:
            raise ValueError(reason)
        import flashinfer

        # flashinfer requires the workspace to be zeroed before its first use.
        self.workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.use_tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP_SIZE
        self.data_types = {"q_data_type": dtype, "kv_data_type": dtype}
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self.graph_decode_wrappers: dict[int, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}

    def bind_graph_buffers(
        self,
        batch_size: int,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
    ) -> None:
        import flashinfer

        self.graph_decode_wrappers[batch_size] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=kv_indptr,
            paged_kv_indices_buffer=kv_indices,
            paged_kv_last_page_len_buffer=kv_last_page_len,
        )

    def plan(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        kv_indptr = _on_host(metadata.kv_indptr_host, metadata.kv_indptr)
        last_page_len = _on_host(metadata.kv_last_page_len_host, metadata.kv_last_page_len)
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, self.pool.page_size)
        if metadata.is_decode:
            self.wrapper = self.graph_decode_wrappers.get(metadata.batch_size, self.decode_wrapper)
            self.wrapper.plan(
                kv_indptr, metadata.kv_indices, last_page_len, *shape, **self.data_types
            )
        else:
            qo_indptr = _on_host(metadata.qo_indptr_host, metadata.qo_indptr)
            self.wrapper = self.prefill_wrapper
            self.wrapper.plan(
                qo_indptr, kv_indptr, metadata.kv_indices, last_page_len, *shape,
                causal=True, **self.data_types,
            )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.write_kv(layer, k, v, self.metadata.slot_mapping)
        return self.wrapper.run(q, self.pool.layer_cache(layer))
