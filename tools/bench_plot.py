"""`bench.py --plot out.png`: the figures people would rather look at than read.

Everything is drawn from the result dictionary the report prints (and `--json` writes),
by what each entry holds rather than by its name, so a run another option adds to the
result shows up without a change here:

* **Engines side by side**: output tok/s of every run with a throughput (nanoqwen, and
  transformers with `--compare hf`, nanoqwen without speculation or at full precision,
  any other engine the result holds), each round a dot over the median round's bar.
* **Where the time goes**: each run's step phases as shares of its wall time.
* **Time to first token by priority**, P50 and P95 under each scheduling policy, when the
  workload has more than one priority.

matplotlib is optional (`pip install -e ".[plot]"`); only this module imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.bench_report import PHASE_LABELS

Metrics = dict[str, Any]
# What the runs nanoqwen adds for comparison are called on the plot.
RUN_LABELS = {
    "no_speculation": "nanoqwen, no speculation", "full_precision": "nanoqwen, full precision",
}
# Inches.
PANEL_WIDTH, TITLE_HEIGHT, TTFT_PANEL_HEIGHT = 8.0, 0.4, 3.2
BAR_PANEL_BASE, BAR_HEIGHT, LEGEND_HEIGHT = 1.0, 0.45, 0.6
AXIS_LABELS_HEIGHT = 0.45  # an x axis's tick labels and label, below the axes


def plot_result(result: Metrics, path: Path) -> None:
    """Draw the panels `result` has figures for into an image file (its suffix: PNG, SVG,
    PDF...)."""
    figure = result_figure(result)
    figure.savefig(path, dpi=120)


def result_figure(result: Metrics) -> Any:
    """A matplotlib `Figure`, one panel above the other: runs side by side, their phases,
    and (with several priorities) time to first token by priority."""
    from matplotlib.figure import Figure  # the optional extra

    # (draw, height in inches): a bar panel grows with its bars.
    panels = [
        (draw_throughput, BAR_PANEL_BASE + BAR_HEIGHT * len(runs(result, "output_tok_s"))),
        (draw_phases, BAR_PANEL_BASE + LEGEND_HEIGHT + BAR_HEIGHT * len(runs(result, "phases"))),
    ]
    if len(priorities(result)) > 1:
        panels.append((draw_ttft_by_priority, TTFT_PANEL_HEIGHT))
    heights = [height for _, height in panels]
    figure = Figure(figsize=(PANEL_WIDTH, sum(heights) + TITLE_HEIGHT), layout="constrained")
    settings = result["settings"]
    figure.suptitle(f"{settings['model']} on {settings['device']} ({settings['dtype']}), "
                    f"scenario {settings['scenario']}")
    grid = figure.subplots(len(panels), 1, squeeze=False, height_ratios=heights)
    for axes, (draw, _) in zip(grid[:, 0], panels):
        draw(axes, result)
    return figure


def runs(result: Metrics, figure: str) -> list[tuple[str, str, Metrics]]:
    """(name in the result, label on the plot, figures) of every run reporting `figure`:
    every scheduling policy's where the workload ran under several."""
    found = []
    for name, value in result.items():
        if name == "policies":  # the last policy's run is "nanoqwen", with its rounds
            found += [
                ("nanoqwen" if figures == result["nanoqwen"] else policy,
                 f"nanoqwen, {policy} policy", figures)
                for policy, figures in value.items() if figure in figures
            ]
        elif isinstance(value, dict) and figure in value and not (
            name == "nanoqwen" and "policies" in result  # the last policy's, listed there
        ):
            found.append((name, RUN_LABELS.get(name, name), value))
    return found


def draw_throughput(axes: Any, result: Metrics) -> None:
    throughput = runs(result, "output_tok_s")
    labels = [label for _, label, _ in throughput]
    axes.barh(labels, [run["output_tok_s"] for _, _, run in throughput], color="tab:blue")
    for row, (name, _, _) in enumerate(throughput):
        rounds = [each["output_tok_s"] for each in result.get("rounds", {}).get(name, [])]
        axes.plot(rounds, [row] * len(rounds), "o", color="black", markersize=3)
    axes.invert_yaxis()  # nanoqwen on top
    axes.set_xlabel("output tok/s (bar: median round; dots: every round)")
    axes.set_title("Engines side by side")


def draw_phases(axes: Any, result: Metrics) -> None:
    timed = runs(result, "phases")
    labels = [label for _, label, _ in timed]
    left = [0.0] * len(timed)
    for phase in timed[0][2]["phases"]:
        shares = [run["phases"].get(phase, {}).get("share", 0.0) for _, _, run in timed]
        axes.barh(labels, shares, left=left, label=PHASE_LABELS.get(phase, phase))
        left = [start + share for start, share in zip(left, shares)]
    axes.invert_yaxis()
    axes.set_xlim(0, 1)
    axes.set_xlabel("share of wall time")
    axes.set_title("Where the time goes")
    # Below the tick labels and the axis label, the same distance whatever the panel's
    # height (a fraction of the axes would reach into the label of a short panel).
    from matplotlib.transforms import ScaledTranslation

    below = axes.transAxes + ScaledTranslation(0, -AXIS_LABELS_HEIGHT, axes.figure.dpi_scale_trans)
    axes.legend(fontsize="small", ncols=3, loc="upper center", bbox_to_anchor=(0.5, 0),
                bbox_transform=below)


def priorities(result: Metrics) -> list[str]:
    return sorted(result["nanoqwen"]["ttft_by_priority_ms"], key=int)


def draw_ttft_by_priority(axes: Any, result: Metrics) -> None:
    """Bars at P50, a tick at P95, one bar per policy within each priority."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    policies = result.get("policies") or {"nanoqwen": result["nanoqwen"]}
    levels = priorities(result)
    width = 0.8 / len(policies)
    for index, (policy, figures) in enumerate(policies.items()):
        latency = [figures["ttft_by_priority_ms"][level] for level in levels]
        where = [position + (index - (len(policies) - 1) / 2) * width
                 for position in range(len(levels))]
        bars = axes.bar(where, [ms["p50"] / 1000 for ms in latency], width, label=policy)
        axes.plot(where, [ms["p95"] / 1000 for ms in latency], "_", markersize=14,
                  color=bars.patches[0].get_facecolor(), markeredgewidth=2)
    axes.set_xticks(range(len(levels)), [f"priority {level}" for level in levels])
    axes.set_yscale("log")
    plain = FuncFormatter(lambda seconds, _: f"{seconds:g}")
    axes.yaxis.set_major_formatter(plain)
    axes.yaxis.set_minor_locator(LogLocator(subs=(2, 5)))  # 0.1, 0.2, 0.5, 1, 2, 5...
    axes.yaxis.set_minor_formatter(plain)
    axes.set_ylabel("seconds (bar: P50; tick: P95)")
    axes.set_title("Time to first token by priority")
    axes.legend(title="scheduling policy", fontsize="small")
