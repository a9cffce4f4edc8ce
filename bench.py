"""Benchmark nanoqwen: throughput, latency, and where the time of each step goes.

    python bench.py --model Qwen/Qwen3-0.6B --compare hf --json result.json
    python bench.py --random-weights qwen3-cpu --num-seqs 64 --max-input 512 --max-output 256

**The workload** is synthetic and fixed by `--seed`: prompts of random token ids (special
tokens left out) with lengths drawn uniformly from `[--min-input, --max-input]`, and for each
an output length from `[--min-output, --max-output]`, generated with `ignore_eos` (greedily,
or at `--temperature` with a seed per request), so every run does exactly the same work.
Five scenarios:

* `random`: independent prompts, all submitted at once (an offline batch job).
* `shared-prefix`: the same, but every prompt starts with the same `--min-input` tokens (a
  shared system prompt), which the prefix cache should serve after the first request.
* `multi-turn`: conversations of `--turns` turns; turn N+1 is submitted when turn N finishes
  and its prompt is turn N's prompt, then its answer, then new tokens (a chat).
* `copy`: the second half of every prompt is the model's own greedy continuation of the
  first half (computed before the timed runs), and the answer goes on from there: text the
  prompt already holds, which is what prompt lookup (`--speculative ngram`) feeds on. A
  random-weights model copies nothing on its own, but its greedy text repeats itself, so
  its answer here is found in the prompt.
* `priority`: background jobs and urgent requests. Three in four requests are background
  (priority 1): prompts and outputs from the upper three quarters of the length ranges,
  all submitted at once. The rest are urgent (priority 0): short prompts and outputs from
  the lowest quarter, arriving one every few steps over about one background lifetime.
  It runs twice, under the fcfs and the priority scheduling policies, and reports the
  time to first token of each priority under each.

**The measurements** come from the loop around `engine.step()`: a request's time to first
token (TTFT) is from its submission to the first step that returns a token for it; its time
per output token (TPOT) is the rest of its life divided by its remaining tokens. A
`PhaseTimer`, observing the engine (`tools.bench_decode.observe`), splits every step into schedule, prepare
inputs, forward, sample and detokenize/bookkeeping, which says where the time goes.

`--compare hf` runs the same prompts through transformers' `generate` on the same weights
(`bench_baseline.py`; multi-turn prompts are the ones nanoqwen served, answers included).
`--compare vllm` and `--compare llamacpp` run them through vLLM (its CPU build on a CPU)
and llama.cpp (on the same `.gguf` file), each in a process of its own, started with the
Python of the environment it is installed in (`--peer-python`; `bench_peers.py`), greedy
with EOS ignored, and report throughput, TTFT, TPOT and the share of nanoqwen's greedy
tokens each matched.
`--rounds N` repeats both, alternating: every round builds a fresh engine, runs the
workload, frees it, then runs transformers. A machine that gets busier or quieter over the
minutes then disturbs both alike; the report shows the median round of each, and the
speedup is the median of the rounds' ratios. `--decode-batch B` adds the steady-state
decode micro-benchmark of `bench_decode.py`.

`--speculative ngram|draft` (with the other speculative-decoding options) runs every round
twice, with speculation and without (which goes first alternates), and reports tokens per
request per step, the acceptance rate, the mean accepted length and the speedup of the
first over the second.

With `--quantization int8|int4` (or a quantized checkpoint's own) or `--kv-cache-dtype
int8|fp8_e4m3`, every round also runs at full precision (weights and KV cache in
`--dtype`), alternating which goes first, and reports side by side the weight memory, the
KV pages, the speed, and how many output tokens come before each request's first
difference from the full-precision output (greedy agreement, with `--temperature 0`).

`--floor` replays, right after each round, the token schedule the engine just ran through
the model's dense layers alone (`bench_floor.py`): `floor_ratio` is the engine's wall time
over that floor, and the time above it is split into attention, norms + rope +
activations, sampling and bookkeeping. The report shows the round with the median ratio.

`--random-weights PRESET_OR_CONFIG` benchmarks a random-weights model of a given shape
(see `checkpoints.py`), for machines that cannot download a checkpoint.

`--json` writes the result with what makes it comparable later (`bench_environment.py`:
versions, machine, time) and every step of every run; `--plot` draws it (`bench_plot.py`).
"""

from __future__ import annotations

import gc
import json
import math
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import click
import torch
from huggingface_hub.utils import disable_progress_bars
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from transformers import AutoTokenizer
from transformers.utils import logging as transformers_logging

import nanoqwen  # noqa: F401, I001 (first: it sets OpenMP's wait policy before torch loads)
from nanoqwen import LLMEngine, RequestOutput, SamplingParams
from nanoqwen.cli import (
    SPECULATIVE_OPTION_NAMES,
    config_option,
    engine_options,
    in_flags,
    model_option,
    pop_engine_options,
    quiet_library_noise,
)
from nanoqwen.config import resolve_device
from nanoqwen.model.config import DENSE_ARCHITECTURES, ModelConfig
from nanoqwen.model.qwen import QwenForCausalLM
from nanoqwen.speculative.proposers import SpeculationStats
from nanoqwen.stats import kv_cache_group
from nanoqwen.weights.checkpoint import resolve_model_path
from nanoqwen.weights.gguf import from_pretrained_arguments
from nanoqwen.weights.loader import runtime_quantization
from nanoqwen.weights.quantization import weight_memory_bytes
from tools.bench_baseline import run_transformers
from tools.bench_decode import (
    Observers,
    PhaseTimer,
    PoolTooSmall,
    measure_decode_overhead,
    observe,
)
from tools.bench_environment import describe_environment
from tools.bench_floor import (
    FloorRecorder,
    bandwidth_floor,
    bytes_read_per_token,
    measure_bandwidth,
    measure_floor,
)
from tools.bench_load import (
    arrival_times,
    goodput,
    latency_ms,
    parse_goodput,
    percentiles,
    request_latencies,
)
from tools.bench_peers import (
    PEERS,
    PeerUnavailable,
    check_peer,
    run_peer,
    token_agreement,
)
from tools.bench_plot import plot_result
from tools.bench_report import print_load_report, print_report
from tools.bench_servers import nanoqwen_server, vllm_server
from tools.bench_serving import (
    Endpoint,
    ServedRequest,
    describe_rate,
    drive,
    summarize_served,
)
from tools.checkpoints import PRESETS, random_checkpoint

SCENARIOS = ("random", "shared-prefix", "multi-turn", "priority", "copy")
SERVED_SCENARIOS = ("random", "shared-prefix", "copy")  # one turn each: a server's requests
# The priority scenario: one request in URGENT_EVERY is urgent.
URGENT_EVERY, URGENT_PRIORITY, BACKGROUND_PRIORITY = 4, 0, 1
# What the priority scenario compares, in the order it runs them.
COMPARED_POLICIES = ("fcfs", "priority")
WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS = 32, 4

Metrics = dict[str, Any]


# --------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    """What to generate; the same settings and seed always give the same prompts."""

    scenario: str
    num_seqs: int
    min_input: int
    max_input: int
    min_output: int
    max_output: int
    turns: int
    seed: int
    temperature: float = 0.0


@dataclass(frozen=True)
class Turn:
    """One request of a conversation."""

    new_token_ids: list[int]  # appended to the conversation so far (all of it, for turn 1)
    output_len: int
    priority: int = 0
    arrival_step: int = 0  # a first turn is submitted before this engine step (0: at once)
    arrival_s: float = 0.0  # ... and not before this many seconds into the run


Session = list[Turn]  # a conversation; the random scenarios have one turn per session


def make_sessions(workload: Workload, token_ids: Sequence[int]) -> list[Session]:
    """The workload's conversations, prompts drawn from `token_ids`."""
    rng = random.Random(workload.seed)

    def tokens(count: int) -> list[int]:
        return rng.choices(token_ids, k=count)

    def input_len() -> int:
        return rng.randint(workload.min_input, workload.max_input)

    def output_len() -> int:
        return rng.randint(workload.min_output, workload.max_output)

    if workload.scenario in ("random", "copy"):  # copy: see `continue_prompts`
        return [[Turn(tokens(input_len()), output_len())] for _ in range(workload.num_seqs)]
    if workload.scenario == "priority":
        return priority_sessions(workload, rng, token_ids)
    if workload.scenario == "shared-prefix":
        prefix = tokens(workload.min_input)
        return [
            [Turn(prefix + tokens(input_len() - len(prefix)), output_len())]
            for _ in range(workload.num_seqs)
        ]
    sessions = []
    for first in range(0, workload.num_seqs, workload.turns):
        num_turns = min(workload.turns, workload.num_seqs - first)
        sessions.append([Turn(tokens(input_len()), output_len()) for _ in range(num_turns)])
    return sessions


def with_arrivals(sessions: Sequence[Session], rate: float, seed: int) -> list[Session]:
    """The sessions with their first turns arriving at `rate` per second (Poisson, seeded;
    all at once for an infinite rate: `bench_load.arrival_times`)."""
    times = arrival_times(len(sessions), rate, seed)
    return [[replace(session[0], arrival_s=at), *session[1:]]
            for session, at in zip(sessions, times)]


def continue_prompts(engine: LLMEngine, sessions: Sequence[Session]) -> list[Session]:
    """The copy scenario: each (one-turn) prompt's second half replaced by the model's own
    greedy continuation of its first half."""
    prompts = [session[0].new_token_ids for session in sessions]
    halves = [prompt[: -(-len(prompt) // 2)] for prompt in prompts]
    lengths = [len(prompt) - len(half) for prompt, half in zip(prompts, halves)]
    ids = [
        engine.add_request(half, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        for half, n in zip(halves, lengths)
        if n
    ]
    continued = {}
    while engine.has_unfinished_requests():
        continued.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    continuations = iter(continued[request_id] for request_id in ids)
    return [
        [Turn(half + (next(continuations) if length else []), session[0].output_len)]
        for session, half, length in zip(sessions, halves, lengths)
    ]


def priority_sessions(
    workload: Workload, rng: random.Random, token_ids: Sequence[int]
) -> list[Session]:
    """Background requests from the upper three quarters of the length ranges, at once;
    urgent ones from the lowest quarter, spread over about one background output length."""
    input_quarter = workload.min_input + (workload.max_input - workload.min_input) // 4
    output_quarter = workload.min_output + (workload.max_output - workload.min_output) // 4
    num_urgent = workload.num_seqs // URGENT_EVERY
    gap = max(1, (output_quarter + workload.max_output) // 2 // max(num_urgent, 1))

    def turn(inputs: tuple[int, int], outputs: tuple[int, int], priority: int, step: int) -> Turn:
        prompt = rng.choices(token_ids, k=rng.randint(*inputs))
        return Turn(prompt, rng.randint(*outputs), priority, step)

    sessions = []
    for index in range(workload.num_seqs):
        if index % URGENT_EVERY == URGENT_EVERY - 1:
            arrival = (index // URGENT_EVERY) * gap
            short = (workload.min_input, input_quarter), (workload.min_output, output_quarter)
            sessions.append([turn(*short, URGENT_PRIORITY, arrival)])
        else:
            long = (input_quarter, workload.max_input), (output_quarter, workload.max_output)
            sessions.append([turn(*long, BACKGROUND_PRIORITY, 0)])
    return sessions


def longest_request(sessions: Sequence[Session]) -> int:
    """Tokens in the longest request, prompt and output (a conversation's last turn)."""
    return max(sum(len(t.new_token_ids) + t.output_len for t in session) for session in sessions)


def prompt_token_ids(model_path: str, model_vocab_size: int) -> list[int]:
    """Ids a random prompt may use: the tokenizer's ordinary tokens, never a special one.
    Empty for a checkpoint saved without tokenizer files (random weights written by
    transformers, say), for which transformers makes a tokenizer of special tokens only."""
    location, gguf_file = from_pretrained_arguments(model_path)
    tokenizer = AutoTokenizer.from_pretrained(location, **gguf_file)
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    upper = min(tokenizer.vocab_size, model_vocab_size)
    return [token_id for token_id in range(upper) if token_id not in excluded]


# --------------------------------------------------------------------------- running the engine
@dataclass
class RequestTiming:
    """When one request was submitted, got its first token and finished: in seconds, and
    (for the first two) in engine steps run so far."""

    prompt_token_ids: list[int]
    output_len: int  # requested
    priority: int
    position: tuple[int, int]  # (conversation, turn): where its output is in `outputs`
    submitted: float
    submitted_step: int
    first_token: float | None = None
    first_token_step: int | None = None
    finished: float | None = None
    num_output_tokens: int = 0


@dataclass
class EngineRun:
    records: list[RequestTiming]
    wall_s: float
    steps: int
    phase_seconds: dict[str, float]
    peak_kv_pages: int
    kv_pages_total: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: dict[str, int]  # by cause
    request_steps: int  # (request, step) pairs that gave the request tokens
    reduced_thread_steps: int  # steps run on fewer CPU threads, beside busy processes
    speculation: SpeculationStats | None  # None: the engine did not speculate
    per_step: dict[str, list[float]]  # one list per figure, one entry per step
    weight_bytes: int
    read_bytes_per_token: int  # the weights one decode step reads (`bench_floor.py`)
    # Each finished turn's output tokens, by (conversation, turn): runs are compared by them.
    outputs: dict[tuple[int, int], list[int]]
    texts: dict[tuple[int, int], str]  # ... and its text, which a server's answer is checked by
    floor: Metrics | None = None  # with --floor: `measure_floor`'s figures for this run
    swaps: dict[str, int] | None = None  # with --preemption-mode swap: the run's `swap` counts


class SessionDriver:
    """Feeds conversations to the engine: first turns at their arrival (an engine step, a
    time), at most `max_concurrency` conversations at once; each next turn when the one
    before it finishes."""

    def __init__(
        self, engine: LLMEngine, sessions: Sequence[Session], temperature: float,
        max_concurrency: int | None = None,
    ) -> None:
        self.engine = engine
        self.sessions = sessions
        self.temperature = temperature
        self.max_concurrency = max_concurrency or len(sessions)
        self.records: dict[str, RequestTiming] = {}
        self.outputs: dict[tuple[int, int], list[int]] = {}
        self.texts: dict[tuple[int, int], str] = {}
        self._position: dict[str, tuple[int, int]] = {}  # request id → (session, turn)
        # Conversations not started yet, the next to arrive last.
        self.pending = sorted(
            range(len(sessions)),
            key=lambda s: (sessions[s][0].arrival_step, sessions[s][0].arrival_s), reverse=True,
        )
        self.in_flight = 0  # conversations started and not finished
        self.start = self.slot_freed = time.perf_counter()  # when a conversation last ended
        self._was_full = False  # the limit was reached as the step under way began
        # An fcfs engine refuses priorities; it serves every request as equal anyway.
        self._use_priorities = engine.config.scheduling_policy == "priority"

    def submit_arrivals(self, step: int) -> None:
        """Start every conversation whose first turn has arrived by engine step `step` and
        by now, as far as `max_concurrency` lets them in."""
        now = time.perf_counter()
        while self.pending and self.in_flight < self.max_concurrency:
            first = self.sessions[self.pending[-1]][0]
            if first.arrival_step > step or self.start + first.arrival_s > now:
                break
            # Its wait counts from its arrival, through the step under way, as at a server;
            # one the concurrency limit held back arrives when a finished one made room.
            arrived = now if first.arrival_step else self.start + first.arrival_s
            if self._was_full:
                arrived = max(arrived, self.slot_freed)
            self.in_flight += 1
            self._submit(self.pending.pop(), 0, [], step, arrived)
        self._was_full = self.in_flight >= self.max_concurrency

    def next_arrival_s(self) -> float | None:
        """When the next conversation arrives, in seconds into the run, if it arrives by
        the clock and no earlier request is still being served."""
        if not self.pending or self.in_flight or self.engine.has_unfinished_requests():
            return None
        first = self.sessions[self.pending[-1]][0]
        return first.arrival_s if first.arrival_s > 0 and first.arrival_step == 0 else None

    def record(self, output: RequestOutput, now: float, steps: int) -> None:
        """Note what a step (the `steps`-th) did for one request; a finished turn submits
        the next one."""
        record = self.records[output.request_id]
        if output.delta_token_ids and record.first_token is None:
            record.first_token, record.first_token_step = now, steps
        record.num_output_tokens += len(output.delta_token_ids)
        if output.finished:
            record.finished = now
            session, turn = self._position[output.request_id]
            self.outputs[session, turn] = list(output.token_ids)
            self.texts[session, turn] = output.text
            if turn + 1 < len(self.sessions[session]):
                history = record.prompt_token_ids + output.token_ids
                self._submit(session, turn + 1, history, steps, time.perf_counter())
            else:
                self.in_flight -= 1
                self.slot_freed = now

    def _submit(
        self, session: int, turn: int, history: list[int], step: int, submitted: float
    ) -> None:
        spec = self.sessions[session][turn]
        prompt = history + spec.new_token_ids
        # Sampled requests are seeded by their order, so every run draws the same way.
        seed = len(self.records) if self.temperature > 0 else None
        params = SamplingParams(
            temperature=self.temperature, max_tokens=spec.output_len, ignore_eos=True, seed=seed
        )
        priority = spec.priority if self._use_priorities else 0
        request_id = self.engine.add_request(prompt, params, priority=priority)
        self.records[request_id] = RequestTiming(
            prompt, spec.output_len, spec.priority, (session, turn), submitted, step
        )
        self._position[request_id] = (session, turn)


def run_engine(
    engine: LLMEngine,
    timer: PhaseTimer,
    sessions: Sequence[Session],
    temperature: float,
    progress: Progress,
    description: str,
    max_concurrency: int | None = None,
) -> EngineRun:
    """Serve every session to completion, timing each request and (with `timer`, installed
    on `engine`) each step's phases. An engine with nothing to do waits for the next
    arrival (its wait counts in the wall time, and in the next step's seconds)."""
    engine.reset_prefix_cache()  # a previous round's prompts must not be cache hits
    timer.reset()
    before = engine.stats()
    num_requests = sum(len(session) for session in sessions)
    output_tokens = sum(turn.output_len for session in sessions for turn in session)
    task = add_progress_task(progress, description, num_requests, output_tokens)
    done = 0
    driver = SessionDriver(engine, sessions, temperature, max_concurrency)
    steps = generated = request_steps = 0
    per_step: dict[str, list[float]] = {name: [] for name in PER_STEP_FIGURES}
    start = now = driver.start
    while engine.has_unfinished_requests() or driver.pending:
        idle_until = driver.next_arrival_s()
        if idle_until is not None:
            time.sleep(max(start + idle_until - time.perf_counter(), 0.0))
        driver.submit_arrivals(steps)
        running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        step_start, scheduled_before = now, timer.scheduled_tokens
        outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        tokens = 0
        for output in outputs:
            driver.record(output, now, steps)
            tokens += len(output.delta_token_ids)
            request_steps += bool(output.delta_token_ids)
        generated += tokens
        done += sum(output.finished for output in outputs)
        progress.update(task, completed=generated, requests=f"{done}/{num_requests}",
                        tok_s=tok_s_so_far(generated, now - start))
        # The KV group alone: all of stats() reads the process's memory too, inside the timing.
        pages_used = kv_cache_group(engine.allocator, engine.runner.kv_cache.nbytes)["pages_used"]
        step_figures = (now - step_start, running, timer.scheduled_tokens - scheduled_before,
                        tokens, pages_used)
        for figures, value in zip(per_step.values(), step_figures, strict=True):
            figures.append(value)
    wall = now - start
    after = engine.stats()
    return EngineRun(
        records=list(driver.records.values()),
        wall_s=wall,
        steps=steps,
        phase_seconds=dict(timer.seconds),
        peak_kv_pages=int(max(per_step["kv_pages_used"], default=0)),
        kv_pages_total=after["kv_cache"]["pages_total"],
        prefix_query_tokens=grown(before, after, "prefix_cache", "query_tokens"),
        prefix_hit_tokens=grown(before, after, "prefix_cache", "hit_tokens"),
        preemptions={
            cause: count - before["requests"]["preemptions_by_cause"][cause]
            for cause, count in after["requests"]["preemptions_by_cause"].items()
        },
        request_steps=request_steps,
        reduced_thread_steps=grown(before, after, "cpu", "reduced_steps"),
        speculation=SpeculationStats(*(
            grown(before, after, "speculative", key)
            for key in ("proposed_tokens", "accepted_tokens", "verifications")
        )) if "speculative" in after else None,
        swaps={key: grown(before, after, "swap", key)
               for key in ("swaps_out", "swaps_in", "pages_out", "pages_in", "recomputed")}
        if "swap" in after else None,
        per_step=per_step,
        weight_bytes=weight_memory_bytes(engine.runner.model),
        read_bytes_per_token=bytes_read_per_token(engine.runner.model),
        outputs=driver.outputs,
        texts=driver.texts,
    )


# What the JSON records of every step, in `run_engine`'s order: its wall time (from the
# end of the step before, so submitting requests counts), the requests in the engine as
# it began (running and waiting), the tokens it computed (prompt and decode), the tokens
# it generated, and the KV pages held by requests after it.
PER_STEP_FIGURES = ("seconds", "requests", "scheduled_tokens", "output_tokens", "kv_pages_used")


def grown(before: dict[str, Any], after: dict[str, Any], group: str, key: str) -> int:
    """How much a count of `engine.stats()` grew over a run; 0 for a feature that is off."""
    return after[group][key] - before[group][key] if group in after else 0


@dataclass
class Bench:
    """What every engine run of one benchmark shares."""

    model_dir: str
    token_ids: list[int]
    sessions: list[Session]
    temperature: float
    floor: bool  # replay every run's token schedule through the dense layers alone
    progress: Progress
    status_console: Console

    def run(
        self, options: dict[str, Any], description: str, decode: tuple[int, int] | None = None
    ) -> tuple[EngineRun, Metrics | None]:
        """Load a fresh engine, warm it up, serve every session, and free it again. With
        `floor`, the run's floor is measured right after it, on the same machine; with
        `decode` = (batch size, context length), steady-state decoding is timed too."""
        engine, timer, recorder = load_engine(self.model_dir, options, self.floor)
        decode_figures = None
        try:
            warm_up(engine, self.token_ids)
            if recorder is not None:
                recorder.reset()  # the warm-up's steps are not the run's
            run = run_engine(
                engine, timer, self.sessions, self.temperature, self.progress, description
            )
            if recorder is not None:
                with self.status_console.status(f"dense-matmul floor, {description}"):
                    run.floor = measure_floor(engine, recorder, run.wall_s, run.phase_seconds)
            if decode is not None:
                decode_figures = measure_decode(engine, timer, *decode, self.token_ids)
        finally:
            engine.shutdown()  # stops the other tensor-parallel ranks, if any
        del engine
        free_memory()  # on a GPU the engine holds most of it, transformers needs some
        return run, decode_figures


def warm_up(engine: LLMEngine, token_ids: Sequence[int]) -> None:
    """A tiny batch first, so one-time costs (allocator, kernel selection) stay out of round 1."""
    prompt = random.Random(0).choices(token_ids, k=WARMUP_PROMPT_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True)
    for _ in range(2):
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def tok_s_so_far(tokens: int, seconds: float) -> str:
    """The rate so far, to two significant digits below 10 (a big model on a CPU may make
    less than one token a second)."""
    if seconds <= 0:
        return ""
    rate = tokens / seconds
    return f"{rate:.0f} output tok/s" if rate >= 10 else f"{rate:.2g} output tok/s"


# --------------------------------------------------------------------------- summaries
def throughput(requests: int, input_tokens: int, output_tokens: int, wall_s: float) -> Metrics:
    return {
        "requests": requests,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "output_tok_s": output_tokens / wall_s,
        "total_tok_s": (input_tokens + output_tokens) / wall_s,
    }


def summarize_engine_run(run: EngineRun, objectives: dict[str, float] | None = None) -> Metrics:
    """The run's figures; goodput counts the requests that met `objectives` (`bench_load`)."""
    records = run.records
    latencies = [request_latencies(r.submitted, r.first_token, r.finished, r.num_output_tokens)
                 for r in records if r.finished is not None and r.first_token is not None]
    input_tokens = sum(len(r.prompt_token_ids) for r in records)
    output_tokens = sum(r.num_output_tokens for r in records)
    started = [r for r in records if r.first_token is not None]
    priorities = sorted({r.priority for r in started})
    ttft_by_priority = {
        str(p): latency_ms([r.first_token - r.submitted for r in started if r.priority == p])
        for p in priorities
    }
    # Steps, unlike seconds, do not depend on the machine: the policy's own effect.
    ttft_steps_by_priority = {
        str(p): percentiles(
            [r.first_token_step - r.submitted_step for r in started if r.priority == p]
        )
        for p in priorities
    }
    return {
        **throughput(len(records), input_tokens, output_tokens, run.wall_s),
        "ttft_ms": latency_ms([lat["ttft"] for lat in latencies]),
        "ttft_by_priority_ms": ttft_by_priority,
        "ttft_by_priority_steps": ttft_steps_by_priority,
        "tpot_ms": latency_ms([lat["tpot"] for lat in latencies if "tpot" in lat]),
        "e2e_ms": latency_ms([lat["e2e"] for lat in latencies]),
        **goodput(latencies, objectives or {}, run.wall_s, len(records)),
        "peak_kv_pages": run.peak_kv_pages,
        "kv_pages_total": run.kv_pages_total,
        "prefix_hit_rate": run.prefix_hit_tokens / max(run.prefix_query_tokens, 1),
        "preemptions": sum(run.preemptions.values()),
        "preemptions_by_cause": run.preemptions,
        "steps": run.steps,
        "reduced_thread_steps": run.reduced_thread_steps,
        "tokens_per_request_step": output_tokens / max(run.request_steps, 1),
        **({"speculation": run.speculation.as_dict()} if run.speculation else {}),
        **({"swaps": run.swaps} if run.swaps is not None else {}),
        "weight_bytes": run.weight_bytes,
        "phases": phase_breakdown(run.phase_seconds, run.steps, run.wall_s),
        "per_step": run.per_step,
    }



def agreement(run: EngineRun, reference: EngineRun) -> float:
    """The share of `reference`'s output tokens that `run` matched before each turn's
    first difference: one tie broken the other way changes the rest of a greedy output."""
    matched = total = 0
    for position, expected in reference.outputs.items():
        got = run.outputs[position]
        matched += next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), len(expected))
        total += len(expected)
    return matched / max(total, 1)


def phase_breakdown(phase_seconds: dict[str, float], steps: int, wall_s: float) -> Metrics:
    """Each phase's total, per-step average and share of the wall time. What is left,
    "outside steps", is submitting requests and the benchmark's own loop."""
    seconds = {**phase_seconds, "outside steps": max(wall_s - sum(phase_seconds.values()), 0.0)}
    return {
        name: {"seconds": s, "ms_per_step": s / max(steps, 1) * 1000, "share": s / wall_s}
        for name, s in seconds.items()
    }


def median_round(rounds: Sequence[Metrics]) -> Metrics:
    """The round with the median wall time (of an even count, the faster middle one).

    A whole round rather than a median per figure, so the figures stay consistent: tok/s
    is tokens over wall time, and the phases add up to the wall time.
    """
    return sorted(rounds, key=lambda figures: figures["wall_s"])[(len(rounds) - 1) // 2]


def median_floor_round(rounds: Sequence[Metrics]) -> Metrics:
    """The round with the median floor ratio (of an even count, the lower middle one),
    whole, so that its split adds up."""
    return sorted(rounds, key=lambda figures: figures["floor_ratio"])[(len(rounds) - 1) // 2]


def free_memory() -> None:
    """Return what dropped objects held, on a GPU too, before another model needs it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def find_peer(name: str, python: str | None, model_dir: str) -> str:
    try:
        return check_peer(name, python, model_dir)
    except PeerUnavailable as error:
        raise click.UsageError(str(error)) from None


def run_peer_round(
    name: str, python: str, dtype: str, settings: Metrics, reference: EngineRun,
    console: Console, description: str,
) -> Metrics:
    """The requests of nanoqwen's first round through peer `name`: its figures, as
    nanoqwen's have them, and the share of nanoqwen's greedy tokens it matched."""
    records = reference.records
    requests = [(record.prompt_token_ids, record.output_len) for record in records]
    longest = max(len(prompt) + output_len for prompt, output_len in requests)
    with console.status(f"{description}: {len(requests)} requests"):
        try:
            output = run_peer(
                name, python, settings["model_dir"], dtype, settings["threads"], longest,
                requests,
            )
        except PeerUnavailable as error:
            raise click.ClickException(str(error)) from None
    input_tokens = sum(len(prompt) for prompt, _ in requests)
    output_tokens = sum(len(tokens) for tokens in output["output_token_ids"])
    ours = [reference.outputs[record.position] for record in records]
    return {
        "engine": output["engine"],
        "version": output["version"],
        "dtype": dtype if name == "vllm" else "the file's",
        **throughput(len(requests), input_tokens, output_tokens, output["wall_s"]),
        "ttft_ms": latency_ms(output["ttft_s"]),
        "tpot_ms": latency_ms(output["tpot_s"]),
        "agreement": token_agreement(ours, output["output_token_ids"]),
    }


def run_baseline(
    settings: Metrics,
    requests: Sequence[tuple[list[int], int]],
    progress: Progress,
    description: str,
) -> Metrics:
    """The same requests through transformers (`bench_baseline.py`), with progress."""
    output_tokens_by_request = [output_len for _, output_len in requests]
    task = add_progress_task(progress, description, len(requests), sum(output_tokens_by_request))

    def on_batch(done: int, seconds: float) -> None:
        tokens = sum(output_tokens_by_request[:done])
        progress.update(task, completed=tokens, requests=f"{done}/{len(requests)}",
                        tok_s=tok_s_so_far(tokens, seconds))

    run = run_transformers(
        settings["model_dir"], settings["dtype"], settings["device"], settings["threads"],
        settings["max_num_seqs"], requests, on_batch,
    )
    input_tokens = sum(len(prompt) for prompt, _ in requests)
    return {
        **throughput(len(requests), input_tokens, sum(output_tokens_by_request), run.wall_s),
        "batches": run.batches,
    }


# --------------------------------------------------------------------------- load and servers
@dataclass(frozen=True)
class Load:
    """How the requests arrive (`bench_load`): one run per rate, each with at most
    `max_concurrency` requests in flight (None: no limit but the engine's)."""

    rates: tuple[float, ...]
    max_concurrency: int | None
    objectives: dict[str, float]  # goodput's latency objectives, in seconds
    seed: int

    @property
    def is_offline_batch(self) -> bool:
        """All at once with no limit: the plain benchmark, with its comparisons."""
        return self.rates == (math.inf,) and self.max_concurrency is None


@dataclass(frozen=True)
class Servers:
    """Which servers a load run drives: nanoqwen's own (`--serve`), one already running
    (`--endpoint`), vLLM's (`--compare vllm`, with its environment's Python)."""

    serve: bool
    endpoint: str | None
    vllm_python: str | None

    @property
    def any(self) -> bool:
        return self.serve or self.endpoint is not None


def reduced_thread_steps(endpoint: Endpoint) -> float | None:
    """A nanoqwen server's count of steps run on fewer CPU threads (`runner/cpu_threads.py`),
    or None from a server that does not count them."""
    try:
        return endpoint.metric("nanoqwen_cpu_reduced_steps_total")
    except (OSError, ValueError):  # no /metrics page
        return None


def rate_key(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


class LoadBench:
    """Runs of the workload at each of the load's rates, by engine: the in-process engine,
    and the servers. Each rate gets a server started for it and stopped before the next
    one starts: every rate sends the same prompts, and a server's prefix cache would hold
    the last rate's (the in-process engine empties its own before each run)."""

    def __init__(self, bench: Bench, load: Load, settings: Metrics) -> None:
        self.bench, self.load, self.settings = bench, load, settings
        self.rounds: dict[str, dict[str, list[Metrics]]] = {}  # engine → rate → rounds
        self.texts: dict[str, list[str]] = {}  # the engine's texts at each rate, in order
        self.unavailable: dict[str, str] = {}  # server → why it did not start or answer

    def engine_rounds(self, options: dict[str, Any], index: int) -> None:
        label = "nanoqwen"
        engine, timer, _ = load_engine(self.bench.model_dir, options)
        try:
            warm_up(engine, self.bench.token_ids)
            for rate in self.load.rates:
                sessions = with_arrivals(self.bench.sessions, rate, self.load.seed)
                run = run_engine(
                    engine, timer, sessions, self.bench.temperature, self.bench.progress,
                    f"{label}, {describe_rate(rate)}, round {index + 1}",
                    self.load.max_concurrency,
                )
                self.texts[rate_key(rate)] = [run.texts[s, 0] for s in range(len(sessions))]
                self._add(label, rate, summarize_engine_run(run, self.load.objectives))
        finally:
            engine.shutdown()
        del engine
        free_memory()

    def server_rounds(self, label: str, start: Callable[[], AbstractContextManager[Endpoint]],
                      index: int) -> None:
        try:
            for rate in self.load.rates:
                with start() as endpoint:
                    self._warm_up(endpoint)
                    description = f"{label}, {describe_rate(rate)}, round {index + 1}"
                    self._add(label, rate, self._drive(endpoint, rate, description))
        except PeerUnavailable as error:  # it did not start, or did not answer: the
            self.unavailable[label] = str(error)  # others' figures are still reported

    def _warm_up(self, endpoint: Endpoint) -> None:
        prompt = random.Random(0).choices(self.bench.token_ids, k=WARMUP_PROMPT_TOKENS)
        records, _ = drive(endpoint, [(prompt, WARMUP_OUTPUT_TOKENS)] * 2, [0.0, 0.0], None)
        failed = [r.error for r in records if r.error is not None]
        if failed:
            raise click.ClickException(f"{endpoint.url} failed a warm-up request: {failed[0]}")

    def _drive(self, endpoint: Endpoint, rate: float, description: str) -> Metrics:
        requests = [(session[0].new_token_ids, session[0].output_len)
                    for session in self.bench.sessions]
        arrivals = arrival_times(len(requests), rate, self.load.seed)
        total_output = sum(output_len for _, output_len in requests)
        task = add_progress_task(self.bench.progress, description, len(requests), total_output)
        start, tokens, done = time.perf_counter(), 0, 0

        def on_done(record: ServedRequest) -> None:
            nonlocal tokens, done
            tokens, done = tokens + record.output_tokens, done + 1
            rate_so_far = tok_s_so_far(tokens, time.perf_counter() - start)
            self.bench.progress.update(task, completed=tokens, requests=f"{done}/{len(requests)}",
                                       tok_s=rate_so_far)

        reduced_before = reduced_thread_steps(endpoint)
        records, wall = drive(endpoint, requests, arrivals, self.load.max_concurrency, on_done)
        figures = summarize_served(records, wall, self.load.objectives)
        reduced_after = reduced_thread_steps(endpoint)
        if reduced_before is not None and reduced_after is not None:  # as in process
            figures["reduced_thread_steps"] = int(reduced_after - reduced_before)
        reference = self.texts.get(rate_key(rate))
        if reference is not None:  # the same greedy text as the engine's, request by request
            figures["agreement"] = token_agreement(reference, [r.text for r in records])
        return figures

    def _add(self, label: str, rate: float, figures: Metrics) -> None:
        self.rounds.setdefault(label, {}).setdefault(rate_key(rate), []).append(figures)

    def result(self) -> Metrics:
        """The median round of every engine at every rate, and each server's output tok/s
        over the in-process engine's (the same requests, the same arrivals)."""
        runs = {label: {rate: median_round(rounds) for rate, rounds in by_rate.items()}
                for label, by_rate in self.rounds.items()}
        result: Metrics = {"settings": self.settings, "load": runs, "rounds": self.rounds,
                           "unavailable": self.unavailable}
        if "nanoqwen" in runs:
            result["vs_engine"] = {
                label: {rate: figures["output_tok_s"] / runs["nanoqwen"][rate]["output_tok_s"]
                        for rate, figures in by_rate.items()}
                for label, by_rate in runs.items() if label != "nanoqwen"
            }
        return result


def run_load(
    bench: Bench, load: Load, servers: Servers, options: dict[str, Any], settings: Metrics,
    rounds: int,
) -> Metrics:
    """Every round: the in-process engine at each rate (unless only an endpoint is
    driven), then each server at each rate, one after the other."""
    runs = LoadBench(bench, load, settings)
    model_dir, dtype = bench.model_dir, settings["dtype"]
    longest = longest_request(bench.sessions)
    for index in range(rounds):
        if servers.endpoint is None:
            runs.engine_rounds(options, index)
        if servers.serve:
            runs.server_rounds("nanoqwen server", partial(
                nanoqwen_server, model_dir, options, settings["threads"]), index)
        if servers.endpoint is not None:  # someone else's: its cache is theirs to empty
            runs.server_rounds(servers.endpoint, partial(served_endpoint, servers.endpoint),
                               index)
        if servers.vllm_python is not None:
            runs.server_rounds("vLLM server", partial(
                vllm_server, servers.vllm_python, model_dir, dtype, settings["threads"],
                max(longest, WARMUP_PROMPT_TOKENS + WARMUP_OUTPUT_TOKENS),
                settings["max_num_seqs"]), index)
    return runs.result()


@contextmanager
def served_endpoint(url: str) -> Iterator[Endpoint]:
    """A server someone else runs: its model id, read from it."""
    endpoint = Endpoint(url.rstrip("/"))
    try:
        endpoint.model = endpoint.served_model()
    except (OSError, ValueError, KeyError, IndexError) as error:
        raise PeerUnavailable(f"{url} lists no model at /v1/models: {error}") from None
    yield endpoint


# --------------------------------------------------------------------------- command line
# What the report and the JSON call the engine `--compare` runs.
BASELINE_NAMES = {"hf": "transformers", **{name: peer.label for name, peer in PEERS.items()}}


def resolve_model(model: str | None, random_weights: str | None) -> str:
    if (model is None) == (random_weights is None):
        raise click.UsageError("give exactly one of --model and --random-weights")
    try:
        return random_checkpoint(random_weights) if random_weights else resolve_model_path(model)
    except ValueError as error:
        raise click.UsageError(str(error)) from None


def load_engine(
    model_dir: str, options: dict[str, Any], floor: bool = False
) -> tuple[LLMEngine, PhaseTimer, FloorRecorder | None]:
    """A fresh engine, with a phase timer installed (and with `floor`, a floor recorder
    inside it, so that the timer counts what the recorder adds)."""
    try:
        engine = LLMEngine(model_dir, **options)
    except ValueError as error:
        raise click.UsageError(in_flags(str(error))) from None
    recorder = FloorRecorder() if floor else None
    timer = PhaseTimer(engine.device)
    if recorder is not None:
        recorder.attach(engine)
        observe(engine, Observers(timer, recorder))
    else:
        observe(engine, timer)
    return engine, timer, recorder


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """`count` processes that keep a core busy each, for as long as the block runs."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def check_can_plot() -> None:
    """Before minutes of benchmarking, not after: is matplotlib there to draw the plot?"""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.UsageError(
            "--plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)"
        ) from None


def make_load(
    rates: tuple[float, ...], max_concurrency: int | None, objectives: tuple[str, ...], seed: int
) -> Load:
    try:
        parsed = parse_goodput(objectives)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    return Load(tuple(rates) or (math.inf,), max_concurrency, parsed, seed)


def check_load(
    load: Load, workload: Workload, serve: bool, endpoint: str | None, compare: str | None,
    decode_batch: int | None, floor: bool, plot_path: Path | None,
) -> None:
    """What a run at request rates, or through servers, can be combined with."""
    if serve and endpoint is not None:
        raise click.UsageError("give --serve (start serve.py) or --endpoint URL, not both")
    served = serve or endpoint is not None
    if load.is_offline_batch and not served:
        return
    if served and workload.scenario not in SERVED_SCENARIOS:
        raise click.UsageError(f"a server is driven with one-turn requests: --scenario "
                               f"{' or '.join(SERVED_SCENARIOS)}")
    if workload.scenario == "priority":
        raise click.UsageError("the priority scenario has arrivals of its own: "
                               "leave out --request-rate and --max-concurrency")
    others = {"--decode-batch": decode_batch is not None, "--floor": floor,
              "--plot": plot_path is not None, "--temperature": workload.temperature > 0,
              f"--compare {compare}": compare not in (None, "vllm") or (
                  compare == "vllm" and not served)}
    refused = [name for name, given in others.items() if given]
    if refused:
        raise click.UsageError(f"{', '.join(refused)} cannot be combined with --request-rate, "
                               "--max-concurrency, --serve or --endpoint")


def check_workload(workload: Workload) -> None:
    if workload.num_seqs < 1 or workload.turns < 1:
        raise click.UsageError("--num-seqs and --turns must be at least 1")
    if not 1 <= workload.min_input <= workload.max_input:
        raise click.UsageError("need 1 <= --min-input <= --max-input")
    if not 1 <= workload.min_output <= workload.max_output:
        raise click.UsageError("need 1 <= --min-output <= --max-output")


def check_fits(engine: LLMEngine, sessions: Sequence[Session], decode_batch: int | None) -> None:
    needed = longest_request(sessions)
    if needed > engine.max_model_len:
        raise click.UsageError(
            f"the longest request needs {needed} tokens but max_model_len is "
            f"{engine.max_model_len}; shorten the inputs, outputs or turns"
        )
    if decode_batch is not None and decode_batch > engine.config.max_num_seqs:
        raise click.UsageError(
            f"--decode-batch {decode_batch} exceeds --max-num-seqs {engine.config.max_num_seqs}"
        )


def measure_decode(
    engine: LLMEngine, timer: PhaseTimer, batch_size: int, context_len: int, token_ids: list[int]
) -> Metrics:
    try:
        return measure_decode_overhead(engine, timer, batch_size, context_len, token_ids)
    except PoolTooSmall as error:
        raise click.ClickException(str(error)) from None


def companion_options(
    engine: LLMEngine, options: dict[str, Any]
) -> dict[str, tuple[str, dict[str, Any]]]:
    """The runs every round adds for comparison, by their name in the result: what the
    progress bar calls them, and their engine options (`options` is the engine's own)."""
    config, companions = engine.config, {}
    if config.speculative:
        plain = {k: v for k, v in options.items() if k not in SPECULATIVE_OPTION_NAMES}
        companions["no_speculation"] = ("without speculation", plain)
    weights = runtime_quantization(config.quantization, engine.checkpoint, engine.device)
    if weights is not None or config.kv_cache_dtype != "auto":
        full = {**options, "quantization": "none", "kv_cache_dtype": "auto"}
        companions["full_precision"] = ("at full precision", full)
    return companions


def run_companions(
    bench: Bench,
    companions: dict[str, tuple[str, dict[str, Any]]],
    runs: dict[str, list[EngineRun]],
    index: int,
) -> None:
    for name, (label, options) in companions.items():
        runs[name].append(bench.run(options, f"nanoqwen {label}, round {index + 1}")[0])


def parameter_counts(config: ModelConfig) -> Metrics:
    """The model's parameters, and how many of them one token uses: of a sparse layer's
    routed experts only the k it is routed to (counted on the meta device, so whatever the
    weights' form or split)."""
    with torch.device("meta"):
        model = QwenForCausalLM(config)
    total = sum(param.numel() for param in model.parameters())
    idle = 0.0
    if config.moe is not None:
        experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        idle = experts * (1 - config.moe.num_experts_per_tok / config.moe.num_experts)
    return {"parameters": total, "active_parameters": round(total - idle)}


def engine_settings(engine: LLMEngine, threads: int) -> Metrics:
    config = engine.config
    weights = runtime_quantization(config.quantization, engine.checkpoint, engine.device)
    return {
        "architecture": engine.model_config.architecture,
        **parameter_counts(engine.model_config),
        "device": str(engine.device),
        "dtype": str(config.dtype).removeprefix("torch."),
        "quantization": (weights.mode if weights is not None else "none"),
        "kv_cache_dtype": config.kv_cache_dtype,
        "threads": threads,  # in all; tensor-parallel ranks on a CPU share them
        "max_num_seqs": config.max_num_seqs,
        "page_size": config.page_size,
        "chunk_size": config.chunk_size,
        "prefix_cache": config.enable_prefix_cache,
        "scheduling_policy": config.scheduling_policy,
        "priority_aging_steps": config.priority_aging_steps,
        "preemption_mode": config.preemption_mode,
        "swap_space": config.swap_space,
        "tensor_parallel_size": config.tensor_parallel_size,
        "speculative": config.speculative,
        "num_speculative_tokens": config.num_speculative_tokens,
    }


# The workload's sizes where the command line leaves them out: on a GPU nano-vllm's
# published benchmark; on a CPU, where that one runs for hours, one that ends in minutes
# (about 1,300 output tokens of 16 requests).
DEFAULT_SIZES = {
    "cuda": {"num_seqs": 256, "min_input": 100, "max_input": 1024, "min_output": 100,
             "max_output": 1024},
    "cpu": {"num_seqs": 16, "min_input": 32, "max_input": 256, "min_output": 32,
            "max_output": 128},
}


def size_help(name: str) -> str:
    return f"Default: {DEFAULT_SIZES['cuda'][name]} on a GPU, {DEFAULT_SIZES['cpu'][name]} on a CPU."


def workload_sizes(given: dict[str, int | None], device: str | None) -> dict[str, int]:
    """The sizes given, the device's defaults for the rest."""
    defaults = DEFAULT_SIZES[resolve_device(device).type]
    return {name: defaults[name] if value is None else value for name, value in given.items()}


def make_progress(console: Console) -> Progress:
    """Per round and engine: output tokens done of all (the bar, and the time left at the
    rate so far, once tokens come), requests done, and output tokens per second so far."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[requests]} requests"),
        TextColumn("{task.fields[tok_s]}"),
        TimeElapsedColumn(),
        TextColumn("· about"),
        TimeRemainingColumn(),
        TextColumn("left"),
        console=console,
    )


def add_progress_task(progress: Progress, description: str, num_requests: int,
                      output_tokens: int) -> TaskID:
    """A task counting output tokens, which come at a steadier pace than finished requests."""
    return progress.add_task(description, total=output_tokens, requests=f"0/{num_requests}",
                             tok_s="")


def assemble_result(
    settings: Metrics,
    rounds_by_policy: dict[str, list[Metrics]],
    baseline_rounds: list[Metrics] | None,
    baseline_name: str | None,
    decode: Metrics | None,
    plain_rounds: list[Metrics] | None = None,
    floor_rounds: list[Metrics] | None = None,
    full_precision_rounds: list[Metrics] | None = None,
) -> Metrics:
    """The figures of the last policy run are nanoqwen's (with more than one policy, each
    policy's median round is under "policies" too), and each comparison is the median of its
    rounds' ratios: a round's runs are back to back, so a machine getting busier or quieter
    over the minutes disturbs their ratio least."""
    engine_rounds = list(rounds_by_policy.values())[-1]
    result: Metrics = {"settings": settings, "nanoqwen": median_round(engine_rounds)}
    if len(rounds_by_policy) > 1:
        result["policies"] = {
            policy: median_round(rounds) for policy, rounds in rounds_by_policy.items()
        }
    rounds: Metrics = {"nanoqwen": engine_rounds}
    for name, others, ratio_name in (
        (baseline_name, baseline_rounds, "speedup"),
        ("no_speculation", plain_rounds, "speculation_speedup"),
        ("full_precision", full_precision_rounds, "quantization_speedup"),
    ):
        if others is None:
            continue
        result[name] = median_round(others)
        result[ratio_name] = statistics.median(
            ours["output_tok_s"] / theirs["output_tok_s"]
            for ours, theirs in zip(engine_rounds, others, strict=True)
        )
        rounds[name] = others
    if decode is not None:
        result["decode"] = decode
    if floor_rounds is not None:
        # A round's engine run and floor replay are back to back, like the comparisons.
        result["floor"] = median_floor_round(floor_rounds)
        rounds["floor"] = floor_rounds
    result["rounds"] = rounds
    return result


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@config_option
@model_option(default=None)
@click.option(
    "--random-weights",
    default=None,
    metavar="PRESET_OR_CONFIG",
    help=f"Random weights of this shape instead: a preset ({', '.join(PRESETS)}) or a config.json.",
)
@click.option("--num-seqs", type=click.IntRange(min=1), default=None,
              help=f"Requests in total (all turns of all conversations). {size_help('num_seqs')}")
@click.option("--min-input", type=click.IntRange(min=1), default=None,
              help=f"Shortest prompt (shared-prefix: the prefix length). {size_help('min_input')}")
@click.option("--max-input", type=click.IntRange(min=1), default=None,
              help=f"Longest prompt (multi-turn: new tokens per turn). {size_help('max_input')}")
@click.option("--min-output", type=click.IntRange(min=1), default=None,
              help=f"Shortest output. {size_help('min_output')}")
@click.option("--max-output", type=click.IntRange(min=1), default=None,
              help=f"Longest output. {size_help('max_output')}")
@click.option("--seed", default=0, help="Same seed, same prompts and lengths.")
@click.option("--scenario", type=click.Choice(SCENARIOS), default="random")
@click.option("--turns", default=4, help="Turns per conversation (multi-turn).")
@click.option(
    "--temperature",
    default=0.0,
    type=click.FloatRange(min=0),
    help="Sampling temperature of every request (0: greedy); sampled requests are seeded.",
)
@click.option(
    "--compare",
    type=click.Choice(["hf", *PEERS]),
    default=None,
    help="Also run the same requests through transformers' generate (hf, in batches of "
         "--max-num-seqs), vLLM or llama.cpp (on a .gguf --model).",
)
@click.option(
    "--peer-python",
    default=None,
    metavar="PATH",
    help="The python of the environment vLLM or llama.cpp is installed in (default: this one).",
)
@click.option(
    "--peer-dtype",
    default=None,
    type=click.Choice(["float32", "bfloat16", "float16"]),
    help="vLLM's dtype (default: nanoqwen's).",
)
@click.option(
    "--rounds",
    default=1,
    type=click.IntRange(min=1),
    help="Repeat, alternating the engines; report the median round.",
)
@click.option(
    "--decode-batch",
    type=click.IntRange(min=1),
    default=None,
    help="Also time steady-state decode at this batch size (prompts of --min-input tokens).",
)
@click.option(
    "--floor",
    is_flag=True,
    help="Also replay each round's token schedule through the dense layers alone.",
)
@click.option(
    "--background-load",
    default=0,
    type=click.IntRange(min=0),
    help="Busy processes to run beside the engines while they are timed: how an engine "
         "fares when it shares its cores.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="CPU threads for torch, in both engines (default: torch's choice).",
)
@click.option(
    "--request-rate",
    "request_rates",
    type=click.FloatRange(min=0, min_open=True),
    multiple=True,
    metavar="PER_SECOND",
    help="Requests arrive as a Poisson process of this rate (inf: all at once); repeat "
         "for a run at each rate. Default: inf.",
)
@click.option(
    "--max-concurrency",
    type=click.IntRange(min=1),
    default=None,
    help="At most this many requests in flight (with --request-rate inf: a closed loop).",
)
@click.option(
    "--goodput",
    "goodput_objectives",
    multiple=True,
    metavar="KEY:MS",
    help="A latency objective goodput counts (ttft, tpot or e2e, in ms), e.g. ttft:2000; "
         "repeatable.",
)
@click.option(
    "--serve",
    is_flag=True,
    help="Also start serve.py with these engine options and stream the same requests "
         "through it (with --compare vllm: through vLLM's server too), a fresh server for "
         "each rate so that none finds an earlier rate's prompts in its prefix cache.",
)
@click.option(
    "--endpoint",
    default=None,
    metavar="URL",
    help="Stream the requests through this running OpenAI-compatible server instead "
         "(e.g. http://127.0.0.1:8000); every rate sends the same prompts, so its prefix "
         "cache holds the earlier rates' (the report's prefix hits say where it counts them).",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write every figure, with the versions, the machine and each step, to this file.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Draw throughput, where the time goes and TTFT by priority into this image "
    "(.png, .svg, .pdf); needs matplotlib: pip install -e '.[plot]'.",
)
@engine_options
def main(
    model: str | None,
    random_weights: str | None,
    num_seqs: int | None,
    min_input: int | None,
    max_input: int | None,
    min_output: int | None,
    max_output: int | None,
    seed: int,
    scenario: str,
    turns: int,
    temperature: float,
    compare: str | None,
    peer_python: str | None,
    peer_dtype: str | None,
    rounds: int,
    decode_batch: int | None,
    floor: bool,
    background_load: int,
    threads: int | None,
    request_rates: tuple[float, ...],
    max_concurrency: int | None,
    goodput_objectives: tuple[str, ...],
    serve: bool,
    endpoint: str | None,
    json_path: Path | None,
    plot_path: Path | None,
    **engine_option_values: Any,
) -> None:
    """Benchmark nanoqwen on a fixed synthetic workload, optionally against transformers."""
    quiet_library_noise()
    given = {"num_seqs": num_seqs, "min_input": min_input, "max_input": max_input,
             "min_output": min_output, "max_output": max_output}
    sizes = workload_sizes(given, engine_option_values["device"])
    workload = Workload(scenario, **sizes, turns=turns, seed=seed, temperature=temperature)
    check_workload(workload)
    load = make_load(request_rates, max_concurrency, goodput_objectives, seed)
    check_load(load, workload, serve, endpoint, compare, decode_batch, floor, plot_path)
    if plot_path is not None:
        check_can_plot()
    environment = describe_environment()  # the machine as it was when the run began
    if threads is not None:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    # Weight-loading and shard-writing bars of transformers and the hub would cut into ours.
    transformers_logging.disable_progress_bar()
    disable_progress_bars()
    console, status_console = Console(), Console(stderr=True)
    with status_console.status("preparing the model"):
        model_dir = resolve_model(model, random_weights)
    if compare in PEERS:
        with status_console.status(f"looking for {PEERS[compare].label}"):
            peer_python = find_peer(compare, peer_python, model_dir)
    options = pop_engine_options(engine_option_values)
    policies = COMPARED_POLICIES if scenario == "priority" else (options["scheduling_policy"],)
    with status_console.status("loading the model"):
        engine, _, _ = load_engine(model_dir, {**options, "scheduling_policy": policies[0]})
        vocab_size = engine.model_config.vocab_size
        token_ids = prompt_token_ids(model_dir, vocab_size)
    if not token_ids:  # the prompts are ids, and the model has them all: text is not needed
        status_console.print(
            f"{model_dir} has no tokenizer files: prompts draw from all {vocab_size:,} token "
            "ids of the model (its vocab_size)", markup=False,
        )
        token_ids = list(range(vocab_size))
    sessions = make_sessions(workload, token_ids)
    if scenario == "copy":
        with status_console.status("writing the copy prompts"):
            sessions = continue_prompts(engine, sessions)
    check_fits(engine, sessions, decode_batch)
    if floor and engine.model_config.architecture not in DENSE_ARCHITECTURES:
        raise click.UsageError(
            f"--floor replays the dense layers of {' and '.join(DENSE_ARCHITECTURES)} only, "
            f"not {engine.model_config.architecture}'s"
        )
    companions = companion_options(engine, {**options, "scheduling_policy": policies[-1]})
    settings = {
        "model": model or f"random weights: {random_weights}",
        "model_dir": model_dir,
        **asdict(workload),
        "rounds": rounds,
        "compare": compare,
        "background_load": background_load,
        "scheduling_policies": list(policies),
        **engine_settings(engine, threads),
    }
    engine.shutdown()
    del engine
    free_memory()
    if not load.is_offline_batch or serve or endpoint is not None:
        servers = Servers(serve, endpoint, peer_python if compare == "vllm" else None)
        settings.update(request_rates=list(load.rates), max_concurrency=max_concurrency,
                        goodput=list(goodput_objectives))
        with make_progress(status_console) as progress, busy_processes(background_load):
            bench = Bench(model_dir, token_ids, sessions, temperature, floor, progress,
                          status_console)
            result = run_load(bench, load, servers, options, settings, rounds)
        print_load_report(console, result)
        if json_path is not None:
            json_path.write_text(json.dumps({"environment": environment, **result}, indent=2))
        if result["unavailable"]:
            raise click.ClickException("\n".join(result["unavailable"].values()))
        return
    with status_console.status("measuring the memory bandwidth"):
        bandwidth = measure_bandwidth(torch.device(settings["device"]))
    runs: dict[str, list[EngineRun]] = {policy: [] for policy in policies}
    companion_runs: dict[str, list[EngineRun]] = {name: [] for name in companions}
    baseline_rounds: list[Metrics] = []
    decode = None
    with make_progress(status_console) as progress, busy_processes(background_load):
        bench = Bench(model_dir, token_ids, sessions, temperature, floor, progress, status_console)
        for index in range(rounds):
            # Each round has a fresh engine per policy (and one per companion: without
            # speculation, at full precision) and a fresh transformers process, one after
            # the other, so a machine that gets busier or quieter affects all alike. The
            # companions run after the others in even rounds, before them in odd ones, so
            # neither always goes first.
            if index % 2 == 1:
                run_companions(bench, companions, companion_runs, index)
            for policy in policies:
                label = f", {policy}" if len(policies) > 1 else ""
                last = index == rounds - 1 and policy == policies[-1]
                timed_decode = decode_batch is not None and last
                run, figures = bench.run(
                    {**options, "scheduling_policy": policy},
                    f"nanoqwen{label}, round {index + 1}",
                    (decode_batch, workload.min_input) if timed_decode else None,
                )
                runs[policy].append(run)
                decode = figures or decode
            if index % 2 == 0:
                run_companions(bench, companions, companion_runs, index)
            if compare == "hf":
                records = runs[policies[0]][0].records
                requests = [(record.prompt_token_ids, record.output_len) for record in records]
                description = f"transformers, round {index + 1}"
                baseline_rounds.append(run_baseline(settings, requests, progress, description))
            elif compare in PEERS:
                description = f"{PEERS[compare].label}, round {index + 1}"
                peer = run_peer_round(compare, peer_python, peer_dtype or settings["dtype"],
                                      settings, runs[policies[0]][0], status_console, description)
                baseline_rounds.append(peer)
    rounds_by_policy = {
        policy: [summarize_engine_run(run) for run in policy_runs]
        for policy, policy_runs in runs.items()
    }
    companion_rounds = {
        name: [summarize_engine_run(run) for run in companion]
        for name, companion in companion_runs.items()
    }
    for figures, run, full in zip(
        rounds_by_policy[policies[-1]], runs[policies[-1]], companion_runs.get("full_precision", [])
    ):
        figures["agreement"] = agreement(run, full)
    floor_rounds = [run.floor for run in runs[policies[-1]] if run.floor is not None] or None
    median = median_round(rounds_by_policy[policies[-1]])
    batch_one = bandwidth_floor(
        runs[policies[-1]][0].read_bytes_per_token, bandwidth, median["tpot_ms"]["p50"]
    )
    result = assemble_result(
        settings, rounds_by_policy, baseline_rounds or None, BASELINE_NAMES.get(compare), decode,
        companion_rounds.get("no_speculation"), floor_rounds,
        companion_rounds.get("full_precision"),
    )
    result["bandwidth_floor"] = batch_one
    print_report(console, result)
    if json_path is not None:
        json_path.write_text(json.dumps({"environment": environment, **result}, indent=2))
    if plot_path is not None:
        plot_result(result, plot_path)
        status_console.print(f"plot written to {plot_path}")


if __name__ == "__main__":
    main()
