"""The model runner: turn a scheduled batch into tensors, run the model, sample.

The scheduler speaks in requests and token counts; the model wants flat tensors. Each
step the runner lays the batch out the way the attention backends expect (see
`attention.py`): the new tokens of all requests back to back, their positions, the CSR
page table, the slot each new K/V goes to, and the rows whose logits get sampled (the
last new token of every request whose prompt is fully computed).

Those lists are built on the host, where the page tables live, and copied to the device
in one go per tensor (from pinned memory, without waiting, on CUDA). The page-table
arrays are kept on the host as well, for backends that plan on the host.

Decode-only steps can be padded to a fixed batch size and handed to the decode graph
runner (`cuda_graph.py`) instead of being run eagerly. A padding row is a request like
any other to the model: one token at position 0 whose only page is the pool's scratch
page, so its K/V lands there and its logits are never sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanoqwen.attention import AttentionBackend, AttentionMetadata
from nanoqwen.kv_pool import SCRATCH_PAGE, KVPool
from nanoqwen.model import QwenForCausalLM
from nanoqwen.sampler import Sampler, SamplingParams
from nanoqwen.scheduler import Request, ScheduledBatch

if TYPE_CHECKING:
    from nanoqwen.cuda_graph import DecodeGraphRunner

# What a padding row feeds the model. Any valid id does: its result is never read.
PADDING_TOKEN_ID = 0


@dataclass
class StepInputs:
    """A batch laid out for the model; `sample_rows` index into the `T` new tokens."""

    input_ids: torch.Tensor  # int64 [T]
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # int64 [S]
    sampled_requests: list[Request]


class StepLayout:
    """The host-side lists of one step, appended one row (one request) at a time."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.qo_indptr, self.kv_indptr = [0], [0]
        self.kv_indices: list[int] = []
        self.last_page_len: list[int] = []
        self.sample_rows: list[int] = []
        self.max_q_len = self.max_kv_len = 0

    def add_row(self, token_ids: list[int], start: int, pages: list[int], sample: bool) -> None:
        """A request computing `token_ids` at positions `start, start + 1, ...`.

        `pages` are its pages up to and including the one holding its last new token.
        """
        page_size, end = self.page_size, start + len(token_ids)
        if len(token_ids) == 1:  # a decode: the common case, kept cheap for big batches
            self.input_ids.append(token_ids[0])
            self.positions.append(start)
            self.slots.append(pages[-1] * page_size + start % page_size)
        else:
            self.input_ids.extend(token_ids)
            self.positions.extend(range(start, end))
            self.slots.extend(
                pages[pos // page_size] * page_size + pos % page_size for pos in range(start, end)
            )
        self.qo_indptr.append(self.qo_indptr[-1] + len(token_ids))
        self.kv_indptr.append(self.kv_indptr[-1] + len(pages))
        self.kv_indices.extend(pages)
        self.last_page_len.append(end - (len(pages) - 1) * page_size)
        self.max_q_len = max(self.max_q_len, len(token_ids))
        self.max_kv_len = max(self.max_kv_len, end)
        if sample:
            self.sample_rows.append(self.qo_indptr[-1] - 1)

    def to_inputs(self, device: torch.device, sampled_requests: list[Request]) -> StepInputs:
        def on_host(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            # Pinned memory lets the copy to the GPU run without the host waiting for it.
            return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")

        def on_device(host: torch.Tensor) -> torch.Tensor:
            return host.to(device, non_blocking=True)

        qo_indptr = on_host(self.qo_indptr, torch.int32)
        kv_indptr = on_host(self.kv_indptr, torch.int32)
        last_page_len = on_host(self.last_page_len, torch.int32)
        metadata = AttentionMetadata(
            qo_indptr=on_device(qo_indptr),
            kv_indptr=on_device(kv_indptr),
            kv_indices=on_device(on_host(self.kv_indices, torch.int32)),
            kv_last_page_len=on_device(last_page_len),
            positions=on_device(on_host(self.positions, torch.int64)),
            slot_mapping=on_device(on_host(self.slots, torch.int64)),
            max_q_len=self.max_q_len,
            max_kv_len=self.max_kv_len,
            qo_indptr_host=qo_indptr,
            kv_indptr_host=kv_indptr,
            kv_last_page_len_host=last_page_len,
        )
        return StepInputs(
            input_ids=on_device(on_host(self.input_ids, torch.int64)),
            metadata=metadata,
            sample_rows=on_device(on_host(self.sample_rows, torch.int64)),
            sampled_requests=sampled_requests,
        )


def build_step_inputs(
    batch: ScheduledBatch, page_size: int, device: torch.device, pad_to: int = 0
) -> StepInputs:
    """Lay a batch out for the model, with padding rows up to `pad_to` requests."""
    layout = StepLayout(page_size)
    sampled: list[Request] = []
    for index, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        sample = batch.samples(index)
        pages = request.pages[: -(-end // page_size)]
        layout.add_row(request.token_ids[start:end], start, pages, sample)
        if sample:
            sampled.append(request)
    for _ in range(len(batch.requests), pad_to):
        layout.add_row([PADDING_TOKEN_ID], 0, [SCRATCH_PAGE], sample=False)
    return layout.to_inputs(device, sampled)


class ModelRunner:
    """Prepare, run and sample one step; decode steps go through `decode_graphs` if given."""

    def __init__(
        self,
        model: QwenForCausalLM,
        backend: AttentionBackend,
        sampler: Sampler,
        page_size: int,
        device: torch.device,
        decode_graphs: DecodeGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.page_size = page_size
        self.device = device
        self.decode_graphs = decode_graphs

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        bucket = self.decode_graphs.bucket_for(batch) if self.decode_graphs else None
        return build_step_inputs(batch, self.page_size, self.device, pad_to=bucket or 0)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits for the sampled rows, `[S, vocab]`."""
        if self.decode_graphs is not None and self.decode_graphs.handles(inputs.metadata):
            return self.decode_graphs.forward(inputs)
        self.backend.plan(inputs.metadata)
        return self.model(inputs.input_ids, inputs.metadata, self.backend, inputs.sample_rows)

    def sample(self, logits: torch.Tensor, inputs: StepInputs) -> list[int]:
        """The next token of every request that reached its last token this step."""
        if not inputs.sampled_requests:
            return []
        return self.sampler.sample(logits, inputs.sampled_requests)


def peak_step_memory(
    model: QwenForCausalLM,
    backend_class: type[AttentionBackend],
    page_size: int,
    num_tokens: int,
    num_sequences: int,
) -> int:
    """Peak CUDA bytes one step allocates beyond the weights and the KV pool.

    The step computes `num_tokens` prompt tokens spread over `num_sequences` requests, all
    sampled with top-p (the sampler's hungriest path), through a fresh attention backend,
    so its buffers are counted too. It runs on a throwaway pool in which every request
    shares the same pages: only the memory is of interest, not the values.
    """
    config, weight = model.config, model.lm_head.weight
    device = weight.device
    share, rest = divmod(num_tokens, num_sequences)
    lengths = [share + (i < rest) for i in range(num_sequences)]
    num_pages = -(-lengths[0] // page_size)
    pool = KVPool(
        config.num_layers, config.num_kv_heads, config.head_dim, page_size, num_pages + 1,
        weight.dtype, device,
    )
    pages = pool.allocate(num_pages)
    params = SamplingParams(top_p=0.9)
    requests = [
        Request(f"profile-{i}", [PADDING_TOKEN_ID] * length, length, params, pages=pages)
        for i, length in enumerate(lengths)
    ]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    backend = backend_class(pool, config.num_heads, config.num_kv_heads, config.head_dim)
    runner = ModelRunner(model, backend, Sampler(), page_size, device)
    inputs = runner.prepare(ScheduledBatch(requests, lengths))
    runner.sample(runner.forward(inputs), inputs)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
