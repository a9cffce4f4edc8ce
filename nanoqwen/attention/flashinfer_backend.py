"""flashinfer's paged-attention CUDA kernels behind the same interface as the torch backends.

flashinfer reads the CSR page table of `base.py` natively: it was designed around it.
It splits attention into `plan` (on the host: read the page table, split the work across
thread blocks, copy that schedule to the device) and `run` (the kernels). A step is
planned once, and every layer then calls `run`. That split is also what lets decode steps
be replayed from CUDA graphs: see `cuda_graph.py` for why `plan` stays outside the graph.

flashinfer ships its kernels as CUDA sources: `plan` compiles the one a model needs with
nvcc the first time it is asked for (minutes), and later loads it from flashinfer's cache
on disk. So whether flashinfer can serve a model is only known once its kernels are built.
`flashinfer_backend_for` builds them at start-up, by planning and running each kind of step
once on a tiny KV cache, under a status line. On Hopper GPUs flashinfer's prefill picks its
FA3 kernels (built for sm90a), a heavier build than the FA2 ones every GPU runs: if it fails,
the FA2 prefill is tried before flashinfer is given up (`FlashInferFA2Backend`). If that
fails too (no nvcc, no CUDA headers, a kernel that won't load) the runner falls back to the
torch backend, saying why.

A KV cache in fp8 (`kv_cache_dtype="fp8_e4m3"`) is read by the same kernels, planned with
`kv_data_type` fp8: they take one scale for all of a layer's keys and one for its values
(`k_scale`, `v_scale` in `run`, left out when they are 1, flashinfer's default), so the
cache is built without per-vector scales (`memory/kv_cache.py`). flashinfer has no int8 KV
kernels: an int8 cache runs on the torch backend.

Written against flashinfer-python 0.4 to 0.7 (pyproject's `cuda` extra), whose wrappers take
the same parameter names (`tests/fake_flashinfer.py` mimics them).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from rich.console import Console

from nanoqwen.attention.base import AttentionBackend, AttentionMetadata, AttentionShape
from nanoqwen.memory.kv_cache import ONE_BYTE_DTYPES, KVCache

logger = logging.getLogger(__name__)
# Where the start-up status line goes (a spinner on a terminal, nothing otherwise).
console = Console(stderr=True)

# The head sizes asked of flashinfer (every Qwen2/Qwen3 model uses 64 or 128): the common
# ones its kernels are built for. A build that fails costs minutes, so no other is tried.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
# flashinfer's examples use 128 MiB; serving engines give it more, as a large prefill
# split into many pieces keeps their partial results there. One buffer serves every
# wrapper, since a step runs only one of them.
FLASHINFER_WORKSPACE_BYTES = 256 << 20
# Each wrapper's own buffer for its plan's schedule (flashinfer's size, on the device).
FLASHINFER_INT_WORKSPACE_BYTES = 8 << 20
# With at least this many query heads per KV head, decode is faster on tensor cores: the
# kernel stacks a group's heads into the rows of one matrix multiply (flashinfer's advice).
TENSOR_CORE_MIN_GROUP_SIZE = 4


def flashinfer_unsupported_reason(
    head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype
) -> str | None:
    """Why flashinfer cannot run a model of this head size and dtype with KV pages stored
    in `kv_dtype`, or None if it might."""
    if dtype not in FLASHINFER_DTYPES:
        return f"flashinfer runs float16 and bfloat16 only, not {dtype}"
    if kv_dtype not in (dtype, torch.float8_e4m3fn):
        return f"flashinfer reads KV pages in the model's dtype or fp8_e4m3, not {kv_dtype}"
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


class FlashInferUnavailable(Exception):
    """Why flashinfer cannot serve a model here (one line)."""


# The new tokens of the warm-up's one request: a decode's kernels, then a prefill's.
DECODE, PREFILL = 1, 2


def flashinfer_backend_for(
    shape: AttentionShape,
    page_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
) -> type[FlashInferBackend]:
    """The flashinfer backend whose kernels for this model (with KV pages in `kv_dtype`) are
    built (or loaded from flashinfer's cache) and have run on `device`: with the prefill
    kernels flashinfer picks for the GPU, else with FA2's. Raises `FlashInferUnavailable`
    saying why flashinfer cannot serve the model here."""
    if device.type != "cuda":
        raise FlashInferUnavailable(f"flashinfer needs a CUDA device, not {device}")
    reason = flashinfer_unsupported_reason(shape.head_dim, dtype, kv_dtype)
    if reason is not None:
        raise FlashInferUnavailable(reason)
    start = time.perf_counter()
    status = "compiling flashinfer kernels (minutes on the first start, cached after)…"
    with console.status(status):
        backend_class, failure = build_kernels(shape, page_size, dtype, kv_dtype, device)
    if backend_class is None:
        raise FlashInferUnavailable(
            f"flashinfer could not build or run its kernels ({first_line(failure)})"
        )
    if failure is not None:
        logger.warning("flashinfer's own choice of prefill kernels failed (%s); using FA2's",
                       first_line(failure))
    logger.info("flashinfer kernels (%s prefill) ready in %.1f s",
                backend_class.prefill_backend, time.perf_counter() - start)
    return backend_class


def build_kernels(
    shape: AttentionShape,
    page_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
) -> tuple[type[FlashInferBackend] | None, Exception | None]:
    """The first flashinfer backend whose kernels build and run (None if none does), and the
    first failure on the way (None if there was none)."""
    args = (shape, page_size, dtype, kv_dtype, device)
    failure = warm_up_failure(FlashInferBackend, DECODE, *args)
    if failure is not None:  # every variant decodes with the same kernels
        return None, failure
    for backend_class in (FlashInferBackend, FlashInferFA2Backend):
        error = warm_up_failure(backend_class, PREFILL, *args)
        if error is None:
            return backend_class, failure
        failure = failure or error
    return None, failure


def warm_up_failure(
    backend_class: type[FlashInferBackend], num_tokens: int, *args: Any
) -> Exception | None:
    """What `warm_up_kernels` raised, or None once its kernels have run."""
    try:
        warm_up_kernels(backend_class, num_tokens, *args)
    # nvcc missing or failing, CUDA headers not found, a kernel that won't load or launch:
    # flashinfer raises many kinds of errors, and each means these kernels cannot serve.
    except Exception as error:
        logger.debug("%s's kernels failed to build or run", backend_class.__name__,
                     exc_info=True)
        return error
    return None


def first_line(error: BaseException) -> str:
    """An error's type and the first line of its message (build logs run to pages)."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def warm_up_kernels(
    backend_class: type[FlashInferBackend],
    num_tokens: int,
    shape: AttentionShape,
    page_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Plan and run one fresh request of `num_tokens` tokens (`DECODE` or `PREFILL`) on a
    throwaway one-layer KV cache.

    Planning is what makes flashinfer build or load a kernel, so a decode and a prefill
    make it get every kernel a step of this model can use (the graph buckets' decode
    wrappers run the same decode kernel); running them checks that they load and launch.
    """
    heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    pages = list(range(1, 1 + -(-num_tokens // page_size)))  # after the scratch page
    shape = (1, kv_heads, head_dim, page_size, 1 + len(pages), dtype, device)
    if kv_dtype in ONE_BYTE_DTYPES:  # flashinfer reads fp8 pages at one scale per tensor
        from nanoqwen.memory.kv_quant import QuantizedKVCache

        kv_cache: KVCache = QuantizedKVCache(*shape, kv_dtype, per_vector_scales=False)
    else:
        kv_cache = KVCache(*shape)
    backend = backend_class(kv_cache, heads, kv_heads, head_dim)
    backend.plan(one_request(num_tokens, pages, page_size, device))
    q = torch.randn(num_tokens, heads, head_dim, dtype=dtype, device=device)
    k, v = torch.randn(2, num_tokens, kv_heads, head_dim, dtype=dtype, device=device)
    backend.forward(0, q, k, v)
    torch.cuda.synchronize(device)


def one_request(
    num_tokens: int, pages: list[int], page_size: int, device: torch.device
) -> AttentionMetadata:
    """The page table of one fresh request of `num_tokens` tokens on (the first of) `pages`."""
    pages = pages[: -(-num_tokens // page_size)]
    host = {
        "qo_indptr": torch.tensor([0, num_tokens], dtype=torch.int32),
        "kv_indptr": torch.tensor([0, len(pages)], dtype=torch.int32),
        "kv_last_page_len": torch.tensor([num_tokens - (len(pages) - 1) * page_size],
                                         dtype=torch.int32),
    }
    slots = [pages[p // page_size] * page_size + p % page_size for p in range(num_tokens)]
    return AttentionMetadata(
        **{name: tensor.to(device) for name, tensor in host.items()},
        kv_indices=torch.tensor(pages, dtype=torch.int32, device=device),
        positions=torch.arange(num_tokens, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_q_len=num_tokens, max_kv_len=num_tokens,
        **{f"{name}_host": tensor for name, tensor in host.items()},
    )


def run_scales(quantized: bool, scale: float) -> dict[str, float]:
    """The `k_scale` and `v_scale` to pass to `run` for KV pages stored at one `scale` per
    tensor: none for pages in the model's dtype, and none for a scale of 1.

    flashinfer's default (None) is 1, and passing 1 is not free on every version: up to
    0.5 it multiplies the output by any `v_scale` it is given in a kernel of its own, one
    more launch per layer and step (and in every captured graph); 0.6 skips a 1.0."""
    if not quantized or scale == 1.0:
        return {}
    return {"k_scale": scale, "v_scale": scale}


class FencedWrapper:
    """A flashinfer wrapper, and the CUDA event that keeps its `plan` from racing the GPU."""

    def __init__(self, wrapper: Any, planned: torch.cuda.Event) -> None:
        self.wrapper = wrapper
        self.planned = planned

    def plan(self, *args: Any, **kwargs: Any) -> None:
        # `plan` writes its schedule into a pinned host buffer of the wrapper's and queues an
        # async copy of it to the GPU. Planning again before that copy has run (when nothing
        # waited for the GPU in between, as after a step that sampled nothing) would rewrite
        # the buffer under it, and the earlier step would attend with the later schedule. So
        # wait for the event recorded behind the last copy. It is recorded after `plan`, not
        # after `run`: a replayed CUDA graph launches the kernels without calling `run`.
        self.planned.synchronize()
        self.wrapper.plan(*args, **kwargs)
        self.planned.record()

    def run(
        self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], **scales: float
    ) -> torch.Tensor:
        return self.wrapper.run(q, kv_cache, **scales)


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

    Every wrapper is a `FencedWrapper` with its own event, since each has its own staging
    buffer. All wrappers share one workspace buffer, allocated here. New keys and values
    are stored with the same indexed copy into `slot_mapping` as the torch backend uses
    (cast to fp8 first, for an fp8 cache), which a CUDA graph replays like any other kernel.
    """

    supports_cuda_graphs = True
    per_vector_kv_scales = False
    # Which prefill kernels: "auto" lets flashinfer choose (FA3 for 16-bit on Hopper).
    prefill_backend = "auto"

    def __init__(self, kv_cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim)
        device, dtype, kv_dtype = kv_cache.kv.device, kv_cache.dtype, kv_cache.kv.dtype
        reason = flashinfer_unsupported_reason(head_dim, dtype, kv_dtype)
        if reason is not None:
            raise ValueError(reason)
        if kv_cache.scales is not None:
            raise ValueError("flashinfer takes one KV scale per tensor, not one per vector")
        import flashinfer

        # flashinfer requires the workspace to be zeroed before its first use.
        self.workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.use_tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP_SIZE
        self.data_types = {"q_data_type": dtype, "kv_data_type": kv_dtype}
        # What the kernels multiply an fp8 page's numbers by: the cache's one scale, which
        # only a quantized cache has (`memory/kv_quant.py`).
        scale = getattr(kv_cache, "tensor_scale", 1.0)
        self.kv_scales = run_scales(kv_cache.is_quantized, scale)
        self.prefill_wrapper = self._fenced(
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend=self.prefill_backend
            )
        )
        self.decode_wrapper = self._fenced(
            flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
            )
        )
        self.graph_decode_wrappers: dict[int, FencedWrapper] = {}

    @classmethod
    def step_memory(
        cls, shape: AttentionShape, page_size: int, dtype: torch.dtype, kv_dtype: torch.dtype,
        q_lens: list[int], kv_lens: list[int], num_graph_buckets: int = 0,
    ) -> int:
        # The kernels work in the shared workspace whatever the step: only the wrappers'
        # schedules add to it, one for prefills, one for decodes and one per graph bucket.
        return FLASHINFER_WORKSPACE_BYTES + (2 + num_graph_buckets) * FLASHINFER_INT_WORKSPACE_BYTES

    @staticmethod
    def _fenced(wrapper: Any) -> FencedWrapper:
        return FencedWrapper(wrapper, torch.cuda.Event())

    def bind_graph_buffers(
        self,
        batch_size: int,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
    ) -> None:
        import flashinfer

        self.graph_decode_wrappers[batch_size] = self._fenced(
            flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=kv_indptr,
                paged_kv_indices_buffer=kv_indices,
                paged_kv_last_page_len_buffer=kv_last_page_len,
            )
        )

    def plan(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        kv_indptr = metadata.kv_indptr_host
        last_page_len = metadata.kv_last_page_len_host
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, self.kv_cache.page_size)
        if metadata.max_q_len == 1:
            self.wrapper = self.graph_decode_wrappers.get(metadata.batch_size, self.decode_wrapper)
            self.wrapper.plan(
                kv_indptr, metadata.kv_indices, last_page_len, *shape, **self.data_types
            )
        else:
            qo_indptr = metadata.qo_indptr_host
            self.wrapper = self.prefill_wrapper
            self.wrapper.plan(
                qo_indptr, kv_indptr, metadata.kv_indices, last_page_len, *shape,
                causal=True, **self.data_types,
            )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.kv_cache.write(layer, k, v, self.metadata.slot_mapping)
        return self.wrapper.run(q, self.kv_cache.layer_cache(layer), **self.kv_scales)


class FlashInferFA2Backend(FlashInferBackend):
    """flashinfer with its FA2 prefill kernels, where the ones it picks (FA3) fail to build."""

    prefill_backend = "fa2"
