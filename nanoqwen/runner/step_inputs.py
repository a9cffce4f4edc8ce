"""One step's work, flattened into the tensors the model and the attention backends read.

The scheduler decides a step in requests and token counts (`ScheduledBatch`: request `i`
computes its next `num_new_tokens[i]` tokens). The model wants flat tensors instead: the
new tokens of every request back to back in one `[T]` vector, each with its position, plus
the page table of `attention/base.py` saying whose keys live where, the slot each new K/V goes
to, and the rows whose logits get sampled. A request samples the rows from its last
accepted token on: one row when it is decoding or finishing its prompt, none for a
prefill chunk in the middle of a prompt, and `1 + k` when it carries `k` proposed tokens
to verify: the logits after each say whether it was right. Two kinds of request want
more of the step than a next token, and say so here:

* one asking for prompt logprobs (`sampling/logprobs.py`) has logits computed for the
  rows of its prompt chunk as well (`prompt_rows`): they follow the sampled rows in
  `sample_rows`;
* an embedding request (`sampling/pooling.py`) has its one sampled row pooled
  (`pooled_rows`) instead of sampled for text.

`build_step_inputs` makes that `StepInputs`.

The lists are built on the host, where the page tables live, and copied to the device in
one go per tensor (from pinned memory, without waiting, on CUDA). The page-table arrays
are kept on the host as well, for backends that plan on the host.

A step can be padded with extra rows to a fixed batch size, which CUDA graphs need
(`cuda_graph.py`). A padding row is a request like any other to the model: one token at
position 0 on the pool's scratch page (`memory/page_allocator.py`), and its logits are never
sampled. The page-table format, and why every backend reads it: docs/learn/04-attention-backends.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanoqwen.attention.base import AttentionMetadata
from nanoqwen.memory.page_allocator import SCRATCH_PAGE
from nanoqwen.parallel.step_broadcast import WireFormat, WireStep
from nanoqwen.sampling.logprobs import PromptRows
from nanoqwen.scheduling.batch import ScheduledBatch
from nanoqwen.scheduling.request import Request

# What a padding row feeds the model. Any valid id does: its result is never read.
PADDING_ROW_TOKEN_ID = 0
# The page table's tensors, in `AttentionMetadata` (and the CUDA graphs' static buffers).
PAGE_TABLE_TENSORS = (
    "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "positions", "slot_mapping"
)
# What crosses to the other ranks of a split model each step: everything the model and
# the attention backends read. The rest says which requests the sampled rows belong to.
STEP_WIRE = WireFormat(
    tensor_names=("input_ids", "sample_rows", *PAGE_TABLE_TENSORS),
    int_names=("max_q_len", "max_kv_len", "bucket"),
)


@dataclass
class StepInputs:
    """A batch laid out for the model; `sample_rows` index into the `T` new tokens."""

    input_ids: torch.Tensor  # int64 [T]
    metadata: AttentionMetadata
    # int64 [S + P]: the rows logits are computed for. The first S are sampled, the
    # other P score prompt tokens (`prompt_rows`).
    sample_rows: torch.Tensor
    sampled_requests: list[Request]  # whose logits the first S rows are, in order
    num_sampled_rows: list[int]  # how many consecutive rows each of them has
    # Rank 0's alone, like the two above: whose the last P rows of `sample_rows` are, and
    # (sampled row, embedding request) for each row to pool.
    prompt_rows: list[PromptRows] = dataclasses.field(default_factory=list)
    pooled_rows: list[tuple[int, Request]] = dataclasses.field(default_factory=list)
    # The decode batch size this step is padded to, replayed through the static buffers
    # (a CUDA graph, where there are graphs); 0: the step runs eagerly. Decided once, when
    # the step is laid out.
    bucket: int = 0

    def to_wire(self) -> WireStep:
        """What the other ranks need of this step (its tensors on the host)."""
        metadata = self.metadata
        tensors = {name: getattr(metadata, name) for name in PAGE_TABLE_TENSORS}
        tensors.update(input_ids=self.input_ids, sample_rows=self.sample_rows)
        ints = {"max_q_len": metadata.max_q_len, "max_kv_len": metadata.max_kv_len,
                "bucket": self.bucket}
        return WireStep(tensors, ints)

    @classmethod
    def from_wire(cls, step: WireStep) -> StepInputs:
        """A step received by another rank, on the host (no requests: rank 0 samples)."""
        tensors, ints = step.tensors, step.ints
        metadata = AttentionMetadata(
            **{name: tensors[name] for name in PAGE_TABLE_TENSORS},
            max_q_len=ints["max_q_len"], max_kv_len=ints["max_kv_len"],
            qo_indptr_host=tensors["qo_indptr"], kv_indptr_host=tensors["kv_indptr"],
            kv_last_page_len_host=tensors["kv_last_page_len"],
        )
        return cls(tensors["input_ids"], metadata, tensors["sample_rows"], [], [],
                   bucket=ints["bucket"])

    def to(self, device: torch.device) -> StepInputs:
        """The step's tensors on `device` (the host copies of the page table stay), copied
        from pinned memory without making the host wait for the device."""
        if device.type == "cpu":
            return self

        def moved(host: torch.Tensor) -> torch.Tensor:
            return host.pin_memory().to(device, non_blocking=True)

        tensors = {name: moved(getattr(self.metadata, name)) for name in PAGE_TABLE_TENSORS}
        return dataclasses.replace(
            self, input_ids=moved(self.input_ids), sample_rows=moved(self.sample_rows),
            metadata=dataclasses.replace(self.metadata, **tensors),
        )


class StepInputsBuilder:
    """Appends a step's rows (one per request) as host lists, then makes the tensors."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.qo_indptr, self.kv_indptr = [0], [0]
        self.kv_indices: list[int] = []
        self.last_page_len: list[int] = []
        self.sample_rows: list[int] = []
        self.prompt_rows: list[int] = []
        self.max_q_len = self.max_kv_len = 0

    def add_row(self, token_ids: list[int], start: int, pages: list[int], num_sampled: int) -> None:
        """A request computing `token_ids` at positions `start, start + 1, ...`, the last
        `num_sampled` of them sampled.

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
        end_row = self.qo_indptr[-1]
        self.sample_rows.extend(range(end_row - num_sampled, end_row))

    def add_prompt_rows(self, start: int, first: int, count: int) -> None:
        """Compute logits for positions `first, ...` (`count` of them) of the row just added,
        whose tokens start at position `start`."""
        first_row = self.qo_indptr[-2] + first - start
        self.prompt_rows.extend(range(first_row, first_row + count))

    def add_padding_row(self) -> None:
        self.add_row([PADDING_ROW_TOKEN_ID], 0, [SCRATCH_PAGE], num_sampled=0)

    def build(
        self,
        device: torch.device,
        sampled_requests: list[Request],
        num_sampled_rows: list[int],
        prompt_rows: Sequence[PromptRows] = (),
        pooled_rows: Sequence[tuple[int, Request]] = (),
        bucket: int = 0,
    ) -> StepInputs:
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
            sample_rows=on_device(on_host(self.sample_rows + self.prompt_rows, torch.int64)),
            sampled_requests=sampled_requests,
            num_sampled_rows=num_sampled_rows,
            prompt_rows=list(prompt_rows),
            pooled_rows=list(pooled_rows),
            bucket=bucket,
        )


def build_step_inputs(
    batch: ScheduledBatch, page_size: int, device: torch.device, pad_to: int = 0
) -> StepInputs:
    """Lay a batch out for the model, with padding rows up to `pad_to` requests (the
    decode bucket it then runs in)."""
    builder = StepInputsBuilder(page_size)
    sampled: list[Request] = []
    num_sampled_rows: list[int] = []
    prompt_rows: list[PromptRows] = []
    pooled_rows: list[tuple[int, Request]] = []
    for index, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
        start = batch.start(index)
        end = start + num_new
        num_sampled = batch.num_sampled_rows(index)
        pages = request.pages[: -(-end // page_size)]
        builder.add_row(request.tokens_with_proposed(start, end), start, pages, num_sampled)
        if num_sampled:
            if request.pooling is not None:
                pooled_rows.append((len(builder.sample_rows) - 1, request))
            sampled.append(request)
            num_sampled_rows.append(num_sampled)
        if request.prompt_logprobs is not None:
            span = unscored_prompt_rows(request, start, end)
            if span.count:
                builder.add_prompt_rows(start, span.first, span.count)
                prompt_rows.append(span)
    for _ in range(len(batch.requests), pad_to):
        builder.add_padding_row()
    return builder.build(device, sampled, num_sampled_rows, prompt_rows, pooled_rows, pad_to)


def unscored_prompt_rows(request: Request, start: int, end: int) -> PromptRows:
    """The positions in `[start, end)` whose logits score a prompt token not scored yet:
    position `p` scores token `p + 1`, and tokens up to `len(prompt_logprobs)` are done
    (a request recomputing its prompt after a preemption does not score it twice)."""
    first = max(start, len(request.prompt_logprobs))
    stop = min(end, request.num_prompt_tokens - 1)
    return PromptRows(request, first, max(0, stop - first))
