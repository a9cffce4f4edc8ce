"""CPU threads that follow the cores others (other processes, our own side threads) leave idle.

On a CPU every matmul of a step is an OpenMP parallel region: the work is split between
torch's threads, and the region ends when the last of them is done. A decode step is a
hundred-odd such regions, microseconds apart. Between them a thread either spins (and
starts the next region at once) or sleeps (and is woken, which on a VM costs tens of
microseconds per region). Spinning is the fast choice on idle cores and the ruinous one on
shared cores: when another process holds one of the cores, every region waits for the
thread that was descheduled, while its partner spins on the other.

So nanoqwen spins briefly (`GOMP_SPINCOUNT`, set in `nanoqwen/__init__.py` before torch
loads OpenMP) and runs each step on as many threads as there are cores free:
`CpuThreads.step` reads at most twice a second how busy this process's cores were
(`/proc/stat`) less what the steps themselves used, and runs the step on the cores left,
between 1 and torch's thread count. The steps' own use is this process's time
(`os.times`) less that of its other Python threads (`/proc/self/task`): a server's request
handlers, which parse and tokenize, take cores from a step as another process would, while
the step's OpenMP threads do not count, so the choice does not flip with its own count.
The measurements behind these choices: docs/benchmarks.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

# How often the share of the cores is read again: often enough to yield a core within a
# second of another process starting, rarely enough to cost nothing (between reads, a step
# only reads the clock).
INTERVAL_S = 0.5
# A core counts as free when others leave at least this share of it idle: on one
# they use more of, our thread would wait for them at the end of every parallel region.
FREE_ENOUGH = 0.75
PROC_STAT = Path("/proc/stat")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreTimes:
    """Seconds the cores we may run on were busy (anyone) and the steps ran, at `wall`."""

    wall: float
    busy: float
    ours: float


def busy_seconds(stat: str, cpus: set[int]) -> float:
    """Busy time of the given cores from `/proc/stat`'s text: all but idle and iowait."""
    ticks = 0
    for line in stat.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields[:8])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


def thread_seconds(native_id: int) -> float | None:
    """CPU seconds one thread of this process has run (`/proc/self/task/<id>/stat`'s user
    and system time), or None once it has ended."""
    try:  # os.open, not pathlib: a few times cheaper per thread, twice a second
        descriptor = os.open(f"/proc/self/task/{native_id}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        stat = os.read(descriptor, 4096)
    except OSError:  # it ended in between
        return None
    finally:
        os.close(descriptor)
    return task_seconds(stat)


def task_seconds(stat: bytes) -> float | None:
    """User plus system seconds from a `/proc/.../stat` line (None if it is cut short)."""
    fields = stat.rsplit(b")", 1)[-1].split()  # after "pid (name)": a name may hold ") "
    if len(fields) < 13:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads_for(cores: int, others: float, most: int) -> int:
    """Threads for `cores` cores of which others (other processes, this one's other Python
    threads) use `others` (in cores)."""
    free_cores = int(cores - others + (1 - FREE_ENOUGH))
    return max(1, min(most, free_cores))


class CpuThreads:
    """Runs each step on the cores others leave free (see above), then gives
    torch's thread count back as it found it: the count torch is set to is the most a step
    may use, and nothing outside the step sees a change.

    `step()` must be entered on the thread that runs the model, always the same one:
    OpenMP's thread count is a per-thread setting, and every other Python thread counts as
    someone else's.
    """

    def __init__(self, device: torch.device) -> None:
        # Linux's: the cores this process may run on, and how busy each was.
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.enabled = device.type == "cpu" and bool(self.cpus) and PROC_STAT.is_file()
        self.last: CoreTimes | None = None  # first read in the first step, on its thread
        self.others = 0.0  # cores' worth others used, as last read
        # This process's other Python threads: CPU seconds by native id as last read, and
        # what they ran in all (see `_side_seconds`).
        self.side_threads: dict[int, float] = {}
        self.side_total = 0.0
        self.threads = torch.get_num_threads()  # what the last step ran on
        self.reduced_steps = 0  # steps run on fewer threads than torch's count

    @contextmanager
    def step(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        given = torch.get_num_threads()
        if given > 1:  # with one thread there is nothing to share: no read
            self._read_share()
        threads = threads_for(len(self.cpus), self.others, given)
        if threads != self.threads:
            logger.info("running on %d CPU threads: others use %.1f of %d cores",
                        threads, self.others, len(self.cpus))
        self.threads = threads
        self.reduced_steps += threads < given
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(given)

    def stats_group(self) -> dict[str, dict[str, float]]:
        """The `cpu` group of `LLMEngine.stats()` (keys in `nanoqwen/stats.py`); none off a
        CPU, where nothing is chosen."""
        if not self.enabled:
            return {}
        return {
            "cpu": {
                "cores": len(self.cpus),
                "threads": self.threads,
                "others_cores": self.others,
                "reduced_steps": self.reduced_steps,
            }
        }

    def _read_share(self) -> None:
        """Update `others`, at most every `INTERVAL_S`."""
        if self.last is None:
            self.last = self._read()
            return
        if time.monotonic() - self.last.wall < INTERVAL_S:
            return
        now = self._read()
        elapsed = now.wall - self.last.wall
        others_busy = (now.busy - self.last.busy) - (now.ours - self.last.ours)
        self.others = max(0.0, others_busy / elapsed)
        self.last = now

    def _read(self) -> CoreTimes:
        process = os.times()
        return CoreTimes(
            time.monotonic(), busy_seconds(PROC_STAT.read_text(), self.cpus),
            process.user + process.system - self._side_seconds(),
        )

    def _side_seconds(self) -> float:
        """CPU seconds this process's Python threads other than the caller have run, as a
        running total whose growth between reads is what a server's handlers took from the
        cores. A thread's last moments before it ends are missed (counted as the steps')."""
        caller = threading.get_native_id()
        now = {}
        for thread in threading.enumerate():
            if thread.native_id is not None and thread.native_id != caller:
                seconds = thread_seconds(thread.native_id)
                if seconds is not None:
                    now[thread.native_id] = seconds
        # A thread first seen now started since the last read: all its time is new.
        for native_id, seconds in now.items():
            self.side_total += seconds - self.side_threads.get(native_id, 0.0)
        self.side_threads = now
        return self.side_total
