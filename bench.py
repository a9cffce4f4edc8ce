"""Benchmark nanoqwen: throughput, latency, and where the time of each step goes.

    python bench.py --model Qwen/Qwen3-0.6B --compare hf --json result.json
    python bench.py --random-weights qwen3-cpu --num-seqs 64 --max-input 512 --max-output 256

**The workload** is synthetic and fixed by `--seed`: prompts of random token ids (special
tokens left out) with lengths drawn uniformly from `[--min-input, --max-input]`, and for each
an output length from `[--min-output, --max-output]`, generated greedily with `ignore_eos`, so
every run does exactly the same work. Three scenarios:

* `random`: independent prompts, all submitted at once (an offline batch job).
* `shared-prefix`: the same, but every prompt starts with the same `--min-input` tokens (a
  shared system prompt), which the prefix cache should serve after the first request.
* `multi-turn`: conversations of `--turns` turns; turn N+1 is submitted when turn N finishes
  and its prompt is turn N's prompt, then its answer, then new tokens (a chat).

**The measurements** come from the loop around `engine.step()`: a request's time to first
token (TTFT) is from its submission to the first step that returns a token for it; its time
per output token (TPOT) is the rest of its life divided by its remaining tokens. The engine's
`PhaseTimer` splits every step into schedule, prepare inputs, forward, sample and
detokenize/bookkeeping, which says where the time goes.

`--compare hf` runs the same prompts through transformers' `generate` on the same weights:
static batches of `--max-num-seqs` prompts, left-padded, greedy, each batch generating its
longest output length (multi-turn prompts are the ones nanoqwen served, answers included,
batched without waiting for one another). It runs in a separate process, after the engine
has been freed, so the two never share memory. `--rounds N` repeats both, alternating:
every round builds a fresh engine, runs the workload, frees it, then runs transformers. A
machine that gets busier or quieter over the minutes then disturbs both alike; the report
shows the median round of each, and the speedup is the median of the rounds' ratios.

`--decode-batch B` adds a micro-benchmark of steady-state decoding: `B` running requests with
`--min-input`-token prompts, timing whole engine steps against the runner's forward pass
alone on one prepared batch. Their ratio is the engine's overhead over the model; the
scheduler and input-preparation time per step is the host work that, on a GPU, decides
whether the device waits.

`--random-weights PRESET_OR_CONFIG` benchmarks a random-weights model of a given shape
(see `nanoqwen/presets.py`), for machines that cannot download a checkpoint.
"""

from __future__ import annotations

import functools
import gc
import json
import math
import multiprocessing
import random
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from nanoqwen import LLMEngine, RequestOutput, SamplingParams
from nanoqwen.cli import engine_options, pop_engine_options
from nanoqwen.loader import resolve_model_path
from nanoqwen.presets import PRESETS, random_checkpoint

SCENARIOS = ("random", "shared-prefix", "multi-turn")
# Figures both engines report: (label, key, format).
THROUGHPUT_ROWS = [
    ("requests", "requests", "{}"),
    ("input tokens", "input_tokens", "{}"),
    ("output tokens", "output_tokens", "{}"),
    ("wall time (s)", "wall_s", "{:.2f}"),
    ("output tok/s", "output_tok_s", "{:.1f}"),
    ("total tok/s", "total_tok_s", "{:.1f}"),
]
PHASE_LABELS = {
    "schedule": "schedule",
    "prepare": "prepare inputs",
    "forward": "forward",
    "sample": "sample",
    "postprocess": "detokenize + bookkeeping",
}
DECODE_STEPS = 16  # timed steady-state decode steps, and as many bare forward passes
WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS = 32, 4
PAD_TOKEN_ID = 0  # any id will do: padded positions are masked out

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


@dataclass(frozen=True)
class Turn:
    """One request of a conversation."""

    new_token_ids: list[int]  # appended to the conversation so far (all of it, for turn 1)
    output_len: int


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

    if workload.scenario == "random":
        return [[Turn(tokens(input_len()), output_len())] for _ in range(workload.num_seqs)]
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


def longest_request(sessions: Sequence[Session]) -> int:
    """Tokens in the longest request, prompt and output (a conversation's last turn)."""
    return max(sum(len(t.new_token_ids) + t.output_len for t in session) for session in sessions)


def prompt_token_ids(model_dir: str, model_vocab_size: int) -> list[int]:
    """Ids a random prompt may use: the tokenizer's ordinary tokens, never a special one."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    upper = min(tokenizer.vocab_size, model_vocab_size)
    return [token_id for token_id in range(upper) if token_id not in excluded]


# --------------------------------------------------------------------------- running the engine
@dataclass
class RequestRecord:
    prompt_token_ids: list[int]
    output_len: int  # requested
    submitted: float
    first_token: float | None = None
    finished: float | None = None
    num_output_tokens: int = 0


@dataclass
class EngineRun:
    records: list[RequestRecord]
    wall_s: float
    steps: int
    phase_seconds: dict[str, float]
    peak_kv_pages: int
    kv_pages_total: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int


class SessionDriver:
    """Feeds conversations to the engine: first turns at once, each next turn on a finish."""

    def __init__(self, engine: LLMEngine, sessions: Sequence[Session]) -> None:
        self.engine = engine
        self.sessions = sessions
        self.records: dict[str, RequestRecord] = {}
        self._position: dict[str, tuple[int, int]] = {}  # request id → (session, turn)

    def start(self) -> None:
        for session in range(len(self.sessions)):
            self._submit(session, 0, history=[])

    def record(self, output: RequestOutput, now: float) -> None:
        """Note what a step did for one request; a finished turn submits the next one."""
        record = self.records[output.request_id]
        if output.delta_token_ids and record.first_token is None:
            record.first_token = now
        record.num_output_tokens += len(output.delta_token_ids)
        if output.finished:
            record.finished = now
            session, turn = self._position[output.request_id]
            if turn + 1 < len(self.sessions[session]):
                self._submit(session, turn + 1, history=record.prompt_token_ids + output.token_ids)

    def _submit(self, session: int, turn: int, history: list[int]) -> None:
        spec = self.sessions[session][turn]
        prompt = history + spec.new_token_ids
        params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
        request_id = self.engine.add_request(prompt, params)
        self.records[request_id] = RequestRecord(prompt, spec.output_len, time.perf_counter())
        self._position[request_id] = (session, turn)


def run_engine(
    engine: LLMEngine, sessions: Sequence[Session], progress: Progress, description: str
) -> EngineRun:
    """Serve every session to completion, timing each request and each step's phases."""
    engine.reset_prefix_cache()  # a previous round's prompts must not be cache hits
    engine.timer.reset()
    before = engine.stats()
    task = progress.add_task(description, total=sum(len(s) for s in sessions))
    driver = SessionDriver(engine, sessions)
    peak_pages = 0
    start = time.perf_counter()
    driver.start()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            driver.record(output, now)
            if output.finished:
                progress.advance(task)
        peak_pages = max(peak_pages, engine.stats()["pages_used"])
    wall = time.perf_counter() - start
    after = engine.stats()
    return EngineRun(
        records=list(driver.records.values()),
        wall_s=wall,
        steps=engine.timer.steps,
        phase_seconds=dict(engine.timer.seconds),
        peak_kv_pages=peak_pages,
        kv_pages_total=after["pages_total"],
        prefix_query_tokens=after["prefix_query_tokens"] - before["prefix_query_tokens"],
        prefix_hit_tokens=after["prefix_hit_tokens"] - before["prefix_hit_tokens"],
        preemptions=after["preemptions"] - before["preemptions"],
    )


def warm_up(engine: LLMEngine, token_ids: Sequence[int]) -> None:
    """A tiny batch first, so one-time costs (allocator, kernel selection) stay out of round 1."""
    prompt = random.Random(0).choices(token_ids, k=WARMUP_PROMPT_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True)
    for _ in range(2):
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


# --------------------------------------------------------------------------- summaries
def percentile(values: Sequence[float], q: int) -> float:
    """The `q`-th percentile (1-99), interpolating between ranks; 0 for no values."""
    if len(values) < 2:
        return float(values[0]) if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def latency_ms(values: Sequence[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50) * 1000, "p95": percentile(values, 95) * 1000}


def throughput(requests: int, input_tokens: int, output_tokens: int, wall_s: float) -> Metrics:
    return {
        "requests": requests,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "output_tok_s": output_tokens / wall_s,
        "total_tok_s": (input_tokens + output_tokens) / wall_s,
    }


def summarize_engine_run(run: EngineRun) -> Metrics:
    records = run.records
    ttft = [r.first_token - r.submitted for r in records if r.first_token is not None]
    e2e = [r.finished - r.submitted for r in records if r.finished is not None]
    tpot = [
        (r.finished - r.first_token) / (r.num_output_tokens - 1)
        for r in records
        if r.finished is not None and r.first_token is not None and r.num_output_tokens > 1
    ]
    input_tokens = sum(len(r.prompt_token_ids) for r in records)
    output_tokens = sum(r.num_output_tokens for r in records)
    return {
        **throughput(len(records), input_tokens, output_tokens, run.wall_s),
        "ttft_ms": latency_ms(ttft),
        "tpot_ms": latency_ms(tpot),
        "e2e_ms": latency_ms(e2e),
        "peak_kv_pages": run.peak_kv_pages,
        "kv_pages_total": run.kv_pages_total,
        "prefix_hit_rate": run.prefix_hit_tokens / max(run.prefix_query_tokens, 1),
        "preemptions": run.preemptions,
        "steps": run.steps,
        "phases": phase_breakdown(run.phase_seconds, run.steps, run.wall_s),
    }


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


# --------------------------------------------------------------------------- transformers baseline
@functools.cache
def _transformers_model(model_dir: str, dtype: str, device: str) -> torch.nn.Module:
    """Loaded once per worker process, then reused by every batch."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    _transformers_generate(model, [list(range(1, 9))], 2)  # warm-up
    return model


def _transformers_generate(
    model: torch.nn.Module, prompts: list[list[int]], num_tokens: int
) -> float:
    """Seconds for one left-padded greedy batch generating exactly `num_tokens` tokens."""
    width = max(len(p) for p in prompts)
    device = model.device
    input_ids = torch.tensor(
        [[PAD_TOKEN_ID] * (width - len(p)) + p for p in prompts], device=device
    )
    attention_mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device
    )
    # min = max new tokens: EOS cannot end a row early, as with ignore_eos in the engine.
    config = GenerationConfig(
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        pad_token_id=PAD_TOKEN_ID,
    )
    _synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config
        )
    _synchronize(device)
    elapsed = time.perf_counter() - start
    if output.shape[1] != width + num_tokens:
        raise RuntimeError(
            f"transformers generated {output.shape[1] - width} tokens, not {num_tokens}"
        )
    return elapsed


def transformers_batch_seconds(
    model_dir: str, dtype: str, device: str, prompts: list[list[int]], num_tokens: int
) -> float:
    """Runs in the worker process: load (first call only), then time one batch."""
    return _transformers_generate(
        _transformers_model(model_dir, dtype, device), prompts, num_tokens
    )


def run_transformers(
    settings: Metrics,
    requests: Sequence[tuple[list[int], int]],
    progress: Progress,
    description: str,
) -> Metrics:
    """`requests` (prompt, output length) through transformers in a fresh worker process,
    in static batches of `max_num_seqs`. Each batch runs to its longest output, which is the
    cost of static batching, but only the requested tokens are counted."""
    batch_size = settings["max_num_seqs"]
    batch_seconds = functools.partial(
        transformers_batch_seconds, settings["model_dir"], settings["dtype"], settings["device"]
    )
    task = progress.add_task(description, total=len(requests))
    wall = 0.0
    # "spawn": a fresh interpreter, not a fork of this one with the engine's memory mapped.
    with ProcessPoolExecutor(
        max_workers=1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=torch.set_num_threads,
        initargs=(settings["threads"],),
    ) as worker:
        for first in range(0, len(requests), batch_size):
            batch = requests[first : first + batch_size]
            prompts = [prompt for prompt, _ in batch]
            num_tokens = max(output_len for _, output_len in batch)
            wall += worker.submit(batch_seconds, prompts, num_tokens).result()
            progress.advance(task, len(batch))
    input_tokens = sum(len(prompt) for prompt, _ in requests)
    output_tokens = sum(output_len for _, output_len in requests)
    return {
        **throughput(len(requests), input_tokens, output_tokens, wall),
        "batches": math.ceil(len(requests) / batch_size),
    }


def free_memory() -> None:
    """Return what dropped objects held, on a GPU too, before another model needs it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- decode overhead
def measure_decode_overhead(
    engine: LLMEngine, batch_size: int, context_len: int, token_ids: Sequence[int]
) -> Metrics:
    """Steady-state decode of `batch_size` requests: engine step vs. the forward pass alone.

    The forward pass alone is the runner's forward on one decode batch laid out once and run
    again and again (rewriting the same K/V into the same slots). Engine steps and bare
    forwards alternate, so both see the same machine, and medians drop the odd stall.
    """
    engine.reset_prefix_cache()
    preemptions_before = engine.stats()["preemptions"]
    rng = random.Random(0)
    # Requests that finish prefill early decode while the rest prefill: leave them room.
    params = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len, ignore_eos=True)
    request_ids = [
        engine.add_request(rng.choices(token_ids, k=context_len), params) for _ in range(batch_size)
    ]
    try:
        _step_until_all_decode(engine, set(request_ids))
        bare_inputs = engine.runner.prepare(engine.scheduler.schedule())
        bare_forward = functools.partial(engine.runner.forward, bare_inputs)
        bare_forward()  # warm-up
        step_s, forward_s, phases_s = [], [], []
        for _ in range(DECODE_STEPS):
            engine.timer.reset()
            step_s.append(_seconds(engine.step, engine.device))
            phases_s.append(dict(engine.timer.seconds))
            forward_s.append(_seconds(bare_forward, engine.device))
        if engine.stats()["preemptions"] != preemptions_before:
            raise click.ClickException(
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
    engine.step()  # one pure decode step untimed, as warm-up


def _seconds(run_once: Callable[[], object], device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    run_once()
    _synchronize(device)
    return time.perf_counter() - start


# --------------------------------------------------------------------------- report
def print_report(console: Console, result: Metrics) -> None:
    settings = result["settings"]
    console.print(
        f"[bold]{settings['model']}[/] on {settings['device']} ({settings['dtype']}, "
        f"{settings['threads']} torch threads), "
        f"scenario {settings['scenario']}, median of {settings['rounds']} round(s)"
    )
    console.print(
        _summary_table(result["nanoqwen"], result.get("transformers"), result.get("speedup"))
    )
    console.print(_phase_table(result["nanoqwen"]))
    if "decode" in result:
        console.print(_decode_table(result["decode"]))


def _summary_table(engine: Metrics, baseline: Metrics | None, speedup: float | None) -> Table:
    table = Table(title="Throughput and latency")
    table.add_column("metric")
    for column in ("nanoqwen", *(("transformers", "ratio") if baseline is not None else ())):
        table.add_column(column, justify="right")
    for label, key, fmt in THROUGHPUT_ROWS:
        row = [label, fmt.format(engine[key])]
        if baseline is not None:
            row += [fmt.format(baseline[key]), f"{speedup:.2f}x" if key == "output_tok_s" else ""]
        table.add_row(*row)
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("end-to-end", "e2e_ms")):
        table.add_row(
            f"{name} P50 / P95 (ms)", f"{engine[key]['p50']:.1f} / {engine[key]['p95']:.1f}"
        )
    table.add_row("peak KV pages used", f"{engine['peak_kv_pages']} of {engine['kv_pages_total']}")
    table.add_row("prefix cache hit rate", f"{engine['prefix_hit_rate']:.1%}")
    table.add_row("preemptions", str(engine["preemptions"]))
    table.add_row("steps", str(engine["steps"]))
    return table


def _phase_table(engine: Metrics) -> Table:
    table = Table(title="Where the time goes (nanoqwen)")
    for column in ("phase", "total (s)", "per step (ms)", "share of wall time"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for name, phase in engine["phases"].items():
        table.add_row(
            PHASE_LABELS.get(name, name),
            f"{phase['seconds']:.2f}",
            f"{phase['ms_per_step']:.2f}",
            f"{phase['share']:.1%}",
        )
    return table


def _decode_table(decode: Metrics) -> Table:
    title = "Steady-state decode: {batch_size} requests, {context_tokens}-token prompts"
    table = Table(title=title.format(**decode))
    table.add_column("measure")
    table.add_column("ms per step", justify="right")
    table.add_row("engine step", f"{decode['engine_step_ms']:.2f}")
    for name, ms in decode["phases_ms_per_step"].items():
        table.add_row(f"  {PHASE_LABELS.get(name, name)}", f"{ms:.2f}")
    table.add_row("forward pass alone", f"{decode['forward_ms']:.2f}")
    table.add_row("engine step / forward", f"{decode['overhead_ratio']:.3f}x")
    table.add_row("schedule + prepare inputs", f"{decode['schedule_prepare_ms']:.3f}")
    return table


# --------------------------------------------------------------------------- command line
def resolve_model(model: str | None, random_weights: str | None) -> str:
    if (model is None) == (random_weights is None):
        raise click.UsageError("give exactly one of --model and --random-weights")
    try:
        return random_checkpoint(random_weights) if random_weights else resolve_model_path(model)
    except ValueError as error:
        raise click.UsageError(str(error)) from None


def load_engine(model_dir: str, options: dict[str, Any]) -> LLMEngine:
    try:
        return LLMEngine(model_dir, **options)
    except ValueError as error:
        raise click.UsageError(str(error)) from None


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


def engine_settings(engine: LLMEngine) -> Metrics:
    config = engine.config
    return {
        "device": str(engine.device),
        "dtype": str(config.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "max_num_seqs": config.max_num_seqs,
        "page_size": config.page_size,
        "chunk_size": config.chunk_size,
        "prefix_cache": engine.cache is not None,
    }


def make_progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def assemble_result(
    settings: Metrics,
    engine_rounds: list[Metrics],
    baseline_rounds: list[Metrics] | None,
    decode: Metrics | None,
) -> Metrics:
    result: Metrics = {"settings": settings, "nanoqwen": median_round(engine_rounds)}
    rounds: Metrics = {"nanoqwen": engine_rounds}
    if baseline_rounds is not None:
        result["transformers"] = median_round(baseline_rounds)
        # A round's two runs are back to back: their ratio is the comparison that a
        # machine getting busier or quieter over the minutes disturbs least.
        result["speedup"] = statistics.median(
            ours["output_tok_s"] / theirs["output_tok_s"]
            for ours, theirs in zip(engine_rounds, baseline_rounds, strict=True)
        )
        rounds["transformers"] = baseline_rounds
    if decode is not None:
        result["decode"] = decode
    result["rounds"] = rounds
    return result


@click.command(context_settings={"show_default": True})
@click.option("--model", default=None, help="Hub id or checkpoint directory.")
@click.option(
    "--random-weights",
    default=None,
    metavar="PRESET_OR_CONFIG",
    help=f"Random weights of this shape instead: a preset ({', '.join(PRESETS)}) or a config.json.",
)
@click.option("--num-seqs", default=256, help="Requests in total (all turns of all conversations).")
@click.option(
    "--min-input", default=100, help="Shortest prompt (shared-prefix: the prefix length)."
)
@click.option("--max-input", default=1024, help="Longest prompt (multi-turn: new tokens per turn).")
@click.option("--min-output", default=100, help="Shortest output.")
@click.option("--max-output", default=1024, help="Longest output.")
@click.option("--seed", default=0, help="Same seed, same prompts and lengths.")
@click.option("--scenario", type=click.Choice(SCENARIOS), default="random")
@click.option("--turns", default=4, help="Turns per conversation (multi-turn).")
@click.option(
    "--compare",
    type=click.Choice(["hf"]),
    default=None,
    help="Also run transformers' generate, in batches of --max-num-seqs.",
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
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="CPU threads for torch, in both engines (default: torch's choice).",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write every figure to this file.",
)
@engine_options
def main(
    model: str | None,
    random_weights: str | None,
    num_seqs: int,
    min_input: int,
    max_input: int,
    min_output: int,
    max_output: int,
    seed: int,
    scenario: str,
    turns: int,
    compare: str | None,
    rounds: int,
    decode_batch: int | None,
    threads: int | None,
    json_path: Path | None,
    **engine_option_values: Any,
) -> None:
    """Benchmark nanoqwen on a fixed synthetic workload, optionally against transformers."""
    workload = Workload(
        scenario, num_seqs, min_input, max_input, min_output, max_output, turns, seed
    )
    check_workload(workload)
    if threads is not None:
        torch.set_num_threads(threads)
    model_dir = resolve_model(model, random_weights)
    console, status_console = Console(), Console(stderr=True)
    options = pop_engine_options(engine_option_values)
    with status_console.status("loading the model"):
        engine: LLMEngine | None = load_engine(model_dir, options)
        token_ids = prompt_token_ids(model_dir, engine.model_config.vocab_size)
    sessions = make_sessions(workload, token_ids)
    check_fits(engine, sessions, decode_batch)
    settings = {
        "model": model or f"random weights: {random_weights}",
        "model_dir": model_dir,
        **asdict(workload),
        "rounds": rounds,
        "compare": compare,
        **engine_settings(engine),
    }
    runs: list[EngineRun] = []
    baseline_rounds: list[Metrics] = []
    decode = None
    with make_progress(status_console) as progress:
        for index in range(rounds):
            # Each round has a fresh engine and a fresh transformers process, one after the
            # other, so a machine that gets busier or quieter affects both alike.
            if engine is None:
                engine = load_engine(model_dir, options)
            warm_up(engine, token_ids)
            runs.append(run_engine(engine, sessions, progress, f"nanoqwen, round {index + 1}"))
            if decode_batch is not None and index == rounds - 1:
                decode = measure_decode_overhead(engine, decode_batch, min_input, token_ids)
            engine = None
            free_memory()  # on a GPU the engine holds most of it, transformers needs some
            if compare == "hf":
                requests = [
                    (record.prompt_token_ids, record.output_len) for record in runs[0].records
                ]
                description = f"transformers, round {index + 1}"
                baseline_rounds.append(run_transformers(settings, requests, progress, description))
    engine_rounds = [summarize_engine_run(run) for run in runs]
    result = assemble_result(settings, engine_rounds, baseline_rounds or None, decode)
    print_report(console, result)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
