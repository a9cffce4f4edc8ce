"""The model runner: everything that touches the model's device, behind `run(batch)`.

The engine thinks in requests; the runner turns one step of them into tokens. It owns:

* **the model**, loaded from the checkpoint (`loader.py`);
* **the KV pool**, sized once at start-up by `num_kv_pages()`: what the user asked for,
  or on a GPU what is left after the weights and the biggest step's activations, or on a
  CPU a stated share of the available memory;
* **the attention backend**: flashinfer on CUDA when it can run the model, else the fast
  torch backend (`attention_backend` picks one by name; "reference" is the textbook one);
* **the decode CUDA graphs** (`cuda_graph.py`), captured at start-up;
* **the sampler**.

Each step, `run(batch)` lays the batch out (`batch.py`), plans attention once, runs the
forward pass (replaying a graph for decode-only batches that fit a bucket), and samples
the next token of every request whose last token was computed.
"""

from __future__ import annotations

import logging

import psutil
import torch

from nanoqwen.attention import AttentionBackend, ReferenceBackend
from nanoqwen.attention_flashinfer import FlashInferBackend, flashinfer_unsupported_reason
from nanoqwen.attention_torch import TorchBackend
from nanoqwen.batch import PADDING_ROW_TOKEN_ID, ScheduledBatch, StepInputs, build_step_inputs
from nanoqwen.config import EngineConfig, ModelConfig
from nanoqwen.cuda_graph import DecodeGraphRunner, decode_buckets
from nanoqwen.kv_pool import KVPool
from nanoqwen.loader import load_model
from nanoqwen.request import Request
from nanoqwen.sampler import Sampler, SamplingParams

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "reference": ReferenceBackend,
    "torch": TorchBackend,
    "flashinfer": FlashInferBackend,
}
# On the CPU the pool shares RAM with everything else, so it takes this share of what is
# available, and never more than every sequence at full length could use.
CPU_KV_CACHE_FRACTION = 0.2


def attention_backend_class(
    name: str | None, device: torch.device, head_dim: int, dtype: torch.dtype
) -> type[AttentionBackend]:
    """The backend asked for by name; otherwise flashinfer on CUDA when it can run the
    model, the torch backend everywhere else."""
    if name is not None:
        return ATTENTION_BACKENDS[name]
    if device.type != "cuda":
        return TorchBackend
    reason = flashinfer_unsupported_reason(head_dim, dtype)
    if reason is None:
        return FlashInferBackend
    logger.warning("%s; falling back to the slower torch attention backend", reason)
    return TorchBackend


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, checkpoint: str, max_model_len: int
    ) -> None:
        self.config, self.model_config = config, model_config
        self.device: torch.device = config.device
        self.max_model_len = max_model_len
        self.model = load_model(
            checkpoint, model_config, config.dtype, self.device, quantization=config.quantization
        )
        self.sampler = Sampler()
        # Chosen before the pool: on CUDA, sizing the pool runs the model through them.
        self.backend_class = attention_backend_class(
            config.attention_backend, self.device, model_config.head_dim, config.dtype
        )
        self.decode_buckets = decode_buckets(config, model_config, self.backend_class)
        self.pool = self._make_pool(self.num_kv_pages())
        self.backend = self._make_backend(self.pool)
        self.decode_graphs = (
            DecodeGraphRunner(self.model, self.backend, self.decode_buckets, max_model_len)
            if self.decode_buckets
            else None
        )

    # ----------------------------------------------------------------- the step
    def run(self, batch: ScheduledBatch) -> list[tuple[Request, int]]:
        """Run one step; return the next token of every request it reached the end of."""
        inputs = self.prepare(batch)
        logits = self.forward(inputs)
        return list(zip(inputs.sampled_requests, self.sample(logits, inputs)))

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        bucket = self.decode_graphs.bucket_for(batch) if self.decode_graphs else None
        return build_step_inputs(batch, self.pool.page_size, self.device, pad_to=bucket or 0)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits for the sampled rows, `[S, vocab]`."""
        if self.decode_graphs is not None and self.decode_graphs.handles(inputs.metadata):
            return self.decode_graphs.forward(inputs)
        self.backend.plan(inputs.metadata)
        return self.model(inputs.input_ids, inputs.metadata, self.backend, inputs.sample_rows)

    def sample(self, logits: torch.Tensor, inputs: StepInputs) -> list[int]:
        if not inputs.sampled_requests:
            return []
        return self.sampler.sample(logits, inputs.sampled_requests)

    # ----------------------------------------------------------------- KV sizing
    def num_kv_pages(self) -> int:
        """How many pages the KV pool gets: asked for in pages or bytes, or what fits."""
        if self.config.num_pages is not None:
            return self.config.num_pages
        memory = self.config.kv_cache_memory
        if memory is not None and memory <= 1:  # a fraction of what is free
            memory *= self._available_memory()
        if memory is None:
            memory = self._cuda_kv_memory() if self.device.type == "cuda" else self._cpu_kv_memory()
        return max(2, int(memory // self._page_bytes()) + 1)

    def _page_bytes(self) -> int:
        cfg = self.model_config
        return KVPool.bytes_per_page(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.config.page_size, self.config.dtype
        )

    def _available_memory(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        return psutil.virtual_memory().available

    def _cpu_kv_memory(self) -> float:
        pages_per_sequence = -(-self.max_model_len // self.config.page_size)
        every_sequence_full = self.config.max_num_seqs * pages_per_sequence * self._page_bytes()
        return min(CPU_KV_CACHE_FRACTION * self._available_memory(), every_sequence_full)

    def _cuda_kv_memory(self) -> float:
        """`gpu_memory_utilization` of the GPU, less what everything but the KV pool needs.

        That is what is in use now (weights, the CUDA context), the peak of the biggest
        step (a full prefill chunk plus a decode token for every sequence, all sampled),
        and the graph pool, which holds the temporaries of the largest decode bucket for good.
        """
        config = self.config
        num_seqs = config.max_num_seqs
        activations = self._profile_step_memory(config.chunk_size + num_seqs, num_seqs)
        if self.decode_buckets:
            largest = self.decode_buckets[-1]
            activations += self._profile_step_memory(largest, largest)
        torch.cuda.empty_cache()  # so that `free` counts what the profiling runs left cached
        free, total = torch.cuda.mem_get_info(self.device)
        budget = config.gpu_memory_utilization * total - (total - free) - activations
        if budget <= 0:
            gib = 2**30
            raise ValueError(
                f"no GPU memory left for the KV cache: {(total - free) / gib:.1f} GiB in use and "
                f"{activations / gib:.1f} GiB for activations exceed gpu_memory_utilization="
                f"{config.gpu_memory_utilization} of {total / gib:.1f} GiB; lower max_num_seqs "
                "or chunk_size, or raise gpu_memory_utilization"
            )
        return budget

    def _profile_step_memory(self, num_tokens: int, num_sequences: int) -> int:
        """Peak CUDA bytes one step allocates beyond the weights and the KV pool.

        The step computes `num_tokens` prompt tokens spread over `num_sequences` requests,
        all sampled with top-p (the sampler's hungriest path), through a fresh attention
        backend, so its buffers are counted too. It runs on a throwaway pool in which every
        request shares the same pages: only the memory is of interest, not the values.
        """
        share, rest = divmod(num_tokens, num_sequences)
        lengths = [share + (i < rest) for i in range(num_sequences)]
        num_pages = -(-lengths[0] // self.config.page_size)
        pool = self._make_pool(num_pages + 1)
        pages = pool.allocate(num_pages)
        params = SamplingParams(top_p=0.9)
        requests = [
            Request(f"profile-{i}", [PADDING_ROW_TOKEN_ID] * length, params, pages=pages)
            for i, length in enumerate(lengths)
        ]
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        backend = self._make_backend(pool)
        inputs = build_step_inputs(ScheduledBatch(requests, lengths), pool.page_size, self.device)
        backend.plan(inputs.metadata)
        logits = self.model(inputs.input_ids, inputs.metadata, backend, inputs.sample_rows)
        self.sample(logits, inputs)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before

    def _make_pool(self, num_pages: int) -> KVPool:
        cfg = self.model_config
        return KVPool(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.config.page_size, num_pages,
            self.config.dtype, self.device,
        )

    def _make_backend(self, pool: KVPool) -> AttentionBackend:
        cfg = self.model_config
        return self.backend_class(pool, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
