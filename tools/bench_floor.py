"""The dense-matmul floor of `bench.py --floor`: how far the engine is from the arithmetic
no engine can skip (for the dense Qwen2 and Qwen3).

Every engine pays the same matrix products per token: the q/k/v and output projections,
the MLP's gate/up and down projections, the embedding lookup, and the vocabulary
projection for the rows it samples. Everything else (attention over the cache, norms,
rotary embeddings, activations, sampling, scheduling, detokenizing) is overhead a faster
engine could shrink. So the benchmark records the exact token schedule the engine just
ran, how many new tokens and how many sampled rows each step had, and replays it through
the model's own linear layers alone, with the same weights, dtype and threads. That time
is the floor; `floor_ratio = engine_s / floor_s` says how far above it the engine runs.

The rest of the engine's wall time is split so that the parts add up exactly:

* `attention`: the backend's `plan` and `forward` calls, timed inside the engine's run;
* `norms_rope_activations`: the rest of the forward pass, `forward - attention - floor`;
* `sampling`: the sampler's phase;
* `bookkeeping`: everything outside the forward pass and the sampler: scheduling,
  proposing draft tokens (with speculative decoding), preparing inputs, detokenizing,
  stop checks and the benchmark's own loop.

A batch of one request is bound by something else: each step reads every weight to make
one token (of a mixture of experts, the routed ones only), so no engine beats the time the device takes to read them (`bandwidth_floor`:
the weight bytes read per token over the bandwidth measured on the spot by copying a large
tensor). bench reports it beside the time per output token, whatever the batch; its ratio
says most with `--num-seqs 1`.

On CUDA the timings wait for the device (the forward pass is synchronised before the
sampler starts, attention is timed with CUDA events), but decode steps replayed from a
CUDA graph run the backend inside the graph, where it cannot be timed: with graphs on,
their attention counts in `norms_rope_activations` (`--enforce-eager` splits it out).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from nanoqwen import LLMEngine
from nanoqwen.attention.base import AttentionBackend
from nanoqwen.model.moe import SparseMoeBlock
from nanoqwen.model.qwen import QwenForCausalLM
from nanoqwen.runner.runner import StepInputs
from nanoqwen.scheduling.scheduler import Row
from nanoqwen.weights.quantization import tensor_bytes, weight_memory_bytes
from tools.bench_baseline import synchronize

SPLIT = ("attention", "norms_rope_activations", "sampling", "bookkeeping")


@dataclass(frozen=True)
class StepShape:
    """What one engine step computed, padding rows left out."""

    num_tokens: int  # new tokens through the model
    num_sampled: int  # rows whose logits were computed and sampled


class FloorRecorder:
    """Records the engine's token schedule and times its attention backend: a step
    observer, `recorder.attach(engine)` first (so that a `PhaseTimer` enclosing it counts
    what the recorder adds in the phase it belongs to)."""

    def __init__(self) -> None:
        self.steps: list[StepShape] = []
        self.attention_timer: AttentionTimer | None = None

    def phase(self, name: str) -> AbstractContextManager[object]:
        return nullcontext()

    def laid_out(self, rows: list[Row], inputs: StepInputs) -> None:
        self.steps.append(StepShape(sum(len(row.token_ids) for row in rows), len(inputs.sampled)))

    def attach(self, engine: LLMEngine) -> None:
        self.attention_timer = AttentionTimer(engine.runner.backend, engine.device)

    def reset(self) -> None:
        self.steps = []
        if self.attention_timer is not None:
            self.attention_timer.reset()


class AttentionTimer:
    """Wraps a backend's `plan` and `forward` (on the instance) to sum the time they take."""

    def __init__(self, backend: AttentionBackend, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self.reset()
        backend.plan = self._timed(backend.plan)  # type: ignore[method-assign]
        backend.forward = self._timed(backend.forward)  # type: ignore[method-assign]

    def reset(self) -> None:
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _timed(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.on_cuda:  # host clocks would only see the launches
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                result = function(*args, **kwargs)
                end.record()
                self._events.append((start, end))
                return result
            start_s = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._seconds += time.perf_counter() - start_s

        return timed

    def seconds(self) -> float:
        if self._events:
            torch.cuda.synchronize()
            self._seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1000
            self._events = []
        return self._seconds


def replay_floor(model: QwenForCausalLM, steps: Sequence[StepShape]) -> float:
    """Seconds that `model`'s dense layers alone take over the schedule `steps`.

    Per step: the embedding of its new tokens, then in every layer the q/k/v, output,
    gate/up and down projections of all of them, then the lm_head on its sampled rows.
    The projections' inputs are stand-ins of the right shapes (attention outputs and
    activations are not computed), and every call goes through the model's own modules.
    """
    config = model.config
    weight = model.model.norm.weight  # the model's dtype and device (not the head's: int8?)
    max_tokens = max((step.num_tokens for step in steps), default=0)
    generator = torch.Generator(device="cpu").manual_seed(0)

    def stand_in(width: int) -> torch.Tensor:
        values = torch.randn(max_tokens, width, generator=generator)
        return values.to(device=weight.device, dtype=weight.dtype)

    attention_out = stand_in(config.num_heads * config.head_dim)
    activation = stand_in(config.intermediate_size)
    token_ids = torch.randint(config.vocab_size, (max_tokens,), generator=generator)
    token_ids = token_ids.to(weight.device)
    with torch.inference_mode():
        synchronize(weight.device)
        start = time.perf_counter()
        for step in steps:
            hidden = model.model.embed_tokens(token_ids[: step.num_tokens])
            for layer in model.model.layers:
                attention, mlp = layer.self_attn, layer.mlp
                attention.qkv_proj(hidden)
                attention.o_proj(attention_out[: step.num_tokens])
                mlp.gate_up_proj(hidden)
                mlp.down_proj(activation[: step.num_tokens])
            if step.num_sampled:
                model.lm_head(hidden[: step.num_sampled])
        synchronize(weight.device)
        return time.perf_counter() - start


def floor_figures(
    engine_s: float, floor_s: float, phase_seconds: dict[str, float], attention_s: float
) -> dict[str, Any]:
    """The floor ratio and the split of the engine's time above the floor (seconds, and
    as what each part adds to the ratio); the parts add up to `engine_s - floor_s`."""
    forward, sampling = phase_seconds.get("forward", 0.0), phase_seconds.get("sample", 0.0)
    split = {
        "attention": attention_s,
        "norms_rope_activations": forward - attention_s - floor_s,
        "sampling": sampling,
        "bookkeeping": engine_s - forward - sampling,
    }
    return {
        "engine_s": engine_s,
        "floor_s": floor_s,
        "floor_ratio": engine_s / floor_s,
        "split": split,
        "split_ratio": {name: seconds / floor_s for name, seconds in split.items()},
    }


def measure_floor(
    engine: LLMEngine, recorder: FloorRecorder, engine_s: float, phase_seconds: dict[str, float]
) -> dict[str, Any]:
    """Replay the run the recorder just saw and compare; call right after the run."""
    assert recorder.attention_timer is not None, "attach the recorder to the engine first"
    attention_s = recorder.attention_timer.seconds()
    floor_s = replay_floor(engine.runner.model, recorder.steps)
    figures = floor_figures(engine_s, floor_s, phase_seconds, attention_s)
    figures["steps"] = len(recorder.steps)
    figures["tokens"] = sum(step.num_tokens for step in recorder.steps)
    figures["sampled_rows"] = sum(step.num_sampled for step in recorder.steps)
    return figures


# --------------------------------------------------------------------------- batch 1
def measure_bandwidth(device: torch.device, size: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second the device moves copying one large tensor into another (read and
    write both counted), the best of `repeats`: what a step bound by reading its weights
    can hope for."""
    source = torch.ones(size // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * source.element_size() / best


def bytes_read_per_token(model: QwenForCausalLM) -> int:
    """The weight bytes one decode step reads to make one token: every weight once, but of
    an embedding that is not also the lm_head, only one row, and of a sparse layer's routed
    experts only the k the token is routed to."""
    embedding = model.model.embed_tokens.weight
    total = weight_memory_bytes(model) - unrouted_expert_bytes(model)
    if getattr(model.lm_head, "weight", None) is embedding:
        return total
    return total - tensor_bytes(embedding) + tensor_bytes(embedding[0])


def unrouted_expert_bytes(model: QwenForCausalLM) -> int:
    """The bytes of the E - k experts per sparse layer that one token is not routed to."""
    unread = 0.0
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            experts = block.experts
            stacks = tensor_bytes(experts.gate_up_proj.weight) + tensor_bytes(experts.down_proj.weight)
            unread += stacks * (1 - block.num_experts_per_tok / experts.num_experts)
    return round(unread)


def bandwidth_floor(read_bytes: int, bandwidth: float, tpot_ms: float) -> dict[str, float]:
    """The batch-1 floor: a token needs at least the time to read the weights once, at the
    measured bandwidth; `ratio` is the measured time per output token over it."""
    floor_ms = read_bytes / bandwidth * 1000
    return {
        "bandwidth_gb_s": bandwidth / 1e9,
        "bytes_per_token": read_bytes,
        "floor_ms_per_token": floor_ms,
        "tpot_ms": tpot_ms,
        "ratio": tpot_ms / floor_ms,
    }
