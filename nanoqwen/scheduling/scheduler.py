"""Continuous batching: decide, every step, which requests run and how many tokens each.

A static batch waits for its slowest member. Continuous batching instead re-forms the
batch at every step: finished requests leave, waiting ones join, and one forward pass
serves requests at different stages. The unit of work is uniform: a request has
`num_tokens` tokens of which the first `num_computed_tokens` already have K/V in its
pages; a step computes the next `n` of them. A prefill is a request with many uncomputed
tokens, a decode is one with exactly one (the token sampled last step). Once a step
computes a request's last token, the model's logits for it give the next token.

Every request carries an `urgency` key (`waiting_queue.py`): under the default "fcfs"
policy it is just its arrival order; under "priority" it is its priority aged by how long
it has waited, then arrival order. Waiting requests sit in a heap by that key, running
ones in a list sorted by it, so the least urgent running request is always the last.

Policy, every step:

1. **Running requests first, most urgent first.** Each decode gets its one token. A
   request still prefilling gets a chunk of its prompt from the step's prefill budget
   (`chunk_size` tokens, shared by all prefills in the step; decodes don't spend it). So
   decodes are never starved by a long prompt: every step carries every running decode,
   plus at most `chunk_size` prompt tokens.
2. **Then admission, most urgent first**, while the budget, `max_num_seqs` and free pages
   allow. An admitted request first asks the prefix cache for the longest page-aligned
   prefix it already holds and only computes the rest. A request whose next page is being
   computed right now by another request's prefill waits one step, so it can reuse that
   page instead of computing a copy.
3. **Pages on demand.** A request gets pages as its computed length crosses page
   boundaries. When none are free, cached pages are evicted (LRU); if that is not
   enough, the least urgent running request (under fcfs, the latest arrival) is
   *preempted*: its pages are released (its full pages stay in the prefix cache, so its
   restart mostly hits the cache) and it goes back to the waiting heap with its key
   unchanged, to be recomputed later. A request that cannot fit even alone finishes with
   reason "length".
4. **Priority preemption.** A waiting request whose aged priority is strictly better
   than the least urgent running request's takes that request's place when the batch is
   full (`max_num_seqs`) or the pages it needs to start are not there; it never displaces
   one of equal or better aged priority. Under fcfs every aged priority is equal, so this
   never happens. Because keys age, a request that has waited long enough outranks every
   later arrival, so it is neither passed over nor preempted by them: nothing starves.
5. **Proposed tokens** (guesses an engine may ask the model to verify, `request.py`) join
   a request's row after the schedule is made, get pages only when some are free or
   evictable (never by preempting anyone: `make_room_for_proposed`), and spend no
   prefill budget. After the step, `settle_proposed` keeps the K/V of the tokens
   verification accepted and rolls back the rest: the request's computed length shrinks
   to its accepted tokens and the pages past it are freed. The prefix cache only ever
   receives pages of accepted tokens.

Preemptions are counted by cause: "kv_pages" (pages ran out) and "max_num_seqs" (a seat
was given to a more urgent request). The request-side invariant (which pages hold which
tokens) is stated in `request.py`. Between steps, a running request holds exactly the
pages its computed tokens fill.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from operator import attrgetter

from nanoqwen.memory.page_allocator import PageAllocator
from nanoqwen.memory.radix_cache import RadixCache
from nanoqwen.scheduling.batch import ScheduledBatch
from nanoqwen.scheduling.request import Request, Status
from nanoqwen.scheduling.waiting_queue import WaitingQueue, urgency

PREEMPTION_CAUSES = ("kv_pages", "max_num_seqs")
URGENCY = attrgetter("urgency")


@dataclass
class Schedule:
    """Everything one `schedule()` call decided."""

    batch: ScheduledBatch  # what runs this step (possibly nothing)
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
        policy: str = "fcfs",
        aging_steps: int = 0,
    ) -> None:
        self.allocator = allocator
        self.cache = cache
        self.page_size = allocator.page_size
        self.max_num_seqs = max_num_seqs
        self.chunk_size = chunk_size
        self.policy = policy
        self.aging_steps = aging_steps
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # most urgent first
        self.num_steps = 0  # schedule() calls so far: the clock that priorities age by
        self._arrivals = itertools.count()
        self.preemptions = dict.fromkeys(PREEMPTION_CAUSES, 0)

    # ----------------------------------------------------------------- queue management
    def add(self, request: Request) -> None:
        request.urgency = urgency(
            self.policy, request.priority, self.num_steps, next(self._arrivals), self.aging_steps
        )
        self.waiting.push(request)

    def finish(self, request: Request, reason: str) -> None:
        """Take a request out of the queues for good, caching and releasing its pages."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        self._release_pages(request)
        request.status, request.finish_reason = Status.FINISHED, reason

    def _release_pages(self, request: Request) -> None:
        self._offer_to_cache(request)
        self.allocator.release(request.pages)
        request.pages = []
        request.num_computed_tokens = 0
        request.num_pages_in_cache = 0

    def _offer_to_cache(self, request: Request) -> None:
        """Give the prefix cache every full page of computed tokens it hasn't seen yet."""
        full_pages = request.num_computed_tokens // self.page_size
        if self.cache is None or full_pages <= request.num_pages_in_cache:
            return
        self.cache.insert(request.token_ids[: full_pages * self.page_size], request.pages[:full_pages])
        request.num_pages_in_cache = full_pages

    # ----------------------------------------------------------------- the step
    def schedule(self) -> Schedule:
        self.num_steps += 1
        schedule = Schedule(ScheduledBatch([], []))
        budget = self._schedule_running(schedule, self.chunk_size)
        self._admit_waiting(schedule.batch, budget)
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
            if not self._grow_or_preempt(request, request.num_computed_tokens + num_new, schedule):
                continue  # `request` itself was preempted or finished: the list shifted
            schedule.batch.requests.append(request)
            schedule.batch.num_new_tokens.append(num_new)
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
            self._preempt(victim, "kv_pages", schedule.batch)
            if victim is request:
                return False
        return True

    def _grow(self, request: Request, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.page_size) - len(request.pages)
        if needed <= 0:
            return True
        if not self._make_free(needed):
            return False
        request.pages.extend(self.allocator.allocate(needed))
        return True

    def _make_free(self, num_pages: int) -> bool:
        shortfall = num_pages - self.allocator.num_free_pages
        if shortfall > 0 and self.cache is not None:
            self.cache.evict(shortfall)
        return self.allocator.num_free_pages >= num_pages

    def _preempt(self, request: Request, cause: str, batch: ScheduledBatch) -> None:
        """Send a running request back to wait, dropping it from this step's batch."""
        if request in batch.requests:
            index = batch.requests.index(request)
            del batch.requests[index], batch.num_new_tokens[index]
        self.running.remove(request)
        self._release_pages(request)
        request.status = Status.WAITING
        self.waiting.push(request)
        self.preemptions[cause] += 1

    def _outranks_running(self, request: Request) -> bool:
        """Is `request`'s aged priority strictly better than the least urgent running one's?"""
        return bool(self.running) and request.urgency[0] < self.running[-1].urgency[0]

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        deferred: list[Request] = []
        while budget > 0 and (head := self.waiting.peek()) is not None:
            if len(self.running) >= self.max_num_seqs and not self._outranks_running(head):
                break
            request = self.waiting.pop()
            if not self._admit(request, batch, budget, deferred):
                break
            if request.status is Status.RUNNING:
                budget -= batch.num_new_tokens[-1]
        for request in deferred:
            self.waiting.push(request)

    def _admit(
        self, request: Request, batch: ScheduledBatch, budget: int, deferred: list[Request]
    ) -> bool:
        """Try to start `request`, preempting less urgent running requests for its seat or
        pages if it outranks them. False means stop admitting (no room for it)."""
        reusable = request.token_ids[: request.num_reusable_tokens]
        pages = self.cache.match(reusable) if self.cache else []
        num_cached = len(pages) * self.page_size
        if self._next_page_in_flight(request, num_cached):
            self.allocator.release(pages)
            deferred.append(request)
            return True
        if len(self.running) >= self.max_num_seqs:  # `_admit_waiting` checked it outranks
            self._preempt(self.running[-1], "max_num_seqs", batch)
        num_new = min(request.num_tokens - num_cached, budget)
        request.pages, request.num_computed_tokens = pages, num_cached
        request.num_pages_in_cache = len(pages)
        while not self._grow(request, num_cached + num_new):
            if not self._outranks_running(request):
                self.allocator.release(request.pages)
                request.pages, request.num_computed_tokens, request.num_pages_in_cache = [], 0, 0
                self.waiting.push(request)
                return False
            self._preempt(self.running[-1], "kv_pages", batch)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached
            if self.cache is not None:
                self.cache.record_query(request.num_prompt_tokens, num_cached)
        request.status = Status.RUNNING
        bisect.insort(self.running, request, key=URGENCY)
        batch.requests.append(request)
        batch.num_new_tokens.append(num_new)
        return True

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

    def make_room_for_proposed(self, request: Request, num_tokens: int, count: int) -> int:
        """Pages for up to `count` proposed tokens after the request's first `num_tokens`;
        returns how many fit. Cached pages may be evicted for them, no request preempted."""
        if self._grow(request, num_tokens + count):
            return count
        return max(0, min(count, len(request.pages) * self.page_size - num_tokens))

    # ----------------------------------------------------------------- after the forward
    def advance(self, batch: ScheduledBatch) -> None:
        """Record that the batch's tokens now have K/V; offer new full pages to the cache.

        Proposed tokens don't count yet: only `settle_proposed` knows which were accepted.
        """
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            request.num_computed_tokens += num_new - len(request.proposed_token_ids)
            self._offer_to_cache(request)

    def settle_proposed(self, request: Request) -> None:
        """After a verification step has appended its tokens to a running `request`: the
        K/V of every token but the last (the accepted proposals) stays, the rejected ones'
        slots are rolled back and the pages past them freed."""
        request.proposed_token_ids = []
        request.num_computed_tokens = request.num_tokens - 1
        num_pages = -(-request.num_computed_tokens // self.page_size)
        self.allocator.release(request.pages[num_pages:])
        del request.pages[num_pages:]
        self._offer_to_cache(request)
