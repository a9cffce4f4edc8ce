"""An OpenAI-compatible HTTP server: many client threads, one engine thread.

`LLMEngine` batches many requests into every step, but it is a plain object that only one
thread may touch. An HTTP server is most simply written one thread per connection, each
blocking on its own client. This module joins the two:

    handler threads (one per connection)         engine thread (exactly one)
    parse and validate the JSON
    submit  ────────── command queue ─────────►  add_request / abort / stats
                                                 step() ──► RequestOutputs
    block on its own output queue ◄──────────── route each output by request id
    answer: one JSON document, or an SSE stream with one event per delta

* **Commands.** Other threads never call the engine. They put a *command* (a function of
  the engine, plus a `Future` for its result) on one queue. Between steps the engine
  thread runs every queued command; with no work at all it blocks on that queue, so an
  idle server burns no CPU. An engine error inside a command (a prompt too long) comes
  back through the Future and becomes a 400.
* **Per-request queues.** Every HTTP request owns one queue of `RequestOutput`s, shared by
  its choices (several prompts, or `n` samples). The handler turns what arrives into a
  response: a JSON document, or Server-Sent Events (`data: {chunk}\\n\\n` per delta,
  `data: [DONE]` at the end) exactly as OpenAI shapes them, so the `openai` client works.
* **Cancellation.** Nobody will read a request whose client has gone, and it holds KV
  pages. While waiting for outputs a handler checks its socket; when the client has
  disconnected, or the request outlived `request_timeout`, it sends an abort command and
  the engine frees the pages before its next step.
* **Backpressure.** At most `max_num_seqs` sequences run and `max_queue` more may wait;
  beyond that the server answers 429 with `Retry-After` rather than queue without bound.

Invariant: every submitted engine request is either in the engine with a route to its
queue, or finished, its final output delivered and its admission slot released. So
shutting down is: stop taking commands, abort what the engine holds (which delivers a
final output to every waiting handler), then let the handlers finish their answers.

Each connection carries one request (HTTP/1.0 framing): a stream ends when the connection
closes, and no idle keep-alive connection outlives the server.
"""

from __future__ import annotations

import hmac
from importlib import resources
import json
import logging
import queue
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar, TypeVar

import torch

from nanoqwen.engine import LLMEngine, Prompt, RequestOutput
from nanoqwen.metrics import ServerMetrics
from nanoqwen.sampler import SamplingParams

logger = logging.getLogger("nanoqwen.server")

DEFAULT_MAX_QUEUE = 256
MAX_BODY_BYTES = 4 << 20  # a full context of token ids, as JSON, fits easily
MAX_DISCARD_BYTES = 64 << 20  # past this, a rejected body is not worth reading to the end
DISCARD_TIMEOUT_SECONDS = 2.0
SOCKET_TIMEOUT_SECONDS = 60.0  # a client that neither sends nor reads for this long is dropped
POLL_SECONDS = 0.25  # how often a handler waiting for tokens checks its client and deadline
RETRY_AFTER_SECONDS = 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SAMPLES_PER_PROMPT = 128  # OpenAI's limit on n

# Request fields passed to SamplingParams as they are; it validates them and names the culprit.
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "presence_penalty", "frequency_penalty",
)
# Accepted by OpenAI but not implemented here: refuse them rather than silently ignore them.
UNSUPPORTED_FIELDS = ("logprobs", "top_logprobs", "logit_bias", "tools", "echo", "suffix")

T = TypeVar("T")

# `GET /` serves a whole chat client in one page: fetch() streams the SSE response, the
# conversation lives in the browser and is sent in full every turn, and Stop aborts the
# fetch (which the server sees as a disconnect, and aborts the request).
CHAT_PAGE = (resources.files("nanoqwen") / "chat.html").read_bytes()


class APIError(Exception):
    """An error answered to the client as OpenAI shapes it."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def not_serving() -> APIError:
    return APIError(503, "the server is shutting down", "server_error", code="not_serving")


class ClientDisconnected(Exception):
    """The client closed its connection: there is nobody left to answer."""


# ---------------------------------------------------------------------------- engine thread
@dataclass(eq=False)
class Submission:
    """The engine requests behind one HTTP request, and the queue their outputs arrive on."""

    request_ids: list[str]  # in choice order
    outputs: queue.SimpleQueue[RequestOutput | Exception]
    unfinished: set[str] = field(init=False)

    def __post_init__(self) -> None:
        self.unfinished = set(self.request_ids)

    def next_output(self, timeout: float) -> RequestOutput | None:
        """The next output of any choice, or None if none came within `timeout` seconds."""
        try:
            item = self.outputs.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, Exception):
            raise APIError(500, f"the engine failed: {item}", "server_error") from item
        if item.finished:
            self.unfinished.discard(item.request_id)
        # A handler stops reading once it asks for an abort, so an abort it sees came from
        # the server stopping.
        if item.finish_reason == "abort":
            raise not_serving()
        return item


class EngineLoop:
    """The one thread that drives the engine; other threads talk to it through commands."""

    _STOP = None  # the command that ends the loop

    def __init__(self, engine: LLMEngine, capacity: int) -> None:
        self.engine = engine
        self.capacity = capacity  # engine requests admitted at once, running plus waiting
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future] | None] = (
            queue.SimpleQueue()
        )
        self._routes: dict[str, queue.SimpleQueue] = {}  # touched by the engine thread only
        self._lock = threading.Lock()  # guards _stopped and _num_admitted
        self._stopped = False
        self._num_admitted = 0
        self._thread = threading.Thread(target=self._run, name="nanoqwen-engine", daemon=True)

    # ------------------------------------------------------------ called by other threads
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Abort everything in flight (each handler gets its final output) and end the thread."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._commands.put(self._STOP)
        self._thread.join()

    @property
    def is_serving(self) -> bool:
        with self._lock:
            return not self._stopped

    def call(self, function: Callable[[LLMEngine], T]) -> T:
        """Run `function(engine)` on the engine thread; return its result or raise its error."""
        return self._enqueue(function).result()

    def abort(self, request_ids: Iterable[str]) -> None:
        """Have these requests aborted before the next step; does not wait."""
        ids = list(request_ids)
        self._enqueue(lambda engine: self._abort_now(engine, ids))

    def submit(self, sequences: list[tuple[Prompt, SamplingParams]], id_prefix: str) -> Submission:
        """Add one engine request per (prompt, params), all or none; 429 when full."""
        count = len(sequences)
        if count > self.capacity:
            raise bad_request(f"{count} sequences asked for; this server holds {self.capacity}")
        with self._lock:
            if self._num_admitted + count > self.capacity:
                raise APIError(
                    429, "too many requests are queued; retry later", "rate_limit_error",
                    code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                )
            self._num_admitted += count
        outputs: queue.SimpleQueue[RequestOutput | Exception] = queue.SimpleQueue()
        try:
            ids = self.call(lambda engine: self._add(engine, sequences, id_prefix, outputs))
        except ValueError as error:  # the engine refused the prompt or its parameters
            self._release(count)
            raise bad_request(str(error)) from error
        except BaseException:
            self._release(count)
            raise
        return Submission(ids, outputs)

    def _enqueue(self, function: Callable[[LLMEngine], Any]) -> Future:
        future: Future = Future()
        with self._lock:
            if self._stopped:
                future.set_exception(not_serving())
            else:
                self._commands.put((function, future))
        return future

    def _release(self, count: int) -> None:
        with self._lock:
            self._num_admitted -= count

    # ------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        if self.engine.device.type == "cuda":  # the current CUDA device is set per thread
            torch.cuda.set_device(self.engine.device)
        try:
            while self._run_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
            self._abort_now(self.engine, list(self._routes))
        except Exception as error:  # an engine in an unknown state is not trusted again
            logger.exception("the engine failed; no more requests will be served")
            self._fail_everything(error)

    def _run_commands(self, block: bool) -> bool:
        """Run every queued command, first waiting for one if `block`; False once told to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while command is not self._STOP:
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
        engine: LLMEngine,
        sequences: list[tuple[Prompt, SamplingParams]],
        id_prefix: str,
        outputs: queue.SimpleQueue,
    ) -> list[str]:
        ids: list[str] = []
        try:
            for index, (prompt, params) in enumerate(sequences):
                ids.append(engine.add_request(prompt, params, request_id=f"{id_prefix}-{index}"))
        except ValueError:
            self._abort_now(engine, ids)  # all or none: a bad third prompt fails the request
            raise
        for request_id in ids:
            self._routes[request_id] = outputs
        return ids

    def _abort_now(self, engine: LLMEngine, request_ids: list[str]) -> None:
        finals = [engine.abort(request_id) for request_id in request_ids]
        self._deliver([output for output in finals if output is not None])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:  # rolled back in `_add` before it was ever routed
                continue
            route.put(output)
            if output.finished:
                del self._routes[output.request_id]
                self._release(1)

    def _fail_everything(self, error: Exception) -> None:
        with self._lock:
            self._stopped = True
        for route in self._routes.values():
            route.put(error)
        self._routes.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not self._STOP:
                command[1].set_exception(not_serving())


# ---------------------------------------------------------------------------- request parsing
@dataclass
class GenerationOptions:
    """What a completion request asks for besides its prompt."""

    params: list[SamplingParams]  # one per sample of a prompt (`n` of them)
    stream: bool
    include_usage: bool


def parse_generation_options(body: dict[str, Any], default_max_tokens: int) -> GenerationOptions:
    for name in UNSUPPORTED_FIELDS:
        if body.get(name):
            raise bad_request(f"{name} is not supported by this server", name)
    stream = _field(body, "stream", bool, "a boolean", False)
    stream_options = _field(body, "stream_options", dict, "an object", {})
    include_usage = _field(
        stream_options, "include_usage", bool, "a boolean", False, "stream_options.include_usage"
    )
    n = _field(body, "n", int, "an integer", 1)
    if not 1 <= n <= MAX_SAMPLES_PER_PROMPT:
        raise bad_request(f"n must be in [1, {MAX_SAMPLES_PER_PROMPT}], got {n}", "n")
    # max_completion_tokens is the newer name of max_tokens.
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    fields = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    try:
        params = SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens, **fields
        )
        # With a seed, the n samples still differ: each gets its own seed.
        samples = [params if params.seed is None else replace(params, seed=params.seed + i)
                   for i in range(n)]
    except ValueError as error:
        raise bad_request(str(error), _named_parameter(str(error))) from error
    return GenerationOptions(samples, stream, include_usage)


def parse_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    return [_parse_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def parse_enable_thinking(body: dict[str, Any]) -> bool | None:
    """Qwen3's switch, passed as vLLM does: `chat_template_kwargs: {"enable_thinking": false}`."""
    template_kwargs = _field(body, "chat_template_kwargs", dict, "an object", {})
    return _field(
        template_kwargs, "enable_thinking", bool, "a boolean", None,
        "chat_template_kwargs.enable_thinking",
    )


def parse_prompts(body: dict[str, Any]) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, str) for item in prompt):
            return list(prompt)
        if all(_is_token_id(item) for item in prompt):
            return [prompt]
        if all(isinstance(item, list) and all(map(_is_token_id, item)) for item in prompt):
            return list(prompt)
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of them",
        "prompt",
    )


def _parse_message(message: object, param: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise bad_request(f"{param} must be an object", param)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise bad_request(f"{param}.role must be a non-empty string", f"{param}.role")
    return {"role": role, "content": _message_text(message.get("content"), f"{param}.content")}


def _message_text(content: object, param: str) -> str:
    if content is None:  # an assistant turn that only called tools
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise bad_request(f"{param} must be a string or a list of text parts", param)


def _field(
    container: dict[str, Any],
    name: str,
    kind: type,
    description: str,
    default: Any,
    param: str | None = None,
) -> Any:
    """`container[name]`, checked to be a `kind`; `default` when absent or null."""
    value = container.get(name)
    if value is None:
        return default
    # bool is a subclass of int, but `"n": true` is a mistake, not 1.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise bad_request(f"{param or name} must be {description}, got {value!r}", param or name)
    return value


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _named_parameter(message: str) -> str | None:
    """SamplingParams' messages begin with the parameter's name."""
    first_word = message.split(" ", 1)[0]
    return first_word if first_word in (*SAMPLING_FIELDS, "max_tokens") else None


# ---------------------------------------------------------------------------- response shapes
class CompletionsAPI:
    """/v1/completions: each choice carries `text`, in responses and chunks alike."""

    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def delta_choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return self.choice(index, text, finish_reason)

    def opening_choices(self, count: int) -> list[dict[str, Any]]:
        return []


class ChatAPI:
    """/v1/chat/completions: a `message` per choice; a stream opens with the role, then deltas."""

    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        return {
            "index": index, "message": message, "logprobs": None, "finish_reason": finish_reason
        }

    def delta_choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def opening_choices(self, count: int) -> list[dict[str, Any]]:
        opening = {"role": "assistant", "content": ""}
        return [{"index": i, "delta": opening, "logprobs": None, "finish_reason": None}
                for i in range(count)]


API = CompletionsAPI | ChatAPI


@dataclass(frozen=True)
class Reply:
    """Builds one request's response objects: the whole response, or its stream chunks."""

    api: API
    response_id: str
    model: str
    created: int
    include_usage: bool

    def response(self, outputs: list[RequestOutput], usage: dict[str, Any]) -> dict[str, Any]:
        choices = [self.api.choice(i, out.text, out.finish_reason) for i, out in enumerate(outputs)]
        return self._envelope(self.api.object, choices, usage=usage)

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        # With include_usage OpenAI sends "usage": null in every chunk but the last.
        return self._envelope(
            self.api.chunk_object, choices, **({"usage": None} if self.include_usage else {})
        )

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._envelope(self.api.chunk_object, [], usage=usage)

    def _envelope(self, object_name: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.response_id, "object": object_name, "created": self.created,
            "model": self.model, "choices": choices, **extra,
        }


@dataclass
class RequestRecord:
    """One HTTP request as the access log and the latency metrics see it."""

    client: str
    method: str
    path: str
    start: float = field(default_factory=time.perf_counter)
    status: int | None = None  # None until a status line was sent
    response_id: str = "-"
    samples_per_prompt: int = 1
    latest: dict[int, RequestOutput] = field(default_factory=dict)  # each choice's newest output
    first_token_at: float | None = None
    last_token_at: dict[int, float] = field(default_factory=dict)
    outcome: str = ""

    def on_output(self, index: int, output: RequestOutput, metrics: ServerMetrics) -> None:
        self.latest[index] = output
        if not output.delta_token_ids:
            return
        now = time.perf_counter()
        previous = self.last_token_at.get(index)
        if previous is None:
            metrics.time_to_first_token.observe(now - self.start)
            self.first_token_at = self.first_token_at or now
        else:
            gap = (now - previous) / len(output.delta_token_ids)
            for _ in output.delta_token_ids:
                metrics.inter_token_latency.observe(gap)
        self.last_token_at[index] = now

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage block; the `n` samples of a prompt count its tokens once."""
        firsts = [out for i, out in self.latest.items() if i % self.samples_per_prompt == 0]
        prompt_tokens = sum(len(out.prompt_token_ids) for out in firsts)
        completion_tokens = sum(len(out.token_ids) for out in self.latest.values())
        cached_tokens = sum(out.num_cached_tokens for out in firsts)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    def log_line(self) -> str:
        usage = self.usage()
        ttft = "-" if self.first_token_at is None else f"{self.first_token_at - self.start:.3f}s"
        total = time.perf_counter() - self.start
        outcome = self.outcome or ",".join(
            f"finish={out.finish_reason}" for out in self.latest.values() if out.finished
        )
        # 499, as nginx logs it: the client left before any status was sent.
        return (
            f"{self.client} {self.method} {self.path} {self.status or 499} {self.response_id} "
            f"prompt_tokens={usage['prompt_tokens']} "
            f"completion_tokens={usage['completion_tokens']} "
            f"ttft={ttft} total={total:.3f}s {outcome}"
        ).rstrip()


# ---------------------------------------------------------------------------- HTTP
@contextmanager
def _client_writes() -> Iterator[None]:
    """A failed write means the client went away."""
    try:
        yield
    except OSError as error:
        raise ClientDisconnected from error


class Handler(BaseHTTPRequestHandler):
    """One connection, one request: route it, answer it, log it."""

    server: OpenAIServer
    protocol_version = "HTTP/1.0"
    server_version = "nanoqwen"
    timeout = SOCKET_TIMEOUT_SECONDS

    def _handle(self) -> None:
        self.record = RequestRecord(self.client_address[0], self.command, self.path)
        self._streaming = False
        self._unread_body = 0
        try:
            self._unread_body = self._declared_body_length()
            self._dispatch()
        except ClientDisconnected:
            self.record.outcome = "client disconnected"
        except APIError as error:
            self._send_error(error)
        except Exception:
            logger.exception("unexpected error in %s %s", self.command, self.path)
            self._send_error(APIError(500, "internal server error", "server_error"))
        finally:
            self._discard_unread_body()
            if self.record.status is None:
                self.server.metrics.requests.inc(status="499")
            logger.info(self.record.log_line())

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """Silenced: `_handle` logs one line per request with more in it."""

    def _dispatch(self) -> None:
        path = self.path.split("?", 1)[0]
        methods = self.ROUTES.get(path)
        if methods is None:
            raise APIError(404, f"no route {path}", "not_found_error", code="not_found")
        route = methods.get(self.command)
        if route is None:
            allowed = ", ".join(methods)
            raise APIError(
                405, f"{self.command} is not allowed on {path}; use {allowed}",
                code="method_not_allowed", headers={"Allow": allowed},
            )
        if path.startswith("/v1/"):
            self._authorize()
        route(self)

    # ------------------------------------------------------------ routes
    def chat_page(self) -> None:
        self._send_bytes(200, CHAT_PAGE, "text/html; charset=utf-8")

    def health(self) -> None:
        if not self.server.engine_loop.is_serving:
            raise not_serving()
        self._send_json(200, {"status": "ok"})

    def metrics(self) -> None:
        stats = self.server.engine_loop.call(lambda engine: engine.stats())
        text = self.server.metrics.render(stats)
        self._send_bytes(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def list_models(self) -> None:
        model = {
            "id": self.server.settings.model_name, "object": "model",
            "created": self.server.created, "owned_by": "nanoqwen",
            "max_model_len": self.server.engine.max_model_len,
        }
        self._send_json(200, {"object": "list", "data": [model]})

    def chat_completions(self) -> None:
        body = self._read_json()
        messages = parse_messages(body)
        enable_thinking = parse_enable_thinking(body)
        options = parse_generation_options(body, self.server.engine.max_model_len)
        prompt = self._render_chat(messages, enable_thinking)
        self._generate(ChatAPI(), [prompt], options)

    def completions(self) -> None:
        body = self._read_json()
        prompts = parse_prompts(body)
        options = parse_generation_options(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
        self._generate(CompletionsAPI(), prompts, options)

    ROUTES: ClassVar[dict[str, dict[str, Callable[[Handler], None]]]] = {
        "/": {"GET": chat_page},
        "/health": {"GET": health},
        "/metrics": {"GET": metrics},
        "/v1/models": {"GET": list_models},
        "/v1/chat/completions": {"POST": chat_completions},
        "/v1/completions": {"POST": completions},
    }

    # ------------------------------------------------------------ generation
    def _render_chat(
        self, messages: list[dict[str, str]], enable_thinking: bool | None
    ) -> list[int]:
        # On the engine thread: a fast tokenizer is not safe to use from many threads at once.
        try:
            return self.server.engine_loop.call(
                lambda engine: engine.tokenizer.apply_chat_template(messages, enable_thinking)
            )
        except APIError:
            raise
        except Exception as error:  # the template itself refused (say, roles out of order)
            raise bad_request(f"cannot apply the chat template: {error}", "messages") from error

    def _generate(self, api: API, prompts: list[Prompt], options: GenerationOptions) -> None:
        response_id = f"{api.id_prefix}-{uuid.uuid4().hex[:24]}"
        self.record.response_id = response_id
        self.record.samples_per_prompt = len(options.params)
        # Choices are ordered prompt by prompt, then sample by sample, as OpenAI orders them.
        sequences = [(prompt, params) for prompt in prompts for params in options.params]
        submission = self.server.engine_loop.submit(sequences, response_id)
        reply = Reply(
            api, response_id, self.server.settings.model_name, int(time.time()),
            options.include_usage,
        )
        try:
            if options.stream:
                self._stream(reply, submission)
            else:
                finals = self._collect(submission)
                self._send_json(200, reply.response(finals, self.record.usage()))
            self.server.metrics.request_duration.observe(time.perf_counter() - self.record.start)
        finally:
            if submission.unfinished:  # the client left, timed out, or something failed
                self.server.engine_loop.abort(submission.unfinished)

    def _collect(self, submission: Submission) -> list[RequestOutput]:
        for _ in self._follow(submission):
            pass
        return [self.record.latest[i] for i in range(len(submission.request_ids))]

    def _stream(self, reply: Reply, submission: Submission) -> None:
        self._start_event_stream()
        opening = reply.api.opening_choices(len(submission.request_ids))
        if opening:
            self._send_event(reply.chunk(opening))
        for index, output in self._follow(submission):
            if output.delta_text or output.finished:
                choice = reply.api.delta_choice(index, output.delta_text, output.finish_reason)
                self._send_event(reply.chunk([choice]))
        if reply.include_usage:
            self._send_event(reply.usage_chunk(self.record.usage()))
        self._send_event("[DONE]")

    def _follow(self, submission: Submission) -> Iterator[tuple[int, RequestOutput]]:
        """Yield (choice index, output) as outputs arrive, until every choice has finished.

        Raises ClientDisconnected when the client has gone and 504 past the deadline; the
        caller then aborts what is unfinished.
        """
        index_of = {request_id: i for i, request_id in enumerate(submission.request_ids)}
        timeout = self.server.settings.request_timeout
        deadline = None if timeout is None else self.record.start + timeout
        while submission.unfinished:
            if self._client_disconnected():
                raise ClientDisconnected
            wait = POLL_SECONDS if deadline is None else deadline - time.perf_counter()
            output = submission.next_output(timeout=min(max(wait, 0.0), POLL_SECONDS))
            if output is not None:
                index = index_of[output.request_id]
                self.record.on_output(index, output, self.server.metrics)
                yield index, output
            elif deadline is not None and time.perf_counter() >= deadline:
                raise APIError(
                    504, f"the request did not finish within {timeout:g} s and was aborted",
                    "timeout_error", code="request_timeout",
                )

    def _client_disconnected(self) -> bool:
        """True once the client has closed (or reset) its end of the connection.

        A waiting client sends nothing, so a socket that turns readable yet has no bytes to
        peek at has reached end-of-file.
        """
        readable, _, _ = select.select([self.connection], [], [], 0)
        if not readable:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    # ------------------------------------------------------------ reading
    def _declared_body_length(self) -> int:
        value = self.headers.get("Content-Length", "0").strip()
        if not (value.isascii() and value.isdigit()):
            raise bad_request(f"Content-Length must be a non-negative integer, got {value!r}")
        return int(value)

    def _read_json(self) -> dict[str, Any]:
        if "Content-Length" not in self.headers:
            raise APIError(411, "a Content-Length header is required", code="length_required")
        length, limit = self._unread_body, self.server.settings.max_body_bytes
        if length > limit:
            raise APIError(
                413, f"the request body has {length} bytes; the limit is {limit}",
                code="request_too_large",
            )
        try:
            raw = self.rfile.read(length)
        except OSError as error:
            raise ClientDisconnected from error
        self._unread_body = 0
        if len(raw) < length:
            raise ClientDisconnected
        try:
            body = json.loads(raw)
        except ValueError as error:  # also catches bytes that are not UTF-8
            raise bad_request(f"the request body is not valid JSON: {error}") from error
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        return body

    def _authorize(self) -> None:
        key = self.server.settings.api_key
        if key is None:
            return
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        # compare_digest: the time taken must not reveal how much of a guess was right.
        matches = hmac.compare_digest(token.strip().encode(), key.encode())
        if scheme.lower() != "bearer" or not matches:
            raise APIError(
                401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                "authentication_error", code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def _discard_unread_body(self) -> None:
        """Read and drop a body that was answered unread (404, 413, ...): closing a socket
        with unread bytes resets the connection, and the client could lose our answer."""
        remaining = min(self._unread_body, MAX_DISCARD_BYTES)
        try:
            self.connection.settimeout(DISCARD_TIMEOUT_SECONDS)
            while remaining > 0:
                chunk = self.rfile.read(min(remaining, 1 << 16))
                if not chunk:
                    return
                remaining -= len(chunk)
        except OSError:
            return

    # ------------------------------------------------------------ writing
    def _send_json(
        self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        body = json.dumps(payload, ensure_ascii=False).encode()
        self._send_bytes(status, body, "application/json", headers)

    def _send_bytes(
        self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self._set_status(status)
        with _client_writes():
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

    def _start_event_stream(self) -> None:
        self._set_status(200)
        self._streaming = True
        with _client_writes():
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()

    def _set_status(self, status: int) -> None:
        # Counted before it is sent, so a client never sees an answer the metrics lack.
        self.record.status = status
        self.server.metrics.requests.inc(status=str(status))

    def _send_event(self, payload: dict[str, Any] | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
        with _client_writes():
            self.wfile.write(f"data: {data}\n\n".encode())

    def _send_error(self, error: APIError) -> None:
        self.record.outcome = f"error: {error.message}"
        try:
            if self._streaming:  # the status line is long gone: report it in the stream
                self._send_event(error.body())
            else:
                self._send_json(error.status, error.body(), error.headers)
        except ClientDisconnected:
            self.record.outcome += " (client disconnected)"


# ---------------------------------------------------------------------------- the server
@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # what /v1/models lists and responses echo
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    max_queue: int = DEFAULT_MAX_QUEUE  # sequences that may wait beyond max_num_seqs
    request_timeout: float | None = None  # seconds before an unfinished request is aborted
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset for no key)")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")


class OpenAIServer(ThreadingHTTPServer):
    """A thread per connection, plus the engine thread.

    `serve_forever()` answers requests until `shutdown()`; `server_close()` then aborts
    what is in flight, stops the engine thread, closes the socket and waits for every
    handler thread to finish its answer.
    """

    daemon_threads = False  # so server_close() can wait for the handlers
    # The listen backlog. http.server's default of 5 makes a burst of clients wait for
    # (or, on a busy machine, fail) TCP retransmits before they are even accepted.
    request_queue_size = 1024

    def __init__(
        self, address: tuple[str, int], engine: LLMEngine, settings: ServerSettings
    ) -> None:
        super().__init__(address, Handler)
        self.engine = engine
        self.settings = settings
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self.engine_loop = EngineLoop(engine, engine.config.max_num_seqs + settings.max_queue)
        self.engine_loop.start()

    def server_close(self) -> None:
        self.engine_loop.stop()
        super().server_close()


def make_server(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    request_timeout: float | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    **engine_options: Any,
) -> OpenAIServer:
    """Load `model` into an engine and bind a server to (host, port); port 0 picks a free one.

    `engine_options` go to `LLMEngine` (device, dtype, max_num_seqs, ...). The server is
    bound but not yet serving: run `serve_forever()`, e.g. in a thread.
    """
    settings = ServerSettings(
        served_model_name or model, api_key, max_queue, request_timeout, max_body_bytes
    )
    engine = LLMEngine(model, **engine_options)
    return OpenAIServer((host, port), engine, settings)
