"""Start-up's memory profile run on the CPU, in every rank of a split model.

On a GPU, start-up sizes the KV cache by running the worst step any schedule can make on
every rank and reading the CUDA allocator's counters (`runner/memory_profile.py`). A CPU
has no such counters, so start-up never profiles there. `profiling` wraps start-up's
sizing so that it runs the same profile first, with counters that read nothing: only
whether every rank can run the profile's steps is checked, not what they measure. A
split model's workers start in processes of their own: `start_rank_runner` installs the
wrapper there (pickled by name, as any rank's starter is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanoqwen.parallel import launch
from nanoqwen.runner import startup
from nanoqwen.runner.memory_profile import Overhead, measure_overheads
from nanoqwen.runner.runner import ModelRunner

# What each profile in this process measured (nothing: the counters read 0), in order.
PROFILED: list[Overhead] = []


class NoCounters:
    """Stands in for the CUDA allocator's counters, which a CPU does not have."""

    def allocated(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass

    def peak(self) -> int:
        return 0

    def free(self) -> int:
        return 2**60


def profiling(cache_memory: Callable[..., float]) -> Callable[..., float]:
    """Start-up's `cache_memory`, profiling the models' worst steps first as on a GPU."""

    def profiled(models: Any, parts: startup.RunnerParts, *args: Any) -> float:
        max_proposed = args[-1]
        PROFILED.append(measure_overheads(
            models, parts.runner, parts.backend_class, len(parts.buckets), parts.settings,
            NoCounters(), max_proposed,
        ))
        return cache_memory(models, parts, *args)

    return profiled


def start_rank_runner(*args: Any) -> ModelRunner:
    """A worker's start-up (`launch.start_rank_runner`), profiling as on a GPU."""
    startup.cache_memory = profiling(startup.cache_memory)
    return launch.start_rank_runner(*args)
