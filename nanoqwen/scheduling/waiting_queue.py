"""Who goes next: each request's urgency as one sortable key, and the heap of waiting ones.

A request has a `priority` (lower is more urgent, 0 by default). Served strictly by
priority, a request behind a steady stream of more urgent ones would wait forever, so
priorities *age*: a request's effective priority improves by one level every
`aging_steps` scheduler steps after it arrives. Precisely, at step `t` a request that
arrived at step `a` has the effective priority

    effective(t) = priority - (t - a) / aging_steps

and requests are served by (effective priority, arrival order).

That looks like it needs every waiting request re-ranked every step. It doesn't. For two
requests at the same step `t`, multiply by `aging_steps` (positive) and add `t`:

    effective_i(t) < effective_j(t)
    <=>  priority_i * aging_steps + a_i  <  priority_j * aging_steps + a_j

`t` cancels: the order between two requests is the same at every step. So the key
`priority * aging_steps + arrival_step`, computed once at arrival, orders the requests
exactly as their effective priorities do at any step, and a heap keyed by it never needs
updating. Arrival order breaks ties. Read the key as a virtual arrival step: priority `p`
means "serve me as if I had arrived `p * aging_steps` steps later than I did".

(Aging by whole levels, `priority - floor((t - a) / aging_steps)`, has no such key:
whether two requests tie then depends on where `t` falls between multiples of
`aging_steps`, so their order changes over time. The linear rule gains one level per
`aging_steps` steps too, and is never a whole level away from it.)

With `aging_steps = 0` aging is off and the key is the priority itself. First come first
served is the same machinery with every request at level 0: arrival order alone decides.

A priority must be an integer, and only the "priority" policy takes one other than 0
(`check_priority`): an fcfs engine refuses it rather than silently ignore it.

The key stays with a request while it runs: the scheduler compares running requests'
keys with waiting ones' to choose whom to preempt (`scheduler.py`). So a request that
has waited long enough outranks every later arrival, and cannot be pushed out by them
either: that is what bounds its wait.
"""

from __future__ import annotations

import heapq

from nanoqwen.scheduling.request import Request, Urgency


def check_priority(priority: object, policy: str) -> None:
    """A ValueError unless `priority` is an integer that `policy` can honour."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority={priority} needs scheduling_policy='priority' (this engine's is {policy!r})"
        )


def priority_list(priority: object, count: int) -> list[object]:
    """The priorities of `count` requests: `priority`, a list of them; None: all 0. Each
    is checked as its request is added (`check_priority`)."""
    priorities = [0] * count if priority is None else priority
    if not isinstance(priorities, (list, tuple)) or len(priorities) != count:
        raise ValueError(f"priority must be a list of {count} integers, got {priority!r}")
    return list(priorities)


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
        self._drop_removed()
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Request:
        self._drop_removed()
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._removed.add(request)

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][1] in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[1])
