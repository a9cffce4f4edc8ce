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
per output token (TPOT) is the rest of its life divided by its remaining tokens. A
`PhaseTimer` installed with `engine.instrument` splits every step into schedule, prepare
inputs, forward, sample and detokenize/bookkeeping, which says where the time goes.

`--compare hf` runs the same prompts through transformers' `generate` on the same weights
(`bench_baseline.py`; multi-turn prompts are the ones nanoqwen served, answers included).
`--rounds N` repeats both, alternating: every round builds a fresh engine, runs the
workload, frees it, then runs transformers. A machine that gets busier or quieter over the
minutes then disturbs both alike; the report shows the median round of each, and the
speedup is the median of the rounds' ratios. `--decode-batch B` adds the steady-state
decode micro-benchmark of `bench_decode.py`.

`--floor` replays, right after each round, the token schedule the engine just ran through
the model's dense layers alone (`bench_floor.py`): `floor_ratio` is the engine's wall time
over that floor, and the time above it is split into attention, norms + rope +
activations, sampling and bookkeeping. The report shows the round with the median ratio.

`--random-weights PRESET_OR_CONFIG` benchmarks a random-weights model of a given shape
(see `checkpoints.py`), for machines that cannot download a checkpoint.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click
import torch
from huggingface_hub.utils import disable_progress_bars
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from transformers import AutoTokenizer
from transformers.utils import logging as transformers_logging

from bench_baseline import run_transformers
from bench_decode import PhaseTimer, PoolTooSmall, measure_decode_overhead
from bench_floor import SPLIT, FloorRecorder, measure_floor
from checkpoints import PRESETS, random_checkpoint
from nanoqwen import LLMEngine, RequestOutput, SamplingParams
from nanoqwen.cli import engine_options, pop_engine_options
from nanoqwen.loader import resolve_model_path

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
class RequestTiming:
    """When one request was submitted, got its first token and finished."""

    prompt_token_ids: list[int]
    output_len: int  # requested
    submitted: float
    first_token: float | None = None
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
    preemptions: int


class SessionDriver:
    """Feeds conversations to the engine: first turns at once, each next turn on a finish."""

    def __init__(self, engine: LLMEngine, sessions: Sequence[Session]) -> None:
        self.engine = engine
        self.sessions = sessions
        self.records: dict[str, RequestTiming] = {}
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
        self.records[request_id] = RequestTiming(prompt, spec.output_len, time.perf_counter())
        self._position[request_id] = (session, turn)


def run_engine(
    engine: LLMEngine,
    timer: PhaseTimer,
    sessions: Sequence[Session],
    progress: Progress,
    description: str,
) -> EngineRun:
    """Serve every session to completion, timing each request and (with `timer`, installed
    on `engine`) each step's phases."""
    engine.reset_prefix_cache()  # a previous round's prompts must not be cache hits
    timer.reset()
    before = engine.stats()
    task = progress.add_task(description, total=sum(len(s) for s in sessions), tok_s="")
    driver = SessionDriver(engine, sessions)
    peak_pages = steps = generated = 0
    start = time.perf_counter()
    driver.start()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        for output in outputs:
            driver.record(output, now)
            generated += len(output.delta_token_ids)
        finished = sum(output.finished for output in outputs)
        progress.update(task, advance=finished, tok_s=tok_s_so_far(generated, now - start))
        peak_pages = max(peak_pages, engine.stats()["pages_used"])
    wall = time.perf_counter() - start
    after = engine.stats()
    return EngineRun(
        records=list(driver.records.values()),
        wall_s=wall,
        steps=steps,
        phase_seconds=dict(timer.seconds),
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


def tok_s_so_far(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.0f} output tok/s" if seconds > 0 else ""


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


def median_floor_round(rounds: Sequence[Metrics]) -> Metrics:
    """The round with the median floor ratio (of an even count, the lower middle one),
    whole, so that its split adds up."""
    return sorted(rounds, key=lambda figures: figures["floor_ratio"])[(len(rounds) - 1) // 2]


def free_memory() -> None:
    """Return what dropped objects held, on a GPU too, before another model needs it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_baseline(
    settings: Metrics,
    requests: Sequence[tuple[list[int], int]],
    progress: Progress,
    description: str,
) -> Metrics:
    """The same requests through transformers (`bench_baseline.py`), with progress."""
    task = progress.add_task(description, total=len(requests), tok_s="")
    output_tokens_by_request = [output_len for _, output_len in requests]

    def on_batch(done: int, seconds: float) -> None:
        tokens = sum(output_tokens_by_request[:done])
        progress.update(task, completed=done, tok_s=tok_s_so_far(tokens, seconds))

    run = run_transformers(
        settings["model_dir"], settings["dtype"], settings["device"], settings["threads"],
        settings["max_num_seqs"], requests, on_batch,
    )
    input_tokens = sum(len(prompt) for prompt, _ in requests)
    return {
        **throughput(len(requests), input_tokens, sum(output_tokens_by_request), run.wall_s),
        "batches": run.batches,
    }


# --------------------------------------------------------------------------- report
def print_report(console: Console, result: Metrics) -> None:
    settings = result["settings"]
    console.print(
        f"[bold]{settings['model']}[/] on {settings['device']} ({settings['dtype']}, "
        f"{settings['threads']} torch threads, {settings['tensor_parallel_size']} rank(s)), "
        f"scenario {settings['scenario']}, median of {settings['rounds']} round(s)"
    )
    console.print(
        _summary_table(result["nanoqwen"], result.get("transformers"), result.get("speedup"))
    )
    console.print(_phase_table(result["nanoqwen"]))
    if "floor" in result:
        console.print(_floor_table(result["floor"]))
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


FLOOR_LABELS = {
    "attention": "attention (plan + forward)",
    "norms_rope_activations": "norms, rope, activations (rest of forward)",
    "sampling": "sampling",
    "bookkeeping": "bookkeeping (schedule, prepare, detokenize)",
}


def _floor_table(floor: Metrics) -> Table:
    table = Table(title=f"Against the dense-matmul floor: {floor['floor_ratio']:.2f}x")
    for column in ("part", "seconds", "adds to the ratio"):
        table.add_column(column, justify="left" if column == "part" else "right")
    table.add_row("engine wall time", f"{floor['engine_s']:.2f}", f"{floor['floor_ratio']:.2f}x")
    table.add_row("dense matmuls alone (floor)", f"{floor['floor_s']:.2f}", "1.00x")
    for name in SPLIT:
        table.add_row(
            f"  {FLOOR_LABELS[name]}", f"{floor['split'][name]:.2f}",
            f"+{floor['split_ratio'][name]:.2f}x",
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


def load_engine(
    model_dir: str, options: dict[str, Any], floor: bool = False
) -> tuple[LLMEngine, PhaseTimer, FloorRecorder | None]:
    """A fresh engine, with a phase timer installed (and with `floor`, a floor recorder
    inside it, so that the timer counts what the recorder adds)."""
    try:
        engine = LLMEngine(model_dir, **options)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    recorder = FloorRecorder() if floor else None
    if recorder is not None:
        engine.instrument(recorder.wrap)
        recorder.attach(engine)
    timer = PhaseTimer()
    engine.instrument(timer.wrap)
    return engine, timer, recorder


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


def engine_settings(engine: LLMEngine, threads: int) -> Metrics:
    config = engine.config
    return {
        "device": str(engine.device),
        "dtype": str(config.dtype).removeprefix("torch."),
        "threads": threads,  # in all; tensor-parallel ranks on a CPU share them
        "max_num_seqs": config.max_num_seqs,
        "page_size": config.page_size,
        "chunk_size": config.chunk_size,
        "prefix_cache": config.enable_prefix_cache,
        "tensor_parallel_size": config.tensor_parallel_size,
    }


def make_progress(console: Console) -> Progress:
    """Per round and engine: requests done of all, and output tokens per second so far."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TextColumn("{task.fields[tok_s]}"),
        TimeElapsedColumn(),
        console=console,
    )


def assemble_result(
    settings: Metrics,
    engine_rounds: list[Metrics],
    baseline_rounds: list[Metrics] | None,
    decode: Metrics | None,
    floor_rounds: list[Metrics] | None = None,
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
    if floor_rounds is not None:
        # A round's engine run and floor replay are back to back, like the baseline's.
        result["floor"] = median_floor_round(floor_rounds)
        rounds["floor"] = floor_rounds
    result["rounds"] = rounds
    return result


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
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
    "--floor",
    is_flag=True,
    help="Also replay each round's token schedule through the dense layers alone.",
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
    floor: bool,
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
    threads = torch.get_num_threads()
    # Weight-loading and shard-writing bars of transformers and the hub would cut into ours.
    transformers_logging.disable_progress_bar()
    disable_progress_bars()
    console, status_console = Console(), Console(stderr=True)
    with status_console.status("preparing the model"):
        model_dir = resolve_model(model, random_weights)
    options = pop_engine_options(engine_option_values)
    with status_console.status("loading the model"):
        engine, timer, recorder = load_engine(model_dir, options, floor)
        token_ids = prompt_token_ids(model_dir, engine.model_config.vocab_size)
    sessions = make_sessions(workload, token_ids)
    check_fits(engine, sessions, decode_batch)
    settings = {
        "model": model or f"random weights: {random_weights}",
        "model_dir": model_dir,
        **asdict(workload),
        "rounds": rounds,
        "compare": compare,
        **engine_settings(engine, threads),
    }
    runs: list[EngineRun] = []
    baseline_rounds: list[Metrics] = []
    floor_rounds: list[Metrics] = []
    decode = None
    with make_progress(status_console) as progress:
        for index in range(rounds):
            # Each round has a fresh engine and a fresh transformers process, one after the
            # other, so a machine that gets busier or quieter affects both alike.
            if engine is None:
                engine, timer, recorder = load_engine(model_dir, options, floor)
            warm_up(engine, token_ids)
            description = f"nanoqwen, round {index + 1}"
            if recorder is not None:
                recorder.reset()
            runs.append(run_engine(engine, timer, sessions, progress, description))
            if recorder is not None:  # the floor right after the run, on the same machine
                run = runs[-1]
                with status_console.status(f"dense-matmul floor, round {index + 1}"):
                    floor_rounds.append(
                        measure_floor(engine, recorder, run.wall_s, run.phase_seconds)
                    )
            if decode_batch is not None and index == rounds - 1:
                decode = measure_decode(engine, timer, decode_batch, min_input, token_ids)
            engine.shutdown()  # stops the other tensor-parallel ranks, if any
            engine = recorder = None
            free_memory()  # on a GPU the engine holds most of it, transformers needs some
            if compare == "hf":
                requests = [
                    (record.prompt_token_ids, record.output_len) for record in runs[0].records
                ]
                description = f"transformers, round {index + 1}"
                baseline_rounds.append(run_baseline(settings, requests, progress, description))
    engine_rounds = [summarize_engine_run(run) for run in runs]
    result = assemble_result(
        settings, engine_rounds, baseline_rounds or None, decode, floor_rounds or None
    )
    print_report(console, result)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
