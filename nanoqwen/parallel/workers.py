"""Running one model on N ranks: the worker processes, and what crosses between them.

How the model is split is `parallel.py`; this module is the plumbing around it.

* **Who runs what.** Rank 0 is the caller's process and alone has the engine: requests,
  scheduler, prefix cache, tokenizer, sampler. `launch` starts the other N-1 ranks
  (`torch.multiprocessing`, spawn), each a `ModelRunner` over its slice of the weights
  with a KV pool of its heads. Under `torchrun` the N processes exist already: all run
  the same script, and in every rank but 0 `LLM(...)` serves steps until rank 0 stops.
* **One broadcast per step** (`step_broadcast.py`): rank 0 sends the flattened batch and
  every rank runs the forward pass on it. With the same page tables everywhere, each
  pool mirrors rank 0's page for page: page accounting happens once, on rank 0.
* **Failure.** A dead worker fails the engine, never hangs it: a thread on rank 0 waits
  on the worker processes and records which one died and how; gloo notices a vanished
  peer at once (NCCL is aborted); from then on every step raises `WorkerFailure` at once.
  Workers exit when rank 0's end of their pipe closes. Collectives also time out, as a
  last resort against a rank that hangs.
* **Interrupts.** A step is a chain of collectives every rank must finish: Ctrl-C on
  rank 0 lands when the step ends (a second one at once, leaving the ranks out of step
  for good); workers ignore it.
* **Shutdown.** `Workers.shutdown` (also run at exit) tells the workers to stop, gives
  them a few seconds, then terminates whatever is left.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoqwen.config import EngineConfig
from nanoqwen.parallel.sharding import TensorParallel
from nanoqwen.parallel.step_broadcast import (
    ShardRunner,
    send_step,
    send_stop,
    serve_steps,
    to_device,
)
from nanoqwen.runner.step_inputs import StepInputs

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a rank stuck inside a step: the last resort
IDLE_TIMEOUT = timedelta(days=365)  # workers wait for the next step as long as it takes
STARTUP_TIMEOUT = timedelta(minutes=5)
NO_MORE_STEPS = "; the tensor-parallel ranks cannot run more steps"
STOP_SECONDS = 5.0  # how long stopped workers get to exit before they are terminated
# After a failed collective, how long to wait for the watcher to say which worker died.
DEATH_NOTICE_SECONDS = 2.0


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died, or the ranks fell out of step: the engine is done."""


RunnerFactory = Callable[..., ShardRunner]


# --------------------------------------------------------------------------- rank 0
class Workers:
    """Rank 0's handle on the other ranks: send steps, guard them, notice deaths, stop."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        processes: list[BaseProcess] | None = None,
        pipes: list[Connection] | None = None,
        cpu_threads: int | None = None,  # rank 0's torch threads before it shared the cores
    ) -> None:
        self.group = group
        self.processes, self.pipes = processes or [], pipes or []
        self.cpu_threads = cpu_threads
        self.failure: str | None = None  # set once the ranks can no longer run steps
        self._died = threading.Event()
        # One step at a time on the group, and no stop in the middle of one (a server
        # steps on its engine thread while the main thread may be exiting).
        self._step_lock = threading.Lock()
        self._closed = False
        if self.processes:
            threading.Thread(target=self._watch, name="nanoqwen-tp-watch", daemon=True).start()
        atexit.register(self.shutdown)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def broadcast(self, inputs: StepInputs, device: torch.device) -> StepInputs:
        """Send a step to every rank; return it on rank 0's device."""
        send_step(inputs, self.group)
        return to_device(inputs, device)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one step on every rank: fail fast once broken, finish the step before
        Ctrl-C, and treat any error inside as the end of the ranks' lockstep."""
        with self._step_lock, deferred_interrupt():
            if self.failure is not None:
                raise WorkerFailure(self.failure)
            try:
                yield
            except KeyboardInterrupt:
                self.abandon("a step was interrupted on rank 0 while the other ranks ran it")
                raise
            except Exception as error:
                self.abandon(f"a step failed on rank 0 ({type(error).__name__}: {error})")
                raise self.explain(error)

    def explain(self, error: Exception) -> Exception:
        """`error`, or if it was a collective that lost its peer, a `WorkerFailure` saying
        which worker died. (gloo reports the lost peer before the watcher sees the exit.)"""
        if isinstance(error, RuntimeError) and self.processes:
            if self._died.wait(DEATH_NOTICE_SECONDS):
                failure = WorkerFailure(self.failure)
                failure.__cause__ = error
                return failure
        return error

    def abandon(self, reason: str) -> None:
        """The ranks are out of step: later steps fail at once, and shutdown terminates the
        workers instead of asking them to stop."""
        if self.failure is None:
            self.failure = reason + NO_MORE_STEPS

    def _watch(self) -> None:
        """Wait for any worker to exit; unless we are shutting down, that is a failure."""
        by_sentinel = {process.sentinel: rank for rank, process in enumerate(self.processes, 1)}
        rank = by_sentinel[wait(list(by_sentinel))[0]]
        if self._closed:
            return
        process, pipe = self.processes[rank - 1], self.pipes[rank - 1]
        process.join()
        # A death is the cause of whatever else failed: it replaces an earlier reason.
        self.failure = describe_exit(rank, process, pipe) + NO_MORE_STEPS
        self._died.set()
        abort_nccl()

    def shutdown(self) -> None:
        """Stop every other rank (terminating those that do not stop), release the group."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        between_steps = self._step_lock.acquire(timeout=STOP_SECONDS)
        if not between_steps:
            self.abandon("shut down in the middle of a step")
        try:
            self._stop()
        finally:
            self.abandon("the engine was shut down")  # so that a later step fails at once
            if between_steps:
                self._step_lock.release()

    def _stop(self) -> None:
        in_lockstep = self.failure is None
        if in_lockstep:
            with suppress(Exception):  # a worker that is gone already is terminated below
                send_stop(self.group)
        # Workers out of step with rank 0 would never see a stop: terminate them now.
        stop_processes(self.processes, STOP_SECONDS if in_lockstep else 0.0)
        for pipe in self.pipes:
            pipe.close()
        if dist.is_initialized():
            with suppress(Exception):
                dist.destroy_process_group()
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)


@contextmanager
def starting(workers: Workers | None) -> Iterator[None]:
    """Around rank 0's own start-up: should it fail, the workers are stopped too, and a
    worker that died first is the error."""
    try:
        yield
    except BaseException as error:
        if workers is None:
            raise
        if isinstance(error, Exception):
            error = workers.explain(error)
        workers.abandon(f"rank 0 failed to start ({type(error).__name__})")
        workers.shutdown()
        raise error


def describe_exit(rank: int, process: BaseProcess, pipe: Connection) -> str:
    # If another thread joining it has just reaped it, its exit code shows up a moment later.
    deadline = time.monotonic() + 1.0
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    code = process.exitcode or 0
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    with suppress(EOFError, OSError):
        if pipe.poll():
            how += f": {pipe.recv()}"
    return f"tensor-parallel worker {rank} (pid {process.pid}) {how}"


def abort_nccl() -> None:
    """NCCL would wait for a dead peer until its timeout; aborting the communicators makes
    the collectives in flight fail now. (gloo fails by itself when a peer's socket closes.)"""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        with suppress(Exception):
            dist.distributed_c10d._abort_process_group()


def stop_processes(processes: list[BaseProcess], grace_seconds: float = 0.0) -> None:
    """Wait up to `grace_seconds` for the processes to exit, then terminate the rest."""
    deadline = time.monotonic() + grace_seconds
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(1.0)
        if process.is_alive():
            process.kill()
            process.join()


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) until the block ends; a second one interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals only ever reach the main thread
        return
    pending: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending and previous is not signal.SIG_IGN:
        if callable(previous):
            previous(signal.SIGINT, None)
        else:
            signal.raise_signal(signal.SIGINT)


# --------------------------------------------------------------------------- start-up
def launch(
    config: EngineConfig, make_runner: RunnerFactory, runner_args: tuple[Any, ...]
) -> tuple[TensorParallel, EngineConfig, Workers]:
    """Bring up all `config.tensor_parallel_size` ranks; return rank 0's part: its rank,
    its config (its device) and its handle on the others.

    The other ranks build `make_runner(their config, *runner_args, tp=...)` and serve steps.
    """
    size = config.tensor_parallel_size
    if dist.is_initialized():
        raise ValueError(
            "torch.distributed is already in use in this process: run one tensor-parallel "
            "engine per process (shut the previous one down first)"
        )
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return join_torchrun(config, make_runner, runner_args)
    check_devices(config.device, size)
    threads = cpu_threads = None
    if config.device.type == "cpu":  # the ranks share the cores
        cpu_threads = torch.get_num_threads()
        threads = max(1, cpu_threads // size)
        torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                          timeout=STARTUP_TIMEOUT)
    context = mp.get_context("spawn")
    processes, pipes = [], []
    try:
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            args = (rank, size, store.port, theirs, rank_config(config, rank), make_runner,
                    runner_args, threads)
            process = context.Process(target=worker_main, args=args, daemon=True,
                                      name=f"nanoqwen-tp-rank{rank}")
            process.start()
            theirs.close()  # so that the worker alone holds its end: it sees us exit
            processes.append(process)
            pipes.append(ours)
        wait_for_workers(store, processes, pipes)
        config = rank_config(config, 0)
        group = init_ranks(config.device, 0, size, store)
    except BaseException:
        stop_processes(processes)
        if cpu_threads is not None:
            torch.set_num_threads(cpu_threads)
        raise
    return TensorParallel(0, size), config, Workers(group, processes, pipes, cpu_threads)


def join_torchrun(
    config: EngineConfig, make_runner: RunnerFactory, runner_args: tuple[Any, ...]
) -> tuple[TensorParallel, EngineConfig, Workers]:
    """Under torchrun (env:// rendezvous): every process runs this; only rank 0 returns."""
    size, world = config.tensor_parallel_size, int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(
            f"tensor_parallel_size={size} but torchrun started {world} processes (WORLD_SIZE)"
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    config = rank_config(config, local_rank)
    group = init_ranks(config.device, rank, size, store=None)
    tp = TensorParallel(rank, size)
    if rank == 0:
        return tp, config, Workers(group)
    serve_steps(make_runner(config, *runner_args, tp=tp), group)
    dist.destroy_process_group()
    raise SystemExit(0)  # this process was only ever a worker


def worker_main(
    rank: int,
    size: int,
    port: int,
    parent: Connection,
    config: EngineConfig,
    make_runner: RunnerFactory,
    runner_args: tuple[Any, ...],
    threads: int | None,
) -> None:
    """A spawned worker process, from start-up to rank 0's stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process; rank 0 decides
    threading.Thread(target=exit_with_parent, args=(parent,), daemon=True).start()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=STARTUP_TIMEOUT)
        store.set(f"nanoqwen-worker-{rank}", "up")
        group = init_ranks(config.device, rank, size, store)
        serve_steps(make_runner(config, *runner_args, tp=TensorParallel(rank, size)), group)
        dist.destroy_process_group()
    except BaseException as error:
        with suppress(OSError):
            parent.send(f"{type(error).__name__}: {error}")
        raise


def exit_with_parent(parent: Connection) -> None:
    """Return only when rank 0 is gone (its end of the pipe closed), then exit at once."""
    with suppress(EOFError, OSError):
        parent.recv()
    os._exit(1)


def wait_for_workers(
    store: dist.TCPStore, processes: list[BaseProcess], pipes: list[Connection]
) -> None:
    """Until every worker has started, checking that none died on the way."""
    keys = [f"nanoqwen-worker-{rank}" for rank in range(1, len(processes) + 1)]
    deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
    while not store.check(keys):
        for rank, (process, pipe) in enumerate(zip(processes, pipes), 1):
            if not process.is_alive():
                raise WorkerFailure(describe_exit(rank, process, pipe) + " while starting")
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


def rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    """The settings of the rank that is `local_rank` on its machine: on GPUs, its own GPU."""
    if config.device.type != "cuda":
        return config
    return dataclasses.replace(
        config, device=torch.device("cuda", (config.device.index or 0) + local_rank)
    )


def check_devices(device: torch.device, size: int) -> None:
    if device.type != "cuda":
        return
    first, count = device.index or 0, torch.cuda.device_count()
    if first + size > count:
        raise ValueError(
            f"tensor_parallel_size={size} needs GPUs cuda:{first}..cuda:{first + size - 1}, "
            f"but this machine has {count}"
        )
