"""flashinfer's paged-attention CUDA kernels behind the same interface as the torch backends.

flashinfer reads the CSR page table of `attention.py` natively: it was designed around it.
It splits attention into `plan` (on the host: read the page table, split the work across
thread blocks, write that schedule to the device) and `run` (the kernels). A step is
planned once, and every layer then calls `run`. That split is also what lets decode steps
be replayed from CUDA graphs: see `cuda_graph.py` for why `plan` stays outside the graph.
"""

from __future__ import annotations

import torch

from nanoqwen.attention import AttentionBackend, AttentionMetadata
from nanoqwen.kv_pool import KVPool

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


class FlashInferBackend(AttentionBackend):
    """flashinfer's kernels, fed the same page table as the torch backends.

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
        kv_indptr = metadata.on_host("kv_indptr")
        last_page_len = metadata.on_host("kv_last_page_len")
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, self.pool.page_size)
        if metadata.is_decode:
            self.wrapper = self.graph_decode_wrappers.get(metadata.batch_size, self.decode_wrapper)
            self.wrapper.plan(
                kv_indptr, metadata.kv_indices, last_page_len, *shape, **self.data_types
            )
        else:
            qo_indptr = metadata.on_host("qo_indptr")
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
