"""CPU threads that follow the cores other processes leave idle.

On a CPU every matmul of a step is an OpenMP parallel region: the work is split between
torch's threads, and the region ends when the last of them is done. A decode step is a
hundred-odd such regions, microseconds apart. Between them a thread either spins (and
starts the next region at once) or sleeps (and is woken, which on a VM costs tens of
microseconds per region: 25% of a step here). Spinning is the fast choice on idle cores and
the ruinous one on shared cores: when another process holds one of the cores, every region
waits for the thread that was descheduled, while its partner spins on the other core.
Measured on 2 cores, Qwen2.5-1.5B in bfloat16, batch-1 decode: quiet, 137 ms a token
spinning vs 180 ms sleeping; beside one busy process, 1,140 ms spinning on 2 threads,
227 ms sleeping on 2, 220 ms on 1 thread.

So nanoqwen spins briefly (`GOMP_SPINCOUNT`, set in `nanoqwen/__init__.py` before torch
loads OpenMP) and runs each step on as many threads as there are cores free:
`CpuThreads.step` reads at most twice a second how busy this process's cores were
(`/proc/stat`) less what this process used (`os.times`), and runs the step on the cores
left, between 1 and torch's thread count. What this process uses itself does not
count, so the choice does not flip with its own thread count.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

# How often the share of the cores is read again: often enough to yield a core within a
# second of another process starting, rarely enough to cost nothing (a read takes 34 us on
# 2 cores; between reads `adjust` costs a clock read).
INTERVAL_S = 0.5
# A core counts as free when other processes leave at least this share of it idle: on one
# they use more of, our thread would wait for them at the end of every parallel region.
FREE_ENOUGH = 0.75
PROC_STAT = Path("/proc/stat")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreTimes:
    """Seconds the cores we may run on were busy (anyone) and this process ran, at `wall`."""

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


def threads_for(cores: int, others: float, most: int) -> int:
    """Threads for `cores` cores of which other processes use `others` (in cores)."""
    free_cores = int(cores - others + (1 - FREE_ENOUGH))
    return max(1, min(most, free_cores))


class CpuThreads:
    """Runs each step on the cores other processes leave free (see above), then gives
    torch's thread count back as it found it: the count torch is set to is the most a step
    may use, and nothing outside the step sees a change.

    `step()` must be entered on the thread that runs the model: OpenMP's thread count is a
    per-thread setting.
    """

    def __init__(self, device: torch.device) -> None:
        # Linux's: the cores this process may run on, and how busy each was.
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.enabled = device.type == "cpu" and bool(self.cpus) and PROC_STAT.is_file()
        self.last = self._read() if self.enabled else None
        self.others = 0.0  # cores other processes used, as last read
        self.threads = torch.get_num_threads()  # what the last step ran on, for the log

    @contextmanager
    def step(self) -> Iterator[None]:
        given = torch.get_num_threads()
        if not self.enabled or given == 1:
            yield
            return
        self._read_share()
        threads = threads_for(len(self.cpus), self.others, given)
        if threads != self.threads:
            logger.info("running on %d CPU threads: other processes use %.1f of %d cores",
                        threads, self.others, len(self.cpus))
            self.threads = threads
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(given)

    def _read_share(self) -> None:
        """Update `others`, at most every `INTERVAL_S`."""
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
            process.user + process.system,
        )
