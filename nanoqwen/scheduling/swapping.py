"""Preemption by swapping: a preempted request's pages wait in host memory, not recomputed.

The core scheduler preempts by recompute: a victim's pages are released, its full pages
left to the prefix cache, and when it resumes it computes again whatever the cache lost
meanwhile. `SwappingScheduler` adds a host copy (`memory/swap.py`) and changes nothing
else:

* **swap out**, when a request is preempted: the full pages of its computed tokens are
  copied to the host pool before the usual release. If the pool has too few free pages,
  nothing is copied: that request falls back to recompute.
* **swap in**, when it is admitted again: the prefix cache is asked first, and only the
  pages it no longer holds are copied back, into free pages (evicting cached ones), and
  handed to the prefix cache; the usual admission then finds the whole prefix there, as
  any cache hit. The tokens past the last full page (fewer than a page) are recomputed.

So the copy goes back through the same door as a cache hit, and admission, page
accounting and preemption stay the core's. The host copy is dropped once the request runs
again, or when it finishes (an abort, say) while waiting.

Models with recurrent layers are refused: their state slot would have to be swapped and
restored exactly at the page boundary too (use recompute).

Invariant: the host pages held are exactly those of the swapped-out requests, waiting ones
only. Counted in `stats()["swap"]`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from nanoqwen.memory.kv_cache import KVCache
from nanoqwen.memory.swap import HostKVPool
from nanoqwen.scheduling.request import Request, Status
from nanoqwen.scheduling.scheduler import Row, Scheduler

SWAP_COUNTS = ("swaps_out", "swaps_in", "pages_out", "pages_in", "recomputed")


class SwappingScheduler(Scheduler):
    def __init__(self, host: HostKVPool, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.host = host
        self.swapped: dict[Request, list[int]] = {}  # a waiting request's host pages
        # Requests swapped out and in, their pages, and preemptions that found the pool full.
        self.swaps = dict.fromkeys(SWAP_COUNTS, 0)

    def _preempt(self, request: Request, cause: str, rows: list[Row]) -> None:
        self._swap_out(request)
        super()._preempt(request, cause, rows)

    def _admit(self, request: Request, rows: list[Row], budget: int, deferred: list[Request]) -> bool:
        self._swap_in(request)
        admitted = super()._admit(request, rows, budget, deferred)
        if request.status is Status.RUNNING:
            self._forget(request)
        return admitted

    def finish(self, request: Request, reason: str) -> None:
        self._forget(request)
        super().finish(request, reason)

    def _swap_out(self, request: Request) -> None:
        num_pages = min(request.num_computed_tokens, request.num_tokens) // self.page_size
        if num_pages == 0:
            return
        host_pages = self.host.swap_out(request.pages[:num_pages])
        if host_pages is None:
            self.swaps["recomputed"] += 1
            return
        self.swapped[request] = host_pages
        self.swaps["swaps_out"] += 1
        self.swaps["pages_out"] += num_pages

    def _swap_in(self, request: Request) -> None:
        """Put back into the prefix cache the pages of `request`'s copy that it lost, as
        many as free (or evictable) pages allow."""
        host_pages = self.swapped.get(request)
        if host_pages is None:
            return
        tokens = request.token_ids[: len(host_pages) * self.page_size]
        held = self.cache.match(tokens)  # the pages the cache still has: held while we copy
        missing = len(host_pages) - len(held)
        if missing > self.allocator.num_free_pages:
            self.cache.evict(missing - self.allocator.num_free_pages)
        fresh = self.allocator.allocate(min(missing, self.allocator.num_free_pages))
        if fresh:
            self.host.swap_in(host_pages[len(held) : len(held) + len(fresh)], fresh)
            self.cache.insert(tokens, held + fresh)
            self.swaps["swaps_in"] += 1
            self.swaps["pages_in"] += len(fresh)
        self.allocator.release(held + fresh)  # the cache holds them now

    def _forget(self, request: Request) -> None:
        host_pages = self.swapped.pop(request, None)
        if host_pages is not None:
            self.host.release(host_pages)

    def stats_group(self) -> dict[str, dict[str, int]]:
        return {"swap": {
            **self.swaps,
            "host_pages_total": self.host.num_pages,
            "host_pages_used": self.host.num_used_pages,
            "host_bytes": self.host.num_pages * self.host.page_bytes,
        }}


def swapping_scheduler(cache: KVCache, swap_space: int, states: Any) -> partial:
    """The scheduler class for `preemption_mode="swap"`, its host pool bound."""
    if states is not None:
        raise ValueError(
            "preemption_mode='swap' is not supported for models with recurrent layers "
            "(their state slot would need swapping too): use preemption_mode='recompute'"
        )
    return partial(SwappingScheduler, HostKVPool(cache, swap_space))
