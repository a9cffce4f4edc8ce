"""Bringing up the ranks of a split model: checks first, then the processes, then the group.

`start_split_model` is the one call the engine makes, for N > 1 ranks. It first refuses
what cannot split (heads that don't divide, weights that don't slice), before any process
exists; then it starts ranks 1..N-1, each a fresh
`python -m nanoqwen.parallel.worker` process told its job through its stdin. Being their
own entry point, workers never import the user's main module: a script without an
`if __name__ == "__main__":` guard, a script piped on stdin and `python -c` all work.
Under `torchrun` the N processes exist already: all run the same script, and in every
rank but 0 the engine's start-up serves steps until rank 0 stops (`join_torchrun`).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from nanoqwen.config import EngineConfig, RunnerSettings
from nanoqwen.model.layers import SINGLE, TensorParallel
from nanoqwen.parallel.split_runner import Rank0Runner, forward_from_wire
from nanoqwen.parallel.step_broadcast import STEP_WIRE, serve_steps
from nanoqwen.parallel.workers import (
    COLLECTIVE_TIMEOUT,
    IDLE_TIMEOUT,
    STARTUP_TIMEOUT,
    WorkerFailure,
    Workers,
    describe_exit,
    starting,
    stop_processes,
)
from nanoqwen.runner.runner import ModelRunner
from nanoqwen.runner.startup import start_runners
from nanoqwen.weights.checkpoint import Checkpoint


@dataclass(frozen=True)
class Ranks:
    """This process's place in the split: its rank's view, its device (a GPU per rank),
    and on rank 0 the handle on the other ranks."""

    tp: TensorParallel = SINGLE
    device: torch.device | None = None  # None: the engine's own
    workers: Workers | None = None



# Given its `Ranks`, build a rank's runner, ready to run steps (sized and allocated alike
# on every rank). Pickled to the workers, so a module-level function or a partial of one.
RunnerStarter = Callable[[Ranks], ModelRunner]


def start_split_model(
    config: EngineConfig, checkpoint: Checkpoint, settings: RunnerSettings, max_proposed: int = 0
) -> tuple[ModelRunner, Workers]:
    """Rank 0's runner of a model split across `config.tensor_parallel_size` ranks, and its
    handle on the others, each of which starts the same way and then serves steps."""
    starter = partial(start_rank_runner, checkpoint, settings, max_proposed)
    ranks = start_ranks(config, checkpoint, starter)
    with starting(ranks.workers):  # if rank 0 fails to start, the other ranks go too
        (runner,) = start_runners(
            [checkpoint], settings, ranks.tp, ranks.device, max_proposed, agree=min_over_ranks,
            make=partial(Rank0Runner, workers=ranks.workers),
        )
    return runner, ranks.workers


def start_rank_runner(
    checkpoint: Checkpoint, settings: RunnerSettings, max_proposed: int, ranks: Ranks
) -> ModelRunner:
    """How every rank but 0 starts its runner (rank 0's `start_split_model` does the same)."""
    (runner,) = start_runners([checkpoint], settings, ranks.tp, ranks.device, max_proposed,
                              agree=min_over_ranks)
    return runner


def min_over_ranks(value: int) -> int:
    """The smallest `value` of any rank: what every rank can afford (a KV page count)."""
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


@dataclass(frozen=True)
class WorkerJob:
    """Everything a worker process is told at start (through its stdin, pickled)."""

    rank: int
    size: int
    store_port: int
    device: torch.device
    threads: int | None  # CPU threads, when the ranks share a CPU's cores
    start_runner: RunnerStarter


def start_ranks(config: EngineConfig, checkpoint: Checkpoint, start_runner: RunnerStarter) -> Ranks:
    """Bring up all `config.tensor_parallel_size` ranks; return rank 0's `Ranks`."""
    size = config.tensor_parallel_size
    shape = checkpoint.model_config
    check_splittable_shape(shape.num_heads, shape.num_kv_heads, shape.intermediate_size, size)
    if shape.moe is not None:
        shape.moe.check_splittable(size)
    if shape.state_layers:
        from nanoqwen.model.gated_deltanet import check_splittable

        check_splittable(shape.hf_config, size)
    check_splittable_weights(checkpoint, config.quantization)
    if dist.is_initialized():
        raise ValueError(
            "torch.distributed is already in use in this process: run one tensor-parallel "
            "engine per process (shut the previous one down first)"
        )
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return join_torchrun(config, start_runner)
    check_devices(config.device, size)
    threads = cpu_threads = None
    if config.device.type == "cpu":  # the ranks share the cores
        cpu_threads = torch.get_num_threads()
        threads = max(1, cpu_threads // size)
        torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                          timeout=STARTUP_TIMEOUT)
    processes: list[subprocess.Popen] = []
    try:
        for rank in range(1, size):
            job = WorkerJob(rank, size, store.port, rank_device(config.device, rank), threads,
                            start_runner)
            processes.append(spawn_worker(job))
        wait_for_workers(store, processes)
        device = rank_device(config.device, 0)
        group = init_ranks(device, 0, size, store)
    except BaseException:
        stop_processes(processes)
        if cpu_threads is not None:
            torch.set_num_threads(cpu_threads)
        raise
    workers = Workers(group, processes, store, cpu_threads)
    return Ranks(TensorParallel(0, size), device, workers)


def spawn_worker(job: WorkerJob) -> subprocess.Popen:
    """A fresh interpreter running `nanoqwen.parallel.worker`, its job written to its stdin,
    which then stays open as its lifeline: the worker exits when it closes."""
    process = subprocess.Popen(
        [sys.executable, "-m", "nanoqwen.parallel.worker"], stdin=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    process.stdin.write(pickle.dumps(job))
    process.stdin.flush()
    return process


def join_torchrun(config: EngineConfig, start_runner: RunnerStarter) -> Ranks:
    """Under torchrun (env:// rendezvous): every process runs this; only rank 0 returns."""
    size, world = config.tensor_parallel_size, int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(
            f"tensor_parallel_size={size} but torchrun started {world} processes (WORLD_SIZE)"
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    device = rank_device(config.device, local_rank)
    group = init_ranks(device, rank, size, store=None)
    tp = TensorParallel(rank, size)
    if rank == 0:
        return Ranks(tp, device, Workers(group))
    runner = start_runner(Ranks(tp, device))
    serve_steps(partial(forward_from_wire, runner), STEP_WIRE, group)
    dist.destroy_process_group()
    raise SystemExit(0)  # this process was only ever a worker


def wait_for_workers(store: dist.TCPStore, processes: list[subprocess.Popen]) -> None:
    """Until every worker has started, checking that none died on the way."""
    keys = [f"nanoqwen-worker-{rank}" for rank in range(1, len(processes) + 1)]
    deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
    while not store.check(keys):
        for rank, process in enumerate(processes, 1):
            if process.poll() is not None:
                raise WorkerFailure(describe_exit(rank, process, store) + " while starting")
        if time.monotonic() > deadline:
            raise WorkerFailure("tensor-parallel workers did not start in time")
        time.sleep(0.02)


def init_ranks(
    device: torch.device, rank: int, size: int, store: dist.Store | None
) -> dist.ProcessGroup:
    """Join the default process group (collectives of the model) and return the gloo group
    the steps are broadcast over, on which workers may wait idle indefinitely."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    init_method = None if store is not None else "env://"
    dist.init_process_group(backend, init_method=init_method, store=store, rank=rank,
                            world_size=size, timeout=COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of the rank that is `local_rank` on its machine: on GPUs, its own GPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_rank)


def check_devices(device: torch.device, size: int) -> None:
    if device.type != "cuda":
        return
    first, count = device.index or 0, torch.cuda.device_count()
    if first + size > count:
        raise ValueError(
            f"tensor_parallel_size={size} needs GPUs cuda:{first}..cuda:{first + size - 1}, "
            f"but this machine has {count}"
        )


def check_splittable_weights(checkpoint: Checkpoint, quantization: str | None) -> None:
    """A ValueError unless the weights can be split across ranks: each rank reads its
    slices of plain safetensors tensors and keeps them in the model's dtype."""
    kind, path = checkpoint.format_name, checkpoint.path
    if kind is not None:
        raise ValueError(
            "tensor parallelism reads each rank's slices of plain safetensors weights, "
            f"which a {kind} checkpoint does not have ({path}): use tensor_parallel_size=1 "
            "or a checkpoint of float weights"
        )
    if quantization not in (None, "none"):
        raise ValueError(
            f"quantization={quantization!r} does not work with tensor parallelism yet: "
            "use quantization='none' or tensor_parallel_size=1"
        )


def check_splittable_shape(
    num_heads: int, num_kv_heads: int, intermediate_size: int, size: int
) -> None:
    """A ValueError unless `size` ranks can each hold whole heads and an equal MLP slice."""
    name = f"tensor_parallel_size={size}"
    if num_heads % size:
        raise ValueError(f"{name} must divide the model's {num_heads} attention heads")
    kv = num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ValueError(
            f"{name} must divide the model's {kv} key/value heads or be a multiple of them, "
            "so that every rank holds whole key/value heads"
        )
    if intermediate_size % size:
        raise ValueError(f"{name} must divide the model's intermediate_size={intermediate_size}")
