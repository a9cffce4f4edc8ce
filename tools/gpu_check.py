"""The Python parts of `tools/gpu_check.sh`: what the machine is, the kernel build, the report.

`gpu_check.sh` runs the check's parts, each under a time limit, and calls these between them:

* `environment --out FILE`: the GPU, driver, torch and its CUDA, nvcc, flashinfer and the
  other packages the check installs, printed and written as JSON; `capability FILE` then
  prints the first GPU's compute capability, or fails if torch saw none;
* `checkpoint --preset NAME`: builds (or finds) the random-weights checkpoint of a preset
  shape, so that the benchmarks don't;
* `kernels --preset NAME --out FILE`: builds flashinfer's kernels for that shape the way
  an engine does at start-up (`flashinfer_backend_for`), and says how long it took and how
  many kernel modules it compiled;
* `report --work DIR --out FILE`: gathers the parts' records, the test results (pytest's
  JUnit XML) and the benchmark results into one JSON (docs/gpu.md says what it holds),
  prints a summary, and exits with 1 if a part failed or ran out of time.

`capability` and `report` run without torch; the others import it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

GIB = 1 << 30
# The packages the check installs from its wheels (and those it relies on the machine for),
# whose versions the report records.
PACKAGES = ("transformers", "tokenizers", "xgrammar", "torchao", "gguf", "apache-tvm-ffi",
            "pydantic", "triton")
# The benchmark runs, in the order the check runs them: part name, what the summary calls it.
BENCH_PARTS = {
    "bench_graphs": "flashinfer, CUDA graphs",
    "bench_eager": "flashinfer, eager",
    "bench_torch": "torch attention",
    "bench_batch1": "batch 1, against the floors",
}


# --------------------------------------------------------------------------- the machine
def capability(environment_json: Path) -> str | None:
    """The compute capability (`major.minor`) of the first GPU torch saw, if it saw one."""
    found = json.loads(environment_json.read_text())
    return found["gpus"][0]["capability"] if found["cuda_available"] and found["gpus"] else None


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def command_output(*command: str) -> str | None:
    """A command's standard output, stripped, or None if it is missing or fails."""
    if shutil.which(command[0]) is None and not Path(command[0]).is_file():
        return None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def nvcc() -> dict[str, str | None]:
    """Where flashinfer finds nvcc (as it looks: CUDA_HOME, then the PATH, then
    /usr/local/cuda) and its release."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    path = str(Path(cuda_home, "bin", "nvcc")) if cuda_home else shutil.which("nvcc")
    if path is None and Path("/usr/local/cuda/bin/nvcc").is_file():
        path = "/usr/local/cuda/bin/nvcc"
    text = command_output(path, "--version") if path else None
    release = re.search(r"release [\d.]+, V([\d.]+)", text or "")
    return {"path": path, "version": release.group(1) if release else None}


def flashinfer_status() -> dict[str, str | None]:
    """flashinfer's version, and why it does not import if it does not."""
    status: dict[str, str | None] = {"version": installed_version("flashinfer-python"),
                                     "import_error": None}
    try:
        import flashinfer
    except Exception as error:  # any failure to import means the same here: unusable
        status["import_error"] = f"{type(error).__name__}: {error}"
    else:
        status["version"] = getattr(flashinfer, "__version__", status["version"])
        status["path"] = str(Path(flashinfer.__file__).parent)
    return status


def environment() -> dict[str, Any]:
    """What this machine is, as far as the check's figures depend on it."""
    import torch

    gpus = []
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        properties = torch.cuda.get_device_properties(index)
        gpus.append({
            "name": properties.name,
            "capability": f"{properties.major}.{properties.minor}",
            "memory_gib": round(properties.total_memory / GIB, 1),
            "multiprocessors": properties.multi_processor_count,
        })
    driver = command_output("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    return {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "driver": driver.splitlines()[0] if driver else None,
        "nvcc": nvcc(),
        "ninja": shutil.which("ninja"),  # what flashinfer's JIT runs its builds with
        "flashinfer": flashinfer_status(),
        "packages": {name: installed_version(name) for name in PACKAGES},
        "settings": {name: os.environ.get(name) for name in (
            "FLASHINFER_CUDA_ARCH_LIST", "MAX_JOBS", "CUDA_HOME", "FLASHINFER_WORKSPACE_BASE")},
        "cpu_count": os.cpu_count(),
    }


def describe_environment(found: dict[str, Any]) -> str:
    """The environment in a few lines, for the log."""
    gpus = "; ".join(f"{g['name']} (sm_{g['capability'].replace('.', '')}, "
                     f"{g['memory_gib']} GiB)" for g in found["gpus"]) or "none"
    flashinfer = found["flashinfer"]
    packages = ", ".join(f"{name} {version or 'missing'}"
                         for name, version in found["packages"].items())
    lines = [
        f"GPU:        {gpus}, driver {found['driver'] or 'unknown'}",
        f"torch:      {found['torch']} (CUDA {found['torch_cuda'] or 'none'}), "
        f"GPU available: {found['cuda_available']}",
        f"nvcc:       {found['nvcc']['version'] or 'not found'} ({found['nvcc']['path']}), "
        f"ninja: {found['ninja'] or 'not found'}",
        f"flashinfer: {flashinfer['version'] or 'not installed'}"
        + (f" (does not import: {flashinfer['import_error']})"
           if flashinfer["import_error"] else ""),
        f"python:     {found['python']} ({found['python_executable']})",
        f"packages:   {packages}",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the model
def preset_shape(preset: str) -> dict[str, int]:
    """A benchmark preset's attention shape (`tools/checkpoints.py`'s `PRESETS`)."""
    from tools.checkpoints import PRESETS

    config = PRESETS[preset]
    heads = config["num_attention_heads"]
    return {
        "num_layers": config["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": config["num_key_value_heads"],
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
    }


def build_checkpoint(preset: str) -> dict[str, Any]:
    from tools.checkpoints import random_checkpoint

    start = time.perf_counter()
    directory = random_checkpoint(preset)
    return {"preset": preset, "directory": directory,
            "seconds": round(time.perf_counter() - start, 1)}


def kernel_modules(jit_dir: Path | None) -> int:
    """How many compiled kernel modules flashinfer's JIT cache holds."""
    return sum(1 for _ in jit_dir.rglob("*.so")) if jit_dir and jit_dir.is_dir() else 0


def build_kernels(preset: str, page_size: int) -> dict[str, Any]:
    """Build (or load) the flashinfer kernels a bfloat16 model of the preset's shape uses, as
    an engine does at start-up: one decode, then one prefill (FA3 on Hopper, FA2 if that
    fails), on a tiny KV cache. Only this GPU's architecture is compiled for (flashinfer's
    default, or FLASHINFER_CUDA_ARCH_LIST)."""
    import torch

    from nanoqwen.attention.base import AttentionShape
    from nanoqwen.attention.flashinfer_backend import (
        FlashInferUnavailable,
        flashinfer_backend_for,
    )

    try:
        from flashinfer.jit import env as jit_env

        jit_dir: Path | None = Path(jit_env.FLASHINFER_JIT_DIR)
    except (ImportError, AttributeError):
        jit_dir = None
    shape = preset_shape(preset)
    before = kernel_modules(jit_dir)
    found: dict[str, Any] = {"preset": preset, **shape, "page_size": page_size,
                             "dtype": "bfloat16", "jit_dir": str(jit_dir),
                             "modules_cached_before": before}
    start = time.perf_counter()
    try:
        backend = flashinfer_backend_for(
            AttentionShape(**shape), page_size, torch.bfloat16, torch.bfloat16,
            torch.device("cuda"),
        )
    except FlashInferUnavailable as error:
        found["error"] = str(error)
    else:
        found["prefill"] = backend.prefill_backend
    found["seconds"] = round(time.perf_counter() - start, 1)
    found["modules_built"] = kernel_modules(jit_dir) - before
    return found


# --------------------------------------------------------------------------- the report
def read_parts(path: Path) -> list[dict[str, Any]]:
    """The parts `gpu_check.sh` recorded, one tab-separated line each: name, status
    (ok, failed, timed_out, skipped), seconds, limit, note, command."""
    parts = []
    for line in path.read_text().splitlines():
        name, status, seconds, limit, note, command = line.split("\t")
        parts.append({"name": name, "status": status, "seconds": int(seconds),
                      "limit_s": int(limit) if limit else None, "note": note,
                      "command": command})
    return parts


def junit_results(junit_xml: Path) -> dict[str, Any] | None:
    """pytest's outcome counts, and each failure's test and first line, from its JUnit XML."""
    if not junit_xml.is_file():
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        if case.get("name") is None:  # the test an interrupt stopped: no outcome
            continue
        outcome = next((child for child in case
                        if child.tag in ("failure", "error", "skipped")), None)
        kind = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(
            outcome.tag if outcome is not None else "", "passed")
        counts[kind] += 1
        if kind in ("failed", "errors"):
            message = (outcome.get("message") or outcome.text or "").strip()
            failures.append({"test": f"{case.get('classname')}::{case.get('name')}",
                             "message": (message.splitlines() or [""])[0][:300]})
    return {**counts, "failures": failures}


def bench_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of one bench.py result."""
    figures = result["nanoqwen"]
    summary = {
        "requests": figures["requests"],
        "output_tokens": figures["output_tokens"],
        "wall_s": figures["wall_s"],
        "output_tok_s": figures["output_tok_s"],
        "total_tok_s": figures["total_tok_s"],
        "ttft_ms_p50": figures["ttft_ms"]["p50"],
        "tpot_ms_p50": figures["tpot_ms"]["p50"],
        "preemptions": figures["preemptions"],
    }
    if "bandwidth_floor" in result:
        summary["bandwidth_floor_ms_per_token"] = result["bandwidth_floor"]["floor_ms_per_token"]
        summary["tpot_over_bandwidth_floor"] = result["bandwidth_floor"]["ratio"]
    if "floor" in result:
        summary["wall_over_dense_matmul_floor"] = result["floor"]["floor_ratio"]
    return summary


def ratio(summary: dict[str, dict[str, Any]], faster: str, slower: str) -> float | None:
    if faster in summary and slower in summary:
        return summary[faster]["output_tok_s"] / summary[slower]["output_tok_s"]
    return None


def build_report(work: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Everything the parts left in `work`, as one object (docs/gpu.md describes it)."""

    def read_json(name: str) -> Any:
        path = work / name
        return json.loads(path.read_text()) if path.is_file() else None

    parts = read_parts(work / "parts.tsv")
    benchmarks = {name: read_json(f"{name}.json") for name in BENCH_PARTS}
    benchmarks = {name: result for name, result in benchmarks.items() if result is not None}
    summary: dict[str, Any] = {name: bench_summary(result) for name, result in benchmarks.items()}
    summary["graphs_over_eager"] = ratio(summary, "bench_graphs", "bench_eager")
    summary["flashinfer_over_torch"] = ratio(summary, "bench_graphs", "bench_torch")
    kernels = read_json("kernels.json")
    summary["kernel_build_s"] = kernels.get("seconds") if kernels else None
    return {
        **settings,
        "ok": all(part["status"] in ("ok", "skipped") for part in parts),
        "parts": parts,
        "environment": read_json("environment.json"),
        "checkpoint": read_json("checkpoint.json"),
        "kernels": kernels,
        "tests": junit_results(work / "pytest.xml"),
        "summary": summary,
        "benchmarks": benchmarks,
    }


def describe_report(report: dict[str, Any]) -> str:
    """The parts and the headline figures, for the end of the log."""
    lines = [f"{'part':<14} {'status':<10} {'seconds':>7} {'limit':>6}  note"]
    for part in report["parts"]:
        limit = "" if part["limit_s"] is None else str(part["limit_s"])
        lines.append(f"{part['name']:<14} {part['status']:<10} {part['seconds']:>7} "
                     f"{limit:>6}  {part['note']}")
    if report["kernels"] and "seconds" in report["kernels"]:
        kernels = report["kernels"]
        lines.append(f"flashinfer kernels for {kernels['preset']}: {kernels['seconds']} s, "
                     f"{kernels['modules_built']} modules compiled "
                     f"({kernels['modules_cached_before']} cached before)"
                     + (f"; failed: {kernels['error']}" if "error" in kernels else ""))
    if report["tests"]:
        tests = report["tests"]
        lines.append("pytest -m cuda: " + ", ".join(
            f"{tests[kind]} {kind}" for kind in ("passed", "failed", "errors", "skipped")))
        lines += [f"  FAILED {f['test']}: {f['message']}" for f in tests["failures"]]
    summary = report["summary"]
    for name, title in BENCH_PARTS.items():
        if name in summary:
            figures = summary[name]
            line = (f"{title}: {figures['output_tok_s']:.0f} output tok/s, "
                    f"{figures['total_tok_s']:.0f} total tok/s, TTFT p50 "
                    f"{figures['ttft_ms_p50']:.1f} ms, TPOT p50 {figures['tpot_ms_p50']:.2f} ms")
            if name == "bench_batch1" and "tpot_over_bandwidth_floor" in figures:
                line += (f", TPOT {figures['tpot_over_bandwidth_floor']:.2f}x the bandwidth "
                         f"floor ({figures['bandwidth_floor_ms_per_token']:.2f} ms/token)")
            if name == "bench_batch1" and "wall_over_dense_matmul_floor" in figures:
                line += (f", wall time {figures['wall_over_dense_matmul_floor']:.2f}x the "
                         f"dense-matmul floor")
            lines.append(line)
    for key, title in (("graphs_over_eager", "graphs over eager"),
                       ("flashinfer_over_torch", "flashinfer over torch attention")):
        if summary[key] is not None:
            lines.append(f"{title}: {summary[key]:.2f}x output tok/s")
    if report["mode"] == "dry-run":
        lines.append(f"dry run: the CUDA parts were skipped ({report['dry_run_reason']})")
    lines.append("result: " + ("every part that ran passed" if report["ok"]
                               else "some parts failed or ran out of time (see above)"))
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line
def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("capability", help="the first GPU's, from `environment`")
    command.add_argument("environment_json", type=Path)
    command = commands.add_parser("environment", help="versions of what the check runs on")
    command.add_argument("--out", type=Path, required=True)
    command = commands.add_parser("checkpoint", help="build a preset's random weights")
    command.add_argument("--preset", required=True)
    command.add_argument("--out", type=Path, required=True)
    command = commands.add_parser("kernels", help="build flashinfer's kernels for a preset")
    command.add_argument("--preset", required=True)
    command.add_argument("--page-size", type=int, default=16)
    command.add_argument("--out", type=Path, required=True)
    command = commands.add_parser("report", help="gather the parts into one JSON")
    command.add_argument("--work", type=Path, required=True)
    command.add_argument("--out", type=Path, required=True)
    command.add_argument("--mode", choices=["gpu", "dry-run"], required=True)
    command.add_argument("--dry-run-reason", default=None)
    command.add_argument("--started", required=True)
    command.add_argument("--wall-s", type=int, required=True)
    command.add_argument("--deadline-s", type=int, required=True)
    args = parser.parse_args(argv)

    if args.command == "capability":
        found = capability(args.environment_json)
        if found is None:
            return 1
        print(found)
        return 0
    if args.command == "environment":
        found = environment()
        write_json(args.out, found)
        print(describe_environment(found))
        return 0
    if args.command == "checkpoint":
        built = build_checkpoint(args.preset)
        write_json(args.out, built)
        print(f"random weights of {args.preset}: {built['directory']} ({built['seconds']} s)")
        return 0
    if args.command == "kernels":
        # flashinfer's own JIT log and the engine's "kernels ready" line, in the check's log.
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        built = build_kernels(args.preset, args.page_size)
        write_json(args.out, built)
        print(f"flashinfer kernels for {args.preset}: {built['seconds']} s, "
              f"{built['modules_built']} modules compiled "
              f"({built['modules_cached_before']} cached before), "
              + (f"prefill {built['prefill']}" if "prefill" in built
                 else f"FAILED: {built['error']}"))
        return 0 if "prefill" in built else 1
    settings = {"mode": args.mode, "dry_run_reason": args.dry_run_reason,
                "started": args.started, "wall_s": args.wall_s, "deadline_s": args.deadline_s}
    report = build_report(args.work, settings)
    write_json(args.out, report)
    print(describe_report(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
