"""Measuring, on a GPU, what the engine needs beside its weights and its KV cache.

On a GPU the KV cache gets whatever memory the rest of the engine leaves, so the rest must
be known before the cache exists. By default the cache gets `gpu_memory_utilization` of
the whole device, less what is in use (weights, the CUDA context) and less that
`Overhead`; a `kv_cache_memory` fraction takes that share of what is free once the
overhead is set aside (`gpu_kv_memory`). Beyond the weights, the overhead comes in three
kinds:

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
  bucket's decode step for good;
* with a draft model, **the draft distributions** it keeps for verification: a float32
  row over the vocabulary per draft of every sampled request (`max_num_seqs` × drafts ×
  vocabulary × 4 bytes at most: 0.6 GB for 256 sequences of 4 drafts over Qwen's 151,936
  tokens), counted, not measured, since they build up across steps.

`profile_overhead` builds each of them with the backend that will serve and measures it
with the CUDA allocator's counters, running the worst step through a runner like any step's
(`runner.py`). Every rank of a split model profiles its own slice in step with the others,
on a plain runner (the workers serve no steps yet): the forward every step runs, whose
all-reduces meet across the ranks; rank 0 alone gets logits and samples. It runs on a
throwaway KV cache that holds one sequence of `max_model_len` tokens (which the real cache
must hold anyway), whose pages every request of the profile shares: only memory is
measured, never values.

What attention needs in the worst step is also known without running it: each backend
states an upper bound from the step's lengths (`AttentionBackend.step_memory`; the torch
backend's plan follows the same arithmetic, `attention/torch_layout.py`). The profile
refuses a step that cannot fit before running it (`worst_step_attention_bytes`), and the
tests check that bound at a GPU's scale on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from nanoqwen.attention.base import AttentionBackend, AttentionShape
from nanoqwen.config import RunnerSettings
from nanoqwen.model.qwen import QwenForCausalLM
from nanoqwen.runner.runner import PADDING_TOKEN_ID, ModelRunner
from nanoqwen.sampling.params import SamplingParams
from nanoqwen.sampling.penalties import LogitBias, Penalties
from nanoqwen.scheduling.request import Request
from nanoqwen.scheduling.scheduler import Row

logger = logging.getLogger(__name__)
GIB = 2**30
# Every sampling option at once: penalties count each request's tokens over the whole
# vocabulary, top-k/top-p sort it. The sampler's hungriest path.
EVERY_SAMPLING_OPTION = SamplingParams(
    temperature=1.0, top_p=0.9, top_k=50, min_p=0.05,
    repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
)


@dataclass(frozen=True)
class WorstStep:
    """The largest step any schedule can make: `max_num_seqs` sequences at `max_model_len`,
    each decoding with `max_proposed` tokens appended to verify, plus a full prefill chunk."""

    max_num_seqs: int
    chunk_size: int
    max_model_len: int
    max_proposed: int = 0


@dataclass
class Overhead:
    """GPU bytes the engine needs beside its weights and its KV cache."""

    resident: int = 0  # backend and graph-runner buffers, kept for good
    step: int = 0  # the worst step's activations, allocated and freed by every step
    graphs: int = 0  # the graph pool: the largest bucket's step, kept for good
    draft_probs: int = 0  # a draft model's distributions, kept for verification

    @property
    def total(self) -> int:
        return self.resident + self.step + self.graphs + self.draft_probs

    def __add__(self, other: Overhead) -> Overhead:
        return Overhead(self.resident + other.resident, self.step + other.step,
                        self.graphs + other.graphs, self.draft_probs + other.draft_probs)

    def __str__(self) -> str:
        drafts = f", draft distributions {self.draft_probs / GIB:.2f}" if self.draft_probs else ""
        return (
            f"{self.total / GIB:.2f} GiB (buffers {self.resident / GIB:.2f}, largest step "
            f"{self.step / GIB:.2f}, CUDA graphs {self.graphs / GIB:.2f}{drafts})"
        )


def gpu_kv_memory_for(
    models: Sequence[QwenForCausalLM],
    make_runner: Callable[[QwenForCausalLM, int], ModelRunner],
    backend_class: type[AttentionBackend],
    num_graph_buckets: int,
    settings: RunnerSettings,
    device: torch.device,
    max_proposed: int,
) -> float:
    """Bytes the KV caches of `models` may take on their GPU, once the rest of the engine's
    needs are measured (`measure_overheads`)."""
    overhead = measure_overheads(models, make_runner, backend_class, num_graph_buckets,
                                 settings, CudaMemory(device), max_proposed)
    torch.cuda.empty_cache()  # so that `free` counts what the profile left cached
    free, total = torch.cuda.mem_get_info(device)
    fraction = settings.kv_cache_memory
    memory = gpu_kv_memory(free, total, overhead, fraction, settings.gpu_memory_utilization)
    logger.info("KV cache: %.2f GiB; the rest of the engine needs %s", memory / GIB, overhead)
    return memory


def measure_overheads(
    models: Sequence[QwenForCausalLM],
    make_runner: Callable[[QwenForCausalLM, int], ModelRunner],
    backend_class: type[AttentionBackend],
    num_graph_buckets: int,
    settings: RunnerSettings,
    memory: MemoryCounters,
    max_proposed: int,
) -> Overhead:
    """What `models` need beside their weights and KV caches, each measured running its
    worst step on a runner `make_runner` builds: the first (the target) with `max_proposed`
    tokens appended to every decode, the others (a draft model) without: they compute the
    target's rows before any are appended, then one-token rows. A draft model adds the
    distributions its drafts came from (`draft_probs_bytes`)."""
    overhead = Overhead()
    if len(models) > 1:
        vocab_size = models[0].config.vocab_size
        overhead.draft_probs = draft_probs_bytes(settings.max_num_seqs, max_proposed, vocab_size)
    for index, model in enumerate(models):
        worst = WorstStep(settings.max_num_seqs, settings.chunk_size, settings.max_model_len,
                          max_proposed if index == 0 else 0)
        attention_bytes = worst_step_attention_bytes(
            backend_class, model.attention_shape, settings.page_size, settings.dtype,
            settings.kv_storage_dtype, worst, num_graph_buckets,
        )
        overhead += profile_overhead(
            lambda num_pages, model=model: make_runner(model, num_pages), worst,
            settings.page_size, memory, backend_class.__name__, attention_bytes,
        )
    return overhead


def draft_probs_bytes(max_num_seqs: int, max_proposed: int, vocab_size: int) -> int:
    """The most a draft model's kept distributions take: a float32 row over the target's
    vocabulary for each draft of every sequence (`speculative/proposers.py`)."""
    return max_num_seqs * max_proposed * vocab_size * 4


def gpu_kv_memory(
    free: int, total: int, overhead: Overhead, fraction: float | None, utilization: float
) -> float:
    """Bytes the KV cache may take on a GPU: `fraction` of the memory that is free once
    the overhead is set aside, or by default `utilization` of the whole GPU less what is
    in use and the overhead. Raises if nothing is left."""
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
    make_runner: Callable[[int], ModelRunner],
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
        if attention_bytes is not None and attention_bytes > memory.free():
            raise ValueError(f"{cannot_fit} (its attention alone needs up to "
                             f"{attention_bytes / 2**30:.2f} GiB)")
        start = memory.allocated()
        runner = make_runner(1 + -(-worst.max_model_len // page_size))
        resident = memory.allocated() - start - runner.kv_cache.nbytes
        for processor in (LogitBias, Penalties):
            runner.sampler.add_processor(processor)
        pages = list(range(1, runner.kv_cache.num_pages))  # every page but the scratch page
        rows = worst_step(
            pages, worst.max_num_seqs, worst.chunk_size, worst.max_model_len, worst.max_proposed
        )
        step = _peak_of(memory, lambda: sample_every_row(runner, rows))
        graph_pool = 0
        if runner.graphs is not None:
            decodes = worst_step(pages, runner.graphs.buckets[-1], 0, worst.max_model_len)
            graph_pool = _peak_of(memory, lambda: runner.forward(runner.prepare(decodes)))
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
    rows = worst_step(
        [], worst.max_num_seqs, worst.chunk_size, worst.max_model_len, worst.max_proposed
    )
    q_lens = [len(row.token_ids) for row in rows]
    kv_lens = [row.start + len(row.token_ids) for row in rows]
    return backend_class.step_memory(
        shape, page_size, dtype, kv_dtype, q_lens, kv_lens, num_graph_buckets
    )


def worst_step(
    pages: list[int], num_decodes: int, chunk_size: int, length: int, num_proposed: int = 0
) -> list[Row]:
    """`num_decodes` decodes, each with `num_proposed` tokens appended to verify, and, if
    `chunk_size`, a prefill chunk, every one of them ending at `length` tokens, all on the
    same `pages` and all sampled."""
    chunk = [min(chunk_size, length)] if chunk_size else []
    rows = []
    for index, num_new in enumerate(chunk + [1 + num_proposed] * num_decodes):
        appended = num_new - 1 if index >= len(chunk) else 0  # tokens past the request's own
        request = Request(f"profile-{index}", [PADDING_TOKEN_ID] * (length - appended),
                          EVERY_SAMPLING_OPTION, pages=pages)
        rows.append(Row(request, length - num_new, [PADDING_TOKEN_ID] * num_new, 1 + appended))
    return rows


def sample_every_row(runner: ModelRunner, rows: list[Row]) -> None:
    """Run a step as every step runs (`ModelRunner.forward`: on a split model each rank its
    slice, in step with the others) and sample every row of logits it computes (a
    verification samples each of a row's rows: the sampler's largest call). Only rank 0
    gets logits and samples."""
    logits = runner.forward(runner.prepare(rows))
    if logits is not None:
        runner.sampler.sample(logits, [row.request for row in rows for _ in range(row.num_sampled)])


def _peak_of(memory: MemoryCounters, run: Callable[[], object]) -> int:
    """Bytes `run` allocates at its peak beyond what was allocated before it."""
    before = memory.allocated()
    memory.reset_peak()
    run()
    return memory.peak() - before
