"""Sizing the KV pool on a GPU: measure everything else first.

On a GPU the KV pool gets whatever memory the rest of the engine leaves, so the rest must
be known before the pool exists. Beyond the weights, it comes in three kinds:

* **resident buffers**, allocated once and kept: the attention backend's (flashinfer's
  workspace, and a decode wrapper per CUDA-graph bucket) and the graph runner's static
  inputs and logits;
* **a step's activations**, allocated and freed by every step. The profiled step is one
  no schedule exceeds in requests, tokens or context: `max_num_seqs` decodes (each with
  its draft tokens, under speculative decoding) plus a full prefill chunk, every one of them at `max_model_len`, all sampled with every sampling
  option on. Long contexts matter: the torch backend gathers each decode's keys into a
  workspace, padded to the longest one. (It pads prefills to the longest one too, so a
  chunk shared by one long prompt and many short ones can need more than one whole
  chunk does; flashinfer's memory does not depend on how a step is split.)
* **the graph pool**, where the captured CUDA graphs keep the temporaries of the largest
  bucket's decode step for good.

`profile_overhead` builds each of them with the backend that will serve and measures it
with the CUDA allocator's counters. It runs on a throwaway pool that holds one sequence of
`max_model_len` tokens (which the real pool must hold anyway), whose pages every request
of the profile shares: only memory is measured, never values. `kv_budget` then takes the
overhead out of the memory the pool may have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from nanoqwen.attention.base import AttentionBackend
from nanoqwen.config import EngineConfig
from nanoqwen.memory.kv_pool import KVPool
from nanoqwen.model.qwen import QwenForCausalLM
from nanoqwen.runner.cuda_graph import DecodeGraphRunner
from nanoqwen.runner.step_inputs import PADDING_ROW_TOKEN_ID, build_step_inputs
from nanoqwen.sampling.params import SamplingParams
from nanoqwen.sampling.sampler import Sampler
from nanoqwen.scheduling.batch import ScheduledBatch
from nanoqwen.scheduling.request import Request

GIB = 2**30
# Every sampling option at once: penalties count each request's tokens over the whole
# vocabulary, top-k/top-p sort it. The sampler's hungriest path.
EVERY_SAMPLING_OPTION = SamplingParams(
    top_p=0.9, top_k=50, min_p=0.05,
    repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
)


@dataclass
class Overhead:
    """GPU bytes the engine needs beside its weights and its KV pool."""

    resident: int  # backend and graph-runner buffers, kept for good
    step: int  # the worst step's activations, allocated and freed by every step
    graphs: int  # the graph pool: the largest bucket's step, kept for good

    @property
    def total(self) -> int:
        return self.resident + self.step + self.graphs

    def __str__(self) -> str:
        return (
            f"{self.total / GIB:.2f} GiB (buffers {self.resident / GIB:.2f}, largest step "
            f"{self.step / GIB:.2f}, CUDA graphs {self.graphs / GIB:.2f})"
        )


class MemoryCounters(Protocol):
    def allocated(self) -> int: ...
    def reset_peak(self) -> None: ...
    def peak(self) -> int: ...


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


def profile_overhead(
    model: QwenForCausalLM,
    sampler: Sampler,
    backend_class: type[AttentionBackend],
    make_pool: Callable[[int], KVPool],
    config: EngineConfig,
    max_model_len: int,
    buckets: list[int],
    memory: MemoryCounters,
) -> Overhead:
    """Measure the three kinds of overhead (see the module docstring)."""
    shape = model.config
    try:
        pool = make_pool(1 + -(-max_model_len // config.page_size))
        pages = pool.allocate(pool.num_usable_pages)
        start = memory.allocated()
        backend = backend_class(pool, shape.num_heads, shape.num_kv_heads, shape.head_dim)
        graphs = DecodeGraphRunner(model, backend, buckets, max_model_len) if buckets else None
        resident = memory.allocated() - start

        batch = worst_step(
            pages, config.max_num_seqs, config.chunk_size, max_model_len,
            config.num_drafts_per_step,
        )
        step = _peak_of(memory, lambda: _run_step(model, sampler, backend, batch, pool))

        graph_pool = 0
        if graphs is not None:
            largest = graphs.buckets[-1]
            decodes = worst_step(pages, largest, 0, max_model_len)
            graph_pool = _peak_of(memory, lambda: graphs.forward(
                build_step_inputs(decodes, pool.page_size, pool.kv.device, pad_to=largest)
            ))
    except torch.cuda.OutOfMemoryError as error:
        raise ValueError(
            "the GPU ran out of memory measuring what the engine needs beside the KV cache "
            f"(a step of {config.max_num_seqs} sequences at max_model_len={max_model_len} "
            f"plus a {config.chunk_size}-token prefill chunk, with the "
            f"{backend_class.__name__}): lower max_num_seqs, max_model_len or chunk_size"
        ) from error
    return Overhead(resident=resident, step=step, graphs=graph_pool)


def worst_step(
    pages: list[int], num_decodes: int, chunk_size: int, length: int, num_drafts: int = 0
) -> ScheduledBatch:
    """`num_decodes` decodes, each verifying `num_drafts` draft tokens, and, if
    `chunk_size`, a prefill chunk, every one of them ending at `length` tokens, all on the
    same `pages` and all sampled."""
    chunk = [min(chunk_size, length)] if chunk_size else []
    requests = []
    for index, drafts in enumerate([0] * len(chunk) + [num_drafts] * num_decodes):
        tokens = [PADDING_ROW_TOKEN_ID] * (length - drafts)
        request = Request(f"profile-{index}", tokens, EVERY_SAMPLING_OPTION, pages=pages)
        request.draft_token_ids = [PADDING_ROW_TOKEN_ID] * drafts
        requests.append(request)
    new_tokens = chunk + [1 + num_drafts] * num_decodes
    for request, num_new in zip(requests, new_tokens):
        request.num_computed_tokens = length - num_new
    return ScheduledBatch(requests, new_tokens)


def _run_step(
    model: QwenForCausalLM,
    sampler: Sampler,
    backend: AttentionBackend,
    batch: ScheduledBatch,
    pool: KVPool,
) -> None:
    """One eager step, as the runner takes it: lay out, plan, forward, sample."""
    inputs = build_step_inputs(batch, pool.page_size, pool.kv.device)
    backend.plan(inputs.metadata)
    logits = model(inputs.input_ids, inputs.metadata, backend, inputs.sample_rows)
    sampler.sample(logits, inputs.sampled_requests)


def _peak_of(memory: MemoryCounters, run: Callable[[], object]) -> int:
    """Bytes `run` allocates at its peak beyond what was allocated before it."""
    before = memory.allocated()
    memory.reset_peak()
    run()
    return memory.peak() - before


def kv_budget(
    free: int, total: int, overhead: Overhead, fraction: float | None, utilization: float
) -> float:
    """Bytes the KV pool may take: `fraction` of the memory that is free once the overhead
    is set aside, or by default `utilization` of the whole GPU less what is in use and the
    overhead. Raises if nothing is left."""
    if fraction is not None:
        budget = fraction * (free - overhead.total)
        asked = f"kv_cache_memory={fraction} of the {free / GIB:.2f} GiB free"
    else:
        budget = utilization * total - (total - free) - overhead.total
        asked = (
            f"gpu_memory_utilization={utilization} of {total / GIB:.2f} GiB, with "
            f"{(total - free) / GIB:.2f} GiB in use"
        )
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {asked}, less {overhead} for the rest of "
            "the engine; lower max_num_seqs, max_model_len or chunk_size, or give it more memory"
        )
    return budget
