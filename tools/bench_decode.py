"""The decode micro-benchmark of `bench.py --decode-batch B`: what an engine step adds to
the model's forward pass.

`B` requests with `--min-input`-token prompts are prefilled until every one of them is
decoding; from then on every step is the same shape. The benchmark times whole engine steps
against the forward pass alone, run again and again on one step's inputs (rewriting the
same K/V into the same slots). Their ratio is the engine's overhead over the model; the
scheduler and input-preparation time per step is the host work that, on a GPU, decides
whether the device waits. Engine steps and bare forwards alternate, so both see the same
machine, and medians drop the odd stall.
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from nanoqwen import LLMEngine, SamplingParams
from nanoqwen.runner.runner import StepInputs
from nanoqwen.scheduling.scheduler import Row
from tools.bench_baseline import synchronize

DECODE_STEPS = 16  # timed steady-state decode steps, and as many bare forward passes
# The phases of a step, in order, as an observer sees them.
STEP_PHASES = ("schedule", "propose", "prepare", "forward", "sample", "postprocess")


def observe(engine: LLMEngine, observer: Any) -> None:
    """Have `observer` watch every later step of `engine`: each phase (`STEP_PHASES`) runs
    inside `observer.phase(name)`, and `observer.laid_out(rows, step)` sees each step as it
    was laid out. The engine knows nothing of it: the calls that make up a step (the
    scheduler's, the step hooks', the runner's, the appending of tokens) are wrapped on
    their instances."""
    runner = engine.runner

    def timed(owner: Any, name: str, phase: str) -> None:
        call = getattr(owner, name)

        def in_phase(*args: Any, **kwargs: Any) -> Any:
            with observer.phase(phase):
                return call(*args, **kwargs)

        setattr(owner, name, in_phase)

    prepare = runner.prepare

    def laid_out(rows: list[Row], bucket: int | None = None) -> StepInputs:
        with observer.phase("prepare"):
            step = prepare(rows, bucket)
        observer.laid_out(rows, step)
        return step

    runner.prepare = laid_out
    timed(engine.scheduler, "schedule", "schedule")
    for hook in engine.step_hooks:
        timed(hook, "before_layout", "propose")
    timed(runner, "forward", "forward")
    timed(runner, "choose_tokens", "sample")
    timed(engine.scheduler, "advance", "postprocess")
    timed(engine, "_append_tokens", "postprocess")


class PhaseTimer:
    """Wall time spent in each phase of `engine.step()`, summed over steps, and the tokens
    the steps computed: a step observer. On CUDA the forward pass
    only queues kernels, so the timer waits for them at the end of "forward", keeping their
    time there. Install it with `observe(engine, timer)`."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self.scheduled_tokens = 0  # prompt and decode tokens laid out, over every step
        self.last_inputs: StepInputs | None = None  # the latest step, to replay its forward

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if name == "forward" and self.device is not None:
                synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def laid_out(self, rows: list[Row], inputs: StepInputs) -> None:
        self.last_inputs = inputs
        self.scheduled_tokens += sum(len(row.token_ids) for row in rows)

    def reset(self) -> None:
        self.seconds = {}
        self.scheduled_tokens = 0


class Observers:
    """Several step observers as one; the first one's phases enclose the others'."""

    def __init__(self, *observers: Any) -> None:
        self.observers = observers

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with ExitStack() as stack:
            for observer in self.observers:
                stack.enter_context(observer.phase(name))
            yield

    def laid_out(self, rows: list[Row], inputs: StepInputs) -> None:
        for observer in self.observers:
            observer.laid_out(rows, inputs)


class PoolTooSmall(Exception):
    """The decode batch did not fit in the KV pool (requests were preempted)."""


def measure_decode_overhead(
    engine: LLMEngine, timer: PhaseTimer, batch_size: int, context_len: int, token_ids: Sequence[int]
) -> dict[str, Any]:
    """Steady-state decode of `batch_size` requests: engine step vs. the forward pass alone.

    `timer` must be observing `engine`.
    """
    engine.reset_prefix_cache()
    preemptions_before = engine.stats()["requests"]["preemptions"]
    rng = random.Random(0)
    # Requests that finish prefill early decode while the rest prefill: leave them room.
    params = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len, ignore_eos=True)
    request_ids = [
        engine.add_request(rng.choices(token_ids, k=context_len), params) for _ in range(batch_size)
    ]
    try:
        _step_until_all_decode(engine, set(request_ids))
        inputs = timer.last_inputs
        bare_forward = functools.partial(engine.runner.forward, inputs)
        step_s, forward_s, phases_s = [], [], []
        for _ in range(DECODE_STEPS):
            timer.reset()
            step_s.append(_seconds(engine.step, engine))
            phases_s.append(dict(timer.seconds))
            forward_s.append(_seconds(bare_forward, engine))
        if engine.stats()["requests"]["preemptions"] != preemptions_before:
            raise PoolTooSmall(
                f"the KV pool cannot hold {batch_size} requests of {context_len} tokens; "
                "lower --decode-batch or give the pool more memory"
            )
    finally:
        for request_id in request_ids:
            engine.abort(request_id)
    phases_ms = {
        name: statistics.median(step[name] for step in phases_s) * 1000 for name in phases_s[0]
    }
    return {
        "batch_size": batch_size,
        "context_tokens": context_len,
        "steps": DECODE_STEPS,
        "engine_step_ms": statistics.median(step_s) * 1000,
        "forward_ms": statistics.median(forward_s) * 1000,
        "overhead_ratio": statistics.median(step_s) / statistics.median(forward_s),
        "schedule_prepare_ms": phases_ms.get("schedule", 0.0) + phases_ms.get("prepare", 0.0),
        "phases_ms_per_step": phases_ms,
    }


def _step_until_all_decode(engine: LLMEngine, request_ids: set[str]) -> None:
    """Step until every request has its first token: from then on, steps are pure decode."""
    waiting_for_first_token = set(request_ids)
    while waiting_for_first_token:
        for output in engine.step():
            if output.delta_token_ids:
                waiting_for_first_token.discard(output.request_id)
    engine.step()  # one pure decode step untimed, as warm-up (and the forward to replay)


def _seconds(run_once: Callable[[], object], engine: LLMEngine) -> float:
    synchronize(engine.device)
    start = time.perf_counter()
    run_once()
    synchronize(engine.device)
    return time.perf_counter() - start
