"""The flow of one generation request, from its queue slots to its last event.

Every generating route (chat completions, completions, the Responses API, embeddings)
ends the same way once its request is checked: reserve queue slots (429 when full),
tokenize while holding them, submit the sequences to the engine loop (429 when their user
has as many as `max_seqs_per_user` already), and wait for their
outputs, checking between outputs that the client is still there and the request within
its deadline; whatever is unfinished when the handler leaves is aborted. What differs is
only the shape of the answer, which an `Answer` gives: one JSON document from the final
outputs, or a stream of Server-Sent Events — an opening, events as outputs arrive, a
closing, and the error events of a stream that fails after its `200`.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from nanoqwen.engine import EncodedPrompt
from nanoqwen.outputs import RequestOutput
from nanoqwen.sampling.params import PoolingParams, SamplingParams
from nanoqwen.scheduling.policies import UserLimitExceeded
from nanoqwen.server import protocol
from nanoqwen.server.engine_loop import (
    NotServing,
    QueueFull,
    RequestFailed,
    Reservation,
    Submission,
)
from nanoqwen.server.plumbing import Event, EventStream, HTTPHandler
from nanoqwen.server.protocol import APIError, GenerationOptions, bad_request

POLL_SECONDS = 0.25  # how often a handler waiting for tokens checks its client and deadline
RETRY_AFTER_SECONDS = 1


class Answer(EventStream, Protocol):
    """A generating route's answer: whole, or as events (see the module docstring)."""

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]: ...
    def opening_events(self, count: int) -> list[Event]: ...
    def output_events(self, index: int, output: RequestOutput) -> list[Event]: ...
    def closing_events(self) -> list[Event]: ...


class GenerationHandler(HTTPHandler):
    """An HTTP handler that runs requests through the engine loop and answers them."""

    def _as_api_error(self, error: Exception) -> APIError:
        if isinstance(error, QueueFull):
            return APIError(
                429, "too many requests are queued; retry later", "rate_limit_error",
                code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        if isinstance(error, NotServing):
            return protocol.not_serving(str(error))
        if isinstance(error, RequestFailed):
            if error.reason is not None:  # the request's own doing (its grammar)
                return APIError(400, error.reason, code="request_failed")
            return protocol.internal_error(self.record.request_id)  # the loop has logged it
        return super()._as_api_error(error)

    def _still_wanted(self) -> None:
        """Raise unless someone still waits for this request: its client is there
        (ClientDisconnected) and the server serving (NotServing)."""
        self._check_client()
        state = self.server.engine_loop.state
        if state != "serving":
            raise NotServing(f"the engine loop has {state}")

    def _name_request(self, prefix: str) -> str:
        """Give the request its id (`prefix` and random hex): answers, engine requests and
        the log all use it."""
        self.record.request_id = f"{prefix}{uuid.uuid4().hex[:24]}"
        return self.record.request_id

    def _generate(self, answer: Answer, reservation: Reservation, prompts: list[EncodedPrompt],
                  options: GenerationOptions) -> None:
        self.record.samples_per_prompt = len(options.params)
        # Choices are ordered prompt by prompt, then sample by sample, as OpenAI orders them.
        sequences = [(prompt, params) for prompt in prompts for params in options.params]
        with self._submitted(reservation, sequences, options.scheduling) as submission:
            if options.stream:
                self._stream(answer, submission)
            else:
                self._send_json(200, answer.response(self._collect(submission)))
            self.server.metrics.request_duration.observe(time.perf_counter() - self.record.start)

    def _reserve(self, count: int) -> Reservation:
        """Queue slots for a request of `count` sequences, held from before its tokenizing
        (a 429 when the queue is full)."""
        loop = self.server.engine_loop
        if count > loop.capacity:
            raise bad_request(f"{count} sequences asked for; this server holds {loop.capacity}")
        per_user = self.server.engine.config.max_seqs_per_user
        if per_user is not None and count > per_user:
            raise bad_request(f"{count} sequences asked for; this server allows {per_user} "
                              "per user at once")
        return loop.reserve(count)

    def _user(self, given: str | None) -> str | None:
        """Whom a request counts for (fair turns, per-user caps): its `user` field, else its
        API key (as a digest: the key itself goes nowhere), else no one: the shared user."""
        if given is not None or self.server.settings.api_key is None:
            return given
        token = self.headers.get("Authorization", "").partition(" ")[2].strip()
        return "key-" + hashlib.sha256(token.encode()).hexdigest()[:16]

    @contextmanager
    def _submitted(
        self, reservation: Reservation,
        sequences: list[tuple[EncodedPrompt, SamplingParams | PoolingParams]],
        scheduling: dict[str, Any],
    ) -> Iterator[Submission]:
        """Hand the sequences to the engine, with `add_request`'s `scheduling` arguments
        (its `user` resolved by `_user`); whatever is unfinished on leaving (the client
        left, timed out, or something failed) is aborted."""
        scheduling = {**scheduling, "user": self._user(scheduling.get("user"))}
        try:
            submission = reservation.submit(sequences, self.record.request_id, scheduling)
        except UserLimitExceeded as error:
            raise APIError(
                429, str(error), "rate_limit_error", code="user_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from error
        except ValueError as error:  # the engine refused the input
            raise bad_request(str(error), protocol.named_parameter(str(error))) from error
        samples = self.record.samples_per_prompt
        self.record.prompt_lengths = [len(prompt.token_ids) for prompt, _ in sequences[::samples]]
        try:
            yield submission
        finally:
            if submission.unfinished:
                self.server.engine_loop.abort(submission.unfinished)

    def _collect(self, submission: Submission) -> list[RequestOutput]:
        for _ in self._follow(submission):
            pass
        return [self.record.latest[i] for i in range(len(submission.request_ids))]

    def _stream(self, answer: Answer, submission: Submission) -> None:
        self.event_stream = answer
        self._send_head(200, "text/event-stream; charset=utf-8", {"Cache-Control": "no-cache"})
        for event in answer.opening_events(len(submission.request_ids)):
            self._send_event(event)
        for index, output in self._follow(submission):
            for event in answer.output_events(index, output):
                self._send_event(event)
        self._decide_status(200)  # every output is in: what is left to send can't fail it
        for event in answer.closing_events():
            self._send_event(event)

    def _follow(self, submission: Submission) -> Iterator[tuple[int, RequestOutput]]:
        """Yield (choice index, output) as outputs arrive, until every choice has finished.

        Raises ClientDisconnected when the client has gone and 504 past the deadline; the
        caller then aborts what is unfinished.
        """
        index_of = {request_id: i for i, request_id in enumerate(submission.request_ids)}
        timeout = self.server.settings.request_timeout
        deadline = None if timeout is None else self.record.start + timeout
        next_check = 0.0
        while submission.unfinished:
            # Once per poll period, not per token: a stream's writes notice a gone client
            # anyway, and every system call a token costs competes with the engine's step.
            if time.perf_counter() >= next_check:
                self._check_client()
                next_check = time.perf_counter() + POLL_SECONDS
            wait = POLL_SECONDS if deadline is None else deadline - time.perf_counter()
            output = submission.next_output(timeout=min(max(wait, 0.0), POLL_SECONDS))
            if output is not None:
                index = index_of[output.request_id]
                self._on_output(index, output)
                yield index, output
            elif deadline is not None and time.perf_counter() >= deadline:
                raise APIError(
                    504, f"the request did not finish within {timeout:g} s and was aborted",
                    "timeout_error", code="request_timeout",
                )

    def _on_output(self, index: int, output: RequestOutput) -> None:
        record, metrics = self.record, self.server.metrics
        record.latest[index] = output
        if not output.delta_token_ids:
            return
        now = time.perf_counter()
        previous = record.last_token_at.get(index)
        if previous is None:
            metrics.time_to_first_token.observe(now - record.start)
            record.first_token_at = record.first_token_at or now
        else:
            gap = (now - previous) / len(output.delta_token_ids)
            for _ in output.delta_token_ids:
                metrics.inter_token_latency.observe(gap)
        record.last_token_at[index] = now
