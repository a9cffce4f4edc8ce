"""CUDA graphs for decode steps: record the forward pass once, replay it every step.

A decode step launches hundreds of small kernels, and on a GPU launching them from Python
takes longer than running them; a CUDA graph replays a recorded forward pass with one
call. A graph is frozen (same kernels, shapes and addresses every replay), so decode is
fitted to it:

* buckets: one graph per batch size (1, 2, 4, 8, then every multiple of 8 up to
  `max_num_seqs`, at most 256); a step of B decodes is padded to the smallest bucket;
* static buffers: each step's ids, positions, slots and page table are copied into tensors
  that never move, shared by all buckets; the final hidden states land in another (the
  lm_head runs after the replay, outside the graph);
* padding rows are one-token requests on the scratch page (`memory/page_allocator.py`),
  never sampled;
* the attention backend's `plan` runs before each replay, outside the graph, writing into
  buffers the captured kernels read (`attention/flashinfer_backend.py`).

Graphs are captured at start-up, largest first, sharing one memory pool. Prefill, mixed
and oversized steps run eagerly. On the CPU there are no graphs, but asking for
`decode_buckets` runs the same padding and buffers, which is how the tests check them.

Invariant: a replayed step computes exactly what the eager step would for its real rows;
padding rows write only to the scratch page. The story: docs/learn/10-cuda-graphs.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from nanoqwen.attention.base import (
    PAGE_TABLE_TENSORS,
    AttentionBackend,
    AttentionMetadata,
)
from nanoqwen.model.qwen import QwenForCausalLM
from nanoqwen.runner.runner import StepInputs
from nanoqwen.scheduling.scheduler import Row

if TYPE_CHECKING:
    from nanoqwen.memory.state_pool import StateStep

logger = logging.getLogger(__name__)

# Bigger decode steps run long enough that launch overhead no longer matters.
MAX_BUCKET = 256
DEFAULT_BUCKETS = [1, 2, 4, 8, *range(16, MAX_BUCKET + 1, 8)]


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to the first bucket that holds `max_num_seqs` (capped)."""
    last = bisect.bisect_left(DEFAULT_BUCKETS, min(max_num_seqs, MAX_BUCKET))
    return DEFAULT_BUCKETS[: last + 1]


def can_capture(
    device: torch.device, backend_class: type[AttentionBackend], rope_type: str
) -> bool:
    """Graphs need CUDA, a backend that plans into fixed buffers, and a forward pass that
    never reads device values on the host (dynamic RoPE does, to pick its scaling)."""
    return device.type == "cuda" and backend_class.supports_cuda_graphs and rope_type != "dynamic"


def decode_buckets(
    asked: list[int] | None,
    max_num_seqs: int,
    device: torch.device,
    backend_class: type[AttentionBackend],
    rope_type: str,
) -> list[int]:
    """The batch sizes decode steps are padded to (`asked`, or the defaults where graphs
    can be captured); none means every step runs eagerly."""
    if asked is not None:
        return list(asked)
    if not can_capture(device, backend_class, rope_type):
        return []
    return default_buckets(max_num_seqs)


class DecodeGraphRunner:
    """Runs decode steps padded to a bucket through static buffers, replaying a CUDA graph
    per bucket where graphs can be captured, and calling the model eagerly elsewhere."""

    def __init__(
        self,
        model: QwenForCausalLM,
        backend: AttentionBackend,
        buckets: list[int],
        max_model_len: int,
    ) -> None:
        self.model = model
        self.backend = backend
        self.buckets = sorted(buckets)
        self.page_size = backend.kv_cache.page_size
        self.device = backend.kv_cache.kv.device
        largest = self.buckets[-1]
        max_pages = largest * -(-max_model_len // self.page_size)
        int32 = {"dtype": torch.int32, "device": self.device}
        int64 = {"dtype": torch.int64, "device": self.device}
        self.input_ids = torch.zeros(largest, **int64)
        self.state_slots = torch.zeros(largest, **int64)  # a recurrent model's rows' slots
        self.static = AttentionMetadata(
            qo_indptr=torch.zeros(largest + 1, **int32),
            kv_indptr=torch.zeros(largest + 1, **int32),
            kv_indices=torch.zeros(max_pages, **int32),
            kv_last_page_len=torch.zeros(largest, **int32),
            positions=torch.zeros(largest, **int64),
            slot_mapping=torch.zeros(largest, **int64),
            max_q_len=1,
            max_kv_len=0,
            # The host copies are the step's own (`load`): flashinfer plans from them.
            qo_indptr_host=torch.zeros(0, **int32),
            kv_indptr_host=torch.zeros(0, **int32),
            kv_last_page_len_host=torch.zeros(0, **int32),
        )
        # Every row of a bucket gets its hidden state: a graph cannot know which rows are
        # padding.
        self.all_rows = torch.arange(largest, device=self.device)
        self.hidden = torch.zeros(
            largest, model.config.hidden_size, dtype=model.model.norm.weight.dtype,
            device=self.device,
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if backend.supports_cuda_graphs:
            for bucket in self.buckets:
                backend.bind_graph_buffers(
                    bucket,
                    self.static.kv_indptr[: bucket + 1],
                    self.static.kv_indices,
                    self.static.kv_last_page_len[:bucket],
                )

    # ----------------------------------------------------------------- per step
    def bucket_for(self, rows: list[Row]) -> int:
        """The bucket a decode-only step pads to; 0 (eager) for other steps and oversized
        ones."""
        if len(rows) > self.buckets[-1] or any(len(row.token_ids) != 1 for row in rows):
            return 0
        return self.buckets[bisect.bisect_left(self.buckets, len(rows))]

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states of the sampled rows, `[S, hidden]`, of a step padded to a
        bucket."""
        metadata, states = self.load(inputs)
        self.backend.plan(metadata)
        graph = self.graphs.get(inputs.bucket)
        if graph is not None:
            graph.replay()
        else:
            self.run_model(metadata, states)
        return self.hidden[inputs.sample_rows]

    def load(self, inputs: StepInputs) -> tuple[AttentionMetadata, StateStep | None]:
        """Copy a step into the static buffers; return its page table (and the state pool's
        part, for a model with recurrent layers) viewing them."""
        self.input_ids[: inputs.input_ids.numel()].copy_(inputs.input_ids)
        views = {}
        for name in PAGE_TABLE_TENSORS:
            step_tensor = getattr(inputs.metadata, name)
            views[name] = getattr(self.static, name)[: step_tensor.numel()]
            views[name].copy_(step_tensor)
        states = inputs.states
        if states is not None:
            slots = self.state_slots[: states.slots.numel()]
            states = dataclasses.replace(states, slots=slots.copy_(states.slots))
        # Host-side fields (sizes, the host copies flashinfer plans from) stay the step's.
        return dataclasses.replace(inputs.metadata, **views), states

    def run_model(self, metadata: AttentionMetadata, states: StateStep | None) -> None:
        bucket = metadata.batch_size
        hidden = self.model(self.input_ids[:bucket], metadata, self.backend,
                            self.all_rows[:bucket], states)
        self.hidden[:bucket].copy_(hidden)

    # ----------------------------------------------------------------- start-up
    def capture_all(self, padding_step: Callable[[int], StepInputs]) -> None:
        """Record every bucket's graph, where graphs can be captured (a no-op elsewhere),
        from `padding_step(bucket)`: a step of padding rows only, laid out as any step is.

        Capture records on the current CUDA device, so the caller makes the cache's current.
        Each runner captures on a stream of its own, on its own device: torch's default
        capture stream belongs to whichever device captured first in the process.
        """
        if not can_capture(self.device, type(self.backend), self.model.config.rope_type):
            return
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        stream = torch.cuda.Stream(self.device)
        pool = None
        # Largest first: the smaller graphs then fit in the pool the largest one made.
        for bucket in reversed(self.buckets):
            pool = self.capture(padding_step(bucket), stream, pool)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs for batch sizes %d-%d in %.1f s (%.0f MiB)",
            len(self.graphs), self.buckets[0], self.buckets[-1], time.perf_counter() - start,
            (torch.cuda.memory_reserved(self.device) - reserved) / 2**20,
        )

    def capture(
        self, step: StepInputs, stream: torch.cuda.Stream, pool: tuple[int, int] | None
    ) -> tuple[int, int]:
        """Record the forward pass of a padding step; return the graph's memory pool."""
        metadata, states = self.load(step)
        self.backend.plan(metadata)
        # Lazy set-up (loading kernels, creating library handles) cannot happen during a
        # capture, so run once eagerly first.
        self.run_model(metadata, states)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self.run_model(metadata, states)
        self.graphs[step.bucket] = graph
        return graph.pool()
