"""The OpenAI routes: parse and check a request, tokenize it, submit it, answer it.

A completion request goes through three hands. On its handler thread, `protocol` checks
every field and turns the prompt (or the chat, through the model's template) into token
ids, holding the request's queue slots while it does (tokenizing is work too); the engine
loop admits the sequences and streams their outputs back; and the handler shapes them
(`responses`) into one JSON document or an SSE stream, checking between outputs that the
client is still there and the request within its deadline.
"""

from __future__ import annotations

import hmac
import importlib.metadata
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar
from urllib.parse import unquote

from nanoqwen.engine import EncodedPrompt
from nanoqwen.metrics import CONTENT_TYPE
from nanoqwen.outputs import RequestOutput
from nanoqwen.sampling.grammar import StructuredOutput
from nanoqwen.sampling.params import SamplingParams
from nanoqwen.sampling.pooling import PoolingParams
from nanoqwen.server import page, protocol, tokenizing, tokens
from nanoqwen.server.engine_loop import (
    NotServing,
    QueueFull,
    RequestFailed,
    Reservation,
    Submission,
)
from nanoqwen.server.fields import check_fields
from nanoqwen.server.logprobs import parse_chat_logprobs, parse_completion_logprobs
from nanoqwen.server.plumbing import HTTPHandler
from nanoqwen.server.protocol import APIError, GenerationOptions, bad_request
from nanoqwen.server.responses import API, ChatAPI, CompletionsAPI, Reply
from nanoqwen.server.structured import (
    compile_structured_output,
    parse_structured_output,
)
from nanoqwen.server.tools import ToolOptions, parse_tools, tool_fields

MODEL_PATH = "/v1/models/"  # GET /v1/models/{id}: the id may hold slashes (a hub id)
POLL_SECONDS = 0.25  # how often a handler waiting for tokens checks its client and deadline
RETRY_AFTER_SECONDS = 1
# What a server with an API key answers without it: the health probe, and the chat page's
# files (the page asks its user for the key and sends it with its API calls).
OPEN_PATHS = frozenset({*page.PAGE_FILES, "/favicon.ico", "/health"})


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
        path = self.record.path
        # A browser's preflight never carries the key; the request it clears does.
        if self.command != "OPTIONS" and path not in OPEN_PATHS:
            self._authorize()
        methods = self.ROUTES.get(path)
        if methods is None and path.startswith(MODEL_PATH):
            methods = {"GET": OpenAIHandler.get_model}
        if methods is None:
            raise APIError(404, f"no route {path}", "not_found_error", code="not_found")
        # HEAD is GET without the body (which `_send_bytes` leaves out).
        allowed = ", ".join([*methods, "HEAD"] if "GET" in methods else methods)
        if self.command == "OPTIONS":  # a browser asking whether it may (CORS preflight)
            cors = {"Access-Control-Allow-Methods": allowed,
                    "Access-Control-Allow-Headers": "Authorization, Content-Type"}
            self._send_bytes(204, b"", "text/plain", {"Allow": allowed, **cors})
            return
        route = methods.get("GET" if self.command == "HEAD" else self.command)
        if route is None:
            raise APIError(405, f"{self.command} is not allowed on {path}; use {allowed}",
                           code="method_not_allowed", headers={"Allow": allowed})
        route(self)

    def page_file(self) -> None:
        """The chat page and the files it loads (see `page`)."""
        self._send_bytes(*page.answer(self.record.path, self.headers.get("If-None-Match")))

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
        card = tokens.model_card(self.server.settings.model_name, self.server.created,
                                 self.server.engine)
        self._send_json(200, {"object": "list", "data": [card]})

    def get_model(self) -> None:
        model_id = unquote(self.record.path.removeprefix(MODEL_PATH))
        if model_id != self.server.settings.model_name:
            protocol.check_model({"model": model_id}, self.server.settings.model_name)
        self._send_json(200, tokens.model_card(model_id, self.server.created, self.server.engine))

    def version(self) -> None:
        self._send_json(200, {"version": importlib.metadata.version("nanoqwen")})

    def chat_completions(self) -> None:
        engine, body = self.server.engine, self._read_json()
        protocol.check_model(body, self.server.settings.model_name)
        check_fields(body, "chat")
        messages = tokenizing.parse_messages(body, tool_fields)
        tools = parse_tools(body)
        template = tokenizing.parse_template_options(body, messages, tools and tools.tools)
        logprobs = parse_chat_logprobs(body)
        options = protocol.parse_generation_options(
            body, engine.max_model_len, engine, logprobs=logprobs,
            structured_output=self._structured_output(body, tools),
        )
        with self._reserve(len(options.params)) as reservation:
            prompt = tokenizing.render_chat(engine, messages, template)
            prompts = tokenizing.encode_prompts(engine, [prompt], "messages")
            tokenizing.check_context(prompts, options, engine.max_model_len)
            api = ChatAPI(engine.tokenizer, logprobs is not None, tools)
            self._generate(api, reservation, prompts, options)

    def completions(self) -> None:
        engine, body = self.server.engine, self._read_json()
        protocol.check_model(body, self.server.settings.model_name)
        check_fields(body, "completions")
        prompts = tokenizing.parse_prompts(body)
        logprobs, echo = parse_completion_logprobs(body)
        options = protocol.parse_generation_options(
            body, protocol.COMPLETIONS_DEFAULT_MAX_TOKENS, engine, logprobs=logprobs,
            prompt_logprobs=logprobs if echo else None,
            structured_output=self._structured_output(body, None),
        )
        # Tokenizing comes last: it is the one slow step, and every check before it is cheap.
        with self._reserve(len(prompts) * len(options.params)) as reservation:
            encoded = tokenizing.encode_prompts(engine, prompts, "prompt")
            tokenizing.check_context(encoded, options, engine.max_model_len)
            api = CompletionsAPI(engine.tokenizer, logprobs is not None, echo)
            self._generate(api, reservation, encoded, options)

    def embeddings(self) -> None:
        engine, body = self.server.engine, self._read_json()
        protocol.check_model(body, self.server.settings.model_name)
        check_fields(body, "embeddings")
        encoding = tokens.parse_encoding_format(body)
        prompts = tokenizing.parse_prompts(body, "input")
        with self._reserve(len(prompts)) as reservation:
            encoded = tokenizing.encode_prompts(engine, prompts, "input")
            sequences = [(prompt, PoolingParams()) for prompt in encoded]
            with self._submitted(reservation, sequences, "embd") as submission:
                finals = self._collect(submission)
        model_id = self.server.settings.model_name
        self._send_json(200, tokens.embeddings_response(finals, encoding, model_id))

    def tokenize(self) -> None:
        engine, body = self.server.engine, self._read_json()
        protocol.check_model(body, self.server.settings.model_name)
        if body.get("messages") is not None:  # a chat, rendered as the chat route renders it
            messages = tokenizing.parse_messages(body, tool_fields)
            tools = parse_tools(body)
            template = tokenizing.parse_template_options(body, messages, tools and tools.tools)
            with self._reserve(1):
                token_ids = tokenizing.render_chat(engine, messages, template)
        elif isinstance(body.get("prompt"), str):
            tokenizing.check_text_size(len(body["prompt"].encode()), engine.max_model_len, "prompt")
            with self._reserve(1):
                token_ids = engine.tokenizer.encode(body["prompt"])
        else:
            raise bad_request("tokenize needs a prompt string or chat messages", "prompt")
        self._send_json(200, tokens.tokenize_response(engine, token_ids, body))

    def detokenize(self) -> None:
        engine, body = self.server.engine, self._read_json()
        protocol.check_model(body, self.server.settings.model_name)
        token_ids = tokens.parse_detokenize(body, engine.model_config.vocab_size)
        text = engine.tokenizer.decode(token_ids, skip_special_tokens=False)
        self._send_json(200, {"prompt": text})

    def _structured_output(
        self, body: dict[str, Any], tools: ToolOptions | None
    ) -> StructuredOutput | None:
        """The grammar the request asks for (or its tool_choice forces), compiled now."""
        spec, param = parse_structured_output(body)
        forced = tools.grammar() if tools is not None else None
        if forced is not None:
            if spec is not None:
                raise bad_request(f"tool_choice {tools.choice} cannot be combined with {param}",
                                  "tool_choice")
            spec, param = forced, "tools"
        if spec is not None:
            try:
                compile_structured_output(self.server.engine, spec, param)
            except APIError as error:
                compile = self.server.engine.grammars.compile
                named = tools.schema_error(compile) if forced is not None else None
                raise (named or error) from None
        return spec

    ROUTES: ClassVar[dict[str, dict[str, Callable[[OpenAIHandler], None]]]] = {
        **dict.fromkeys(page.PAGE_FILES, {"GET": page_file}),  # "/" and "/static/..."
        "/favicon.ico": {"GET": no_icon},
        "/health": {"GET": health},
        "/metrics": {"GET": metrics},
        "/v1/models": {"GET": list_models},
        "/v1/chat/completions": {"POST": chat_completions},
        "/v1/completions": {"POST": completions},
        "/v1/embeddings": {"POST": embeddings},
        "/tokenize": {"POST": tokenize},
        "/detokenize": {"POST": detokenize},
        "/version": {"GET": version},
    }

    # ------------------------------------------------------------ generation
    def _generate(self, api: API, reservation: Reservation, prompts: list[EncodedPrompt],
                  options: GenerationOptions) -> None:
        self.record.samples_per_prompt = len(options.params)
        # Choices are ordered prompt by prompt, then sample by sample, as OpenAI orders them.
        sequences = [(prompt, params) for prompt in prompts for params in options.params]
        with self._submitted(reservation, sequences, api.id_prefix, options.priority) as submission:
            reply = Reply(api, self.record.request_id, self.server.settings.model_name,
                          int(time.time()), options.include_usage)
            if options.stream:
                self._stream(reply, submission)
            else:
                finals = self._collect(submission)
                self._send_json(200, reply.response(finals, self.record.usage()))
            self.server.metrics.request_duration.observe(time.perf_counter() - self.record.start)

    def _reserve(self, count: int) -> Reservation:
        """Queue slots for a request of `count` sequences, held from before its tokenizing
        (a 429 when the queue is full)."""
        loop = self.server.engine_loop
        if count > loop.capacity:
            raise bad_request(f"{count} sequences asked for; this server holds {loop.capacity}")
        return loop.reserve(count)

    @contextmanager
    def _submitted(
        self, reservation: Reservation,
        sequences: list[tuple[EncodedPrompt, SamplingParams | PoolingParams]],
        id_prefix: str, priority: int = 0,
    ) -> Iterator[Submission]:
        """Hand the sequences to the engine; whatever is unfinished on leaving (the client
        left, timed out, or something failed) is aborted."""
        self.record.request_id = f"{id_prefix}-{uuid.uuid4().hex[:24]}"
        try:
            submission = reservation.submit(sequences, self.record.request_id, priority)
        except ValueError as error:  # the engine refused the input
            raise bad_request(str(error), protocol.named_parameter(str(error))) from error
        try:
            yield submission
        finally:
            if submission.unfinished:
                self.server.engine_loop.abort(submission.unfinished)

    def _collect(self, submission: Submission) -> list[RequestOutput]:
        for _ in self._follow(submission):
            pass
        return [self.record.latest[i] for i in range(len(submission.request_ids))]

    def _stream(self, reply: Reply, submission: Submission) -> None:
        self.event_stream = True
        self._send_head(200, "text/event-stream; charset=utf-8", {"Cache-Control": "no-cache"})
        for opening in reply.api.opening_choices(len(submission.request_ids)):
            self._send_event(reply.chunk([opening]))  # one per choice, as OpenAI sends them
        for index, output in self._follow(submission):
            choice = reply.api.delta_choice(index, output)
            if choice is not None:
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

