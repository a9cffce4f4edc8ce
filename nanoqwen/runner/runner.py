"""The model runner: one step of requests in, their new tokens out, on the model's device.

The engine thinks in requests; the runner turns one step of them into tokens, in three
stages that read like the step of any serving engine:

1. **Lay out** (`prepare`): the scheduler's rows become flat tensors: the new tokens of
   every request back to back in one `[T]` vector, each with its position, the page table
   of `attention/base.py` saying whose keys live where, the slot each new K/V goes to, and
   the rows whose logits are sampled (`StepInputs`). A decode-only step that fits a
   CUDA-graph bucket is padded to it here (`cuda_graph.py`): padding rows are one-token
   requests on the scratch page whose results are never read.
2. **Forward**: attention is planned once for all layers, then the model runs (or its
   graph replays), giving the final hidden states of the sampled rows and their logits.
3. **Choose tokens**: the sampler draws each sampled row's next token.

Features attach at three points, and a plain request meets none of them: `choose_tokens`
may be replaced (speculative decoding verifies the tokens it appended to rows), output
hooks may ask for more rows and read them (prompt logprobs, embeddings: `OutputHook`), and
a split model wraps the whole runner (`parallel/`). On a CPU each forward runs on the
cores others leave free (`cpu_threads.py`).

Invariant: the logits of a row depend only on its request's tokens and pages, never on
what else the step holds (in float32; low-precision kernels may round differently by
batch shape). The story: docs/learn/01-forward-pass-and-kv-cache.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from nanoqwen.attention.base import (
    PAGE_TABLE_TENSORS,
    AttentionBackend,
    AttentionMetadata,
)
from nanoqwen.memory.page_allocator import SCRATCH_PAGE
from nanoqwen.model.qwen import QwenForCausalLM
from nanoqwen.runner.cpu_threads import CpuThreads
from nanoqwen.sampling.sampler import Sampler
from nanoqwen.scheduling.scheduler import Row

if TYPE_CHECKING:
    from nanoqwen.memory.state_pool import StateCache, StateStep

# What a padding row feeds the model. Any valid id does: its result is never read.
PADDING_TOKEN_ID = 0
# Each sampled row's new tokens from its `num_sampled` consecutive rows of logits.
TokenChooser = Callable[[Sampler, torch.Tensor, Sequence[Row]], list[list[int]]]


@dataclass
class StepInputs:
    """A step laid out for the model; `sample_rows` index into its `T` new tokens."""

    input_ids: torch.Tensor  # int64 [T]
    metadata: AttentionMetadata
    # int64 [S + E]: the rows whose hidden states and logits are computed: the S sampled
    # ones, then the E extra rows output hooks asked for.
    sample_rows: torch.Tensor
    sampled: list[Row]  # the rows with sampled tokens, in order (rank 0's only)
    num_sampled: int  # S
    extra: list[list[int]] = field(default_factory=list)  # each output hook's extra rows
    # The decode batch size this step is padded to and replayed through the static buffers
    # (a CUDA graph, where there are graphs); 0: the step runs eagerly.
    bucket: int = 0
    states: StateStep | None = None  # the state pool's part, for models with recurrent layers


class GraphRunner(Protocol):
    """Decode steps padded to buckets and replayed (`cuda_graph.py`'s `DecodeGraphRunner`)."""

    def bucket_for(self, rows: list[Row]) -> int: ...
    def forward(self, step: StepInputs) -> torch.Tensor: ...
    def capture_all(self, padding_step: Callable[[int], StepInputs]) -> None: ...


class OutputHook(Protocol):
    """A feature that reads more of a step than its sampled rows' logits."""

    def extra_rows(self, rows: Sequence[Row], row_starts: Sequence[int]) -> list[int]:
        """Rows of the step's `[T]` tokens (row `i`'s first is `row_starts[i]`) whose
        logits it wants besides the sampled ones."""

    def take(self, sampled: Sequence[Row], hidden: torch.Tensor, extra_logits: torch.Tensor) -> None:
        """The sampled rows' final hidden states, and the logits of its extra rows."""


def sample_one_each(sampler: Sampler, logits: torch.Tensor, rows: Sequence[Row]) -> list[list[int]]:
    """One token per sampled row: the plain step's choice."""
    return [[token] for token in sampler.sample(logits, [row.request for row in rows])]


def on_device(device: torch.device) -> AbstractContextManager[object]:
    """Make `device` the current CUDA device for a while (nothing to do on a CPU): graph
    capture, events and streams follow the current device, which is per thread. The
    context can be entered again and again, one at a time."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


class ModelRunner:
    """The model, its KV cache, the attention backend and the sampler, on one device."""

    def __init__(
        self, model: QwenForCausalLM, backend: AttentionBackend, graphs: GraphRunner | None = None
    ) -> None:
        self.model, self.backend, self.graphs = model, backend, graphs
        self.kv_cache = backend.kv_cache
        self.device = self.kv_cache.kv.device
        self.layout_device = self.device  # where steps are laid out (the host, on rank 0 of a split model)
        self.sampler = Sampler()
        self.choose_tokens: TokenChooser = sample_one_each
        self.output_hooks: list[OutputHook] = []
        self.states: StateCache | None = None  # the state pool, for recurrent layers
        self.cpu_threads = CpuThreads(self.device)
        self.on_device = on_device(self.device)

    def run(self, rows: list[Row]) -> list[list[int]]:
        """One step: the new tokens of every row that reaches its request's last token."""
        with self.on_device:
            step = self.prepare(rows)
            logits = self.forward(step)
            return self.choose_tokens(self.sampler, logits, step.sampled)

    def prepare(self, rows: list[Row], bucket: int | None = None) -> StepInputs:
        """The rows as flat tensors, padded to their graph bucket (or to `bucket`)."""
        if bucket is None:
            bucket = self.graphs.bucket_for(rows) if self.graphs else 0
        extra = []
        if self.output_hooks:  # extra rows run eagerly: graphs compute the sampled ones
            extra = [hook.extra_rows(rows, row_starts(rows)) for hook in self.output_hooks]
            bucket = 0 if any(extra) else bucket
        step = lay_out(rows, self.kv_cache.page_size, self.layout_device, bucket, extra)
        if self.states is not None:
            from nanoqwen.memory.state_pool import lay_out_states

            step.states = lay_out_states(rows, bucket)
        return step

    def forward(self, step: StepInputs) -> torch.Tensor | None:
        """Logits of the sampled rows, `[S, vocab]` (None on ranks other than 0). Output
        hooks get what they asked for on the way."""
        states = None if self.states is None else self.states.before(step.states)
        with self.cpu_threads.step():
            if step.bucket:
                hidden = self.graphs.forward(step)
            else:
                self.backend.plan(step.metadata)
                hidden = self.model(step.input_ids, step.metadata, self.backend, step.sample_rows,
                                    states)
            logits = self.model.compute_logits(hidden)
        if states is not None:
            self.states.after(states)
        if self.output_hooks and logits is not None:
            self._hand_out(step, hidden, logits)
        return logits if logits is None else logits[: step.num_sampled]

    def _hand_out(self, step: StepInputs, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        start = step.num_sampled
        for hook, extra in zip(self.output_hooks, step.extra):
            hook.take(step.sampled, hidden[: step.num_sampled], logits[start : start + len(extra)])
            start += len(extra)

    def capture_graphs(self) -> None:
        """Record the decode graphs, from padding steps laid out like any other."""
        if self.graphs is not None:
            with self.on_device:
                self.graphs.capture_all(self._padding_step)

    def _padding_step(self, bucket: int) -> StepInputs:
        step = self.prepare([], bucket)
        if self.states is not None:
            self.states.before(step.states)
        return step


def row_starts(rows: Sequence[Row]) -> list[int]:
    """Where each row's tokens start in the step's flat `[T]` vector."""
    starts, total = [], 0
    for row in rows:
        starts.append(total)
        total += len(row.token_ids)
    return starts


def lay_out(
    rows: Sequence[Row], page_size: int, device: torch.device, pad_to: int = 0,
    extra: Sequence[list[int]] = (),
) -> StepInputs:
    """Flatten `rows` (padded with one-token rows on the scratch page up to `pad_to`) into
    the tensors the model and the attention backends read; `extra` rows of logits follow
    the sampled ones."""
    input_ids, positions, slots, kv_indices, last_page_len = [], [], [], [], []
    qo_indptr, kv_indptr, sample_rows, sampled = [0], [0], [], []
    max_q_len = max_kv_len = 0
    padding = [Row(None, 0, [PADDING_TOKEN_ID], 0)] * (pad_to - len(rows))  # type: ignore[arg-type]
    for row in [*rows, *padding]:
        end = row.start + len(row.token_ids)
        pages = row.request.pages[: -(-end // page_size)] if row.request else [SCRATCH_PAGE]
        input_ids.extend(row.token_ids)
        for position in range(row.start, end):
            positions.append(position)
            slots.append(pages[position // page_size] * page_size + position % page_size)
        qo_indptr.append(qo_indptr[-1] + len(row.token_ids))
        kv_indptr.append(kv_indptr[-1] + len(pages))
        kv_indices.extend(pages)
        last_page_len.append(end - (len(pages) - 1) * page_size)
        max_q_len, max_kv_len = max(max_q_len, len(row.token_ids)), max(max_kv_len, end)
        if row.num_sampled:
            sample_rows.extend(range(qo_indptr[-1] - row.num_sampled, qo_indptr[-1]))
            sampled.append(row)
    num_sampled = len(sample_rows)
    for rows_wanted in extra:
        sample_rows.extend(rows_wanted)
    # Built on the host, where the page tables live; the CSR arrays stay there too, where
    # backends plan from them, and the rest is copied to the device.
    qo_indptr_host = torch.tensor(qo_indptr, dtype=torch.int32)
    kv_indptr_host = torch.tensor(kv_indptr, dtype=torch.int32)
    last_page_len_host = torch.tensor(last_page_len, dtype=torch.int32)
    metadata = AttentionMetadata(
        qo_indptr=qo_indptr_host, kv_indptr=kv_indptr_host,
        kv_indices=torch.tensor(kv_indices, dtype=torch.int32),
        kv_last_page_len=last_page_len_host, positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots), max_q_len=max_q_len, max_kv_len=max_kv_len,
        qo_indptr_host=qo_indptr_host, kv_indptr_host=kv_indptr_host,
        kv_last_page_len_host=last_page_len_host,
    )
    step = StepInputs(torch.tensor(input_ids), metadata,
                      torch.tensor(sample_rows, dtype=torch.int64), sampled, num_sampled,
                      list(extra), pad_to)
    return step if device.type == "cpu" else moved(step, device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; the copy to a GPU is queued without the host waiting."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def moved(step: StepInputs, device: torch.device) -> StepInputs:
    """A step laid out on the host, on `device` (its host copies of the page table stay)."""
    metadata = dataclasses.replace(step.metadata, **{
        name: to_device(getattr(step.metadata, name), device) for name in PAGE_TABLE_TENSORS
    })
    return dataclasses.replace(step, input_ids=to_device(step.input_ids, device),
                               sample_rows=to_device(step.sample_rows, device), metadata=metadata)
