"""Who goes next: a policy gives each request one sortable key; a heap holds the waiting ones.

A policy's `urgency` turns a request into a key once, when it arrives; smaller is more
urgent. Here, "fcfs" (arrival order) and "priority": a request's `priority` (lower is more
urgent, 0 by default) *ages*, improving by one level per `aging_steps` steps of waiting, so
no request waits forever. The key

    level * aging_steps + arrival_step        (then arrival order, to break ties)

orders requests exactly as their effective levels do at every step: compare two at step
`t` and `t` cancels, so the heap never needs re-sorting. With `aging_steps = 0` the key is
the level itself; "fcfs" is every level 0. `policies.py` (deadlines, shortest prompt, fair
turns between users) gives other levels or keys, imported only when an engine uses them.

Invariant: a request's key never changes, while it waits or while it runs (the scheduler
compares running and waiting keys to choose whom to preempt). So once a request has
waited long enough it outranks every later arrival and cannot be pushed out by them: its
wait is bounded. The derivation, and why aging by whole levels would not give one key:
docs/learn/07-preemption-and-priority.md.
"""

from __future__ import annotations

import heapq
import math

from nanoqwen.scheduling.request import Request, Urgency


class Policy:
    """"fcfs" and "priority" (see the module docstring); other policies subclass it."""

    def __init__(self, name: str, aging_steps: int) -> None:
        self.name, self.aging_steps = name, aging_steps if name != "fcfs" else 0

    def check(self, priority: object, deadline: object, user: object) -> None:
        """A ValueError unless a request's scheduling fields are ones this engine honours (an
        fcfs engine refuses a non-zero priority rather than silently ignore it)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.name != "priority":
            raise ValueError(f"priority={priority} needs scheduling_policy='priority' "
                             f"(this engine's is {self.name!r})")
        if deadline is not None and not (type(deadline) in (int, float) and 0 < deadline < math.inf):
            raise ValueError(f"deadline must be a positive number of seconds, got {deadline!r}")
        if user is not None and not isinstance(user, str):
            raise ValueError(f"user must be a string, got {user!r}")

    def urgency(
        self, request: Request, step: int, arrival: int, level: float | None = None
    ) -> Urgency:
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
