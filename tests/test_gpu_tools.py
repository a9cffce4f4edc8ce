"""The GPU check's tools, checked where there is no GPU and no network.

`tools/gpu_check.sh` runs here as a dry run (no CUDA GPU, or `--dry-run`): every CUDA part
is skipped with its reason, the rest runs, and the JSON and the log say so. The commands it
would run on a GPU are recorded, and are checked here against the options bench.py takes, so
they cannot drift apart unnoticed. `tools/gpu_wheels.sh` needs the package index and is not
run: its check of a folder of wheels (`tools/gpu_wheels.py`) is, on wheels made up here, and
its list is checked against what pyproject declares.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_helpers import declared_flashinfer_range
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from test_bench import bench

from tools import gpu_check, gpu_wheels

REPOSITORY = Path(__file__).resolve().parents[1]
CUDA_PARTS = ["install", "kernels", "checkpoint",
              "bench_graphs", "bench_eager", "bench_torch", "bench_batch1", "pytest"]


# ----------------------------------------------------------------- gpu_check.sh, dry run
@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One dry run of the check: on its own where no GPU is to be seen (as in CI), with
    `--dry-run` where one is (so that the tests never start the real, 9-minute check)."""
    gpu_here = shutil.which("nvidia-smi") is not None or torch.cuda.is_available()
    out, scratch = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("scratch")
    command = ["bash", str(REPOSITORY / "tools" / "gpu_check.sh"), str(out)]
    completed = subprocess.run(
        command + (["--dry-run"] if gpu_here else []), capture_output=True, text=True,
        timeout=120, env={**os.environ, "PYTHON": sys.executable, "TMPDIR": str(scratch)},
    )
    return {
        "flagged": gpu_here, "completed": completed, "scratch": scratch,
        "json": json.loads((out / "gpu_check.json").read_text()),
        "log": (out / "gpu_check.log").read_text(),
    }


def test_a_dry_run_skips_every_cuda_part_and_says_why(dry_run: dict[str, Any]) -> None:
    assert dry_run["completed"].returncode == 0, dry_run["completed"].stderr
    report, log = dry_run["json"], dry_run["log"]
    assert report["mode"] == "dry-run" and report["ok"] is True
    if dry_run["flagged"]:
        assert report["dry_run_reason"] == "--dry-run"
    else:
        assert report["dry_run_reason"].startswith("no CUDA GPU")
    parts = {part["name"]: part for part in report["parts"]}
    assert list(parts) == ["install", "environment", "kernels", "checkpoint", "bench_graphs",
                           "bench_eager", "bench_torch", "bench_batch1", "pytest"]
    for name in CUDA_PARTS:
        assert parts[name]["status"] == "skipped"
        assert parts[name]["note"].startswith("dry run")
        assert f"== {name}: skipped: dry run" in log
    assert f"CPU dry run: every CUDA part is skipped ({report['dry_run_reason']})" in log
    assert f"dry run: the CUDA parts were skipped ({report['dry_run_reason']})" in log
    # What did run: the environment part, on this Python and its torch.
    assert parts["environment"]["status"] == "ok"
    assert report["environment"]["torch"] == torch.__version__
    assert report["environment"]["python_executable"] == sys.executable
    assert report["tests"] is None and report["benchmarks"] == {}
    # The scratch folder (installed wheels, the parts' results) is gone.
    assert not list(dry_run["scratch"].glob("nanoqwen-gpu-check.*"))


def recorded_command(report: dict[str, Any], name: str) -> list[str]:
    return shlex.split(next(p["command"] for p in report["parts"] if p["name"] == name))


@pytest.mark.parametrize("name", ["bench_graphs", "bench_eager", "bench_torch", "bench_batch1"])
def test_the_benchmarks_it_would_run_are_valid_bench_commands(
    dry_run: dict[str, Any], name: str
) -> None:
    """bench.py parses each command line (without running it), and each is the workload
    the check promises: nano-vllm's on Qwen3-0.6B's shape, or one request with the floors."""
    command = recorded_command(dry_run["json"], name)
    assert command[:2] == [sys.executable, "bench.py"]
    context = bench.main.make_context("bench.py", command[2:])
    options = context.params
    assert options["random_weights"] == "qwen3-0.6b" and options["device"] == "cuda"
    if name == "bench_batch1":
        assert (options["num_seqs"], options["max_num_seqs"], options["floor"]) == (1, 1, True)
    else:
        workload = [options[key] for key in ("num_seqs", "min_input", "max_input",
                                             "min_output", "max_output", "max_model_len")]
        assert workload == [256, 100, 1024, 100, 1024, 4096]
    backend = {"bench_torch": "torch"}.get(name, "flashinfer")
    assert options["attention_backend"] == backend
    assert options["enforce_eager"] == (name == "bench_eager")


def test_the_tests_and_kernels_it_would_run(dry_run: dict[str, Any]) -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    pytest_command = recorded_command(dry_run["json"], "pytest")
    marker = pytest_command[pytest_command.index("-m", 2) + 1]
    declared = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())
    markers = declared["tool"]["pytest"]["ini_options"]["markers"]
    assert any(line.startswith(f"{marker}:") for line in markers)
    kernels = recorded_command(dry_run["json"], "kernels")
    preset = kernels[kernels.index("--preset") + 1]
    assert gpu_check.preset_shape(preset) == dict(
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128)


def test_the_check_refuses_a_missing_outdir_and_unknown_options() -> None:
    for arguments in ([], ["out", "--fast"], ["a", "b"]):
        completed = subprocess.run(
            ["bash", str(REPOSITORY / "tools" / "gpu_check.sh"), *arguments],
            capture_output=True, text=True, timeout=30,
        )
        assert completed.returncode == 2 and "usage: tools/gpu_check.sh OUTDIR [--dry-run]" \
            in completed.stderr


# ----------------------------------------------------------------- gpu_check.sh, on a GPU
# What the GPU machine's Python does for each part, as far as the check can tell: it writes
# the files the part is asked for (copies of the ones in the `canned` folder, named after
# them) and notes each call. `capability` and `report` run for real. A call whose command
# line holds FAKE_FAIL fails; the first FAKE_STALLS calls whose command line holds FAKE_STALL
# exit as `timeout` does when it stops a command (124).
FAKE_PYTHON = """#!{python}
import os, shutil, sys
from pathlib import Path

args, canned = sys.argv[1:], Path({canned!r})
with open(canned / "calls.txt", "a") as calls:
    calls.write(" ".join(args) + "\\t" + os.environ.get("FLASHINFER_CUDA_ARCH_LIST", "") + "\\t"
                + os.environ["PYTHONPATH"] + "\\n")
if args[:2] == ["-m", "tools.gpu_check"] and args[2] in ("capability", "report"):
    os.execv(sys.executable, [sys.executable, *args])
if args[:3] == ["-m", "pip", "install"]:
    Path(args[args.index("--target") + 1]).mkdir(parents=True)
stall = os.environ["FAKE_STALL"]
if stall and stall in " ".join(args) and \
        (canned / "calls.txt").read_text().count(stall) <= int(os.environ["FAKE_STALLS"]):
    sys.exit(124)
if os.environ["FAKE_FAIL"] in " ".join(args):
    sys.exit(3)
if args[:3] == ["-m", "pip", "install"]:
    sys.exit(0)
out = next(args[i + 1] for i, arg in enumerate(args) if arg in ("--out", "--json", "--junitxml"))
shutil.copy(canned / Path(out).name, out)
print("ran", " ".join(args[:3]))
"""


def bench_result(output_tok_s: float, batch_one: bool = False) -> dict[str, Any]:
    """A bench.py result with the figures the report reads."""
    result: dict[str, Any] = {"nanoqwen": {
        "requests": 1 if batch_one else 256, "output_tokens": 256 if batch_one else 143_000,
        "wall_s": 10.0, "output_tok_s": output_tok_s, "total_tok_s": 2 * output_tok_s,
        "ttft_ms": {"p50": 50.0}, "tpot_ms": {"p50": 4.0}, "preemptions": 0,
    }, "bandwidth_floor": {"floor_ms_per_token": 0.4, "ratio": 10.0}}
    if batch_one:
        result["floor"] = {"floor_ratio": 3.0}
    return result


@pytest.fixture
def on_a_gpu(tmp_path: Path):
    """Runs the check on stand-ins for nvidia-smi and for the GPU machine's Python (its calls
    fail where their command line holds `fail`); returns the exit status, the JSON, the log
    and the calls the stand-in saw (command line, FLASHINFER_CUDA_ARCH_LIST, PYTHONPATH).
    The wheels go into `tmp_path / "cache"`, where a second run finds them."""
    canned, bin_dir, wheels, out = (tmp_path / name for name in ("canned", "bin", "w", "out"))
    for folder in (canned, bin_dir, wheels):
        folder.mkdir()
    (wheels / "flashinfer_python-0.7.0.post1-py3-none-any.whl").touch()
    environment = {"cuda_available": True, "gpus": [{"name": "GPU", "capability": "9.0"}]}
    files = {
        "environment.json": environment, "checkpoint.json": {"directory": "weights"},
        "kernels.json": {"preset": "qwen3-0.6b", "seconds": 95.0, "modules_built": 2,
                         "modules_cached_before": 0, "prefill": "auto"},
        "bench_graphs.json": bench_result(6000.0), "bench_eager.json": bench_result(1500.0),
        "bench_torch.json": bench_result(2000.0),
        "bench_batch1.json": bench_result(250.0, batch_one=True),
    }
    for name, value in files.items():
        (canned / name).write_text(json.dumps(value))
    (canned / "pytest.xml").write_text(
        '<testsuite><testcase classname="tests.test_cuda" name="test_a"/></testsuite>')
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON.format(python=sys.executable, canned=str(canned)))
    nvidia_smi = bin_dir / "nvidia-smi"
    nvidia_smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    for script in (python, nvidia_smi):
        script.chmod(0o755)

    def run(fail: str, stall: str = "", stalls: int = 1) -> dict[str, Any]:
        (canned / "calls.txt").unlink(missing_ok=True)
        completed = subprocess.run(
            ["bash", str(REPOSITORY / "tools" / "gpu_check.sh"), str(out)],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                 "PYTHON": str(python), "WHEELS": str(wheels), "TMPDIR": str(tmp_path),
                 "XDG_CACHE_HOME": str(tmp_path / "cache"),
                 "FLASHINFER_CUDA_ARCH_LIST": "", "FAKE_FAIL": fail,
                 "FAKE_STALL": stall, "FAKE_STALLS": str(stalls)},
        )
        calls = [line.split("\t") for line in (canned / "calls.txt").read_text().splitlines()]
        return {"status": completed.returncode, "stderr": completed.stderr, "calls": calls,
                "json": json.loads((out / "gpu_check.json").read_text()),
                "log": (out / "gpu_check.log").read_text()}

    return run


def test_on_a_gpu_every_part_runs_in_order_and_the_report_gathers_them(
    on_a_gpu, tmp_path: Path
) -> None:
    """The order of the parts, what each is given (the wheels' folder first on PYTHONPATH,
    flashinfer's target architecture), and a report of everything they wrote, a failed
    part included."""
    run = on_a_gpu(fail="--attention-backend torch")
    assert run["status"] == 1, run["stderr"]  # bench_torch failed
    report = run["json"]
    statuses = [(part["name"], part["status"]) for part in report["parts"]]
    assert statuses == [
        ("install", "ok"), ("environment", "ok"), ("kernels", "ok"), ("checkpoint", "ok"),
        ("bench_graphs", "ok"), ("bench_eager", "ok"), ("bench_torch", "failed"),
        ("bench_batch1", "ok"), ("pytest", "ok"),
    ]
    assert report["parts"][6]["note"] == "exit status 3"
    assert report["mode"] == "gpu" and report["ok"] is False
    assert report["tests"]["passed"] == 1 and report["kernels"]["seconds"] == 95.0
    assert sorted(report["benchmarks"]) == ["bench_batch1", "bench_eager", "bench_graphs"]
    summary = report["summary"]
    assert summary["graphs_over_eager"] == 4.0 and summary["flashinfer_over_torch"] is None
    assert summary["bench_batch1"]["wall_over_dense_matmul_floor"] == 3.0
    assert summary["kernel_build_s"] == 95.0

    target = run["calls"][0][0].split("--target ")[1].split()[0]
    site = target.removesuffix(".partial")
    assert Path(site).parent == tmp_path / "cache" / "nanoqwen" / "gpu-check"
    assert Path(site).is_dir() and not Path(target).exists()
    assert all(path.split(":")[:2] == [site, str(REPOSITORY)] for _, _, path in run["calls"])
    # The random weights' part gives the build's own time, and the benchmarks' wait apart.
    checkpoint = report["parts"][3]
    assert re.fullmatch(r"built in the background, the benchmarks waited \d+ s for it",
                        checkpoint["note"])
    assert f"== checkpoint: ok after {checkpoint['seconds']} s ({checkpoint['note']})" in \
        run["log"]
    # The kernels are built for the GPU torch saw (an empty setting counts as none).
    assert all(arch == "9.0" for command, arch, _ in run["calls"] if "kernels" in command)
    assert "flashinfer builds for compute capability 9.0" in run["log"]
    assert "== bench_torch: failed after" in run["log"]
    assert "ran -m tools.gpu_check kernels" in run["log"]


def test_a_second_run_finds_the_wheels_where_the_first_installed_them(
    on_a_gpu, tmp_path: Path
) -> None:
    """flashinfer reuses the kernels it built only from the same folder: the wheels are
    installed once per set of wheels, an interrupted install is not taken for one, and a
    different set goes elsewhere."""
    def install_and_path(run: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
        install = run["json"]["parts"][0]
        return install, {path.split(":")[0] for _, _, path in run["calls"]}

    failed = on_a_gpu(fail="pip install")
    install, _ = install_and_path(failed)
    assert install["status"] == "failed" and failed["status"] == 1
    installed = (tmp_path / "cache" / "nanoqwen" / "gpu-check").iterdir()
    assert [path.suffix for path in installed] == [".partial"]

    first = on_a_gpu(fail="nothing")
    install, (site,) = install_and_path(first)
    assert install["status"] == "ok" and Path(site).is_dir()

    second = on_a_gpu(fail="nothing")
    install, paths = install_and_path(second)
    assert install["status"] == "skipped", second["log"]
    assert install["note"] == f"these wheels are installed already, in {site}"
    assert paths == {site} and not any("pip install" in c for c, _, _ in second["calls"])
    assert second["status"] == 0, second["stderr"]

    (tmp_path / "w" / "gguf-0.19.0-py3-none-any.whl").touch()
    other = on_a_gpu(fail="nothing")
    install, (other_site,) = install_and_path(other)
    assert install["status"] == "ok" and other_site != site


def test_on_a_gpu_kernels_that_fail_to_build_skip_the_flashinfer_benchmarks(on_a_gpu) -> None:
    run = on_a_gpu(fail="tools.gpu_check kernels")
    assert run["status"] == 1, run["stderr"]
    parts = {part["name"]: part for part in run["json"]["parts"]}
    assert parts["kernels"]["status"] == "failed"
    for name in ("bench_graphs", "bench_eager", "bench_batch1"):
        assert parts[name]["status"] == "skipped"
        assert parts[name]["note"] == "flashinfer's kernels failed to build (see the kernels part)"
    assert parts["pytest"]["status"] == parts["bench_torch"]["status"] == "ok"
    assert list(run["json"]["benchmarks"]) == ["bench_torch"]
    assert not any("--attention-backend flashinfer" in command for command, _, _ in run["calls"])


def test_on_a_gpu_a_kernel_build_out_of_time_goes_on_in_the_benchmarks_time(on_a_gpu) -> None:
    """An interrupted build leaves the rest to do: it is resumed once, in the time set aside
    for the flashinfer benchmarks, and they run after it, in order, in what is left."""
    run = on_a_gpu(fail="nothing", stall="tools.gpu_check kernels")
    parts = [(part["name"], part["status"]) for part in run["json"]["parts"]]
    assert parts[2:4] == [("kernels", "timed_out"), ("kernels_resumed", "ok")], parts
    assert [name for name, status in parts[5:]] == [
        "bench_graphs", "bench_eager", "bench_torch", "bench_batch1", "pytest"]
    assert all(status == "ok" for _, status in parts[3:])
    resumed = run["json"]["parts"][3]
    # Its whole cap: with the flashinfer benchmarks' floors (170 s) still set aside, the
    # 540 s run would leave it at most 168 s even at its very start.
    assert resumed["limit_s"] == 170
    kernel_calls = [c for c, _, _ in run["calls"] if "tools.gpu_check kernels" in c]
    assert len(kernel_calls) == 2 and kernel_calls[0] == kernel_calls[1]


def test_on_a_gpu_kernels_still_unbuilt_skip_the_flashinfer_benchmarks(on_a_gpu) -> None:
    """Out of time twice, the build is not begun a third time by each benchmark."""
    run = on_a_gpu(fail="nothing", stall="tools.gpu_check kernels", stalls=2)
    assert run["status"] == 1, run["stderr"]
    parts = {part["name"]: part for part in run["json"]["parts"]}
    assert parts["kernels"]["status"] == parts["kernels_resumed"]["status"] == "timed_out"
    for name in ("bench_graphs", "bench_eager", "bench_batch1"):
        assert parts[name]["status"] == "skipped"
        assert parts[name]["note"] == \
            "flashinfer's kernels were not built in time (see the kernels parts)"
    assert parts["bench_torch"]["status"] == parts["pytest"]["status"] == "ok"
    assert sum("tools.gpu_check kernels" in command for command, _, _ in run["calls"]) == 2


# ----------------------------------------------------------------- the report's parts
def test_the_report_counts_test_outcomes_from_junit_xml(tmp_path: Path) -> None:
    junit = tmp_path / "pytest.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad">'
        '<failure message="assert 1 == 2&#10;more">long</failure></testcase>'
        '<testcase classname="tests.test_b" name="test_skip"><skipped message="no"/></testcase>'
        '<testcase classname="" name="tests.test_c"><error message="ImportError: x"/></testcase>'
        '<testcase time="0.000" />'  # where pytest was interrupted: no outcome
        '</testsuite></testsuites>'
    )
    results = gpu_check.junit_results(junit)
    assert {k: results[k] for k in ("passed", "failed", "errors", "skipped")} == dict(
        passed=1, failed=1, errors=1, skipped=1)
    assert results["failures"] == [
        {"test": "tests.test_a::test_bad", "message": "assert 1 == 2"},
        {"test": "::tests.test_c", "message": "ImportError: x"},
    ]
    assert gpu_check.junit_results(tmp_path / "missing.xml") is None


def test_a_part_that_ran_out_of_time_fails_the_report(tmp_path: Path) -> None:
    (tmp_path / "parts.tsv").write_text(
        "environment\tok\t3\t40\t\tpython -m tools.gpu_check environment\n"
        "pytest\ttimed_out\t230\t230\tran out of its 230 s and was stopped\tpython -m pytest\n"
    )
    settings = dict(mode="gpu", dry_run_reason=None, started="now", wall_s=240, deadline_s=540)
    report = gpu_check.build_report(tmp_path, settings)
    assert report["ok"] is False and report["parts"][1]["limit_s"] == 230
    assert "pytest         timed_out      230    230  ran out of its 230 s" in \
        gpu_check.describe_report(report)


# ----------------------------------------------------------------- gpu_wheels
def make_wheel(folder: Path, name: str, version: str, *requires: str, padding: int = 0) -> Path:
    """A wheel with nothing in it but its metadata (and `padding` bytes, for its size)."""
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    metadata = "\n".join([f"Name: {name}", f"Version: {version}",
                          *(f"Requires-Dist: {need}" for need in requires)])
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", metadata)
        archive.writestr("padding", bytes(padding))
    return path


def test_the_wheel_check_finds_what_would_fail_on_the_gpu_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    make_wheel(tmp_path, "alpha", "1.0", "beta>=2", "torch", "nvidia-cutlass-dsl>=4",
               "gamma", "delta; extra == 'docs'", "epsilon; sys_platform == 'win32'",
               "zeta; python_version < '3.11'")
    make_wheel(tmp_path, "beta", "1.5")
    make_wheel(tmp_path, "Gamma", "1.0")
    make_wheel(tmp_path, "gamma", "2.0")
    assert gpu_wheels.main([str(tmp_path)]) == 1
    printed = capsys.readouterr().out
    problems = [line for line in printed.splitlines() if line.startswith("PROBLEM")]
    assert problems == [
        "PROBLEM: two versions of gamma: 1.0 and 2.0 (pip install refuses both)",
        "PROBLEM: alpha 1.0 needs beta>=2, the folder has beta 1.5",
    ]
    assert "left out: nvidia-cutlass-dsl (flashinfer's CuTe-DSL kernels" in printed


def test_the_wheel_check_finds_an_unmet_need_and_adds_up_the_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    make_wheel(tmp_path, "alpha", "1.0", "omega", padding=600_000)
    make_wheel(tmp_path, "beta", "1.0", "alpha==1.0", "numpy", padding=600_000)
    assert gpu_wheels.main([str(tmp_path), "--limit-mib", "1"]) == 1
    printed = capsys.readouterr().out
    total = float(re.search(r"^total\s+([\d.]+)", printed, re.M).group(1))
    assert total == pytest.approx(sum(p.stat().st_size for p in tmp_path.iterdir()) / 2**20,
                                  abs=0.01)
    assert ("PROBLEM: alpha 1.0 needs omega: no wheel here, and not a package a CUDA "
            "PyTorch image has") in printed
    assert f"PROBLEM: the wheels take {total:.2f} MiB, more than 1" in printed
    (tmp_path / "alpha-1.0-py3-none-any.whl").unlink()
    make_wheel(tmp_path, "alpha", "1.0", "numpy")
    assert gpu_wheels.main([str(tmp_path)]) == 0
    assert "PROBLEM" not in capsys.readouterr().out


def pinned_wheels() -> dict[str, str]:
    """tools/gpu_wheels.txt: normalized name to the one version pinned."""
    pins = {}
    for line in (REPOSITORY / "tools" / "gpu_wheels.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            assert canonicalize_name(name) not in pins, f"{name} is pinned twice"
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_the_wheel_list_covers_what_nanoqwen_and_its_tests_import() -> None:
    """Every dependency pyproject declares (the package's, the cuda extra's, the tests') is
    carried as a wheel, had by a CUDA PyTorch image, or left out with a reason; and the
    flashinfer carried is one the cuda extra allows."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    declared = [Requirement(line) for line in
                project["dependencies"] + extras["cuda"] + extras["test"]]
    pins = pinned_wheels()
    for need in declared:
        name = canonicalize_name(need.name)
        assert name in pins or name in gpu_wheels.GPU_IMAGE_PROVIDES or \
            name in gpu_wheels.LEFT_OUT, f"{need} is neither carried nor on a GPU image"
        if name in pins:
            assert need.specifier.contains(pins[name]), f"{name}=={pins[name]} is not {need}"
    assert "torch" not in pins
    assert pins["flashinfer-python"] in declared_flashinfer_range()
