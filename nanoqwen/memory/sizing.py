"""How many KV pages to make: the arithmetic, apart from the measuring.

The KV cache is allocated once, at start-up, so its size is decided once, from what the
user asked for and what the device has:

* asked for in pages (`num_pages`) or bytes (`kv_cache_memory` above 1): as asked;
* on a GPU, by default, `gpu_memory_utilization` of the whole device, less what is in use
  (weights, the CUDA context) and less the `Overhead` the rest of the engine will need,
  which the runner measures by running its worst step (`runner/memory_profile.py`); a
  `kv_cache_memory` fraction takes that share of what is free once the overhead is set
  aside;
* on a CPU, which shares its RAM with everything else, what every sequence at full length
  could use, but never more than a stated share of the machine's RAM (of its total, not
  of what happens to be free at start-up, so that the cache is the same size every run);
  a `kv_cache_memory` fraction takes that share of what is available.

Every model that keeps K/V for the same tokens (a proposer's model beside the target) has a
cache with the same pages, so a page costs the sum of their bytes per page.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
# On the CPU the cache shares RAM with everything else: by default it takes at most this
# share of the machine's RAM.
CPU_KV_CACHE_FRACTION = 0.2


@dataclass(frozen=True)
class KVBudget:
    """What the user asked of the KV cache's size (`EngineConfig`'s fields of that name)."""

    num_pages: int | None = None
    kv_cache_memory: float | None = None  # bytes, or (at most 1) a fraction of free memory
    gpu_memory_utilization: float = 0.9

    @property
    def bytes_asked(self) -> float | None:
        memory = self.kv_cache_memory
        return memory if memory is not None and memory > 1 else None

    @property
    def fraction_asked(self) -> float | None:
        memory = self.kv_cache_memory
        return memory if memory is not None and memory <= 1 else None


@dataclass(frozen=True)
class WorstStep:
    """The largest step any schedule can make: `max_num_seqs` sequences at `max_model_len`,
    each decoding with `max_proposed` proposed tokens to verify, plus a full prefill chunk."""

    max_num_seqs: int
    chunk_size: int
    max_model_len: int
    max_proposed: int = 0


@dataclass
class Overhead:
    """GPU bytes the engine needs beside its weights and its KV cache."""

    resident: int = 0  # backend and graph-runner buffers, kept for good
    step: int = 0  # the worst step's activations, allocated and freed by every step
    graphs: int = 0  # the graph pool: the largest bucket's step, kept for good

    @property
    def total(self) -> int:
        return self.resident + self.step + self.graphs

    def __add__(self, other: Overhead) -> Overhead:
        return Overhead(self.resident + other.resident, self.step + other.step,
                        self.graphs + other.graphs)

    def __str__(self) -> str:
        return (
            f"{self.total / GIB:.2f} GiB (buffers {self.resident / GIB:.2f}, largest step "
            f"{self.step / GIB:.2f}, CUDA graphs {self.graphs / GIB:.2f})"
        )


def pages_for(memory: float, page_bytes: int) -> int:
    """How many pages `memory` bytes hold, plus the scratch page (at least one usable)."""
    return max(2, int(memory // page_bytes) + 1)


def cpu_kv_memory(
    total: float, available: float, fraction: float | None, worst: WorstStep, page_size: int,
    page_bytes: int,
) -> float:
    """Bytes for the cache on a CPU with `total` bytes of RAM, `available` of them free
    (this rank's shares of both)."""
    if fraction is not None:
        return fraction * available
    pages_per_sequence = -(-worst.max_model_len // page_size)
    every_sequence_full = worst.max_num_seqs * pages_per_sequence * page_bytes
    return min(CPU_KV_CACHE_FRACTION * total, every_sequence_full)


def gpu_kv_memory(
    free: int, total: int, overhead: Overhead, fraction: float | None, utilization: float
) -> float:
    """Bytes the KV cache may take on a GPU: `fraction` of the memory that is free once
    the overhead is set aside, or by default `utilization` of the whole GPU less what is
    in use and the overhead. Raises if nothing is left."""
    if fraction is not None:
        budget = fraction * (free - overhead.total)
        asked = f"kv_cache_memory={fraction} of the {free / GIB:.2f} GiB free"
    else:
        budget = utilization * total - (total - free) - overhead.total
        asked = (
            f"gpu_memory_utilization={utilization} of {total / GIB:.2f} GiB, with "
            f"{(total - free) / GIB:.2f} GiB in use"
        )
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {asked}, less {overhead} for the rest of "
            "the engine; lower max_num_seqs, max_model_len or chunk_size, or give it more memory"
        )
    return budget
