"""Which request fields each route understands, and what becomes of the others.

OpenAI keeps adding request fields. A client that sends one it relies on must never get a
200 that quietly ignored it, so for every route this module sorts the fields into:

* **supported**: implemented (the tables of docs/server.md list them);
* **labels**: OpenAI fields that only tag a request for the caller's own bookkeeping
  (`user`, `metadata`, ...): accepted, no effect on the answer;
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

logger = logging.getLogger("nanoqwen.server")

# Sampling fields both completion routes take: OpenAI's, then vLLM's and SGLang's extras.
_SAMPLING = {
    "model", "n", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "seed",
    "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "priority",
    "response_format", "structured_outputs",
    # vLLM's names before structured_outputs, still sent by older clients.
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
}
SUPPORTED = {
    "chat": _SAMPLING | {
        "messages", "top_logprobs", "tools", "tool_choice",
        "parallel_tool_calls", "chat_template_kwargs", "continue_final_message",
        "add_generation_prompt",
    },
    "completions": _SAMPLING | {"prompt", "echo"},
    "embeddings": {"model", "input", "encoding_format"},
}
LABELS = {
    "chat": {"user", "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
             "service_tier"},
    "completions": {"user"},
    "embeddings": {"user"},
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
}
_REPLACEMENTS = {"functions": "tools", "function_call": "tool_choice"}


def check_fields(body: dict[str, Any], route: str) -> None:
    """Refuse OpenAI fields `route` cannot honour (a 400 naming the first), and log the
    unknown ones."""
    for name, honoured in UNSUPPORTED[route].items():
        value = body.get(name)
        if value is not None and not honoured(value, body):
            instead = f"; use {_REPLACEMENTS[name]}" if name in _REPLACEMENTS else ""
            raise bad_request(f"{name} is not supported by this server{instead}", name)
    known = SUPPORTED[route] | LABELS[route] | set(UNSUPPORTED[route])
    unknown = sorted(name for name in body if name not in known)
    if unknown:
        logger.warning("ignoring fields this server does not know: %s", ", ".join(unknown))
