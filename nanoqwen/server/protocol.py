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
from dataclasses import dataclass, replace
from typing import Any

from nanoqwen.engine import LLMEngine
from nanoqwen.sampling.params import SamplingParams
from nanoqwen.text.stop_strings import compile_stop_strings

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SAMPLES_PER_PROMPT = 128  # OpenAI's limit on n
# Request fields passed to SamplingParams, which checks types and ranges and names the culprit.
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "allowed_token_ids",
)
# Upper limits SamplingParams leaves open. Temperature takes OpenAI's range; a repetition
# penalty beyond these bounds (SGLang's) divides float32 logits towards overflow.
SAMPLING_LIMITS = {"temperature": (0.0, 2.0), "repetition_penalty": (0.01, 2.0)}
INT64 = (-(2**63), 2**63 - 1)  # OpenAI's seed is an int64
# The names of the length limit a route takes, the first one given wins: chat's
# max_completion_tokens is the newer name of max_tokens (the Responses API says
# max_output_tokens).
MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens")
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
    include_usage: bool  # a stream ends with a chunk that holds the usage
    continuous_usage: bool = False  # and every chunk holds the usage so far (vLLM's)
    priority: int = 0  # lower is served sooner (vLLM's field), under priority scheduling
    max_tokens: tuple[str, int] | None = None  # (field, value) when the request set it
    deadline: float | None = None  # seconds after arrival it should be done by
    user: str | None = None  # OpenAI's `user`: who sent it (fair turns, per-user caps)

    @property
    def scheduling(self) -> dict[str, Any]:
        """`LLMEngine.add_request`'s scheduling arguments for each of the sequences."""
        return {"priority": self.priority, "deadline": self.deadline, "user": self.user}


def parse_generation_options(
    body: dict[str, Any], default_max_tokens: int, engine: LLMEngine,
    max_tokens_fields: tuple[str, ...] = MAX_TOKENS_FIELDS, **sampling: Any
) -> GenerationOptions:
    """What the request asks for besides its prompt, each field checked. `sampling` holds
    `SamplingParams` fields the route worked out itself (logprobs, a grammar);
    `max_tokens_fields`, the route's names for the length limit."""
    stream = checked_field(body, "stream", bool, "a boolean", False)
    stream_options = checked_field(body, "stream_options", dict, "an object", {})
    if body.get("stream_options") is not None and not stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    include_usage, continuous_usage = (
        checked_field(stream_options, name, bool, "a boolean", False, f"stream_options.{name}")
        for name in ("include_usage", "continuous_usage_stats")
    )
    n = checked_field(body, "n", int, "an integer", 1)
    priority = checked_field(body, "priority", int, "an integer", 0)  # the engine checks the policy
    # The engine checks that a deadline is positive and finite.
    deadline = checked_field(body, "deadline", (int, float), "a number of seconds", None)
    user = checked_field(body, "user", str, "a string", None)
    if not 1 <= n <= MAX_SAMPLES_PER_PROMPT:
        raise bad_request(f"n must be in [1, {MAX_SAMPLES_PER_PROMPT}], got {n}", "n")
    max_tokens_field = next(
        (name for name in max_tokens_fields if body.get(name) is not None), max_tokens_fields[-1]
    )
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
        param = named_parameter(str(error))
        raise bad_request(str(error), max_tokens_field if param == "max_tokens" else param) \
            from error
    # Compiled here, on the handler thread: the engine thread finds it in the cache.
    compile_stop_strings(tuple(params.stop))
    asked = None if max_tokens is None else (max_tokens_field, params.max_tokens)
    return GenerationOptions(samples, stream, include_usage, continuous_usage, priority, asked,
                             deadline, user)


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
    if is_int(top_k) and top_k > vocab_size:
        # As many as there are: the same as no top-k at all.
        fields = {**fields, "top_k": vocab_size}
    for name, (lowest, highest) in SAMPLING_LIMITS.items():
        value = fields.get(name)
        if _is_number(value) and not lowest <= value <= highest:
            raise bad_request(f"{name} must be in [{lowest:g}, {highest:g}], got {value!r}", name)
    seed = fields.get("seed")
    if is_int(seed) and not INT64[0] <= seed <= INT64[1]:
        raise bad_request(f"seed must be a 64-bit signed integer, got {seed}", "seed")
    stop_ids = fields.get("stop_token_ids")
    if isinstance(stop_ids, list) and any(is_int(i) and i >= vocab_size for i in stop_ids):
        raise bad_request(f"stop_token_ids must be below the vocabulary size {vocab_size}",
                          "stop_token_ids")
    return fields


def named_parameter(message: str) -> str | None:
    """The request field an engine's `ValueError` is about: its messages begin with the
    parameter's name (SamplingParams', and `add_request`'s about scheduling)."""
    first_word = message.split("=", 1)[0].split(" ", 1)[0]
    named = (*SAMPLING_FIELDS, "max_tokens", "priority", "deadline", "user", "logit_bias",
             "logprobs")
    return first_word if first_word in named else None


def checked_field(
    container: dict[str, Any],
    name: str,
    kind: type | tuple[type, ...],
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


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
