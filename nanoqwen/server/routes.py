"""The OpenAI routes: parse and check a request, tokenize it, submit it, answer it.

A completion request goes through three hands. On its handler thread, `protocol` checks
every field and turns the prompt (or the chat, through the model's template) into token
ids; the engine loop admits the sequences and streams their outputs back; and the handler
shapes them (`responses`) into one JSON document or an SSE stream, checking between
outputs that the client is still there and the request within its deadline.
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import Callable, Iterator
from importlib import resources
from typing import ClassVar

from nanoqwen.engine import EncodedPrompt
from nanoqwen.metrics import CONTENT_TYPE
from nanoqwen.outputs import RequestOutput
from nanoqwen.server import protocol
from nanoqwen.server.engine_loop import NotServing, QueueFull, RequestFailed, Submission
from nanoqwen.server.plumbing import HTTPHandler
from nanoqwen.server.protocol import APIError, GenerationOptions, bad_request
from nanoqwen.server.responses import API, ChatAPI, CompletionsAPI, Reply

POLL_SECONDS = 0.25  # how often a handler waiting for tokens checks its client and deadline
RETRY_AFTER_SECONDS = 1

# `GET /` serves a whole chat client in one page: fetch() streams the SSE response, the
# conversation lives in the browser and is sent in full every turn, and Stop aborts the
# fetch (which the server sees as a disconnect, and aborts the request).
CHAT_PAGE = (resources.files("nanoqwen") / "chat.html").read_bytes()


class OpenAIHandler(HTTPHandler):
    """The routes of an OpenAI-compatible server, and the generation flow behind them."""

    def _as_api_error(self, error: Exception) -> APIError:
        if isinstance(error, QueueFull):
            return APIError(
                429, "too many requests are queued; retry later", "rate_limit_error",
                code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        if isinstance(error, NotServing):
            return protocol.not_serving(str(error))
        if isinstance(error, RequestFailed):  # the engine loop has logged it
            return protocol.internal_error(self.record.request_id)
        return super()._as_api_error(error)

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

    # ------------------------------------------------------------ routes
    def _dispatch(self) -> None:
        path = self.path.split("?", 1)[0]
        methods = self.ROUTES.get(path)
        if methods is None:
            raise APIError(404, f"no route {path}", "not_found_error", code="not_found")
        allowed = ", ".join(methods)
        if self.command == "OPTIONS":  # a browser asking whether it may (CORS preflight)
            cors = {"Access-Control-Allow-Methods": allowed,
                    "Access-Control-Allow-Headers": "Authorization, Content-Type"}
            self._send_bytes(204, b"", "text/plain", {"Allow": allowed, **cors})
            return
        route = methods.get(self.command)
        if route is None:
            raise APIError(405, f"{self.command} is not allowed on {path}; use {allowed}",
                           code="method_not_allowed", headers={"Allow": allowed})
        if path.startswith("/v1/"):
            self._authorize()
        route(self)

    def chat_page(self) -> None:
        self._send_bytes(200, CHAT_PAGE, "text/html; charset=utf-8")

    def no_icon(self) -> None:
        self._send_bytes(204, b"", "image/x-icon")

    def health(self) -> None:
        state = self.server.engine_loop.state
        if state != "serving":
            raise protocol.not_serving(f"the engine loop has {state}")
        self._send_json(200, {"status": "ok"})

    def metrics(self) -> None:
        self._send_bytes(200, self.server.metrics.render(), CONTENT_TYPE)

    def list_models(self) -> None:
        engine = self.server.engine
        model = {
            "id": self.server.settings.model_name, "object": "model",
            "created": self.server.created, "owned_by": "nanoqwen",
            "max_model_len": engine.max_model_len,
            # What a request that leaves these out samples with (the chat page shows them).
            "sampling_defaults": engine.sampling_defaults,
        }
        self._send_json(200, {"object": "list", "data": [model]})

    def chat_completions(self) -> None:
        engine, body = self.server.engine, self._read_json()
        protocol.check_model(body, self.server.settings.model_name)
        messages = protocol.parse_messages(body)
        enable_thinking = protocol.parse_enable_thinking(body)
        options = protocol.parse_generation_options(body, engine.max_model_len, engine)
        prompt = protocol.render_chat(engine, messages, enable_thinking)
        self._generate(ChatAPI(), protocol.encode_prompts(engine, [prompt], "messages"), options)

    def completions(self) -> None:
        engine, body = self.server.engine, self._read_json()
        protocol.check_model(body, self.server.settings.model_name)
        prompts = protocol.parse_prompts(body)
        default_max_tokens = protocol.COMPLETIONS_DEFAULT_MAX_TOKENS
        options = protocol.parse_generation_options(body, default_max_tokens, engine)
        # Tokenizing comes last: it is the one slow step, and every check before it is cheap.
        self._generate(CompletionsAPI(), protocol.encode_prompts(engine, prompts, "prompt"), options)

    ROUTES: ClassVar[dict[str, dict[str, Callable[[OpenAIHandler], None]]]] = {
        "/": {"GET": chat_page},
        "/favicon.ico": {"GET": no_icon},
        "/health": {"GET": health},
        "/metrics": {"GET": metrics},
        "/v1/models": {"GET": list_models},
        "/v1/chat/completions": {"POST": chat_completions},
        "/v1/completions": {"POST": completions},
    }

    # ------------------------------------------------------------ generation
    def _generate(self, api: API, prompts: list[EncodedPrompt], options: GenerationOptions) -> None:
        response_id = f"{api.id_prefix}-{uuid.uuid4().hex[:24]}"
        self.record.request_id = response_id
        self.record.samples_per_prompt = len(options.params)
        # Choices are ordered prompt by prompt, then sample by sample, as OpenAI orders them.
        sequences = [(prompt, params) for prompt in prompts for params in options.params]
        loop = self.server.engine_loop
        if len(sequences) > loop.capacity:
            raise bad_request(f"{len(sequences)} sequences asked for; "
                              f"this server holds {loop.capacity}")
        try:
            submission = loop.submit(sequences, response_id, options.priority)
        except ValueError as error:  # the engine refused the input
            raise bad_request(str(error), protocol.named_parameter(str(error))) from error
        reply = Reply(api, response_id, self.server.settings.model_name, int(time.time()),
                      options.include_usage)
        try:
            if options.stream:
                self._stream(reply, submission)
            else:
                finals = self._collect(submission)
                self._send_json(200, reply.response(finals, self.record.usage()))
            self.server.metrics.request_duration.observe(time.perf_counter() - self.record.start)
        finally:
            if submission.unfinished:  # the client left, timed out, or something failed
                loop.abort(submission.unfinished)

    def _collect(self, submission: Submission) -> list[RequestOutput]:
        for _ in self._follow(submission):
            pass
        return [self.record.latest[i] for i in range(len(submission.request_ids))]

    def _stream(self, reply: Reply, submission: Submission) -> None:
        self.event_stream = True
        self._send_head(200, "text/event-stream; charset=utf-8", {"Cache-Control": "no-cache"})
        opening = reply.api.opening_choices(len(submission.request_ids))
        if opening:
            self._send_event(reply.chunk(opening))
        for index, output in self._follow(submission):
            if output.delta_text or output.finished:
                choice = reply.api.delta_choice(index, output.delta_text, output.finish_reason)
                self._send_event(reply.chunk([choice]))
        if reply.include_usage:
            self._send_event(reply.usage_chunk(self.record.usage()))
        self._decide_status(200)
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
            self._check_client()
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

