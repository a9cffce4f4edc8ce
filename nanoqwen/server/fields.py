"""Which request fields each route understands, and what becomes of the others.

OpenAI keeps adding request fields. A client that sends one it relies on must never get a
200 that quietly ignored it, so for every route this module sorts the fields into:

* **supported**: implemented (the tables of docs/server.md list them);
* **labels**: OpenAI fields that only tag a request for the caller's own bookkeeping
  (`metadata`, `safety_identifier`, ...): accepted, no effect on the answer (`user` is
  supported: it says whose turn a request takes under fair scheduling);
* **unsupported**: every other OpenAI field: a 400 naming it, unless its value is the one
  this server's behaviour already matches (`best_of` equal to `n`, `store: false`, ...);
* anything else is another server's extension unknown here: ignored with a logged warning,
  as vLLM does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from nanoqwen.server.protocol import bad_request
from nanoqwen.server.responses_input import SAMPLING as RESPONSES_SAMPLING

logger = logging.getLogger("nanoqwen.server")

# Sampling fields both completion routes take: OpenAI's, then vLLM's and SGLang's extras.
_SAMPLING = {
    "model", "n", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "seed",
    "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "priority",
    "deadline", "user", "allowed_token_ids",
    "response_format", "structured_outputs",
    # vLLM's names before structured_outputs, still sent by older clients; SGLang's.
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "regex", "ebnf",
    "prompt_logprobs",  # vLLM's scores of the prompt's tokens
}
SUPPORTED = {
    "chat": _SAMPLING | {
        "messages", "top_logprobs", "tools", "tool_choice",
        "parallel_tool_calls", "chat_template_kwargs", "continue_final_message",
        "add_generation_prompt", "echo",
    },
    "completions": _SAMPLING | {"prompt", "echo"},
    "embeddings": {"model", "input", "encoding_format", "user"},
    "responses": {
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
        "tools", "tool_choice", "parallel_tool_calls", "text", "include", "top_logprobs",
        "chat_template_kwargs", *RESPONSES_SAMPLING,
    },
}
_CHAT_LABELS = {"metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                "service_tier"}
LABELS = {
    "chat": _CHAT_LABELS,
    "completions": set(),
    "embeddings": set(),
    "responses": _CHAT_LABELS,
}
Honoured = Callable[[Any, dict[str, Any]], bool]  # (value, body) -> does it change nothing?
_NEVER: Honoured = lambda value, body: False  # noqa: E731
# best_of = n asks for nothing beyond the n samples.
_BEST_OF_N: Honoured = lambda value, body: value == body.get("n", 1)  # noqa: E731
UNSUPPORTED: dict[str, dict[str, Honoured]] = {
    "chat": {
        "audio": _NEVER, "prediction": _NEVER, "reasoning_effort": _NEVER, "verbosity": _NEVER,
        "web_search_options": _NEVER, "functions": _NEVER, "function_call": _NEVER,
        "modalities": lambda value, body: value == ["text"],
        "store": lambda value, body: value is False,
        "best_of": _BEST_OF_N,
    },
    "completions": {
        "suffix": _NEVER,
        "best_of": _BEST_OF_N,
    },
    "embeddings": {"dimensions": _NEVER},
    "responses": {
        "previous_response_id": _NEVER, "conversation": _NEVER, "prompt": _NEVER,
        "reasoning": _NEVER, "max_tool_calls": _NEVER, "context_management": _NEVER,
        "store": lambda value, body: value is False,
        "background": lambda value, body: value is False,
        "truncation": lambda value, body: value == "disabled",
        # Padding against length side channels; a server that never pads answers false only.
        "stream_options": lambda value, body: value == {} or value == {
            "include_obfuscation": False},
        # Chat completions' names, sent to this route by mistake.
        "messages": _NEVER, "max_tokens": _NEVER, "max_completion_tokens": _NEVER,
        "response_format": _NEVER, "logprobs": _NEVER,
        "n": lambda value, body: value == 1,
    },
}
_STATELESS = "this server keeps no responses: send the conversation so far as input"
_ADVICE = {"functions": "use tools", "function_call": "use tool_choice",
           "previous_response_id": _STATELESS, "conversation": _STATELESS,
           "store": _STATELESS, "messages": "use input", "max_tokens": "use max_output_tokens",
           "max_completion_tokens": "use max_output_tokens",
           "response_format": "use text.format",
           "logprobs": "use include: ['message.output_text.logprobs'] and top_logprobs"}


def check_fields(body: dict[str, Any], route: str) -> None:
    """Refuse OpenAI fields `route` cannot honour (a 400 naming the first), and log the
    unknown ones."""
    for name, honoured in UNSUPPORTED[route].items():
        value = body.get(name)
        if value is not None and not honoured(value, body):
            advice = f"; {_ADVICE[name]}" if name in _ADVICE else ""
            raise bad_request(f"{name} is not supported by this server{advice}", name)
    known = SUPPORTED[route] | LABELS[route] | set(UNSUPPORTED[route])
    unknown = sorted(name for name in body if name not in known)
    if unknown:
        logger.warning("ignoring fields this server does not know: %s", ", ".join(unknown))
