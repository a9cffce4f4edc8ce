"""Continuous batching: decide, every step, which requests run and how many tokens each.

A request has `num_tokens` tokens, the first `num_computed_tokens` of which have K/V in its
pages; a step computes the next `n` of them (a prefill: many; a decode: one). The decision
is a list of `Row`s, one per request: the tokens it computes and whether the step reaches
its last token (then its logits are sampled). Requests are ordered by their `urgency`
(`waiting_queue.py`): waiting ones in a heap, running ones in a list, least urgent last.
Every step, `schedule()`:

1. gives each running request, most urgent first, its decode token, or a chunk of its
   prompt from the step's `chunk_size` budget, which decodes don't spend;
2. admits waiting requests, most urgent first, while the budget, `max_num_seqs` and pages
   allow, each starting from the longest page-aligned prefix the prefix cache holds (and
   waiting a step if another request is computing the page it needs next);
3. grows page tables on demand, evicting cached pages first, then preempting the least
   urgent running request (its full pages stay cached; it waits to be recomputed). A
   waiting request strictly more urgent than the least urgent running one takes its seat
   or its pages. A request that cannot fit even alone finishes with "length".

Two calls let a feature that appends tokens of its own to a row (speculative decoding)
work with the pages without the scheduler knowing why: `reserve` grows a request's pages
only as far as free or evictable pages allow, and `rollback` forgets K/V past a point.

Invariants: between steps a running request holds exactly the pages its computed tokens
fill, and only tokens a request has are ever offered to the prefix cache; a request is
never displaced by one of equal or lower aged priority, so nothing ping-pongs and no wait
is unbounded. Preemptions are counted by cause ("kv_pages", "max_num_seqs"). The story:
docs/learn/02-continuous-batching.md, 06-chunked-prefill.md and 08-preemption-and-priority.md.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field
from operator import attrgetter

from nanoqwen.memory.page_allocator import PageAllocator
from nanoqwen.memory.radix_cache import RadixCache
from nanoqwen.memory.state_pool import StateSlots
from nanoqwen.scheduling.request import Request, Status
from nanoqwen.scheduling.waiting_queue import Policy, WaitingQueue

PREEMPTION_CAUSES = ("kv_pages", "max_num_seqs")
URGENCY = attrgetter("urgency")


@dataclass(eq=False)
class Row:
    """One request's part of a step: `token_ids` at positions `start, start + 1, ...`, the
    last `num_sampled` of which have their logits sampled (1 when the step reaches the
    request's last token, 0 for a prompt chunk that stops short of it). A model with
    recurrent layers also gets the request's state slot, where it starts from, and where
    to save it after the step (`memory/state_pool.py`)."""

    request: Request
    start: int
    token_ids: list[int]
    num_sampled: int
    state_slot: int | None = None
    state_source: int | None = None
    state_save: int | None = None


@dataclass
class Schedule:
    """Everything one `schedule()` call decided."""

    rows: list[Row] = field(default_factory=list)  # what runs this step (possibly nothing)
    # Requests finished with reason "length" because they cannot fit in the pool even
    # alone; their pages are already released.
    out_of_memory: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        cache: RadixCache | None,
        max_num_seqs: int,
        chunk_size: int,
        policy: Policy,
        states: StateSlots | None = None,  # the state pool's slots, for recurrent layers
    ) -> None:
        self.allocator = allocator
        self.cache = cache
        self.states = states
        self.page_size = allocator.page_size
        self.max_num_seqs = max_num_seqs
        self.chunk_size = chunk_size
        self.policy = policy
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # most urgent first
        self.num_steps = 0  # schedule() calls so far: the clock that priorities age by
        self._arrivals = itertools.count()
        self.preemptions = dict.fromkeys(PREEMPTION_CAUSES, 0)
        self.deadlines = {"met": 0, "missed": 0}  # requests with one, by when they finished

    # ----------------------------------------------------------------- queue management
    def add(self, request: Request) -> None:
        request.urgency = self.policy.urgency(request, self.num_steps, next(self._arrivals))
        self.waiting.push(request)

    def finish(self, request: Request, reason: str) -> None:
        """Take a request out of the queues for good, caching and releasing its pages."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        self._release_pages(request)
        request.status, request.finish_reason = Status.FINISHED, reason
        if request.due is not None and (reason != "abort" or time.monotonic() > request.due):
            self.deadlines["met" if time.monotonic() <= request.due else "missed"] += 1

    def _release_pages(self, request: Request) -> None:
        self._offer_to_cache(request)
        self.allocator.release(request.pages)
        if request.state_slot is not None:
            self.states.release(request)
        request.pages = []
        request.num_computed_tokens = 0
        request.num_pages_in_cache = 0

    def _offer_to_cache(self, request: Request) -> None:
        """Give the prefix cache every full page of the request's own computed tokens it
        hasn't seen yet (K/V computed for tokens a feature appended to a row counts only
        once they are the request's)."""
        computed = min(request.num_computed_tokens, request.num_tokens)
        full_pages = computed // self.page_size
        if self.cache is None or full_pages <= request.num_pages_in_cache:
            return
        self.cache.insert(request.token_ids[: full_pages * self.page_size], request.pages[:full_pages])
        request.num_pages_in_cache = full_pages

    # ----------------------------------------------------------------- the step
    def schedule(self) -> Schedule:
        self.num_steps += 1
        if self.states is not None:
            self.states.new_step()
        schedule = Schedule()
        budget = self._schedule_running(schedule, self.chunk_size)
        self._admit_waiting(schedule.rows, budget)
        return schedule

    def _schedule_running(self, schedule: Schedule, budget: int) -> int:
        index = 0
        while index < len(self.running):
            request = self.running[index]
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = 1 if remaining == 1 else min(remaining, budget)
            if num_new == 0:
                index += 1
                continue
            if self.states is not None:
                num_new = self.states.chunk_end(request, request.num_computed_tokens, num_new)
            if not self._grow_or_preempt(request, request.num_computed_tokens + num_new, schedule):
                continue  # `request` itself was preempted or finished: the list shifted
            schedule.rows.append(self._row(request, num_new))
            budget -= num_new if remaining > 1 else 0
            index += 1
        return budget

    def _grow_or_preempt(self, request: Request, num_tokens: int, schedule: Schedule) -> bool:
        """Give `request` pages for `num_tokens` tokens, preempting less urgent requests
        (or, as the least urgent, itself) if needed."""
        while not self._grow(request, num_tokens):
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                # Alone and still out of pages: it can never fit in this pool.
                self.finish(request, "length")
                schedule.out_of_memory.append(request)
                return False
            self._preempt(victim, "kv_pages", schedule.rows)
            if victim is request:
                return False
        return True

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Pages for `num_tokens` tokens, evicting cached pages if need be; False if they
        cannot be had without preempting someone."""
        needed = -(-num_tokens // self.page_size) - len(request.pages)
        if needed <= 0:
            return True
        shortfall = needed - self.allocator.num_free_pages
        if shortfall > 0 and self.cache is not None:
            self.cache.evict(shortfall)
        if self.allocator.num_free_pages < needed:
            return False
        request.pages.extend(self.allocator.allocate(needed))
        return True

    def _preempt(self, request: Request, cause: str, rows: list[Row]) -> None:
        """Send a running request back to wait, dropping it from this step's rows."""
        rows[:] = [row for row in rows if row.request is not request]
        self.running.remove(request)
        self._release_pages(request)
        request.status = Status.WAITING
        self.waiting.push(request)
        self.preemptions[cause] += 1

    def _outranks_running(self, request: Request) -> bool:
        """Is `request`'s aged priority strictly better than the least urgent running one's?"""
        return bool(self.running) and request.urgency[0] < self.running[-1].urgency[0]

    def _admit_waiting(self, rows: list[Row], budget: int) -> None:
        deferred: list[Request] = []
        while budget > 0 and (head := self.waiting.peek()) is not None:
            if len(self.running) >= self.max_num_seqs and not self._outranks_running(head):
                break
            request = self.waiting.pop()
            if not self._admit(request, rows, budget, deferred):
                break
            if request.status is Status.RUNNING:
                budget -= len(rows[-1].token_ids)
        for request in deferred:
            self.waiting.push(request)

    def _admit(self, request: Request, rows: list[Row], budget: int, deferred: list[Request]) -> bool:
        """Try to start `request`, preempting less urgent running requests for its seat or
        pages if it outranks them. False means stop admitting (no room for it)."""
        reusable = request.token_ids[: request.num_reusable_tokens]
        pages = self.cache.match(reusable) if self.cache else []
        source = None
        if self.states is not None:  # the state must be had where the reused pages end
            keep, source = self.states.restore_point(request.token_ids, len(pages))
            self.allocator.release(pages[keep:])
            del pages[keep:]
        num_cached = len(pages) * self.page_size
        if self._next_page_in_flight(request, num_cached):
            self.allocator.release(pages)
            deferred.append(request)
            return True
        if len(self.running) >= self.max_num_seqs:  # `_admit_waiting` checked it outranks
            self._preempt(self.running[-1], "max_num_seqs", rows)
        num_new = min(request.num_tokens - num_cached, budget)
        if self.states is not None:
            num_new = self.states.chunk_end(request, num_cached, num_new)
        request.pages, request.num_computed_tokens = pages, num_cached
        request.num_pages_in_cache = len(pages)
        while not self._grow(request, num_cached + num_new) or (
            self.states is not None and request.state_slot is None and not self.states.take(request)
        ):
            if not self._outranks_running(request):
                self.allocator.release(request.pages)
                request.pages, request.num_computed_tokens, request.num_pages_in_cache = [], 0, 0
                self.waiting.push(request)
                return False
            self._preempt(self.running[-1], "kv_pages", rows)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached
            if self.cache is not None:
                self.cache.record_query(len(request.prompt_token_ids), num_cached)
        request.status = Status.RUNNING
        bisect.insort(self.running, request, key=URGENCY)
        rows.append(self._row(request, num_new, source))
        return True

    def _row(self, request: Request, num_new: int, state_source: int | None = None) -> Row:
        """The row that computes `request`'s next `num_new` tokens (with, for a model that
        keeps states, where its state starts from: `state_source`, when admitted)."""
        start = request.num_computed_tokens
        end = start + num_new
        row = Row(request, start, request.token_ids[start:end], int(end == request.num_tokens))
        if self.states is not None:
            self.states.fill(row, state_source)
        return row

    def _next_page_in_flight(self, request: Request, start: int) -> bool:
        """Is another running request about to compute the page `request` needs next?"""
        if self.cache is None or start + self.page_size >= request.num_tokens:
            return False
        next_page = request.token_ids[start : start + self.page_size]
        return any(
            other.num_computed_tokens <= start < other.num_tokens - 1
            and other.token_ids[start : start + self.page_size] == next_page
            and other.token_ids[:start] == request.token_ids[:start]
            for other in self.running
        )

    # ----------------------------------------------------------------- after the forward
    def advance(self, rows: list[Row]) -> None:
        """Record that the rows' tokens now have K/V; offer new full pages to the cache."""
        for row in rows:
            row.request.num_computed_tokens = row.start + len(row.token_ids)
            self._offer_to_cache(row.request)
        if self.states is not None:
            self.states.saved(rows)

    # ----------------------------------------------------------------- for features
    def reserve(self, request: Request, num_tokens: int) -> int:
        """Pages for up to `num_tokens` tokens of a running request, from free or cached
        pages only (no one is preempted); returns how many tokens its pages now hold."""
        if self._grow(request, num_tokens):
            return num_tokens
        return len(request.pages) * self.page_size

    def rollback(self, request: Request, num_computed: int) -> None:
        """Keep the K/V of the request's first `num_computed` tokens only, freeing the pages
        past them (what was computed there is forgotten, never cached)."""
        request.num_computed_tokens = num_computed
        num_pages = -(-num_computed // self.page_size)
        self.allocator.release(request.pages[num_pages:])
        del request.pages[num_pages:]
