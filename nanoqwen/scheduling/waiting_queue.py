"""Who goes next: a policy gives each request one sortable key; a heap holds the waiting ones.

A policy's `urgency` keys a request as it arrives (smaller: more urgent). Here "fcfs" and
"priority", whose `priority` (lower first) *ages* a level per `aging_steps` steps. The key

    level * aging_steps + arrival_step        (then arrival order, to break ties)

orders requests as their effective levels do at every step: compare two at step `t` and
`t` cancels, so the heap never needs re-sorting. With `aging_steps = 0` the key is the
level itself; "fcfs" is every level 0. `policies.py` (deadlines, shortest prompt, fair turns
between users) gives other levels or keys, imported only when an engine uses them.

Invariant: a request's key never changes, while it waits or while it runs (the scheduler
compares running and waiting keys to choose whom to preempt). A later arrival's key is at
least `min(PRIORITY_RANGE) * aging_steps` plus its arrival step, so arrivals from step
`key - min(PRIORITY_RANGE) * aging_steps` on rank below a waiting request: its wait is
bounded (unbounded priorities would let a client starve everyone). The derivation, and
why aging by whole levels would not give one key: docs/learn/08-preemption-and-priority.md.
"""

from __future__ import annotations

import heapq
import math

from nanoqwen.scheduling.request import Request, Urgency

# The priorities a request may ask for (lower is served sooner): bounded, so aging bounds waits.
PRIORITY_RANGE = range(-10, 11)


class Policy:
    """"fcfs" and "priority" (see the module docstring); other policies subclass it."""

    def __init__(self, name: str, aging_steps: int) -> None:
        self.name, self.aging_steps = name, aging_steps if name != "fcfs" else 0

    def check(self, priority: object, deadline: object, user: object) -> None:
        """A ValueError unless this engine honours the fields (a priority only "priority")."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority not in PRIORITY_RANGE:
            low, high = PRIORITY_RANGE[0], PRIORITY_RANGE[-1]
            raise ValueError(f"priority must be in [{low}, {high}], got {priority}")
        if priority != 0 and self.name != "priority":
            raise ValueError(f"priority={priority} needs scheduling_policy='priority' "
                             f"(this engine's is {self.name!r})")
        if deadline is not None and not (type(deadline) in (int, float) and 0 < deadline < math.inf):
            raise ValueError(f"deadline must be a positive number of seconds, got {deadline!r}")
        if user is not None and not isinstance(user, str):
            raise ValueError(f"user must be a string, got {user!r}")

    def urgency(self, request: Request, step: int, arrival: int,
                level: float | None = None) -> Urgency:
        """The key of `request`, arriving at `step` as the `arrival`-th request, ranked by
        `level` (another policy's), by default its priority (0 under fcfs)."""
        level = request.priority if level is None else level
        if self.aging_steps == 0:
            return (level, arrival)
        return (level * self.aging_steps + step, arrival)


class WaitingQueue:
    """Requests waiting to run, most urgent (smallest `urgency`) first.

    A binary heap: adding and taking the most urgent cost O(log n), looking at it O(1).
    Removing a request from the middle (an abort) only marks it; the mark is dropped when
    it reaches the top. So no operation ever walks the whole queue.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[Urgency, Request]] = []
        self._removed: set[Request] = set()

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.urgency, request))

    def peek(self) -> Request | None:
        """The most urgent waiting request, left in the queue; None if there is none."""
        while self._heap and self._heap[0][1] in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[1])
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Request:
        """Take the most urgent waiting request out (there must be one)."""
        self.peek()
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._removed.add(request)

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)
