"""The OpenAI protocol, requests side: what a client may ask for, checked, and its errors.

Everything a request carries is checked here, before the engine sees any of it, and every
refusal is an `APIError`: an HTTP status plus OpenAI's error object (`{"error": {"message",
"type", "param", "code"}}`), with `param` naming the field at fault. The engine only ever
receives token ids and a valid `SamplingParams`; prompts are tokenized (and chat messages
rendered through the template, grammars compiled) on the calling handler thread, never on
the engine thread. The fields of one feature are read in that feature's module
(`logprobs`, `structured`, `tools`); which fields a route takes at all, in `fields`.

Which errors are whose: 4xx means the request was wrong (400 bad field, 404 unknown model
or route, 413 body too large, 415 not JSON, 429 queue full); 5xx means the server was
(500 a bug or an engine failure, answered with a generic message and a request id while
the details go to the log; 503 not serving; 504 the request outlived its timeout).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jinja2

from nanoqwen.engine import EncodedPrompt, LLMEngine, Prompt, PromptTooLong
from nanoqwen.sampling.params import SamplingParams
from nanoqwen.text.stop_strings import compile_stop_strings

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SAMPLES_PER_PROMPT = 128  # OpenAI's limit on n
# A token is a few bytes of text: about 4 in English prose or code, 3 to 6 in Chinese. No
# text that fits the context comes near this many per token, so a longer prompt is refused
# from its length alone, before the tokenizer spends seconds on it.
MAX_PROMPT_BYTES_PER_TOKEN = 16
# The roles a message may have, and the one the chat template renders it as: `developer` is
# OpenAI's newer name for `system`, which is all the templates know.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}

# Request fields passed to SamplingParams, which checks types and ranges and names the culprit.
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "presence_penalty", "frequency_penalty",
)
# Upper limits SamplingParams leaves open. Temperature takes OpenAI's range; a repetition
# penalty beyond these bounds (SGLang's) divides float32 logits towards overflow.
SAMPLING_LIMITS = {"temperature": (0.0, 2.0), "repetition_penalty": (0.01, 2.0)}
INT64 = (-(2**63), 2**63 - 1)  # OpenAI's seed is an int64
# Which request fields a route accepts, and what becomes of the others: `fields.py`.


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


def context_too_long(message: str, param: str) -> APIError:
    """A 400 for a request that cannot fit the model's context, with the code OpenAI gives it
    (a chat client reads it to offer dropping the oldest turns)."""
    return APIError(400, message, param=param, code="context_length_exceeded")


def internal_error(request_id: str) -> APIError:
    """A 500 that tells the client nothing internal, only how to find it in the log."""
    return APIError(
        500, f"internal server error; the server log has the details under {request_id}",
        "server_error", code="internal_error",
    )


def not_serving(reason: str = "the server is shutting down") -> APIError:
    return APIError(503, reason, "server_error", code="not_serving")


# ---------------------------------------------------------------------------- the body
def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
        # JSON may escape a lone UTF-16 surrogate ("\ud800"), which no tokenizer can encode.
        json.dumps(body, ensure_ascii=False).encode()
    except RecursionError as error:
        raise bad_request("the request body is nested too deeply") from error
    except UnicodeEncodeError as error:
        raise bad_request("the request body holds a lone surrogate: not valid Unicode") from error
    except ValueError as error:  # also catches bytes that are not UTF-8
        raise bad_request(f"the request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def check_model(body: dict[str, Any], model_id: str) -> None:
    """The request must name the served model; leaving `model` out means that model."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {model!r}", "model")
    if model != model_id:
        raise APIError(
            404, f"the model '{model}' does not exist; this server serves '{model_id}'",
            param="model", code="model_not_found",
        )


# ---------------------------------------------------------------------------- sampling
@dataclass
class GenerationOptions:
    """What a completion request asks for besides its prompt.

    Per-request engine settings beyond sampling belong here.
    """

    params: list[SamplingParams]  # one per sample of a prompt (`n` of them)
    stream: bool
    include_usage: bool
    priority: int = 0  # lower is served sooner (vLLM's field), under priority scheduling
    max_tokens: tuple[str, int] | None = None  # (field, value) when the request set it


def parse_generation_options(
    body: dict[str, Any], default_max_tokens: int, engine: LLMEngine, **sampling: Any
) -> GenerationOptions:
    """What the request asks for besides its prompt, each field checked. `sampling` holds
    `SamplingParams` fields the route worked out itself (logprobs, a grammar)."""
    stream = _field(body, "stream", bool, "a boolean", False)
    stream_options = _field(body, "stream_options", dict, "an object", {})
    if body.get("stream_options") is not None and not stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    include_usage = _field(
        stream_options, "include_usage", bool, "a boolean", False, "stream_options.include_usage"
    )
    n = _field(body, "n", int, "an integer", 1)
    priority = _field(body, "priority", int, "an integer", 0)  # the engine checks the policy
    if not 1 <= n <= MAX_SAMPLES_PER_PROMPT:
        raise bad_request(f"n must be in [1, {MAX_SAMPLES_PER_PROMPT}], got {n}", "n")
    # max_completion_tokens is the newer name of max_tokens.
    max_tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(max_tokens_field)
    given = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    # What the request leaves out, the engine fills from the model's recommended settings.
    fields = within_limits(given, engine.model_config.vocab_size)
    logit_bias = parse_logit_bias(body, engine.model_config.vocab_size)
    try:
        params = SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            logit_bias=logit_bias, **fields, **sampling,
        )
        # With a seed, the n samples still differ: each gets its own seed.
        samples = [params if params.seed is None else replace(params, seed=params.seed + i)
                   for i in range(n)]
    except ValueError as error:
        raise bad_request(str(error), named_parameter(str(error))) from error
    # Compiled here, on the handler thread: the engine thread finds it in the cache.
    compile_stop_strings(tuple(params.stop))
    asked = None if max_tokens is None else (max_tokens_field, params.max_tokens)
    return GenerationOptions(samples, stream, include_usage, priority, asked)


def check_context(prompts: list[EncodedPrompt], options: GenerationOptions,
                  max_model_len: int) -> None:
    """A request that asks for more tokens than the context leaves after a prompt is
    refused (as vLLM and SGLang do); one that leaves max_tokens out gets what is left."""
    if options.max_tokens is None:
        return
    name, asked = options.max_tokens
    for prompt in prompts:
        if len(prompt.token_ids) + asked > max_model_len:
            raise context_too_long(
                f"{name} is too large: {asked}. This model's context is {max_model_len} tokens "
                f"and the prompt has {len(prompt.token_ids)} ({asked} > {max_model_len} - "
                f"{len(prompt.token_ids)})", name,
            )


def parse_logit_bias(body: dict[str, Any], vocab_size: int) -> dict[int, Any] | None:
    """`logit_bias` with its keys (token ids, which JSON writes as strings) as ints."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise bad_request("logit_bias must map token ids to numbers", "logit_bias")
    parsed = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
            raise bad_request(f"logit_bias keys must be token ids below {vocab_size}, got "
                              f"{key!r}", "logit_bias")
        parsed[int(key)] = value
    return parsed


def within_limits(fields: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """The request's sampling fields, bounded where SamplingParams leaves them open, so
    every value fits the sampler's tensors: `top_k` clamped, absurd values a 400."""
    top_k = fields.get("top_k")
    if _is_int(top_k) and top_k > vocab_size:
        # As many as there are: the same as no top-k at all.
        fields = {**fields, "top_k": vocab_size}
    for name, (lowest, highest) in SAMPLING_LIMITS.items():
        value = fields.get(name)
        if _is_number(value) and not lowest <= value <= highest:
            raise bad_request(f"{name} must be in [{lowest:g}, {highest:g}], got {value!r}", name)
    seed = fields.get("seed")
    if _is_int(seed) and not INT64[0] <= seed <= INT64[1]:
        raise bad_request(f"seed must be a 64-bit signed integer, got {seed}", "seed")
    stop_ids = fields.get("stop_token_ids")
    if isinstance(stop_ids, list) and any(_is_int(i) and i >= vocab_size for i in stop_ids):
        raise bad_request(f"stop_token_ids must be below the vocabulary size {vocab_size}",
                          "stop_token_ids")
    return fields


def named_parameter(message: str) -> str | None:
    """The request field an engine's `ValueError` is about: its messages begin with the
    parameter's name (SamplingParams', and `add_request`'s about priority)."""
    first_word = message.split("=", 1)[0].split(" ", 1)[0]
    named = (*SAMPLING_FIELDS, "max_tokens", "priority", "logit_bias", "logprobs")
    return first_word if first_word in named else None


# ---------------------------------------------------------------------------- prompts
MessageExtras = Callable[[dict[str, Any], str], dict[str, Any]]


def parse_messages(
    body: dict[str, Any], extras: MessageExtras | None = None
) -> list[dict[str, Any]]:
    """The conversation, each message's role and text checked; `extras(message, param)`
    adds fields a template reads besides them (tool calls: `tools.tool_fields`)."""
    messages = body.get("messages")
    if messages is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    parsed = [_parse_message(message, f"messages[{i}]") for i, message in enumerate(messages)]
    if extras is not None:
        for i, (message, raw) in enumerate(zip(parsed, messages)):
            message.update(extras(raw, f"messages[{i}]"))
    return parsed


@dataclass(frozen=True)
class TemplateOptions:
    """How a chat is rendered besides its messages."""

    enable_thinking: bool | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True  # end with the assistant's turn header
    continue_final_message: bool = False  # end inside the last (assistant) message: a prefill


def parse_template_options(
    body: dict[str, Any], messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> TemplateOptions:
    """vLLM's `add_generation_prompt` and `continue_final_message` (an assistant prefill:
    the reply continues the last message's text), and Qwen3's `enable_thinking`."""
    continue_final = _field(body, "continue_final_message", bool, "a boolean", False)
    add_prompt = _field(body, "add_generation_prompt", bool, "a boolean", not continue_final)
    if continue_final and add_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    if continue_final and messages[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs the last message to be the assistant's",
                          "continue_final_message")
    return TemplateOptions(parse_enable_thinking(body), tools, add_prompt, continue_final)


def parse_enable_thinking(body: dict[str, Any]) -> bool | None:
    """Qwen3's switch, passed as vLLM does: `chat_template_kwargs: {"enable_thinking": false}`."""
    template_kwargs = _field(body, "chat_template_kwargs", dict, "an object", {})
    return _field(
        template_kwargs, "enable_thinking", bool, "a boolean", None,
        "chat_template_kwargs.enable_thinking",
    )


def parse_prompts(body: dict[str, Any], name: str = "prompt") -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    prompt = body.get(name)
    if prompt is None:
        raise bad_request(f"{name} is required", name)
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, str) for item in prompt):
            return list(prompt)
        if all(_is_int(item) for item in prompt):
            return [prompt]
        if all(isinstance(item, list) and all(map(_is_int, item)) for item in prompt):
            return list(prompt)
    raise bad_request(
        f"{name} must be a string, a list of strings, a list of token ids or a list of them",
        name,
    )


def check_text_size(size: int, max_model_len: int, param: str) -> None:
    """A 400 for text of `size` bytes that cannot fit the context, without tokenizing it."""
    limit = max_model_len * MAX_PROMPT_BYTES_PER_TOKEN
    if size > limit:
        raise context_too_long(
            f"{param} is too long: {size} bytes of text cannot fit this model's context of "
            f"{max_model_len} tokens (the limit is {limit} bytes)", param,
        )


def encode_prompts(engine: LLMEngine, prompts: list[Prompt], param: str) -> list[EncodedPrompt]:
    """Every prompt's token ids, checked to fit the engine: all of them, or a 400. The
    engine thread takes them as they are, without tokenizing or checking them again."""
    for prompt in prompts:
        if isinstance(prompt, str):
            check_text_size(len(prompt.encode()), engine.max_model_len, param)
    try:
        return [engine.encode_prompt(prompt) for prompt in prompts]
    except PromptTooLong as error:
        raise context_too_long(str(error), param) from error
    except ValueError as error:
        raise bad_request(str(error), param) from error


def render_chat(
    engine: LLMEngine, messages: list[dict[str, Any]], options: TemplateOptions
) -> list[int]:
    """The conversation's token ids, through the model's template; one too long to fit
    the context (told from its size as JSON) is refused before the template sees it."""
    conversation = json.dumps([messages, options.tools], ensure_ascii=False).encode()
    check_text_size(len(conversation), engine.max_model_len, "messages")
    try:
        return engine.tokenizer.apply_chat_template(
            messages, options.enable_thinking, options.tools, options.add_generation_prompt,
            options.continue_final_message,
        )
    # The template itself refused (roles out of order), or transformers did (a prefill it
    # cannot find in the rendered text).
    except (jinja2.TemplateError, ValueError) as error:
        raise bad_request(f"cannot apply the chat template: {error}", "messages") from error


def _parse_message(message: object, param: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise bad_request(f"{param} must be an object", param)
    role = message.get("role")
    # A template would write any other role into the prompt as it is.
    if not isinstance(role, str) or role not in ROLES:
        raise bad_request(f"{param}.role must be one of {', '.join(ROLES)}, got {role!r}",
                          f"{param}.role")
    content = _message_text(message.get("content"), f"{param}.content")
    return {"role": ROLES[role], "content": content}


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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
