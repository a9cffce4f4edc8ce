"""Who goes next: each request's urgency as one sortable key, and the heap of waiting ones.

A request has a `priority` (lower is more urgent, 0 by default). Under the "priority"
policy its effective priority *ages*, improving by one level per `aging_steps` steps of
waiting, so that no request waits forever. The key

    priority * aging_steps + arrival_step        (then arrival order, to break ties)

computed once at arrival, orders requests exactly as their effective priorities do at
every step: compare two requests at step `t` and `t` cancels. So the heap never needs
re-sorting. With `aging_steps = 0` the key is the priority itself; "fcfs" is the same
machinery with every request at level 0. Priorities lie in `PRIORITY_RANGE`, and an fcfs
engine refuses a non-zero one (`check_priority`) rather than silently ignore it.

Invariant: a request's key never changes, while it waits or while it runs (the scheduler
compares running and waiting keys to choose whom to preempt). A later arrival's key is at
least `min(PRIORITY_RANGE) * aging_steps` plus its arrival step, so arrivals from step
`key - min(PRIORITY_RANGE) * aging_steps` on rank below a waiting request: its wait is
bounded (unbounded priorities would let a client starve everyone). The derivation, and
why aging by whole levels would not give one key: docs/learn/08-preemption-and-priority.md.
"""

from __future__ import annotations

import heapq

from nanoqwen.scheduling.request import Request, Urgency

# The priorities a request may ask for (lower is served sooner): bounded, so that aging
# bounds every wait.
PRIORITY_RANGE = range(-10, 11)


def check_priority(priority: object, policy: str) -> None:
    """A ValueError unless `priority` is an integer in `PRIORITY_RANGE` that `policy` can
    honour."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority not in PRIORITY_RANGE:
        low, high = PRIORITY_RANGE[0], PRIORITY_RANGE[-1]
        raise ValueError(f"priority must be in [{low}, {high}], got {priority}")
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority={priority} needs scheduling_policy='priority' (this engine's is {policy!r})"
        )


def urgency(
    policy: str, priority: int, arrival_step: int, arrival: int, aging_steps: int
) -> Urgency:
    """A request's key under `policy`; smaller is more urgent (see the module docstring).

    `arrival` numbers requests in the order they arrived and breaks every tie.
    """
    if policy == "fcfs":
        return (0, arrival)
    if aging_steps == 0:
        return (priority, arrival)
    return (priority * aging_steps + arrival_step, arrival)


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
