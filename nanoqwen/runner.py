"""The model runner: turn a scheduled batch into tensors, run the model, sample.

The scheduler speaks in requests and token counts; the model wants flat tensors. Each
step the runner lays the batch out the way the attention backends expect (see
`attention.py`): the new tokens of all requests back to back, their positions, the CSR
page table, the slot each new K/V goes to, and the rows whose logits get sampled (the
last new token of every request whose prompt is fully computed).

Those lists are built on the host, where the page tables live, and copied to the device
in one go per tensor (from pinned memory, without waiting, on CUDA). Decode-only steps
can then be handed to the CUDA-graph runner instead of being run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoqwen.attention import AttentionBackend, AttentionMetadata
from nanoqwen.model import QwenForCausalLM
from nanoqwen.sampler import Sampler
from nanoqwen.scheduler import Request, ScheduledBatch


@dataclass
class StepInputs:
    """A batch laid out for the model; `sample_rows` index into the `T` new tokens."""

    input_ids: torch.Tensor  # int64 [T]
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # int64 [S]
    sampled_requests: list[Request]


def build_step_inputs(batch: ScheduledBatch, page_size: int, device: torch.device) -> StepInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qo_indptr, kv_indptr, kv_indices, last_page_len = [0], [0], [], []
    sample_rows: list[int] = []
    sampled: list[Request] = []
    max_q_len = max_kv_len = 0
    for index, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        num_pages = -(-end // page_size)
        pages = request.pages[:num_pages]
        input_ids.extend(request.token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(pages[pos // page_size] * page_size + pos % page_size for pos in range(start, end))
        qo_indptr.append(qo_indptr[-1] + num_new)
        kv_indptr.append(kv_indptr[-1] + num_pages)
        kv_indices.extend(pages)
        last_page_len.append(end - (num_pages - 1) * page_size)
        max_q_len, max_kv_len = max(max_q_len, num_new), max(max_kv_len, end)
        if batch.samples(index):
            sample_rows.append(qo_indptr[-1] - 1)
            sampled.append(request)

    def to_device(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
        return host.to(device, non_blocking=True)

    metadata = AttentionMetadata(
        qo_indptr=to_device(qo_indptr, torch.int32),
        kv_indptr=to_device(kv_indptr, torch.int32),
        kv_indices=to_device(kv_indices, torch.int32),
        kv_last_page_len=to_device(last_page_len, torch.int32),
        positions=to_device(positions, torch.int64),
        slot_mapping=to_device(slots, torch.int64),
        max_q_len=max_q_len,
        max_kv_len=max_kv_len,
    )
    return StepInputs(
        input_ids=to_device(input_ids, torch.int64),
        metadata=metadata,
        sample_rows=to_device(sample_rows, torch.int64),
        sampled_requests=sampled,
    )


class ModelRunner:
    def __init__(
        self,
        model: QwenForCausalLM,
        backend: AttentionBackend,
        sampler: Sampler,
        page_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.page_size = page_size
        self.device = device

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits for the sampled rows, `[S, vocab]`."""
        self.backend.plan(inputs.metadata)
        return self.model(inputs.input_ids, inputs.metadata, self.backend, inputs.sample_rows)

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        return build_step_inputs(batch, self.page_size, self.device)

    def sample(self, logits: torch.Tensor, inputs: StepInputs) -> list[int]:
        """The next token of every request that reached its last token this step."""
        if not inputs.sampled_requests:
            return []
        return self.sampler.sample(logits, inputs.sampled_requests)
