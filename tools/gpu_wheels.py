"""Check a folder of wheels meant for a GPU machine that has no package index.

`tools/gpu_wheels.sh` downloads the wheels of `tools/gpu_wheels.txt` without their needs
(`pip download --no-deps`), because resolving them would pull torch, triton and flashinfer's
optional kernel libraries (gigabytes). So nothing but this check says whether the folder is
complete. For every wheel it reads the needs its metadata declares (as they apply to CPython
3.12 on Linux x86_64, extras left out) and finds each one met by another wheel of the folder
(at a version the need allows), by a package a CUDA PyTorch image has (`GPU_IMAGE_PROVIDES`:
there, names only, as versions differ from image to image), or left out on purpose
(`LEFT_OUT`, with the reason). It also finds two versions of one package (which would stop
`pip install` there), and adds up the sizes against a limit.

    python tools/gpu_wheels.py .whl --limit-mib 64

prints one line per wheel (name, version, MiB), the total, and every problem; it exits with
1 if there is one, or if the total is over the limit.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # a Python with pip alone: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

MIB = 1 << 20
# How markers read on the GPU machine: CPython 3.12 on Linux x86_64.
TARGET_ENVIRONMENT = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
    "extra": "",
}
# What a GPU machine with a CUDA PyTorch image already has, of what the wheels need: torch
# with its CUDA build, transformers and the Hugging Face stack, the scientific Python stack,
# pytest, and the packages flashinfer's JIT needs (einops, ninja, nvidia-ml-py, cuda-bindings).
GPU_IMAGE_PROVIDES = frozenset(canonicalize_name(name) for name in (
    "torch", "triton", "transformers", "tokenizers", "safetensors", "huggingface-hub",
    "accelerate", "numpy", "einops", "ninja", "requests", "tabulate", "tqdm", "nvidia-ml-py",
    "cuda-bindings", "cuda-pathfinder", "packaging", "click", "pyyaml", "jinja2", "rich",
    "psutil", "prometheus-client", "pytest", "pytest-cov", "hypothesis", "matplotlib", "anyio",
    "httpx", "idna", "certifi", "h11", "attrs", "filelock", "fsspec", "regex", "setuptools",
))
# Needs deliberately not carried, and why nanoqwen does without them.
LEFT_OUT = {
    canonicalize_name(name): reason for name, reason in {
        "nvidia-cutlass-dsl": "flashinfer's CuTe-DSL kernels, imported only where they are "
                              "called; the paged attention nanoqwen calls is JIT-built CUDA C++ "
                              "(and the DSL's CUDA libraries weigh 88 MiB)",
        "nvidia-cudnn-frontend": "flashinfer's cuDNN attention backend, which nanoqwen does "
                                 "not pick",
        "cuda-tile": "flashinfer's cuTile kernels, imported only where they are called",
        "nccl4py": "flashinfer's communication kernels; nanoqwen's tensor parallelism uses "
                   "torch.distributed",
        "nccl-extensions": "flashinfer's communication kernels (as nccl4py)",
        "cuda-python": "a meta-package over cuda-bindings, which the image has",
        "playwright": "only the chat page's browser tests import it, and skip without it; "
                      "its wheel alone weighs tens of MiB",
        "pytest-xdist": "spreads the CPU tests over processes through pyproject's addopts, "
                        "which tools/gpu_check.sh drops: the GPU tests run in one process, "
                        "each with the whole GPU",
    }.items()
}


@dataclass
class Wheel:
    """One wheel file: its project name (normalized), version, size and declared needs."""

    path: Path
    name: str
    version: Version
    size: int
    requires: list[Requirement] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> Wheel:
        with zipfile.ZipFile(path) as archive:
            metadata_name = next(
                name for name in archive.namelist()
                if re.fullmatch(r"[^/]+\.dist-info/METADATA", name)
            )
            metadata = Parser().parsestr(archive.read(metadata_name).decode())
        return cls(
            path=path,
            name=canonicalize_name(metadata["Name"]),
            version=Version(metadata["Version"]),
            size=path.stat().st_size,
            requires=[Requirement(line) for line in metadata.get_all("Requires-Dist") or []],
        )

    def needs(self) -> list[Requirement]:
        """The needs that apply on the GPU machine (extras not asked for are left out)."""
        return [
            need for need in self.requires
            if need.marker is None or need.marker.evaluate(TARGET_ENVIRONMENT)
        ]


def problems(wheels: list[Wheel]) -> list[str]:
    """Everything that would keep these wheels from installing and importing together on
    the GPU machine: a need nobody meets, a wheel at a version another's need refuses, two
    versions of one package."""
    found: list[str] = []
    by_name: dict[str, Wheel] = {}
    for wheel in wheels:
        if wheel.name in by_name:
            found.append(f"two versions of {wheel.name}: {by_name[wheel.name].version} and "
                         f"{wheel.version} (pip install refuses both)")
        by_name[wheel.name] = wheel
    for wheel in wheels:
        for need in wheel.needs():
            name = canonicalize_name(need.name)
            if name in by_name:
                if not need.specifier.contains(by_name[name].version, prereleases=True):
                    found.append(f"{wheel.name} {wheel.version} needs {need}, the folder has "
                                 f"{name} {by_name[name].version}")
            elif name not in GPU_IMAGE_PROVIDES and name not in LEFT_OUT:
                found.append(f"{wheel.name} {wheel.version} needs {need}: no wheel here, and "
                             f"not a package a CUDA PyTorch image has")
    return found


def read_folder(folder: Path) -> list[Wheel]:
    return [Wheel.read(path) for path in sorted(folder.glob("*.whl"))]


def report(wheels: list[Wheel], limit_mib: float) -> tuple[str, bool]:
    """The table of wheels with their total, every problem, and whether all is well."""
    lines = [f"{'wheel':<28} {'version':<16} {'MiB':>6}"]
    lines += [f"{w.name:<28} {str(w.version):<16} {w.size / MIB:6.2f}" for w in wheels]
    total = sum(wheel.size for wheel in wheels) / MIB
    lines.append(f"{'total':<45} {total:6.2f}  (limit {limit_mib:g} MiB, "
                 f"{len(wheels)} wheels)")
    found = problems(wheels)
    if total > limit_mib:
        found.append(f"the wheels take {total:.2f} MiB, more than {limit_mib:g}")
    used = {canonicalize_name(need.name) for wheel in wheels for need in wheel.needs()}
    lines += [f"left out: {name} ({LEFT_OUT[name]})" for name in sorted(used & LEFT_OUT.keys())]
    lines += [f"PROBLEM: {problem}" for problem in found]
    return "\n".join(lines), not found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the folder of wheels (.whl)")
    parser.add_argument("--limit-mib", type=float, default=64.0,
                        help="the most the wheels may take together (default 64)")
    args = parser.parse_args(argv)
    wheels = read_folder(args.folder)
    if not wheels:
        print(f"no wheels in {args.folder}", file=sys.stderr)
        return 1
    text, fine = report(wheels, args.limit_mib)
    print(text)
    return 0 if fine else 1


if __name__ == "__main__":
    sys.exit(main())
