"""Swap space: KV pages copied to host memory while their request waits, and back.

Preemption by recompute throws a request's K/V away and computes it again later. Swapping
keeps a copy instead: the pages are copied out to a pool in host memory, the device pages
are freed for others, and when the request resumes the copy comes back into fresh device
pages. It trades bus (on a CPU, memory) bandwidth and `swap_space` bytes of RAM for the
prefill compute (docs/learn/08-preemption-and-priority.md measures both). Each copy gathers
the pages into one block on one side, moves it in one transfer, and scatters it on the
other.

`HostKVPool` is the host side of one `KVCache`: for each of the cache's tensors (the K/V
numbers, and a quantized cache's scales: `kv_quant.py`) a twin with the same per-page
layout, `[layers * 2, host pages, words]`: each page of each layer's K or V is one row of
raw words (the widest integers that tile it), so every storage dtype copies the same way,
a word at a time rather than a byte; and a free list of its pages. Which request a copy
belongs to is the scheduler's business (`scheduling/swapping.py`).

Invariant: free + held host pages == `num_pages`; a host page holds exactly the bytes of
the device page it was copied from, until it is released.
"""

from __future__ import annotations

import torch

from nanoqwen.memory.kv_cache import KVCache


class HostKVPool:
    """Pages of a `KVCache`, kept in host memory: `swap_space` bytes' worth."""

    def __init__(self, cache: KVCache, swap_space: int) -> None:
        self.device_tensors = [as_words(t) for t in (cache.kv, cache.scales) if t is not None]
        self.page_bytes = sum(t[:, 0].nbytes for t in self.device_tensors)
        self.num_pages = swap_space // self.page_bytes
        self.tensors = [torch.empty((t.shape[0], self.num_pages, t.shape[2]), dtype=t.dtype)
                        for t in self.device_tensors]
        self.free = list(range(self.num_pages - 1, -1, -1))

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self.free)

    def swap_out(self, pages: list[int]) -> list[int] | None:
        """Copy device `pages` to host pages; their numbers, or None if too few are free."""
        if len(pages) > len(self.free):
            return None
        host_pages = [self.free.pop() for _ in pages]
        source = torch.tensor(pages, device=self.device_tensors[0].device)
        target = torch.tensor(host_pages)
        for device, host in zip(self.device_tensors, self.tensors):
            host.index_copy_(1, target, device.index_select(1, source).cpu())
        return host_pages

    def swap_in(self, host_pages: list[int], pages: list[int]) -> None:
        """Copy host pages back into device `pages` (one for one); the host pages stay held."""
        source = torch.tensor(host_pages)
        target = torch.tensor(pages, device=self.device_tensors[0].device)
        for device, host in zip(self.device_tensors, self.tensors):
            device.index_copy_(1, target, host.index_select(1, source).to(device.device))

    def release(self, host_pages: list[int]) -> None:
        self.free.extend(host_pages)


def as_words(pages: torch.Tensor) -> torch.Tensor:
    """A cache tensor `[layers, 2, pages, ...]` as `[layers * 2, pages, words]`, a view of the
    same memory (float8 codes, which have no index_copy_ on a CPU, become integers too)."""
    rows = pages.view(torch.uint8).reshape(pages.shape[0] * pages.shape[1], pages.shape[2], -1)
    for word in (torch.int64, torch.int32, torch.int16):
        if rows.shape[-1] % word.itemsize == 0:
            return rows.view(word)
    return rows
