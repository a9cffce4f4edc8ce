"""A step's inputs, sent from rank 0 to the other tensor-parallel ranks.

The other ranks have no requests, no scheduler and no page accounting: all they need
each step is what the model and the attention backends read, the tensors of
`StepInputs` (`batch.py`). Rank 0 sends them as two gloo broadcasts from the host:

* a fixed-size header: the command (a step, or stop), each tensor's length and dtype,
  and the page table's two host-side sizes;
* one payload, every tensor back to back as int64, cut apart again on arrival.

A worker's whole life is `serve_steps`: wait for a header, take the payload, run its
part of the forward pass, again until rank 0 says stop. It may wait for a header for
hours, which is why the steps travel on a group whose timeout is practically infinite
(`distributed.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
import torch.distributed as dist

from nanoqwen.attention.base import AttentionMetadata
from nanoqwen.runner.step_inputs import StepInputs

# What crosses the wire each step: everything the model and the attention backends read.
# The other `StepInputs` fields say which requests the sampled rows belong to: rank 0's.
STEP_TENSORS = ("input_ids", "sample_rows")
METADATA_TENSORS = (
    "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "positions", "slot_mapping"
)
METADATA_INTS = ("max_q_len", "max_kv_len")
WIRE_DTYPES = (torch.int32, torch.int64)
NUM_TENSORS = len(STEP_TENSORS) + len(METADATA_TENSORS)
# [command, every tensor's length, every tensor's dtype, the ints]
HEADER_SIZE = 1 + 2 * NUM_TENSORS + len(METADATA_INTS)
STOP, STEP = 0, 1


def send_step(inputs: StepInputs, group: dist.ProcessGroup) -> None:
    """Rank 0: broadcast a step's inputs (host tensors) to the other ranks."""
    tensors = [getattr(inputs, name) for name in STEP_TENSORS]
    tensors += [getattr(inputs.metadata, name) for name in METADATA_TENSORS]
    header = [STEP, *(t.numel() for t in tensors), *(WIRE_DTYPES.index(t.dtype) for t in tensors)]
    header += [getattr(inputs.metadata, name) for name in METADATA_INTS]
    dist.broadcast(torch.tensor(header, dtype=torch.int64), src=0, group=group)
    dist.broadcast(torch.cat([t.to(torch.int64) for t in tensors]), src=0, group=group)


def send_stop(group: dist.ProcessGroup) -> None:
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[0] = STOP
    dist.broadcast(header, src=0, group=group)


def receive_step(group: dist.ProcessGroup) -> StepInputs | None:
    """Other ranks: the next step's inputs, on the host; None when rank 0 says stop."""
    header = torch.empty(HEADER_SIZE, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    command, *values = header.tolist()
    if command == STOP:
        return None
    sizes, codes = values[:NUM_TENSORS], values[NUM_TENSORS : 2 * NUM_TENSORS]
    ints = values[2 * NUM_TENSORS :]
    payload = torch.empty(sum(sizes), dtype=torch.int64)
    dist.broadcast(payload, src=0, group=group)
    tensors = [part.to(WIRE_DTYPES[code]) for part, code in zip(payload.split(sizes), codes)]
    step = dict(zip(STEP_TENSORS, tensors))
    page_table = dict(zip(METADATA_TENSORS, tensors[len(STEP_TENSORS):]))
    host_copies = {
        field.name: page_table[field.name.removesuffix("_host")]
        for field in dataclasses.fields(AttentionMetadata)
        if field.name.endswith("_host")
    }
    metadata = AttentionMetadata(**page_table, **dict(zip(METADATA_INTS, ints)), **host_copies)
    rank0_only = {
        field.name: [] for field in dataclasses.fields(StepInputs)
        if field.name not in (*STEP_TENSORS, "metadata")
    }
    return StepInputs(**step, metadata=metadata, **rank0_only)


def to_device(inputs: StepInputs, device: torch.device) -> StepInputs:
    """A step's host tensors moved to `device`; the host copies of the page table stay."""
    if device.type == "cpu":
        return inputs
    metadata = dataclasses.replace(
        inputs.metadata,
        **{name: getattr(inputs.metadata, name).to(device) for name in METADATA_TENSORS},
    )
    moved = {name: getattr(inputs, name).to(device) for name in STEP_TENSORS}
    return dataclasses.replace(inputs, metadata=metadata, **moved)


class ShardRunner(Protocol):
    """What a worker runs the steps with (`ModelRunner`)."""

    device: torch.device

    def forward_shard(self, inputs: StepInputs) -> torch.Tensor | None: ...


def serve_steps(runner: ShardRunner, group: dist.ProcessGroup) -> None:
    """A worker's life: run every step rank 0 sends, until it says stop."""
    while (inputs := receive_step(group)) is not None:
        runner.forward_shard(to_device(inputs, runner.device))
