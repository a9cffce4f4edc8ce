"""The page allocator: which KV pages are free, and who holds the others. Host-side only.

The KV memory is one buffer cut into fixed-size pages of `page_size` token slots
(`kv_cache.py`), allocated once; each request has a page table, the list of its pages in
token order, so token `i` lives in page `pages[i // page_size]`, slot `i % page_size`.
This module is the bookkeeping, apart from the tensors: a free list of page numbers and a
reference count per page. A page may have several holders (requests sharing a prefix, and
the prefix cache); it returns to the free list when the last one releases it. Pages whose
only holder is the prefix cache ("cached", the evictable ones) are counted as references
come and go, so reading the count costs nothing.

Page 0 is the scratch page: never handed out, it absorbs the writes of padding rows when a
decode batch is padded to a CUDA-graph bucket.

Invariant: a page is in the free list exactly when its reference count is 0; free +
cached + in use == `num_usable_pages`. The story: docs/learn/03-paged-kv-cache.md.
"""

from __future__ import annotations

SCRATCH_PAGE = 0


class PageAllocator:
    """Reference-counted pages `1 .. num_pages - 1` (page 0 is scratch)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.num_usable_pages = num_pages - 1
        self.page_size = page_size
        self.ref_counts = [0] * num_pages
        self.in_cache = [False] * num_pages  # does the prefix cache hold a reference?
        self.num_cache_only_pages = 0
        # Popping from the end hands out low page numbers first, which keeps tests readable.
        self.free_pages = list(range(num_pages - 1, SCRATCH_PAGE, -1))

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free pages, each with one holder (the caller)."""
        if count > len(self.free_pages):
            raise RuntimeError(f"asked for {count} pages, only {len(self.free_pages)} free")
        pages = self.free_pages[len(self.free_pages) - count :][::-1]
        del self.free_pages[len(self.free_pages) - count :]
        for page in pages:
            self.ref_counts[page] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        """Add one holder to each page (it must already be held by someone)."""
        for page in pages:
            assert self.ref_counts[page] > 0, f"retain of free page {page}"
            self._add_holder(page)

    def release(self, pages: list[int]) -> None:
        """Drop one holder from each page; pages nobody holds go back to the free list."""
        for page in pages:
            assert self.ref_counts[page] > 0, f"release of free page {page}"
            self._drop_holder(page)

    def cache_retain(self, pages: list[int]) -> None:
        """The prefix cache becomes a holder of these pages."""
        for page in pages:
            assert not self.in_cache[page], f"page {page} is cached twice"
            self._add_holder(page)
            self.in_cache[page] = True
            self.num_cache_only_pages += self.ref_counts[page] == 1

    def cache_release(self, pages: list[int]) -> None:
        """The prefix cache lets go of these pages."""
        for page in pages:
            assert self.in_cache[page], f"page {page} is not cached"
            self.num_cache_only_pages -= self.ref_counts[page] == 1
            self.in_cache[page] = False
            self._drop_holder(page)

    def _add_holder(self, page: int) -> None:
        self.ref_counts[page] += 1
        if self.ref_counts[page] == 2 and self.in_cache[page]:
            self.num_cache_only_pages -= 1  # a request now uses a cached page

    def _drop_holder(self, page: int) -> None:
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 1 and self.in_cache[page]:
            self.num_cache_only_pages += 1  # the last request let go of a cached page
        elif self.ref_counts[page] == 0:
            self.free_pages.append(page)
