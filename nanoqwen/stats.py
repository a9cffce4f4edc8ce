"""What `LLMEngine.stats()` reports: the engine's own counters, one group per thing counted.

A serving engine is watched through a handful of figures: how full the KV cache is, how
many requests run and wait, how much the prefix cache saves. `stats()` returns them as a
dict of groups, each a dict of plain numbers (or of counts by cause), so a script, the
chat's `/stats`, the benchmark and the Prometheus page (`metrics.py`) all read the same
figures. A group exists only while its feature is on: no `prefix_cache` group without the
prefix cache, and an optional feature adds its group itself (the proposer's, through
the step hook's `stats_group()`, documented there). Counts run from the engine's start; "now"
marks a value of this moment.

| group | key | meaning |
|---|---|---|
| `kv_cache` | `pages_total` | pages requests can hold (the pool has one more, the scratch page) |
| | `pages_used` | now held by requests |
| | `pages_cached` | now held only by the prefix cache: reusable, evicted when pages run out |
| | `pages_free` | now free |
| | `page_size` | tokens per page |
| | `capacity_tokens` | `pages_total × page_size`: tokens of K/V the cache holds at once |
| | `bytes` | the KV tensors' memory, every rank's together (a quantized cache's scales too) |
| `requests` | `running` | now in the running batch |
| | `waiting` | now queued for admission (preempted ones included) |
| | `finished` | by reason: `stop`, `length`, `abort`, `error` |
| | `preemptions` | running requests preempted (pages released, recomputed later) |
| | `preemptions_by_cause` | `kv_pages`: out of pages; `max_num_seqs`: a more urgent one came |
| | `deadlines_met` | requests with a `deadline` that finished by it |
| | `deadlines_missed` | requests with a `deadline` that finished (or were aborted) after it |
| `tokens` | `prompt` | prompt tokens received |
| | `generated` | tokens generated |
| `prefix_cache` | `query_tokens` | prompt tokens looked up in the cache |
| | `hit_tokens` | of them, those whose K/V was reused |
| | `hit_rate` | `hit_tokens / query_tokens` (0 before any lookup) |
| | `evicted_pages` | cached pages evicted to make room |
| `state_pool` | `slots_total` | slots of the state pool (a model with recurrent layers only) |
| | `slots_running` | now held by running requests |
| | `slots_snapshots` | now holding prefix snapshots: reusable, evicted when slots run out |
| | `slots_free` | now free |
| `swap` | `swaps_out` | preempted requests whose pages were copied to host memory (`preemption_mode="swap"` only) |
| | `swaps_in` | admissions that copied pages back (those the prefix cache had lost meanwhile) |
| | `pages_out` | pages copied out |
| | `pages_in` | pages copied back |
| | `recomputed` | preemptions that found the host pool full: recomputed instead |
| | `host_pages_total` | pages the host pool holds (`swap_space` over a page's bytes) |
| | `host_pages_used` | now held by swapped-out requests |
| | `host_bytes` | the host pool's memory |
| `cpu` | `cores` | cores this process may run on (on a CPU only; rank 0's, with split ranks) |
| | `threads` | threads the last step ran on (`runner/cpu_threads.py`) |
| | `others_cores` | cores' worth of time others took, as last read: other processes and this one's other Python threads (a server's handlers) |
| | `reduced_steps` | steps run on fewer threads than torch's count, to leave others a core |
| `memory` | `resident_bytes` | now resident in RAM: this process's (rank 0's, with split ranks) |
| | `weight_bytes` | the model's weights, every rank's (quantized: codes and scales) |
| | `kv_total_bytes` | the `pages_total` pages' bytes (`kv_cache.bytes` less the scratch page) |
| | `kv_used_bytes` | of them, the `pages_used` pages' |
| | `kv_cached_bytes` | the `pages_cached` pages' |
| | `kv_free_bytes` | the `pages_free` pages': used + cached + free = total |
| | `state_pool_bytes` | the state pool's tensors, every rank's (a model with recurrent layers only) |
| | `cuda_allocated_bytes` | now in tensors on the GPU (CUDA only: rank 0's GPU, as torch counts) |
| | `cuda_reserved_bytes` | now held by torch's caching allocator there (allocated, and spare) |

The `memory` group says where the bytes go. On a CPU the process's resident memory holds
everything: weights, KV cache, activations, Python. On a GPU the weights and the KV cache
are in what torch allocated there, and what it reserved beyond that is memory it keeps for
reuse, which no other process can have while the engine runs.
"""

from __future__ import annotations

import weakref
from typing import Any

import psutil
import torch
from torch import nn

from nanoqwen.memory.page_allocator import PageAllocator
from nanoqwen.memory.radix_cache import RadixCache
from nanoqwen.runner.runner import ModelRunner
from nanoqwen.scheduling.scheduler import Scheduler

Stats = dict[str, dict[str, Any]]
PAGE_STATES = ("total", "used", "cached", "free")
# Counting the weights walks every module, milliseconds for a large model, and they never
# change once loaded, while `stats()` may be read every step (bench.py does): once a model.
_weight_bytes: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def kv_cache_group(allocator: PageAllocator, kv_cache_bytes: int) -> dict[str, int]:
    free, cached = allocator.num_free_pages, allocator.num_cache_only_pages
    total = allocator.num_usable_pages
    return {
        "pages_total": total,
        "pages_used": total - free - cached,
        "pages_cached": cached,
        "pages_free": free,
        "page_size": allocator.page_size,
        "capacity_tokens": total * allocator.page_size,
        "bytes": kv_cache_bytes,
    }


def scheduling_groups(scheduler: Scheduler, finished: dict[str, int]) -> Stats:
    """The `requests` group, and the `swap` group when preemption swaps
    (`scheduling/swapping.py`)."""
    requests = {
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "finished": dict(finished),
        "preemptions": sum(scheduler.preemptions.values()),
        "preemptions_by_cause": dict(scheduler.preemptions),
        "deadlines_met": scheduler.deadlines["met"],
        "deadlines_missed": scheduler.deadlines["missed"],
    }
    swapping = getattr(scheduler, "stats_group", None)  # only a swapping scheduler has one
    return {"requests": requests, **({} if swapping is None else swapping())}


def state_pool_group(states: Any) -> Stats:
    """The `state_pool` group (`memory/state_pool.py`'s `StateSlots`), or nothing for a
    model without recurrent layers."""
    if states is None:
        return {}
    return {
        "state_pool": {
            "slots_total": states.num_slots,
            "slots_running": states.num_running,
            "slots_snapshots": len(states.snapshots),
            "slots_free": len(states.free),
        }
    }


def prefix_cache_group(cache: RadixCache | None) -> Stats:
    """The `prefix_cache` group, or nothing when the engine runs without one."""
    if cache is None:
        return {}
    query, hits = cache.query_tokens, cache.hit_tokens
    return {
        "prefix_cache": {
            "query_tokens": query,
            "hit_tokens": hits,
            "hit_rate": hits / query if query else 0.0,
            "evicted_pages": cache.evicted_pages,
        }
    }


def memory_group(runner: ModelRunner, allocator: PageAllocator, num_ranks: int) -> Stats:
    """The `memory` group: the bytes of the process, the weights (every rank's), the KV
    cache by page state, the state pool and, on CUDA, torch's GPU memory."""
    kv_bytes = runner.kv_cache.nbytes * num_ranks
    kv = kv_cache_group(allocator, kv_bytes)
    page_bytes = kv_bytes // allocator.num_pages  # the pool: scratch page too
    group = {
        "resident_bytes": psutil.Process().memory_info().rss,
        "weight_bytes": weight_bytes(runner.model) * num_ranks,
        **{f"kv_{state}_bytes": kv[f"pages_{state}"] * page_bytes for state in PAGE_STATES},
    }
    if runner.states is not None:
        group["state_pool_bytes"] = runner.states.nbytes * num_ranks
    if runner.device.type == "cuda":
        group["cuda_allocated_bytes"] = torch.cuda.memory_allocated(runner.device)
        group["cuda_reserved_bytes"] = torch.cuda.memory_reserved(runner.device)
    return {"memory": group}


def weight_bytes(model: nn.Module) -> int:
    """This rank's weight bytes (`weight_memory_bytes`), counted once per model."""
    if model not in _weight_bytes:
        from nanoqwen.weights.quantization import weight_memory_bytes

        _weight_bytes[model] = weight_memory_bytes(model)
    return _weight_bytes[model]
