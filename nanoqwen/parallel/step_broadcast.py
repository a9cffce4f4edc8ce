"""A step's inputs, sent from rank 0 to the other ranks of a split model.

The other ranks have no requests, no scheduler and no page accounting: all they need each
step is what the model and the attention backends read, a handful of integer tensors and
a few integers of the runner's `StepInputs` (`step_to_wire`, `step_from_wire`). Rank 0
sends them as two gloo broadcasts from the host:

* a fixed-size header: the command (a step, or stop), each tensor's length and dtype,
  and the integers;
* one payload, every tensor back to back as int64, cut apart again on arrival.

A worker's whole life is `serve_steps`: wait for a header, take the payload, run its
part of the forward pass, again until rank 0 says stop. It may wait for a header for
hours, which is why the steps travel on a group whose timeout is practically infinite
(`workers.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoqwen.attention.base import PAGE_TABLE_TENSORS, AttentionMetadata
from nanoqwen.memory.state_pool import StateStep
from nanoqwen.runner.runner import StepInputs

WIRE_DTYPES = (torch.int32, torch.int64)
STOP, STEP = 0, 1


@dataclass
class WireStep:
    """A step as it crosses: named integer tensors (on the host) and named integers."""

    tensors: dict[str, torch.Tensor]
    ints: dict[str, int]


@dataclass(frozen=True)
class WireFormat:
    """The names of what crosses each step, in order: both ends build the same one."""

    tensor_names: tuple[str, ...]
    int_names: tuple[str, ...]

    @property
    def header_size(self) -> int:
        # [command, every tensor's length, every tensor's dtype, the ints]
        return 1 + 2 * len(self.tensor_names) + len(self.int_names)


def send_step(step: WireStep, wire: WireFormat, group: dist.ProcessGroup) -> None:
    """Rank 0: broadcast a step's tensors and ints to the other ranks."""
    tensors = [step.tensors[name] for name in wire.tensor_names]
    header = [STEP, *(t.numel() for t in tensors), *(WIRE_DTYPES.index(t.dtype) for t in tensors)]
    header += [step.ints[name] for name in wire.int_names]
    dist.broadcast(torch.tensor(header, dtype=torch.int64), src=0, group=group)
    dist.broadcast(torch.cat([t.to(torch.int64) for t in tensors]), src=0, group=group)


def send_stop(wire: WireFormat, group: dist.ProcessGroup) -> None:
    header = torch.zeros(wire.header_size, dtype=torch.int64)
    header[0] = STOP
    dist.broadcast(header, src=0, group=group)


def receive_step(wire: WireFormat, group: dist.ProcessGroup) -> WireStep | None:
    """Other ranks: the next step, on the host; None when rank 0 says stop."""
    header = torch.empty(wire.header_size, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    command, *values = header.tolist()
    if command == STOP:
        return None
    count = len(wire.tensor_names)
    sizes, codes, ints = values[:count], values[count : 2 * count], values[2 * count :]
    payload = torch.empty(sum(sizes), dtype=torch.int64)
    dist.broadcast(payload, src=0, group=group)
    tensors = [part.to(WIRE_DTYPES[code]) for part, code in zip(payload.split(sizes), codes)]
    return WireStep(dict(zip(wire.tensor_names, tensors)), dict(zip(wire.int_names, ints)))


def serve_steps(
    run_step: Callable[[WireStep], object], wire: WireFormat, group: dist.ProcessGroup
) -> None:
    """A worker's life: run every step rank 0 sends, until it says stop."""
    while (step := receive_step(wire, group)) is not None:
        run_step(step)


# What crosses to the other ranks each step: everything the model and the attention
# backends read. The rest says which requests the sampled rows belong to (rank 0's alone).
# A model with recurrent layers adds the state pool's part (`memory/state_pool.py`): each
# row's slot and the copies around the forward; empty for other models.
STATE_TENSORS = ("state_slots", "state_copies_before", "state_copies_after")
STEP_WIRE = WireFormat(
    tensor_names=("input_ids", "sample_rows", *PAGE_TABLE_TENSORS, *STATE_TENSORS),
    int_names=("max_q_len", "max_kv_len", "bucket", "num_sampled"),
)


def step_to_wire(step: StepInputs) -> WireStep:
    """What the other ranks need of a step laid out on the host."""
    metadata = step.metadata
    tensors = {name: getattr(metadata, name) for name in PAGE_TABLE_TENSORS}
    tensors.update(input_ids=step.input_ids, sample_rows=step.sample_rows)
    states = step.states
    none = torch.zeros(0, dtype=torch.int64)
    tensors.update(
        state_slots=none if states is None else states.slots,
        state_copies_before=none if states is None else states.copies_before.flatten(),
        state_copies_after=none if states is None else states.copies_after.flatten(),
    )
    ints = {"max_q_len": metadata.max_q_len, "max_kv_len": metadata.max_kv_len,
            "bucket": step.bucket, "num_sampled": step.num_sampled}
    return WireStep(tensors, ints)


def step_from_wire(wire: WireStep) -> StepInputs:
    """A step received by another rank, on the host (no requests: rank 0 samples)."""
    tensors, ints = wire.tensors, wire.ints
    metadata = AttentionMetadata(
        **{name: tensors[name] for name in PAGE_TABLE_TENSORS},
        max_q_len=ints["max_q_len"], max_kv_len=ints["max_kv_len"],
        qo_indptr_host=tensors["qo_indptr"], kv_indptr_host=tensors["kv_indptr"],
        kv_last_page_len_host=tensors["kv_last_page_len"],
    )
    states = None
    if tensors["state_slots"].numel():
        query_lens = (tensors["qo_indptr"][1:] - tensors["qo_indptr"][:-1]).tolist()
        states = StateStep(query_lens, tensors["state_slots"],
                           tensors["state_copies_before"].reshape(-1, 2),
                           tensors["state_copies_after"].reshape(-1, 2))
    return StepInputs(tensors["input_ids"], metadata, tensors["sample_rows"], [],
                      ints["num_sampled"], bucket=ints["bucket"], states=states)
