"""The model runner: everything that touches the model's device, behind `run(batch)`.

The engine thinks in requests; the runner turns one step of them into tokens. It owns:

* **the model**, loaded from the checkpoint (`loader.py`);
* **the KV pool**, sized once at start-up by `num_kv_pages()`: what the user asked for,
  or on a GPU what is left after the weights, the attention and graph buffers, the
  biggest step's activations and the graph pool (measured by `memory_profile.py`), or on
  a CPU a stated share of the available memory;
* **the attention backend**: flashinfer on CUDA when its kernels build and run for the
  model (and its KV cache dtype), else the fast torch backend (`attention_backend` picks
  one by name; "reference" is the textbook one);
* **the decode CUDA graphs** (`cuda_graph.py`), captured at start-up;
* **the sampler**.

On CUDA everything runs with the model's device made current (`on_device`): graph
capture, events and streams use the current device, and each thread has its own, so a
step run by a server's engine thread on `cuda:1` would otherwise record on `cuda:0`.

Each step, `run(batch)` lays the batch out (`batch.py`), plans attention once, runs the
forward pass (replaying a graph for decode-only batches that fit a bucket), and samples
the next token of every request whose last token was computed, or, for a request
carrying draft tokens, verifies them (`verification.py`). Prompt rows a request asked
to score are scored first (`logprobs.py`); a step that ends an embedding request's prompt
runs eagerly and keeps that row's final hidden state (`pooling.py`).

With a draft model (`speculative.py`), a second runner runs it on a pool that mirrors
this one page for page: this runner's pool is sized for both models' bytes per page.

With tensor parallelism (`parallel.py`, `distributed.py`) every rank has a runner over
its slice of the model and a pool of its heads. Rank 0's `forward` sends the step's
inputs to the others before all of them run `forward_shard`; the logits come back to
rank 0 alone, which samples.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

import psutil
import torch

from nanoqwen.attention.base import AttentionBackend
from nanoqwen.attention.registry import attention_backend_class
from nanoqwen.config import EngineConfig
from nanoqwen.memory.kv_pool import KVPool
from nanoqwen.model.config import ModelConfig
from nanoqwen.model.qwen import QwenForCausalLM
from nanoqwen.parallel.sharding import SINGLE, TensorParallel
from nanoqwen.parallel.workers import Workers
from nanoqwen.runner.cuda_graph import DecodeGraphRunner, decode_buckets
from nanoqwen.runner.memory_profile import CudaMemory, kv_budget, profile_overhead
from nanoqwen.runner.step_inputs import StepInputs, build_step_inputs
from nanoqwen.sampling.logprobs import score_prompts
from nanoqwen.sampling.pooling import record_embeddings
from nanoqwen.sampling.sampler import Sampler
from nanoqwen.scheduling.batch import ScheduledBatch
from nanoqwen.scheduling.request import Request
from nanoqwen.speculative.verification import sample_with_drafts
from nanoqwen.weights.checkpoint import Checkpoint
from nanoqwen.weights.loader import load_model

logger = logging.getLogger(__name__)

# On the CPU the pool shares RAM with everything else, so it takes this share of what is
# available, and never more than every sequence at full length could use.
CPU_KV_CACHE_FRACTION = 0.2


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
        config: EngineConfig,
        checkpoint: Checkpoint,
        max_model_len: int,
        tp: TensorParallel = SINGLE,
        workers: Workers | None = None,  # rank 0's handle on the other ranks
        num_pages: int | None = None,  # given: a draft model's pool, mirroring the target's
        draft_model_config: ModelConfig | None = None,  # a draft model sharing this pool's pages
    ) -> None:
        self.config, self.tp, self.workers = config, tp, workers
        model_config = checkpoint.model_config
        self.draft_model_config = draft_model_config
        self.vocab_size = model_config.vocab_size
        self.model_config = tp.shard_config(model_config)  # the heads this rank holds
        self.device = exact_device(config.device)
        self.max_model_len = max_model_len
        with on_device(self.device):
            self.model = load_model(
                checkpoint, config.dtype, self.device,
                quantization=config.quantization, tp=tp,
            )
            self.sampler = Sampler()
            # Chosen before the pool: on CUDA, sizing the pool runs the model through it.
            self.backend_class = attention_backend_class(config, model_config, self.device)
            self.decode_buckets = decode_buckets(config, model_config, self.backend_class)
            # Every rank's pool has the same pages: as many as the tightest rank can hold.
            self.pool = self._make_pool(num_pages or tp.min_over_ranks(self.num_kv_pages()))
            self.backend = self._make_backend(self.pool)
            self.decode_graphs = (
                DecodeGraphRunner(self.model, self.backend, self.decode_buckets, max_model_len)
                if self.decode_buckets
                else None
            )
            if self.decode_graphs is not None:
                self.decode_graphs.capture_all()  # on every rank, the same buckets

    # ----------------------------------------------------------------- the step
    def run(self, batch: ScheduledBatch) -> list[tuple[Request, list[int]]]:
        """Run one step; return the new tokens of every request it reached the end of: one,
        or with draft tokens, the accepted drafts and one more."""
        with on_device(self.device):
            inputs = self.prepare(batch)
            logits = self.forward(inputs)
            return list(zip(inputs.sampled_requests, self.sample(logits, inputs)))

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        bucket = self.decode_graphs.bucket_for(batch) if self.decode_graphs else None
        # With other ranks, the inputs are laid out on the host, where they are sent from.
        device = self.device if self.workers is None else torch.device("cpu")
        return build_step_inputs(batch, self.pool.page_size, device, pad_to=bucket or 0)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits for the sampled rows, `[S, vocab]`."""
        if self.workers is None:
            return self.forward_shard(inputs)
        with self.workers.step():
            return self.forward_shard(self.workers.broadcast(inputs, self.device))

    def forward_shard(self, inputs: StepInputs) -> torch.Tensor | None:
        """This rank's part of the forward pass; the full logits on rank 0, None elsewhere."""
        if inputs.pooled_rows:
            logits = self._forward_pooling(inputs)
        elif self.decode_graphs is not None and self.decode_graphs.handles(inputs.metadata):
            logits = self.decode_graphs.forward(inputs)
        else:
            self.backend.plan(inputs.metadata)
            logits = self.model(inputs.input_ids, inputs.metadata, self.backend, inputs.sample_rows)
        return self.tp.gather_logits(logits, self.vocab_size)

    @torch.inference_mode()
    def _forward_pooling(self, inputs: StepInputs) -> torch.Tensor:
        """An eager forward pass that also hands each embedding request its row's final
        hidden state (graphs keep only logits)."""
        self.backend.plan(inputs.metadata)
        hidden = self.model.hidden_states(inputs.input_ids, inputs.metadata, self.backend)
        rows = hidden[inputs.sample_rows]
        record_embeddings(self.model.model.norm(rows), inputs.pooled_rows)
        return self.model.compute_logits(rows)

    def sample(self, logits: torch.Tensor, inputs: StepInputs) -> list[list[int]]:
        if inputs.prompt_rows:  # the rows after the sampled ones
            num_sampled = sum(inputs.num_sampled_rows)
            score_prompts(logits[num_sampled:], inputs.prompt_rows)
            logits = logits[:num_sampled]
        if not inputs.sampled_requests:
            return []
        return sample_with_drafts(self.sampler, logits, inputs.sampled_requests)

    # ----------------------------------------------------------------- KV sizing
    def num_kv_pages(self) -> int:
        """How many pages the KV pool gets, the scratch page included.

        Asked for in pages, or in bytes; otherwise a share of the memory. On a GPU that is
        `gpu_memory_utilization` of the device (or the `kv_cache_memory` fraction of what
        is free), less what the engine needs beside its weights and the pool, measured by
        `memory_profile.py`; on a CPU, a stated share of the available RAM.
        """
        config = self.config
        if config.num_pages is not None:
            return config.num_pages
        asked = config.kv_cache_memory
        if asked is not None and asked > 1:
            memory = asked
        elif self.device.type == "cuda":
            memory = self._cuda_kv_memory(fraction=asked)
        else:
            memory = self._cpu_kv_memory(fraction=asked)
        return max(2, int(memory // self._page_bytes()) + 1)

    def _page_bytes(self) -> int:
        """Bytes of one page: this model's K/V, plus a draft model's for the same tokens."""
        return sum(
            KVPool.bytes_per_page(
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.config.page_size,
                self.config.kv_storage_dtype, self.backend_class.per_vector_kv_scales,
            )
            for cfg in (self.model_config, self.draft_model_config)
            if cfg is not None
        )

    def _draft_weight_bytes(self) -> int:
        """What a draft model's weights will take, counted on the meta device (no memory)."""
        if self.draft_model_config is None:
            return 0
        with torch.device("meta"):
            draft = QwenForCausalLM(self.draft_model_config)
        return sum(p.numel() for p in draft.parameters()) * self.config.dtype.itemsize

    def _cpu_kv_memory(self, fraction: float | None) -> float:
        # Tensor-parallel ranks on a CPU share its memory.
        available = psutil.virtual_memory().available / self.tp.size
        if fraction is not None:
            return fraction * available
        pages_per_sequence = -(-self.max_model_len // self.config.page_size)
        every_sequence_full = self.config.max_num_seqs * pages_per_sequence * self._page_bytes()
        return min(CPU_KV_CACHE_FRACTION * available, every_sequence_full)

    def _cuda_kv_memory(self, fraction: float | None) -> float:
        overhead = profile_overhead(
            self.model, GatheredSampler(self.sampler, self.tp, self.vocab_size),
            self.backend_class, self._make_pool, self.config, self.max_model_len,
            self.decode_buckets, CudaMemory(self.device),
        )
        torch.cuda.empty_cache()  # so that `free` counts what the profile left cached
        free, total = torch.cuda.mem_get_info(self.device)
        free -= self._draft_weight_bytes()  # loaded once this pool is sized
        budget = kv_budget(free, total, overhead, fraction, self.config.gpu_memory_utilization)
        logger.info("KV cache: %.2f GiB; the rest of the engine needs %s", budget / 2**30, overhead)
        return budget

    def _make_pool(self, num_pages: int) -> KVPool:
        cfg = self.model_config
        return KVPool(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.config.page_size, num_pages,
            self.config.dtype, self.device, storage_dtype=self.config.kv_storage_dtype,
            per_vector_scales=self.backend_class.per_vector_kv_scales,
        )

    def _make_backend(self, pool: KVPool) -> AttentionBackend:
        cfg = self.model_config
        return self.backend_class(pool, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)


class GatheredSampler:
    """The sampler as a tensor-parallel step uses it: the vocabulary slices of the logits
    joined on rank 0, which alone samples. What the memory profile must measure."""

    def __init__(self, sampler: Sampler, tp: TensorParallel, vocab_size: int) -> None:
        self.sampler, self.tp, self.vocab_size = sampler, tp, vocab_size

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[list[int]]:
        logits = self.tp.gather_logits(logits, self.vocab_size)
        return [] if logits is None else sample_with_drafts(self.sampler, logits, requests)
