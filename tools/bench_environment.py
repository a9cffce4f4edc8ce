"""What `bench.py --json` records besides its figures: when, with what, on which machine.

A throughput figure means little without the machine and the library versions that gave
it, and results compared months apart need both to be told apart. Everything here is read
from the running process and the operating system; nothing is measured.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import psutil
import torch

REPOSITORY = Path(__file__).resolve().parents[1]


def describe_environment() -> dict[str, Any]:
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "machine": machine(),
    }


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {
        package: installed_version(package) for package in ("nanoqwen", "torch", "transformers")
    }
    found["nanoqwen_commit"] = git_commit()
    found["python"] = platform.python_version()
    return found


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The commit of the checkout bench.py runs from, with "+changes" when it has edits;
    None outside a git checkout."""
    try:
        commit = run_git("rev-parse", "HEAD")
        edited = run_git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+changes" if edited else "")


def run_git(*arguments: str) -> str:
    return subprocess.run(
        ["git", *arguments], cwd=REPOSITORY, capture_output=True, text=True, check=True,
        timeout=10,
    ).stdout.strip()


def machine() -> dict[str, Any]:
    memory = psutil.virtual_memory()
    return {
        "system": f"{platform.system()} {platform.release()}",
        "cpu": cpu_model(),
        "cpu_cores": psutil.cpu_count(logical=False),
        "cpu_threads": os.cpu_count(),
        "ram_bytes": memory.total,
        "ram_available_bytes": memory.available,  # at the start: other programs' share
        "gpus": [
            {"name": props.name, "memory_bytes": props.total_memory}
            for props in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))
        ],
    }


def cpu_model() -> str:
    """The processor's marketing name (Linux lists it in /proc/cpuinfo), else what the
    platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
