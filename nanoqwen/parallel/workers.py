"""Rank 0's handle on the other ranks of a split model: send steps, notice deaths, stop.

Rank 0 is the caller's process and alone has the engine: requests, scheduler, prefix
cache, tokenizer, sampler. The other ranks (`launch.py` starts them; `worker.py` is their
life) only run forward passes, each over its slice of the weights with a KV cache of its
heads. With the same page tables everywhere, each rank's cache mirrors rank 0's page for
page: page accounting happens once, on rank 0.

* **One broadcast per step** (`step_broadcast.py`): rank 0 sends the flattened batch and
  every rank runs the forward pass on it.
* **Failure.** A dead worker fails the engine, never hangs it: a thread per worker waits
  for its process and records which one died and how (a worker that fails says why in
  the rendezvous store first); gloo notices a vanished peer at once (NCCL is aborted);
  from then on every step raises `WorkerFailure` at once. Workers exit when rank 0's end
  of their stdin closes, however rank 0 ends. Collectives also time out, as a last resort
  against a rank that hangs.
* **Interrupts.** A step is a chain of collectives every rank must finish: Ctrl-C on
  rank 0 lands when the step ends (a second one at once, leaving the ranks out of step
  for good); workers ignore it.
* **Shutdown.** `Workers.shutdown` (also run at exit) tells the workers to stop, gives
  them a few seconds, then terminates whatever is left.
"""

from __future__ import annotations

import atexit
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nanoqwen.parallel.step_broadcast import STEP_WIRE, WireStep, send_step, send_stop

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a rank stuck inside a step: the last resort
IDLE_TIMEOUT = timedelta(days=365)  # workers wait for the next step as long as it takes
STARTUP_TIMEOUT = timedelta(minutes=5)
NO_MORE_STEPS = "; the tensor-parallel ranks cannot run more steps"
STOP_SECONDS = 5.0  # how long stopped workers get to exit before they are terminated
# After a failed collective, how long to wait for the watcher to say which worker died.
DEATH_NOTICE_SECONDS = 2.0


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died, or the ranks fell out of step: the engine is done."""


def failure_key(rank: int) -> str:
    """Where a worker leaves the reason it failed, in the rendezvous store."""
    return f"nanoqwen-worker-{rank}-failure"


class Workers:
    """Rank 0's handle on the other ranks: send steps, guard them, notice deaths, stop."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        processes: list[subprocess.Popen] | None = None,
        store: dist.Store | None = None,  # where failing workers leave their reasons
        cpu_threads: int | None = None,  # rank 0's torch threads before it shared the cores
    ) -> None:
        self.group, self.wire, self.store = group, STEP_WIRE, store
        self.processes = processes or []
        self.cpu_threads = cpu_threads
        self.failure: str | None = None  # set once the ranks can no longer run steps
        self._died = threading.Event()
        # One step at a time on the group, and no stop in the middle of one (a server
        # steps on its engine thread while the main thread may be exiting).
        self._step_lock = threading.Lock()
        self._closed = False
        for rank, process in enumerate(self.processes, 1):
            threading.Thread(
                target=self._watch, args=(rank, process), name=f"nanoqwen-rank{rank}-watch",
                daemon=True,
            ).start()
        atexit.register(self.shutdown)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def broadcast(self, step: WireStep) -> None:
        """Send a step to every other rank."""
        send_step(step, self.wire, self.group)

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

    def explain(self, error: BaseException) -> BaseException:
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

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        """Wait for one worker to exit; unless we are shutting down, that is a failure."""
        process.wait()
        if self._closed or self._died.is_set():
            return
        # A death is the cause of whatever else failed: it replaces an earlier reason.
        self.failure = describe_exit(rank, process, self.store) + NO_MORE_STEPS
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
                send_stop(self.wire, self.group)
        # Workers out of step with rank 0 would never see a stop: terminate them now.
        stop_processes(self.processes, STOP_SECONDS if in_lockstep else 0.0)
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


def describe_exit(rank: int, process: subprocess.Popen, store: dist.Store | None) -> str:
    code = process.wait()
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    if store is not None:
        with suppress(Exception):  # the store is rank 0's own: only a bug would fail here
            if store.check([failure_key(rank)]):
                how += f": {store.get(failure_key(rank)).decode()}"
    return f"tensor-parallel worker {rank} (pid {process.pid}) {how}"


def abort_nccl() -> None:
    """NCCL would wait for a dead peer until its timeout; aborting the communicators makes
    the collectives in flight fail now. (gloo fails by itself when a peer's socket closes.)"""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        with suppress(Exception):
            dist.distributed_c10d._abort_process_group()


def stop_processes(processes: list[subprocess.Popen], grace_seconds: float = 0.0) -> None:
    """Close each worker's lifeline (its stdin), wait up to `grace_seconds` for the
    processes to exit, then terminate the rest."""
    for process in processes:
        if process.stdin is not None:
            with suppress(OSError):
                process.stdin.close()
    deadline = time.monotonic() + grace_seconds
    for process in processes:
        with suppress(subprocess.TimeoutExpired):
            process.wait(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.poll() is None:
            process.terminate()
            with suppress(subprocess.TimeoutExpired):
                process.wait(1.0)
        if process.poll() is None:
            process.kill()
            process.wait()


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
