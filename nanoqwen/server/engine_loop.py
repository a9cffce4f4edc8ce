"""The engine thread: how many blocking client threads share one engine.

`LLMEngine` batches many requests into every step, but only one thread may touch it; an
HTTP server is most simply one thread per connection, blocking on its client.
`EngineLoop` joins the two:

    handler threads (one per connection)         engine thread (exactly one)
                                                 build the engine (load the model)
    parse and validate the request
    reserve its queue slots (or 429)
    tokenize the prompt
    submit  ────────── command queue ─────────►  add_request / abort / stats
                                                 step() ──► RequestOutputs
    block on its own output queue ◄──────────── route each output by request id

Other threads never call the engine: they queue *commands* (a function of the engine and
a `Future`), which the engine thread runs between steps, blocking on the queue when idle.
Commands must be quick; tokenizing and templating happen on the handler thread first. Each
submission (one HTTP request: several prompts, or `n` samples) owns one output queue. At
most `capacity` engine requests are admitted at once, beyond that `reserve` raises
`QueueFull`. A request takes its slots before it is tokenized (a `Reservation`), since
tokenizing a long prompt is work too: a flood of them meets the same limit as requests
waiting for the engine, instead of slowing everyone's handler threads. A step that fails
raises `StepError`: the loop aborts its requests, hands their handlers a `RequestFailed`
and keeps serving; any other failure stops the loop for good (`NotServing`; `state` says
"failed").

The engine thread also builds the engine, before its first step: the thread that runs
torch's parallel CPU work must be one and the same throughout. OpenMP gives every thread
that runs a parallel op a team of worker threads of its own, and once a process has more
of them than cores, the teams stop spinning between ops and sleep; a model loaded on the
main thread and stepped on another made every step slower (docs/benchmarks.md).

Invariant: every admitted engine request is either in the engine with a route to its
queue, or finished, with its final output (or failure) delivered and its admission slot
released. So stopping is: stop taking commands, abort what the engine holds, end the
thread. The story: docs/learn/15-server.md.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch

from nanoqwen.engine import EncodedPrompt, LLMEngine
from nanoqwen.outputs import RequestOutput, StepError
from nanoqwen.sampling.params import PoolingParams, SamplingParams

logger = logging.getLogger("nanoqwen.server")

T = TypeVar("T")
State = Literal["serving", "stopped", "failed"]


class NotServing(Exception):
    """The loop has stopped (the server is shutting down, or the engine failed for good)."""


class QueueFull(Exception):
    """Admitting these requests would exceed the loop's capacity; retry later."""


class RequestFailed(Exception):
    """This request could not be finished, and the server goes on: the engine failed while
    computing it (it was aborted; `reason` is None), or the request itself could not go on
    (finish_reason "error": its grammar allowed no next token; `reason` says so)."""

    def __init__(self, request_id: str, reason: str | None = None) -> None:
        super().__init__(reason or f"the engine failed while computing request {request_id}")
        self.request_id, self.reason = request_id, reason


Output = RequestOutput | NotServing | RequestFailed


@dataclass(eq=False)
class Submission:
    """The engine requests behind one HTTP request, and the queue their outputs arrive on."""

    request_ids: list[str]  # in choice order
    outputs: queue.SimpleQueue[Output]
    unfinished: set[str] = field(init=False)

    def __post_init__(self) -> None:
        self.unfinished = set(self.request_ids)

    def next_output(self, timeout: float) -> RequestOutput | None:
        """The next output of any choice, or None if none came within `timeout` seconds.

        Raises `RequestFailed` or `NotServing` when the engine could not finish a choice.
        """
        try:
            item = self.outputs.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, RequestFailed):
            self.unfinished.discard(item.request_id)  # already aborted by the loop
            raise item
        if isinstance(item, NotServing):
            self.unfinished.clear()
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
        if item.finish_reason == "error":
            raise RequestFailed(item.request_id, item.error)
        # A handler stops reading once it asks for an abort, so an abort it sees came from
        # the server stopping.
        if item.finish_reason == "abort":
            raise NotServing("the server is shutting down")
        return item


class Reservation:
    """Admission slots held for one request while it is prepared: `submit` hands them to
    its engine requests (each releases its own when it finishes); leaving the `with` block
    without submitting gives them back."""

    def __init__(self, loop: EngineLoop, count: int) -> None:
        self.loop, self.count = loop, count
        self.held = True

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.held:
            self.held = False
            self.loop._release(self.count)

    def submit(
        self, sequences: list[tuple[EncodedPrompt, SamplingParams | PoolingParams]],
        id_prefix: str,
        scheduling: dict[str, Any] | None = None,
    ) -> Submission:
        """Add one engine request per (encoded prompt, params), as many as were reserved,
        all with the same `scheduling` arguments of `add_request` (priority, deadline,
        user), all or none.

        Raises whatever `add_request` raised (a `ValueError` for input the engine refuses)
        with nothing left behind in the engine.
        """
        if not self.held or len(sequences) != self.count:  # a bug in the caller
            raise RuntimeError("a reservation is submitted once, with the sequences it holds")
        outputs: queue.SimpleQueue[Output] = queue.SimpleQueue()
        loop = self.loop
        ids = loop.call(lambda engine: loop._add(sequences, id_prefix, scheduling or {}, outputs))
        self.held = False  # the engine requests hold the slots now
        return Submission(ids, outputs)


Command = tuple[Callable[[LLMEngine], Any], Future]


class EngineLoop:
    """The one thread that drives the engine; other threads talk to it through commands."""

    def __init__(self, build_engine: Callable[[], LLMEngine], max_queue: int) -> None:
        self._build_engine = build_engine
        self._max_queue = max_queue
        self._built: Future[LLMEngine] = Future()  # done once built, or once building failed
        self.engine: LLMEngine  # set by the engine thread, before `_built` is done
        self.capacity = 0  # engine requests admitted at once, running plus waiting: set then too
        self._commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()  # None: stop
        self._routes: dict[str, queue.SimpleQueue[Output]] = {}  # the engine thread's only
        self._lock = threading.Lock()  # guards _state and _num_admitted
        self._state: State = "serving"
        self._num_admitted = 0

    # ------------------------------------------------------------ called by other threads
    def start(self) -> LLMEngine:
        """Start the engine thread and return the engine once it has built it; raise what
        building it raised."""
        self._thread = threading.Thread(target=self._run, name="nanoqwen-engine", daemon=True)
        self._thread.start()
        while not self._built.done():  # timed: meanwhile the main thread runs a Ctrl-C's handler
            wait([self._built], timeout=0.25)
        return self._built.result()

    def stop(self) -> None:
        """Abort everything in flight (each handler gets its final output) and end the thread."""
        with self._lock:
            if self._state == "serving":
                self._state = "stopped"
                self._commands.put(None)
        if self._built.done():  # a thread still building is left to end with the process
            self._thread.join()

    @property
    def state(self) -> State:
        with self._lock:
            return self._state

    @property
    def num_admitted(self) -> int:
        """Admission slots held now: by engine requests and by requests being prepared."""
        with self._lock:
            return self._num_admitted

    def call(self, function: Callable[[LLMEngine], T]) -> T:
        """Run `function(engine)` on the engine thread; return its result or raise its error."""
        return self._enqueue(function).result()

    def abort(self, request_ids: Iterable[str]) -> None:
        """Have these requests aborted before the next step; does not wait."""
        ids = list(request_ids)
        self._enqueue(lambda engine: self._abort_now(ids))

    def reserve(self, count: int) -> Reservation:
        """Hold `count` admission slots for one request still being prepared; `QueueFull`
        past capacity. Use it as a `with` block around the preparing and the submitting."""
        with self._lock:
            if self._num_admitted + count > self.capacity:
                raise QueueFull(f"{count} more sequences would exceed {self.capacity}")
            self._num_admitted += count
        return Reservation(self, count)

    def _enqueue(self, function: Callable[[LLMEngine], Any]) -> Future:
        future: Future = Future()
        with self._lock:
            if self._state == "serving":
                self._commands.put((function, future))
            else:
                future.set_exception(NotServing(f"the engine loop has {self._state}"))
        return future

    def _release(self, count: int) -> None:
        with self._lock:
            self._num_admitted -= count

    # ------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            self.engine = self._build_engine()
        except BaseException as error:  # SystemExit too: a tensor-parallel worker's end
            self._built.set_exception(error)
            return
        self.capacity = self.engine.config.max_num_seqs + self._max_queue
        self._built.set_result(self.engine)
        if self.engine.device.type == "cuda":  # the current CUDA device is set per thread
            torch.cuda.set_device(self.engine.device)
        try:
            while self._run_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
            self._abort_now(list(self._routes))
        except Exception:  # an engine in an unknown state is not trusted again
            logger.exception("the engine failed; no more requests will be served")
            self._fail_everything()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepError as error:
            # The batch failed but the engine is sound: drop that batch's requests only.
            logger.error("%s; they are aborted", error, exc_info=error.__cause__ or error)
            for request_id in error.request_ids:
                self.engine.abort(request_id)  # frees its pages; its final output is moot
                self._close_route(request_id, RequestFailed(request_id))
            outputs = error.finished  # requests the step finished before it failed
        self._deliver(outputs)

    def _run_commands(self, block: bool) -> bool:
        """Run every queued command, first waiting for one if `block`; False once told to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while command is not None:
            function, future = command
            try:
                future.set_result(function(self.engine))
            except Exception as error:
                future.set_exception(error)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _add(
        self,
        sequences: list[tuple[EncodedPrompt, SamplingParams | PoolingParams]],
        id_prefix: str,
        scheduling: dict[str, Any],
        outputs: queue.SimpleQueue[Output],
    ) -> list[str]:
        ids: list[str] = []
        try:
            for index, (prompt_ids, params) in enumerate(sequences):
                request_id = f"{id_prefix}-{index}"
                ids.append(
                    self.engine.add_request(prompt_ids, params, request_id, **scheduling)
                )
        except BaseException:
            for request_id in ids:  # all or none: a failing third prompt fails the request
                self.engine.abort(request_id)
            raise
        for request_id in ids:
            self._routes[request_id] = outputs
        return ids

    def _abort_now(self, request_ids: list[str]) -> None:
        finals = [self.engine.abort(request_id) for request_id in request_ids]
        self._deliver([output for output in finals if output is not None])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished:
                self._close_route(output.request_id, output)
            elif output.request_id in self._routes:
                self._routes[output.request_id].put(output)

    def _close_route(self, request_id: str, last: Output) -> None:
        """Hand a request's last item to its handler and release its admission slot."""
        route = self._routes.pop(request_id, None)
        if route is not None:
            route.put(last)
            self._release(1)

    def _fail_everything(self) -> None:
        with self._lock:
            self._state = "failed"
        for request_id in list(self._routes):
            self._close_route(request_id, NotServing("the engine failed"))
        while True:  # commands queued meanwhile: tell their callers too
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None:
                command[1].set_exception(NotServing("the engine failed"))
