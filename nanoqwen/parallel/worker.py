"""A worker process of a split model: `python -m nanoqwen.parallel.worker`, job on stdin.

`launch.py` starts one per rank but 0 and writes it a pickled `WorkerJob`. The worker
joins the ranks, builds its runner (its slice of the model, its KV cache, sized in step
with the others), tells rank 0 it is up, and serves steps until rank 0 says stop. Its
stdin stays open as a lifeline: when it closes (rank 0 exited, however it ended) the
worker exits at once. Ctrl-C reaches every process of a terminal's group; rank 0 decides
what it means, so workers ignore it. A worker that fails leaves the reason in the
rendezvous store, where rank 0 reads it to say which rank died and why.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
from contextlib import suppress
from functools import partial

import torch
import torch.distributed as dist

from nanoqwen.model.layers import TensorParallel
from nanoqwen.parallel.launch import Ranks, WorkerJob, init_ranks
from nanoqwen.parallel.split_runner import forward_from_wire
from nanoqwen.parallel.step_broadcast import STEP_WIRE, serve_steps
from nanoqwen.parallel.workers import STARTUP_TIMEOUT, failure_key


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    job: WorkerJob = pickle.load(sys.stdin.buffer)
    threading.Thread(target=exit_with_parent, daemon=True).start()
    store = dist.TCPStore("127.0.0.1", job.store_port, job.size, is_master=False,
                          timeout=STARTUP_TIMEOUT)
    try:
        if job.threads is not None:
            torch.set_num_threads(job.threads)
        store.set(f"nanoqwen-worker-{job.rank}", "up")
        group = init_ranks(job.device, job.rank, job.size, store)
        runner = job.start_runner(Ranks(TensorParallel(job.rank, job.size), job.device))
        serve_steps(partial(forward_from_wire, runner), STEP_WIRE, group)
        dist.destroy_process_group()
    except BaseException as error:
        with suppress(Exception):
            store.set(failure_key(job.rank), f"{type(error).__name__}: {error}")
        raise


def exit_with_parent() -> None:
    """Return only when rank 0 is gone (its end of our stdin closed), then exit at once."""
    with suppress(OSError):
        while sys.stdin.buffer.read(1 << 16):
            pass
    os._exit(1)


if __name__ == "__main__":
    main()
