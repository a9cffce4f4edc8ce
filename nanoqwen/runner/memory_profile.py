"""Measuring, on a GPU, what the engine needs beside its weights and its KV cache.

On a GPU the KV cache gets whatever memory the rest of the engine leaves, so the rest must
be known before the cache exists (`memory/sizing.py` does the arithmetic). Beyond the
weights, it comes in three kinds:

* **resident buffers**, allocated once and kept: the attention backend's (flashinfer's
  workspace, and a decode wrapper per CUDA-graph bucket) and the graph runner's static
  inputs and logits;
* **a step's activations**, allocated and freed by every step. The profiled step is one
  no schedule exceeds in requests, tokens or context (`WorstStep`): `max_num_seqs`
  decodes (each with its proposed tokens to verify, when the engine proposes any) plus a
  full prefill chunk, every one of them at `max_model_len`, all sampled with every
  sampling option on. Long contexts matter: the torch backend gathers each decode's keys into a
  workspace, padded to the longest one. (It pads prefills to the longest one too, so a
  chunk shared by one long prompt and many short ones can need more than one whole
  chunk does; flashinfer's memory does not depend on how a step is split.)
* **the graph pool**, where the captured CUDA graphs keep the temporaries of the largest
  bucket's decode step for good.

`profile_overhead` builds each of them with the backend that will serve and measures it
with the CUDA allocator's counters, running the worst step through the same pipeline as
every step (`pipeline.py`). It runs on a throwaway KV cache that holds one sequence of
`max_model_len` tokens (which the real cache must hold anyway), whose pages every request
of the profile shares: only memory is measured, never values.

What attention needs in the worst step is also known without running it: each backend
states an upper bound from the step's lengths (`AttentionBackend.step_memory`; the torch
backend's plan follows the same arithmetic, `attention/torch_layout.py`). The profile
refuses a step that cannot fit before running it (`worst_step_attention_bytes`), and the
tests check that bound at a GPU's scale on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from nanoqwen.attention.base import AttentionBackend, AttentionShape
from nanoqwen.memory.kv_cache import KVCache
from nanoqwen.memory.sizing import Overhead, WorstStep
from nanoqwen.runner.pipeline import StepPipeline
from nanoqwen.runner.step_inputs import PADDING_ROW_TOKEN_ID
from nanoqwen.sampling.params import SamplingParams
from nanoqwen.scheduling.batch import ScheduledBatch
from nanoqwen.scheduling.request import Request

logger = logging.getLogger(__name__)
# Every sampling option at once: penalties count each request's tokens over the whole
# vocabulary, top-k/top-p sort it. The sampler's hungriest path.
EVERY_SAMPLING_OPTION = SamplingParams(
    temperature=1.0, top_p=0.9, top_k=50, min_p=0.05,
    repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
)


class MemoryCounters(Protocol):
    def allocated(self) -> int: ...
    def reset_peak(self) -> None: ...
    def peak(self) -> int: ...
    def free(self) -> int: ...


class CudaMemory:
    """The CUDA caching allocator's counters for one device, read once the GPU is idle."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def free(self) -> int:
        """Bytes the device has free, counting what the allocator holds cached."""
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(
            self.device
        )


def profile_overhead(
    make_cache: Callable[[int], KVCache],
    make_pipeline: Callable[[KVCache], StepPipeline],
    worst: WorstStep,
    page_size: int,
    memory: MemoryCounters,
    backend_name: str,
    attention_bytes: int | None = None,  # `worst_step_attention_bytes`, where known
) -> Overhead:
    """Measure the three kinds of overhead (see the module docstring)."""
    cannot_fit = (
        "the GPU ran out of memory measuring what the engine needs beside the KV cache "
        f"(a step of {worst.max_num_seqs} sequences at max_model_len={worst.max_model_len} "
        f"plus a {worst.chunk_size}-token prefill chunk, on the {backend_name} attention "
        "backend): lower max_num_seqs, max_model_len or chunk_size"
    )
    try:
        cache = make_cache(1 + -(-worst.max_model_len // page_size))
        if attention_bytes is not None and attention_bytes > memory.free():
            raise ValueError(f"{cannot_fit} (its attention alone needs up to "
                             f"{attention_bytes / 2**30:.2f} GiB)")
        pages = list(range(1, cache.num_pages))  # every page but the scratch page
        start = memory.allocated()
        pipeline = make_pipeline(cache)
        resident = memory.allocated() - start
        batch = worst_step(
            pages, worst.max_num_seqs, worst.chunk_size, worst.max_model_len, worst.max_proposed
        )
        step = _peak_of(memory, lambda: pipeline.run(batch))
        graph_pool = 0
        if pipeline.graphs is not None:
            decodes = worst_step(pages, pipeline.graphs.buckets[-1], 0, worst.max_model_len)
            graph_pool = _peak_of(memory, lambda: pipeline.forward(pipeline.prepare(decodes)))
    except torch.cuda.OutOfMemoryError as error:
        raise ValueError(cannot_fit) from error
    if attention_bytes is not None:
        logger.info("worst step: attention needs at most %.2f GiB; the step took %.2f GiB",
                    attention_bytes / 2**30, step / 2**30)
    return Overhead(resident=resident, step=step, graphs=graph_pool)


def worst_step_attention_bytes(
    backend_class: type[AttentionBackend],
    shape: AttentionShape,
    page_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    worst: WorstStep,
    num_graph_buckets: int,
) -> int | None:
    """At most how many bytes `backend_class` allocates beside the KV cache, its kept
    buffers included, for a model of `shape` (one rank's heads) to run the worst step
    (None where the backend does not say)."""
    batch = worst_step(
        [], worst.max_num_seqs, worst.chunk_size, worst.max_model_len, worst.max_proposed
    )
    q_lens = batch.num_new_tokens
    kv_lens = [r.num_computed_tokens + n for r, n in zip(batch.requests, q_lens)]
    return backend_class.step_memory(
        shape, page_size, dtype, kv_dtype, q_lens, kv_lens, num_graph_buckets
    )


def worst_step(
    pages: list[int], num_decodes: int, chunk_size: int, length: int, num_proposed: int = 0
) -> ScheduledBatch:
    """`num_decodes` decodes, each verifying `num_proposed` proposed tokens, and, if
    `chunk_size`, a prefill chunk, every one of them ending at `length` tokens, all on the
    same `pages` and all sampled."""
    chunk = [min(chunk_size, length)] if chunk_size else []
    requests = []
    for index, proposed in enumerate([0] * len(chunk) + [num_proposed] * num_decodes):
        tokens = [PADDING_ROW_TOKEN_ID] * (length - proposed)
        request = Request(f"profile-{index}", tokens, EVERY_SAMPLING_OPTION, pages=pages)
        request.proposed_token_ids = [PADDING_ROW_TOKEN_ID] * proposed
        requests.append(request)
    new_tokens = chunk + [1 + num_proposed] * num_decodes
    for request, num_new in zip(requests, new_tokens):
        request.num_computed_tokens = length - num_new
    return ScheduledBatch(requests, new_tokens)


def _peak_of(memory: MemoryCounters, run: Callable[[], object]) -> int:
    """Bytes `run` allocates at its peak beyond what was allocated before it."""
    before = memory.allocated()
    memory.reset_peak()
    run()
    return memory.peak() - before
