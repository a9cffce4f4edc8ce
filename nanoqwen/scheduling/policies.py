"""Scheduling policies beyond arrival order and priority, and a cap on each user's requests.

Each policy here is the core's `Policy` (`waiting_queue.py`) with another idea of who is
most urgent, and still gives a request one key, once, when it arrives. So the waiting heap
and the running list never need re-sorting, and preemption keeps comparing keys: a waiting
request strictly more urgent than the least urgent running one takes its seat or pages.

* **"deadline"**, earliest deadline first: the key is the moment a request is due, its
  arrival plus its `deadline` in seconds (plus `default_deadline` when it has none). While
  the load can be met, nothing is late that could have been on time; past that, every
  request may end a little late (the "domino effect"), and it takes no account of length.
  It ages by the clock: a due time never moves and every later arrival is due after it
  arrives, so once a request is due nothing new outranks it.
* **"sjf"**, shortest job first: the level is log2 of the prompt tokens the prefix cache
  does not hold when the request arrives. Short prompts start sooner and the mean wait
  falls; long prompts wait longer. Aged as priorities are, so each doubling of the prompt
  costs one level, `aging_steps` steps of waiting, and no long prompt waits forever.
* **"fair"**, turns between users: the level is how many requests of the same user are
  already waiting or running. A user's first request ranks with everyone's first, their
  second with everyone's second, so one user's many requests (or one wide `n`) take turns
  with the others' instead of taking the engine. Aged as priorities are.

`PerUserCap` wraps any policy and refuses a user's request beyond `max_seqs_per_user`
unfinished ones (`UserLimitExceeded`; a server answers it with a 429).

Invariant: a key never changes once given; a user's unfinished requests are counted from
the requests themselves, so a finished or aborted one stops counting without being told.
The story: docs/learn/08-preemption-and-priority.md.
"""

from __future__ import annotations

import math
import time
from typing import Any

from nanoqwen.memory.radix_cache import RadixCache
from nanoqwen.scheduling.request import Request, Status, Urgency
from nanoqwen.scheduling.scheduler import Scheduler
from nanoqwen.scheduling.waiting_queue import Policy


class UserLimitExceeded(ValueError):
    """A user already has as many unfinished requests as one may (`max_seqs_per_user`)."""


class EarliestDeadline(Policy):
    def __init__(self, default_deadline: float) -> None:
        super().__init__("deadline", 0)
        self.default_deadline = default_deadline

    def urgency(self, request: Request, step: int, arrival: int, level: float | None = None) -> Urgency:
        # Computed as it arrives: now is its arrival.
        due = time.monotonic() + self.default_deadline if request.due is None else request.due
        return (due, arrival)


class ShortestPrompt(Policy):
    def __init__(self, aging_steps: int, cache: RadixCache | None) -> None:
        super().__init__("sjf", aging_steps)
        self.cache = cache

    def urgency(self, request: Request, step: int, arrival: int, level: float | None = None) -> Urgency:
        return super().urgency(request, step, arrival, math.log2(self.remaining_tokens(request)))

    def remaining_tokens(self, request: Request) -> int:
        """Prompt tokens still to compute: those the prefix cache does not hold now."""
        if self.cache is None:
            return request.num_prompt_tokens
        pages = self.cache.match(request.token_ids[: request.num_reusable_tokens])
        self.cache.allocator.release(pages)  # only looked at: admission matches again
        return request.num_prompt_tokens - len(pages) * self.cache.page_size


class UnfinishedByUser:
    """Who has how many unfinished requests. Each count walks the requests seen, dropping
    the finished ones: O(unfinished requests) per arrival, and nothing kept for long."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    def count(self, user: str | None) -> int:
        self.requests = [r for r in self.requests if r.status is not Status.FINISHED]
        return sum(request.user == user for request in self.requests)

    def add(self, request: Request) -> None:
        self.requests.append(request)


class FairShare(Policy):
    def __init__(self, aging_steps: int) -> None:
        super().__init__("fair", aging_steps)
        self.unfinished = UnfinishedByUser()

    def urgency(self, request: Request, step: int, arrival: int, level: float | None = None) -> Urgency:
        turn = self.unfinished.count(request.user)  # its user's requests ahead of it
        self.unfinished.add(request)
        return super().urgency(request, step, arrival, turn)


class PerUserCap(Policy):
    """`policy` as it is, but a user with `limit` unfinished requests is refused another."""

    def __init__(self, policy: Policy, limit: int) -> None:
        super().__init__(policy.name, policy.aging_steps)
        self.policy, self.limit = policy, limit
        self.unfinished = UnfinishedByUser()

    def check(self, priority: object, deadline: object, user: object) -> None:
        self.policy.check(priority, deadline, user)
        if self.unfinished.count(user) >= self.limit:
            who = "the shared user" if user is None else f"user {user!r}"
            raise UserLimitExceeded(
                f"{who} already has {self.limit} unfinished requests "
                f"(max_seqs_per_user={self.limit}); retry when one finishes"
            )

    def urgency(self, request: Request, step: int, arrival: int, level: float | None = None) -> Urgency:
        self.unfinished.add(request)
        return self.policy.urgency(request, step, arrival)


def make_policy(
    name: str, aging_steps: int, default_deadline: float, cache: RadixCache | None,
    max_seqs_per_user: int | None,
) -> Policy:
    """The policy `name` (any of `config.SCHEDULING_POLICIES`), capped per user if asked."""
    policies = {
        "fcfs": lambda: Policy("fcfs", 0),
        "priority": lambda: Policy("priority", aging_steps),
        "deadline": lambda: EarliestDeadline(default_deadline),
        "sjf": lambda: ShortestPrompt(aging_steps, cache),
        "fair": lambda: FairShare(aging_steps),
    }
    policy = policies[name]()
    return policy if max_seqs_per_user is None else PerUserCap(policy, max_seqs_per_user)


def scheduling_features(config: Any, cache: RadixCache | None, runner: Any, states: Any) -> tuple:
    """What an engine whose settings (`EngineConfig`) ask for more than fcfs or priority with
    recompute schedules with: its policy, and the scheduler class (swapping's, maybe)."""
    policy = make_policy(config.scheduling_policy, config.priority_aging_steps,
                         config.default_deadline, cache, config.max_seqs_per_user)
    if config.preemption_mode == "recompute":
        return policy, Scheduler
    from nanoqwen.scheduling.swapping import swapping_scheduler

    return policy, swapping_scheduler(runner.kv_cache, config.swap_space, states)
