"""The servers `bench.py --serve` starts: nanoqwen's `serve.py`, and with `--compare vllm`,
vLLM's OpenAI server, each in a process of its own, one at a time.

Each is started on a free local port, waited for until `GET /health` answers (or its
process exits, which is reported with the tail of its log), driven, and stopped with
SIGTERM (SIGKILL if it lingers). nanoqwen's gets the benchmark's engine options through
a `--config` file and the benchmark's thread count through `OMP_NUM_THREADS`, so it runs
exactly the engine the offline run measured. vLLM's runs
with the Python of its own environment (`--peer-python`), the environment the offline
comparison gives it (`bench_peers.peer_environment`: its own defaults, on the same
threads, all of them for the model, eagerly, with a KV cache of `VLLM_CPU_KVCACHE_SPACE`
GiB unless the environment says otherwise), and the dtype, context and batch size of
nanoqwen's engine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tools.bench_peers import PeerUnavailable, peer_environment
from tools.bench_serving import Endpoint

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_SECONDS = 900.0  # loading a model (and vLLM's start-up) on a busy CPU
STOP_TIMEOUT_SECONDS = 30.0
# As the offline comparison runs vLLM (tools/peers/vllm_runner.py): its model on every
# thread bench runs (`peer_environment` binds them), a KV cache of 4 GiB.
VLLM_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "4"}
LOG_TAIL_LINES = 20


def free_port() -> int:
    """A port nothing listens on now (the OS's pick for port 0)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def nanoqwen_command(model_dir: str, port: int, config: Path) -> list[str]:
    return [sys.executable, str(ROOT / "serve.py"), "--model", model_dir,
            "--port", str(port), "--config", str(config)]


def vllm_command(python: str, model_dir: str, port: int, dtype: str, max_model_len: int,
                 max_num_seqs: int) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--port", str(port), "--host", "127.0.0.1", "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--seed", "0", "--enforce-eager",
            "--enable-prompt-tokens-details"]  # its usage counts prefix-cache hits


@contextmanager
def nanoqwen_server(model_dir: str, engine_options: dict[str, Any],
                    threads: int) -> Iterator[Endpoint]:
    """serve.py on `model_dir` with these engine options and as many CPU threads as the
    in-process engine (`--threads`), for as long as the block runs."""
    with tempfile.TemporaryDirectory(prefix="nanoqwen-bench-") as scratch:
        config = Path(scratch) / "engine.json"
        config.write_text(json.dumps(engine_options))
        port = free_port()
        environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # torch's default
        with running_server(nanoqwen_command(model_dir, port, config), environment,
                            port, "nanoqwen's server") as endpoint:
            yield endpoint


@contextmanager
def vllm_server(python: str, model_dir: str, dtype: str, threads: int, max_model_len: int,
                max_num_seqs: int) -> Iterator[Endpoint]:
    """vLLM's OpenAI server in its own environment, for as long as the block runs."""
    environment = peer_environment(threads)
    for name, value in VLLM_ENVIRONMENT.items():
        environment.setdefault(name, value)
    port = free_port()
    command = vllm_command(python, model_dir, port, dtype, max_model_len, max_num_seqs)
    with running_server(command, environment, port, "vLLM's server") as endpoint:
        yield endpoint


@contextmanager
def running_server(command: list[str], environment: dict[str, str], port: int,
                   label: str) -> Iterator[Endpoint]:
    """Start `command` (a server listening on `port`), wait until it is healthy, yield its
    endpoint, and stop it; its output goes to a log whose tail an early exit reports."""
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=environment)
        try:
            endpoint = Endpoint(f"http://127.0.0.1:{port}", pid=process.pid)
            wait_until_healthy(process, endpoint, log, label)
            endpoint.model = endpoint.served_model()
            yield endpoint
        finally:
            stop(process)


def wait_until_healthy(process: subprocess.Popen, endpoint: Endpoint, log: Any,
                       label: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            tail = "\n".join(log.read().strip().splitlines()[-LOG_TAIL_LINES:])
            raise PeerUnavailable(f"{label} exited with {process.returncode}:\n{tail}")
        if health_answers(endpoint):
            return
        time.sleep(0.5)
    raise PeerUnavailable(f"{label} did not become healthy in {START_TIMEOUT_SECONDS:.0f} s")


def health_answers(endpoint: Endpoint) -> bool:
    """Whether `GET /health` answers 200 (vLLM's with an empty body); False while the
    server is not listening yet."""
    connection = endpoint.connection(5.0)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
