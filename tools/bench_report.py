"""bench.py's report: the tables it prints from the figures it measured.

Everything here reads the result dictionary `bench.assemble_result` builds (the same one
`--json` writes) and renders it with rich: throughput and latency, the side-by-side
comparisons (transformers, without speculation, at full precision), where the time goes,
the scheduling policies, the dense-matmul floor and the steady-state decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from tools.bench_floor import SPLIT

Metrics = dict[str, Any]
MIB = 2**20
# What the engine `--compare` ran is called in the result.
BASELINE_LABELS = ("transformers", "vLLM", "llama.cpp")
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
    "propose": "propose draft tokens",
    "prepare": "prepare inputs",
    "forward": "forward",
    "sample": "sample",
    "postprocess": "detokenize + bookkeeping",
}


def print_report(console: Console, result: Metrics) -> None:
    settings = result["settings"]
    console.print(
        f"[bold]{settings['model']}[/] ({parameters(settings)}) on {settings['device']} "
        f"({settings['dtype']}, "
        f"KV cache {settings['kv_cache_dtype']}, {plural(settings['threads'], 'torch thread')}, "
        f"{plural(settings['tensor_parallel_size'], 'rank')}), "
        f"scenario {settings['scenario']}, {' and '.join(settings['scheduling_policies'])} "
        f"scheduling, median of {plural(settings['rounds'], 'round')}"
        + (f", {plural(settings['background_load'], 'busy process', 'es')} beside it"
           if settings.get("background_load") else "")
    )
    baseline = next((name for name in BASELINE_LABELS if name in result), None)
    console.print(_summary_table(
        result["nanoqwen"], engine_column(settings), baseline, result.get(baseline),
        result.get("speedup"),
    ))
    if "no_speculation" in result:
        console.print(_speculation_table(result))
    if "full_precision" in result:
        console.print(_quantization_table(result))
    console.print(_phase_table(result["nanoqwen"], engine_column(settings)))
    if "policies" in result:
        console.print(_policy_table(result["policies"]))
    if "floor" in result:
        console.print(_floor_table(result["floor"]))
    if "bandwidth_floor" in result:
        console.print(_bandwidth_table(result["bandwidth_floor"]))
    if "decode" in result:
        console.print(_decode_table(result["decode"]))


def parameters(settings: Metrics) -> str:
    """The architecture and its size: "Qwen3MoeForCausalLM, 30.5B parameters, 3.4B per
    token" (a mixture of experts runs only its routed experts)."""
    total, active = settings["parameters"], settings["active_parameters"]
    text = f"{settings['architecture']}, {count(total)} parameters"
    return text + (f", {count(active)} per token" if active != total else "")


def count(number: int) -> str:
    return f"{number / 1e9:.1f}B" if number >= 1e9 else f"{number / 1e6:.1f}M"


def plural(count: int, noun: str, suffix: str = "s") -> str:
    return f"{count} {noun}" + ("" if count == 1 else suffix)


def engine_column(settings: Metrics) -> str:
    """What the main figures are of: with several scheduling policies, the last one's run
    (the others are in the policy table)."""
    policies = settings["scheduling_policies"]
    return f"nanoqwen, {policies[-1]} policy" if len(policies) > 1 else "nanoqwen"


def _summary_table(
    engine: Metrics, column: str, baseline_name: str | None, baseline: Metrics | None,
    speedup: float | None,
) -> Table:
    """nanoqwen's figures (`column`), beside those of the engine `--compare` ran, if any."""
    table = Table(title="Throughput and latency")
    table.add_column("metric")
    for name in (column, *((baseline_name, "ratio") if baseline is not None else ())):
        table.add_column(name, justify="right")
    for label, key, fmt in THROUGHPUT_ROWS:
        row = [label, fmt.format(engine[key])]
        if baseline is not None:
            row += [fmt.format(baseline[key]), f"{speedup:.2f}x" if key == "output_tok_s" else ""]
        table.add_row(*row)
    for label, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("end-to-end", "e2e_ms")):
        row = [f"{label} P50 / P95 (ms)", _p50_p95(engine[key])]
        if baseline is not None:
            row += [_p50_p95(baseline[key]) if key in baseline else "", ""]
        table.add_row(*row)
    if baseline is not None and "agreement" in baseline:
        table.add_row("greedy tokens as nanoqwen's", "", f"{baseline['agreement']:.1%}", "")
    table.add_row("peak KV pages used", f"{engine['peak_kv_pages']} of {engine['kv_pages_total']}")
    table.add_row("prefix cache hit rate", f"{engine['prefix_hit_rate']:.1%}")
    table.add_row("preemptions", str(engine["preemptions"]))
    if "swaps" in engine:
        swaps = engine["swaps"]
        table.add_row("  swapped out / in (pages)", f"{swaps['swaps_out']} / {swaps['swaps_in']} "
                      f"({swaps['pages_out']} / {swaps['pages_in']})")
        table.add_row("  recomputed (host pool full)", str(swaps["recomputed"]))
    table.add_row("steps", str(engine["steps"]))
    if engine["reduced_thread_steps"]:
        table.add_row("  on fewer CPU threads (others busy)", str(engine["reduced_thread_steps"]))
    return table


def _speculation_table(result: Metrics) -> Table:
    settings = result["settings"]
    method, num_tokens = settings["speculative"], settings["num_speculative_tokens"]
    spec, plain = result["nanoqwen"], result["no_speculation"]
    rows = _side_by_side(spec, plain, (
        ("output tok/s", "output_tok_s", "{:.1f}"),
        ("wall time (s)", "wall_s", "{:.2f}"),
        ("steps", "steps", "{}"),
        ("tokens per request per step", "tokens_per_request_step", "{:.2f}"),
    ))
    figures = spec["speculation"]
    proposed_accepted = f"{figures['proposed_tokens']} / {figures['accepted_tokens']}"
    rows += [
        ("draft tokens proposed / accepted", proposed_accepted, ""),
        ("acceptance rate", f"{figures['acceptance_rate']:.1%}", ""),
        ("mean accepted length", f"{figures['mean_accepted_length']:.2f}", ""),
        ("speedup (median of rounds)", f"{result['speculation_speedup']:.2f}x", ""),
    ]
    title = f"Speculative decoding: {method}, {num_tokens} tokens per request"
    return _comparison_table(title, ("speculative", "plain"), rows)


def _quantization_table(result: Metrics) -> Table:
    settings = result["settings"]
    quantized, full = result["nanoqwen"], result["full_precision"]
    rows = [
        ("weight memory (MiB)", *(f"{run['weight_bytes'] / MIB:.1f}" for run in (quantized, full))),
        *_side_by_side(quantized, full, (
            ("KV pages", "kv_pages_total", "{}"),
            ("output tok/s", "output_tok_s", "{:.1f}"),
        )),
        ("tokens before the first difference", f"{quantized['agreement']:.1%}", ""),
        ("speedup (median of rounds)", f"{result['quantization_speedup']:.2f}x", ""),
    ]
    weights, kv_cache = settings["quantization"], settings["kv_cache_dtype"]
    title = f"Quantization: weights {weights}, KV cache {kv_cache}"
    return _comparison_table(title, ("quantized", "full precision"), rows)


def _side_by_side(
    ours: Metrics, theirs: Metrics, figures: Sequence[tuple[str, str, str]]
) -> list[tuple[str, str, str]]:
    """Rows of (label, our figure, theirs) for each (label, key, format) of `figures`."""
    return [(label, fmt.format(ours[key]), fmt.format(theirs[key])) for label, key, fmt in figures]


def _comparison_table(
    title: str, columns: tuple[str, str], rows: list[tuple[str, str, str]]
) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def _phase_table(engine: Metrics, column: str) -> Table:
    table = Table(title=f"Where the time goes ({column})")
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


def _policy_table(policies: dict[str, Metrics]) -> Table:
    """The same workload under each scheduling policy: latency by priority, side by side."""
    table = Table(title="Scheduling policies on the same workload")
    table.add_column("metric")
    for policy in policies:
        table.add_column(policy, justify="right")
    columns = list(policies.values())
    for priority in columns[0]["ttft_by_priority_ms"]:
        for unit in ("ms", "steps"):
            table.add_row(
                f"TTFT P50 / P95 ({unit}), priority {priority}",
                *(_p50_p95(f[f"ttft_by_priority_{unit}"][priority]) for f in columns),
            )
    table.add_row("end-to-end P50 / P95 (ms)", *(_p50_p95(f["e2e_ms"]) for f in columns))
    table.add_row("output tok/s", *(f"{f['output_tok_s']:.1f}" for f in columns))
    for cause in columns[0]["preemptions_by_cause"]:
        table.add_row(
            f"preemptions ({cause})", *(str(f["preemptions_by_cause"][cause]) for f in columns)
        )
    return table


def _p50_p95(latency: dict[str, float]) -> str:
    return f"{latency['p50']:.1f} / {latency['p95']:.1f}"


FLOOR_LABELS = {
    "attention": "attention (plan + forward)",
    "norms_rope_activations": "norms, rope, activations (rest of forward)",
    "sampling": "sampling",
    "bookkeeping": "bookkeeping (schedule, propose, prepare, detokenize)",
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


def _bandwidth_table(floor: Metrics) -> Table:
    table = Table(title="Batch-1 floor: reading every weight once per token")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("memory bandwidth, measured (GB/s)", f"{floor['bandwidth_gb_s']:.1f}")
    table.add_row("weight bytes read per token (MB)", f"{floor['bytes_per_token'] / 1e6:.0f}")
    table.add_row("floor per token (ms)", f"{floor['floor_ms_per_token']:.1f}")
    table.add_row("TPOT P50 (ms)", f"{floor['tpot_ms']:.1f}")
    table.add_row("TPOT over the floor", f"{floor['ratio']:.2f}x")
    return table


def print_load_report(console: Console, result: Metrics) -> None:
    """A run at request rates, in process and through servers (`bench.run_load`): one row
    per engine and rate."""
    settings = result["settings"]
    limit = settings.get("max_concurrency")
    console.print(
        f"[bold]{settings['model']}[/] on {settings['device']} ({settings['dtype']}), "
        f"{settings['num_seqs']} requests, "
        f"scenario {settings['scenario']}, "
        + (f"at most {limit} in flight, " if limit else "")
        + f"median of {plural(settings['rounds'], 'round')}"
    )
    table = Table(title="Under load: by engine and request rate")
    for name in ("engine", "rate (req/s)", "output tok/s", "vs engine", "TTFT P50 / P95 (ms)",
                 "TPOT P50 / P95 (ms)", "finished (req/s)", "goodput (req/s)", "errors",
                 "same text", "prefix hits"):
        table.add_column(name, justify="left" if name == "engine" else "right")
    ratios = result.get("vs_engine", {})
    for label, by_rate in result["load"].items():
        for rate, figures in by_rate.items():
            ratio = ratios.get(label, {}).get(rate)
            table.add_row(
                label, rate, f"{figures['output_tok_s']:.1f}",
                "" if ratio is None else f"{ratio:.2f}x",
                _p50_p95(figures["ttft_ms"]), _p50_p95(figures["tpot_ms"]),
                f"{figures['finished_req_s']:.2f}",
                f"{figures['goodput_req_s']:.2f} ({figures['goodput_share']:.0%})",
                str(figures.get("errors", 0)),
                f"{figures['agreement']:.1%}" if "agreement" in figures else "",
                f"{figures['prefix_hit_rate']:.0%}" if "prefix_hit_rate" in figures else "",
            )
    console.print(table)
