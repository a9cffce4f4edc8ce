"""The OpenAI routes: parse and check a request, tokenize it, submit it, answer it.

A completion request goes through three hands. On its handler thread, `protocol` checks
every field and turns the prompt (or the chat, through the model's template) into token
ids, holding the request's queue slots while it does (tokenizing is work too); the engine
loop admits the sequences and streams their outputs back; and the handler shapes them
(`responses`, or `responses_output` for the Responses API) into one JSON document or an
SSE stream, checking between outputs that the client is still there and the request
within its deadline (`generation`).
"""

from __future__ import annotations

import hmac
import importlib.metadata
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar
from urllib.parse import unquote

from nanoqwen.metrics import CONTENT_TYPE
from nanoqwen.sampling.params import PoolingParams
from nanoqwen.sampling.structured import CompileBudget, StructuredOutput
from nanoqwen.server import page, protocol, tokenizing, tokens
from nanoqwen.server.fields import check_fields
from nanoqwen.server.generation import Answer, GenerationHandler
from nanoqwen.server.logprobs import (
    parse_chat_logprobs,
    parse_completion_logprobs,
    parse_prompt_logprobs,
)
from nanoqwen.server.protocol import (
    APIError,
    GenerationOptions,
    bad_request,
    checked_field,
)
from nanoqwen.server.responses import API, ChatAPI, CompletionsAPI, Reply
from nanoqwen.server.responses_input import parse_request as parse_response_request
from nanoqwen.server.responses_output import ID_PREFIX as RESPONSE_ID_PREFIX
from nanoqwen.server.responses_output import ResponsesReply
from nanoqwen.server.structured import (
    AskedGrammar,
    check_grammar_size,
    compile_grammar,
    parse_structured_output,
)
from nanoqwen.server.tools import ToolOptions, parse_tools, tool_fields

MODEL_PATH = "/v1/models/"  # GET /v1/models/{id}: the id may hold slashes (a hub id)
# What a server with an API key answers without it: the health probe, and the chat page's
# files (the page asks its user for the key and sends it with its API calls).
OPEN_PATHS = frozenset({*page.PAGE_FILES, "/favicon.ico", "/health"})


class OpenAIHandler(GenerationHandler):
    """The routes of an OpenAI-compatible server."""

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
        engine, body = self.server.engine, self._read_body("chat")
        tools = parse_tools(body)
        messages, template = self._conversation(body, tools)
        logprobs, prompt_logprobs = parse_chat_logprobs(body), parse_prompt_logprobs(body)
        grammar = self._grammar(parse_structured_output(body), tools)
        options = protocol.parse_generation_options(
            body, engine.max_model_len, engine, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_output=grammar and grammar.spec,
        )
        echo = checked_field(body, "echo", bool, "a boolean", False)
        last = messages[-1]  # vLLM's echo: the reply starts with the assistant's last message
        echoed = last["content"] if echo and last["role"] == "assistant" else ""
        api = ChatAPI(engine.tokenizer, logprobs is not None, tools, echoed,
                      prompt_logprobs is not None)
        self._chat(messages, template, options, self._reply(api, options), grammar)

    def create_response(self) -> None:
        """OpenAI's Responses API: a chat turn in other shapes (`responses_input`)."""
        engine, body = self.server.engine, self._read_body("responses")
        request = parse_response_request(body)
        tools = parse_tools(body, flat=True)
        messages, template = self._conversation(request.chat, tools)
        grammar = self._grammar((request.text_format, "text.format"), tools)
        options = protocol.parse_generation_options(
            request.sampling, engine.max_model_len, engine, ("max_output_tokens",),
            logprobs=request.logprobs, structured_output=grammar and grammar.spec,
        )
        answer = ResponsesReply(self._name_request(RESPONSE_ID_PREFIX),
                                self.server.settings.model_name, int(time.time()),
                                self.record.usage, engine.tokenizer, request, tools)
        self._chat(messages, template, options, answer, grammar, "input")

    def completions(self) -> None:
        engine, body = self.server.engine, self._read_body("completions")
        prompts = tokenizing.parse_prompts(body)
        logprobs, echo = parse_completion_logprobs(body)
        prompt_logprobs = parse_prompt_logprobs(body)
        grammar = self._grammar(parse_structured_output(body), None)
        options = protocol.parse_generation_options(
            body, protocol.COMPLETIONS_DEFAULT_MAX_TOKENS, engine, logprobs=logprobs,
            # echo with logprobs scores the prompt too, unless prompt_logprobs says how (vLLM).
            prompt_logprobs=logprobs if prompt_logprobs is None and echo else prompt_logprobs,
            structured_output=grammar and grammar.spec,
        )
        api = CompletionsAPI(engine.tokenizer, logprobs is not None, echo,
                             prompt_logprobs is not None)
        reply = self._reply(api, options)
        # Compiling and tokenizing come last: they are the slow steps, and every check
        # before them is cheap.
        with self._reserve(len(prompts) * len(options.params)) as reservation, \
                self._compiled(grammar):
            encoded = tokenizing.encode_prompts(engine, prompts, "prompt")
            tokenizing.check_context(encoded, options, engine.max_model_len)
            self._generate(reply, reservation, encoded, options)

    def embeddings(self) -> None:
        engine, body = self.server.engine, self._read_body("embeddings")
        encoding = tokens.parse_encoding_format(body)
        prompts = tokenizing.parse_prompts(body, "input")
        request_id = self._name_request("embd-")
        with self._reserve(len(prompts)) as reservation:
            encoded = tokenizing.encode_prompts(engine, prompts, "input")
            sequences = [(prompt, PoolingParams()) for prompt in encoded]
            user = checked_field(body, "user", str, "a string", None)
            with self._submitted(reservation, sequences, {"user": user}) as submission:
                finals = self._collect(submission)
        model_id = self.server.settings.model_name
        self._send_json(200, tokens.embeddings_response(finals, encoding, model_id, request_id))

    def tokenize(self) -> None:
        engine, body = self.server.engine, self._read_body()
        if body.get("messages") is not None:  # a chat, rendered as the chat route renders it
            messages, template = self._conversation(body, parse_tools(body))
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
        engine, body = self.server.engine, self._read_body()
        token_ids = tokens.parse_detokenize(body, engine.model_config.vocab_size)
        text = engine.tokenizer.decode(token_ids, skip_special_tokens=False)
        self._send_json(200, {"prompt": text})

    # ------------------------------------------------------------ shared steps
    def _read_body(self, route: str | None = None) -> dict[str, Any]:
        """The JSON body, naming the served model (or none) and, for a generating `route`,
        holding no field it cannot honour (`fields`)."""
        body = self._read_json()
        protocol.check_model(body, self.server.settings.model_name)
        if route is not None:
            check_fields(body, route)
        return body

    def _conversation(
        self, chat: dict[str, Any], tools: ToolOptions | None
    ) -> tuple[list[dict[str, Any]], tokenizing.TemplateOptions]:
        """A chat request's messages, checked, and how the template renders them."""
        messages = tokenizing.parse_messages(chat, tool_fields)
        return messages, tokenizing.parse_template_options(chat, messages, tools and tools.tools)

    def _chat(self, messages: list[dict[str, Any]], template: tokenizing.TemplateOptions,
              options: GenerationOptions, answer: Answer, grammar: AskedGrammar | None,
              param: str = "messages") -> None:
        """Compile the grammar, render the conversation and tokenize it, holding the
        request's queue slots, and answer it."""
        engine = self.server.engine
        with self._reserve(len(options.params)) as reservation, self._compiled(grammar):
            prompt = tokenizing.render_chat(engine, messages, template, param)
            prompts = tokenizing.encode_prompts(engine, [prompt], param)
            tokenizing.check_context(prompts, options, engine.max_model_len)
            self._generate(answer, reservation, prompts, options)

    def _reply(self, api: API, options: GenerationOptions) -> Reply:
        """The answer of a chat or completions request, under a new request id."""
        return Reply(api, self._name_request(api.id_prefix), self.server.settings.model_name,
                     int(time.time()), self.record.usage, options.include_usage,
                     options.continuous_usage)

    def _grammar(
        self, asked: tuple[StructuredOutput | None, str | None], tools: ToolOptions | None
    ) -> AskedGrammar | None:
        """The grammar the request asks for in its field `asked[1]`, or that its
        tool_choice forces, checked for size (a 400 naming the limit)."""
        spec, param = asked
        forced = tools.grammar() if tools is not None else None
        if forced is not None:
            if spec is not None:
                raise bad_request(f"tool_choice {tools.choice} cannot be combined with {param}",
                                  "tool_choice")
            spec, param = forced, "tools"
        if spec is None:
            return None
        check_grammar_size(spec, param)
        return AskedGrammar(spec, param, tools)

    @contextmanager
    def _compiled(self, grammar: AskedGrammar | None) -> Iterator[Any]:
        """The grammar compiled within the server's budget (entered once the request holds
        its queue slots), and held until the block ends: the engine finds it by its spec
        when the request is added. Given up if the client leaves or the server stops."""
        if grammar is None:
            yield None
            return
        settings = self.server.settings
        budget = CompileBudget(settings.grammar_compile_timeout, settings.grammar_compile_memory)
        yield compile_grammar(self.server.engine, grammar, budget, self._still_wanted)

    ROUTES: ClassVar[dict[str, dict[str, Callable[[OpenAIHandler], None]]]] = {
        **dict.fromkeys(page.PAGE_FILES, {"GET": page_file}),  # "/" and "/static/..."
        "/favicon.ico": {"GET": no_icon},
        "/health": {"GET": health},
        "/metrics": {"GET": metrics},
        "/v1/models": {"GET": list_models},
        "/v1/chat/completions": {"POST": chat_completions},
        "/v1/completions": {"POST": completions},
        "/v1/responses": {"POST": create_response},
        "/v1/embeddings": {"POST": embeddings},
        "/tokenize": {"POST": tokenize},
        "/detokenize": {"POST": detokenize},
        "/version": {"GET": version},
    }
