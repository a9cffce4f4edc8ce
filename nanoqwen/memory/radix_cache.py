"""A radix tree over token ids that remembers which KV pages hold which prefixes.

The K/V of a prefix depend only on its tokens, so a request whose prompt starts with a
cached prefix takes the cached pages into its page table and prefills only the rest. Each
edge of the tree is a run of tokens and each node owns the pages of its edge; the path
from the root spells the prefix they hold. The tree is page-granular: an edge is a whole
number of pages and children are keyed by their first page's tokens, so a match never
ends inside a page, and a request's partial last page is recomputed, never shared.

Ownership is by reference count in the page allocator: the tree holds one reference to
each of its pages, every request one to each page of its table. A page only the tree holds
is cached, reusable and evictable; one a request holds is in use. Eviction is
least-recently-used over leaves, each trimmed from its end; an emptied leaf is removed.

Invariants: every shared page is read-only; eviction never frees a page a request holds;
the tree holds exactly `num_pages` pages. The story: docs/learn/07-radix-prefix-cache.md.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from nanoqwen.memory.page_allocator import PageAllocator

_clock = itertools.count()


@dataclass(eq=False)
class Node:
    tokens: list[int] = field(default_factory=list)  # the edge into this node
    pages: list[int] = field(default_factory=list)  # one page per page_size tokens of the edge
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    last_used: int = 0


class RadixCache:
    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.root = Node()
        self.num_pages = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evicted_pages = 0

    def _key(self, tokens: list[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def match(self, tokens: list[int]) -> list[int]:
        """Pages holding the longest cached page-aligned prefix of `tokens`.

        The caller becomes a holder of the returned pages (their counts go up by one).
        Only whole pages are matched; `len(pages) * page_size` tokens are covered.
        """
        pages: list[int] = []
        node, matched = self.root, 0
        now = next(_clock)
        while matched + self.page_size <= len(tokens):
            child = node.children.get(self._key(tokens, matched))
            if child is None:
                break
            shared_pages = self._shared_pages(child, tokens, matched)
            pages.extend(child.pages[:shared_pages])
            matched += shared_pages * self.page_size
            child.last_used = now
            if shared_pages < len(child.pages):
                break
            node = child
        self.allocator.retain(pages)
        return pages

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    def _shared_pages(self, node: Node, tokens: list[int], start: int) -> int:
        """How many whole pages of `node`'s edge equal `tokens[start:]`."""
        shared = 0
        while shared < len(node.pages):
            offset = shared * self.page_size
            if offset + self.page_size > len(tokens) - start:
                break
            edge_page = node.tokens[offset : offset + self.page_size]
            if edge_page != tokens[start + offset : start + offset + self.page_size]:
                break
            shared += 1
        return shared

    def insert(self, tokens: list[int], pages: list[int]) -> None:
        """Remember that `pages` hold the KV of `tokens` (whole pages only).

        Pages of a prefix the tree already has are left alone (the caller keeps its own
        copies until it releases them); the tree takes a reference to the pages it adopts.
        """
        num_pages = min(len(pages), len(tokens) // self.page_size)
        node, done = self.root, 0
        now = next(_clock)
        while done < num_pages:
            start = done * self.page_size
            child = node.children.get(self._key(tokens, start))
            if child is None:
                self._add_leaf(node, tokens[start : num_pages * self.page_size], pages[done:num_pages], now)
                return
            shared_pages = self._shared_pages(child, tokens[: num_pages * self.page_size], start)
            if shared_pages < len(child.pages):
                child = self._split(child, shared_pages)
            child.last_used = now
            node, done = child, done + shared_pages

    def _add_leaf(self, parent: Node, tokens: list[int], pages: list[int], now: int) -> None:
        leaf = Node(tokens=tokens, pages=list(pages), parent=parent, last_used=now)
        parent.children[self._key(tokens, 0)] = leaf
        self.allocator.cache_retain(leaf.pages)
        self.num_pages += len(leaf.pages)

    def _split(self, node: Node, num_pages: int) -> Node:
        """Cut `node`'s edge after `num_pages` pages; return the new upper half."""
        cut = num_pages * self.page_size
        upper = Node(
            tokens=node.tokens[:cut], pages=node.pages[:num_pages],
            parent=node.parent, last_used=node.last_used,
        )
        assert node.parent is not None
        node.parent.children[self._key(upper.tokens, 0)] = upper
        node.tokens, node.pages, node.parent = node.tokens[cut:], node.pages[num_pages:], upper
        upper.children[self._key(node.tokens, 0)] = node
        return upper

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` cached pages, least recently used leaves first."""
        leaves = [(leaf.last_used, id(leaf), leaf) for leaf in self._leaves()]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < num_pages:
            _, _, leaf = heapq.heappop(leaves)
            freed += self._trim(leaf, num_pages - freed)
            parent = leaf.parent
            if not leaf.pages and parent is not None:
                del parent.children[self._key(leaf.tokens, 0)]
                if parent is not self.root and not parent.children:
                    heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        self.evicted_pages += freed
        return freed

    def _trim(self, leaf: Node, limit: int) -> int:
        """Drop up to `limit` pages from the end of a leaf, stopping at one a request holds."""
        trimmed = 0
        while leaf.pages and trimmed < limit and self.allocator.ref_counts[leaf.pages[-1]] == 1:
            self.allocator.cache_release([leaf.pages.pop()])
            trimmed += 1
        if trimmed:
            # Keep the edge whole pages long; a fully emptied leaf keeps its first page's
            # tokens until it's unlinked, because its parent looks it up by them.
            keep = max(len(leaf.pages), 1) * self.page_size
            leaf.tokens = leaf.tokens[:keep]
        self.num_pages -= trimmed
        return trimmed

    def _leaves(self) -> list[Node]:
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    def pages(self) -> list[int]:
        pages, stack = [], [self.root]
        while stack:
            node = stack.pop()
            pages.extend(node.pages)
            stack.extend(node.children.values())
        return pages

    def reset(self) -> int:
        """Drop every page no request is using; return how many were freed."""
        return self.evict(self.num_pages)
