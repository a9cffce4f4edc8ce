"""Rank 0's runner of a split model: every forward first sends the step to the other ranks.

This is how tensor parallelism wraps the core runner (`runner/runner.py`), which knows
nothing of it: rank 0 lays each step out on the host, broadcasts it (`step_broadcast.py`),
and then runs its own slice of the forward pass like every other rank, whose layers meet
rank 0's in the same all-reduces. Rank 0 alone gets the joined logits and chooses tokens.
The other ranks run `forward_from_wire` for every step rank 0 sends (`worker.py`).
"""

from __future__ import annotations

import torch

from nanoqwen.attention.base import AttentionBackend
from nanoqwen.model.qwen import QwenForCausalLM
from nanoqwen.parallel.step_broadcast import WireStep, step_from_wire, step_to_wire
from nanoqwen.parallel.workers import Workers
from nanoqwen.runner.runner import GraphRunner, ModelRunner, StepInputs, moved


class Rank0Runner(ModelRunner):
    def __init__(
        self, model: QwenForCausalLM, backend: AttentionBackend, graphs: GraphRunner | None,
        workers: Workers,
    ) -> None:
        super().__init__(model, backend, graphs)
        self.workers = workers
        self.layout_device = torch.device("cpu")  # where the step is sent from

    def forward(self, step: StepInputs) -> torch.Tensor | None:
        with self.workers.step():
            self.workers.broadcast(step_to_wire(step))
            return super().forward(moved(step, self.device))


def forward_from_wire(runner: ModelRunner, wire: WireStep) -> None:
    """Another rank's part of a step rank 0 broadcast."""
    runner.forward(moved(step_from_wire(wire), runner.device))
