"""The model runner: everything that touches the model's device, behind `run(batch)`.

The engine thinks in requests; the runner turns one step of them into tokens. It owns the
model (loaded by `weights/loader.py`, this rank's slice when split), the attention backend
(`attention/registry.py` picks it), the KV cache on the device (`memory/kv_cache.py`) and
the step pipeline with its decode CUDA graphs (`pipeline.py`, `cuda_graph.py`). The cache
is sized once: the runner reports what a page costs and, on a GPU, what the rest of the
engine needs (`measure_overhead`), `plan_kv_pages` decides, `allocate_kv_cache` makes it.
Which page is whose is the engine's business, never the runner's.

On CUDA everything runs with the model's device made current (`on_device`), since graph
capture, events and streams follow the current device, which is per thread.

Split across ranks, every rank has a runner over its slice and a cache of its heads with
the same pages; rank 0's `forward` broadcasts the laid-out step (the one place the runner
talks to the other ranks), every rank runs it, and rank 0 alone gets the logits and
chooses tokens. The story: docs/learn/01-forward-pass-and-kv-cache.md and, for the
split, docs/learn/11-tensor-parallelism.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial

import psutil
import torch

from nanoqwen.attention.base import AttentionBackend
from nanoqwen.attention.registry import attention_backend_class
from nanoqwen.memory.kv_cache import KVCache
from nanoqwen.memory.sizing import (
    KVBudget,
    Overhead,
    WorstStep,
    cpu_kv_memory,
    gpu_kv_memory,
    pages_for,
)
from nanoqwen.model.layers import split_across
from nanoqwen.parallel.launch import ALONE, Ranks
from nanoqwen.parallel.step_broadcast import WireStep
from nanoqwen.runner.cpu_threads import CpuThreads
from nanoqwen.runner.cuda_graph import DecodeGraphRunner, decode_buckets
from nanoqwen.runner.memory_profile import (
    CudaMemory,
    profile_overhead,
    worst_step_attention_bytes,
)
from nanoqwen.runner.pipeline import StepPipeline, TokenChooser, sample_one_each
from nanoqwen.runner.step_inputs import StepInputs
from nanoqwen.sampling.sampler import Sampler
from nanoqwen.scheduling.batch import ScheduledBatch
from nanoqwen.scheduling.request import Request
from nanoqwen.weights.checkpoint import Checkpoint
from nanoqwen.weights.loader import load_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerSettings:
    """The engine settings a runner uses (`EngineConfig`'s fields of the same names)."""

    device: torch.device
    dtype: torch.dtype
    page_size: int
    max_model_len: int
    max_num_seqs: int  # for the default decode buckets
    kv_storage_dtype: torch.dtype  # the dtype pages are stored in
    quantization: str | None = None
    attention_backend: str | None = None
    decode_buckets: list[int] | None = None
    enforce_eager: bool = False


def on_device(device: torch.device) -> AbstractContextManager[object]:
    """Make `device` the current CUDA device for a while (nothing to do on a CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def exact_device(device: torch.device) -> torch.device:
    """`cuda` means the current CUDA device: name it, so it stays the same from any thread."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class ModelRunner:
    def __init__(
        self,
        checkpoint: Checkpoint,
        settings: RunnerSettings,
        ranks: Ranks = ALONE,
        choose_tokens: TokenChooser = sample_one_each,
    ) -> None:
        self.settings, self.ranks, self.tp = settings, ranks, ranks.tp
        self.choose_tokens = choose_tokens
        self.device = exact_device(ranks.device or settings.device)
        self.max_model_len = settings.max_model_len
        self.vocab_size = checkpoint.model_config.vocab_size
        with on_device(self.device), split_across(self.tp):
            self.model = load_model(checkpoint, settings.dtype, self.device, settings.quantization)
        self.shape = self.model.attention_shape  # this rank's heads
        self.sampler = Sampler()
        # Chosen before the cache: on CUDA, sizing the cache runs the model through it.
        with on_device(self.device):
            self.backend_class = attention_backend_class(
                settings.attention_backend, self.shape, settings.page_size, settings.dtype,
                settings.kv_storage_dtype, self.device,
            )
        self.decode_buckets = decode_buckets(
            settings.decode_buckets, settings.enforce_eager, settings.max_num_seqs,
            self.device, self.backend_class, checkpoint.model_config.rope_type,
        )
        self.kv_cache: KVCache | None = None
        self.pipeline: StepPipeline | None = None
        self.cpu_threads = CpuThreads(self.device)

    # ----------------------------------------------------------------- the step
    def run(self, batch: ScheduledBatch) -> list[tuple[Request, list[int]]]:
        """Run one step; return the new tokens of every request it reached the end of: one,
        or for a request with proposed tokens, the accepted ones and one more."""
        inputs = self.prepare(batch)
        return self.sample(self.forward(inputs), inputs)

    def logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """The logits of a batch's sampled rows, without choosing tokens (a proposer's)."""
        return self.forward(self.prepare(batch))

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        with on_device(self.device):
            return self.pipeline.prepare(batch)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits for the sampled rows; the other ranks, if any, run the same step."""
        workers = self.ranks.workers
        with on_device(self.device), self.cpu_threads.step():
            if workers is None:
                return self.pipeline.forward(inputs)
            with workers.step():
                workers.broadcast(inputs.to_wire())
                return self.pipeline.forward(inputs.to(self.device))

    def sample(
        self, logits: torch.Tensor, inputs: StepInputs
    ) -> list[tuple[Request, list[int]]]:
        with on_device(self.device):
            return self.pipeline.sample(logits, inputs)

    def forward_from_wire(self, step: WireStep) -> None:
        """Another rank's part of a step rank 0 broadcast."""
        with on_device(self.device), self.cpu_threads.step():
            self.pipeline.forward(StepInputs.from_wire(step).to(self.device))

    # ----------------------------------------------------------------- the KV cache
    @property
    def page_bytes(self) -> int:
        """Bytes of one page of this model's K/V."""
        shape = self.shape
        return KVCache.bytes_per_page(
            shape.num_layers, shape.num_kv_heads, shape.head_dim, self.settings.page_size,
            self.settings.kv_storage_dtype, self.backend_class.per_vector_kv_scales,
        )

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache on every rank together."""
        return self.kv_cache.nbytes * self.tp.size

    def measure_overhead(self, worst: WorstStep) -> Overhead:
        """What this model needs on its GPU beside its weights and its KV cache (see
        `memory_profile.py`); nothing is measured on a CPU."""
        if self.device.type != "cuda":
            return Overhead()
        settings = self.settings
        attention_bytes = worst_step_attention_bytes(
            self.backend_class, self.shape, settings.page_size, settings.dtype,
            settings.kv_storage_dtype, worst, len(self.decode_buckets),
        )
        with on_device(self.device):
            overhead = profile_overhead(
                self._make_cache, self._make_pipeline, worst, settings.page_size,
                CudaMemory(self.device), self.backend_class.__name__, attention_bytes,
            )
            torch.cuda.empty_cache()  # so that `free` counts what the profile left cached
        return overhead

    def allocate_kv_cache(self, num_pages: int) -> None:
        """Make the KV cache, and the pipeline and graphs that read it."""
        with on_device(self.device):
            self.kv_cache = self._make_cache(num_pages)
            self.pipeline = self._make_pipeline(self.kv_cache)
            self.pipeline.capture_graphs()  # on every rank, the same buckets

    @property
    def backend(self) -> AttentionBackend:
        return self.pipeline.backend

    @property
    def decode_graphs(self) -> DecodeGraphRunner | None:
        return self.pipeline.graphs

    def min_over_ranks(self, value: int) -> int:
        return self.tp.min_over_ranks(value)

    @property
    def num_ranks_on_host(self) -> int:
        """How many ranks share this machine's memory (on a CPU, all of them)."""
        return self.tp.size if self.device.type == "cpu" else 1

    def _make_cache(self, num_pages: int) -> KVCache:
        shape = self.shape
        return KVCache(
            shape.num_layers, shape.num_kv_heads, shape.head_dim, self.settings.page_size,
            num_pages, self.settings.dtype, self.device,
            storage_dtype=self.settings.kv_storage_dtype,
            per_vector_scales=self.backend_class.per_vector_kv_scales,
        )

    def _make_pipeline(self, kv_cache: KVCache) -> StepPipeline:
        shape = self.shape
        backend: AttentionBackend = self.backend_class(
            kv_cache, shape.num_heads, shape.num_kv_heads, shape.head_dim
        )
        graphs = (
            DecodeGraphRunner(self.model, backend, self.decode_buckets, self.max_model_len)
            if self.decode_buckets
            else None
        )
        # With other ranks, steps are laid out on the host, where they are sent from.
        layout_device = self.device if self.ranks.workers is None else torch.device("cpu")
        return StepPipeline(
            self.model, backend, graphs, self.sampler, self.choose_tokens,
            partial(self.tp.gather_logits, vocab_size=self.vocab_size), layout_device,
        )


def plan_kv_pages(runners: Sequence[ModelRunner], budget: KVBudget, worst: WorstStep) -> int:
    """How many pages every runner's KV cache gets (the scratch page included): all of
    `runners` keep K/V for the same tokens, in caches with the same pages, and every rank
    of a split model calls this in step, to agree on what the tightest one can hold.

    On a GPU, the rest of the engine's needs are measured first (`measure_overheads`)."""
    first = runners[0]
    if budget.num_pages is not None:
        return budget.num_pages
    page_bytes = sum(runner.page_bytes for runner in runners)
    if budget.bytes_asked is not None:
        memory = budget.bytes_asked
    elif first.device.type == "cuda":
        overhead = measure_overheads(runners, worst)
        free, total = torch.cuda.mem_get_info(first.device)
        memory = gpu_kv_memory(
            free, total, overhead, budget.fraction_asked, budget.gpu_memory_utilization
        )
        logger.info("KV cache: %.2f GiB; the rest of the engine needs %s", memory / 2**30, overhead)
    else:
        ram, ranks = psutil.virtual_memory(), first.num_ranks_on_host
        memory = cpu_kv_memory(
            ram.total / ranks, ram.available / ranks, budget.fraction_asked, worst,
            first.settings.page_size, page_bytes,
        )
    return first.min_over_ranks(pages_for(memory, page_bytes))


def measure_overheads(runners: Sequence[ModelRunner], worst: WorstStep) -> Overhead:
    """What `runners` need on the GPU beside their weights and KV caches, each measured
    running its own worst step (`worst_steps`)."""
    steps = worst_steps(worst, len(runners))
    return sum((runner.measure_overhead(step) for runner, step in zip(runners, steps)), Overhead())


def worst_steps(worst: WorstStep, num_runners: int) -> list[WorstStep]:
    """The worst step of each runner of `plan_kv_pages`: the engine's model's, then for the
    others (a proposer's models) the same chunk and sequences without proposed tokens, as
    they compute the model's rows before its proposer attaches any (and then one-token
    rows): they never verify any."""
    return [worst] + [dataclasses.replace(worst, max_proposed=0)] * (num_runners - 1)


def start_runner(
    checkpoint: Checkpoint,
    settings: RunnerSettings,
    budget: KVBudget,
    worst: WorstStep,
    ranks: Ranks,
) -> ModelRunner:
    """A runner with its KV cache, sized in step with the other ranks: how each worker of
    a split model starts (rank 0 does the same, with its proposer's runners beside it)."""
    runner = ModelRunner(checkpoint, settings, ranks)
    runner.allocate_kv_cache(plan_kv_pages([runner], budget, worst))
    return runner
