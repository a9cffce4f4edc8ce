"""Log-probabilities on the wire, in the two shapes OpenAI gives them.

What they are (the processed distribution a token was sampled from; the raw model output
for prompt tokens) is `sampling/logprobs.py`'s business; this module reads the request
fields that ask for them and writes them out:

* chat: `logprobs: true` and `top_logprobs: k` (0-20) give each choice a `logprobs`
  object whose `content` lists, per generated token, its text, log-probability, UTF-8
  bytes and the `k` likeliest alternatives;
* completions: `logprobs: k` (0-20) gives `tokens`, `token_logprobs`, `top_logprobs` (a
  map from token text to log-probability: the `k` likeliest and the chosen token, so up
  to `k + 1` entries) and `text_offset` (where each token starts in the choice's text).
  With `echo: true` the prompt comes back before the completion, and with `logprobs`
  its tokens are scored too, the first one with null (nothing predicts it). That is the
  request lm-evaluation-harness sends to score a continuation.

vLLM's `prompt_logprobs: k` (both routes, not streamed) scores the prompt in vLLM's own
shape: per prompt token, null for the first, else a map from token id to `{logprob, rank,
decoded_token}` holding the prompt's token and the `k` likeliest (`rank` counts from 1 in
the likeliest-first order, null for a prompt token below the `k` listed). Chat puts it
beside the choices, completions in each choice.

A token a grammar forbids has log-probability -inf, which JSON cannot spell; it is
written as -9999.0, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from nanoqwen.outputs import TokenLogprobs
from nanoqwen.sampling.params import MAX_LOGPROBS
from nanoqwen.server.protocol import bad_request
from nanoqwen.text.tokenizer import Tokenizer

FORBIDDEN_LOGPROB = -9999.0
Scored = tuple[int, TokenLogprobs | None]  # a token id and what was computed for it


def parse_chat_logprobs(body: dict[str, Any]) -> int | None:
    """How many alternatives a chat request wants per token; None: no logprobs."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request("logprobs must be a boolean", "logprobs")
    if top is not None:
        check_count(top, "top_logprobs")
        if not logprobs:
            raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
    return (top or 0) if logprobs else None


def parse_completion_logprobs(body: dict[str, Any]) -> tuple[int | None, bool]:
    """(alternatives per token or None, echo) of a completions request."""
    logprobs, echo = body.get("logprobs"), body.get("echo", False)
    if logprobs is not None:
        check_count(logprobs, "logprobs")
    if echo is not None and not isinstance(echo, bool):
        raise bad_request("echo must be a boolean", "echo")
    return logprobs, bool(echo)


def parse_prompt_logprobs(body: dict[str, Any]) -> int | None:
    """vLLM's `prompt_logprobs`: how many alternatives per prompt token; None: not asked."""
    count = body.get("prompt_logprobs")
    if count is None:
        return None
    check_count(count, "prompt_logprobs")
    if body.get("stream"):  # the prompt is scored before the first token: nothing to stream
        raise bad_request("prompt_logprobs cannot be combined with stream: true",
                          "prompt_logprobs")
    return count


def ranked_prompt(
    tokenizer: Tokenizer, entries: Sequence[TokenLogprobs | None] | None
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` for a prompt's scored tokens (see the module docstring)."""
    return [entry and _ranked(tokenizer, entry) for entry in entries or []]


def _ranked(tokenizer: Tokenizer, entry: TokenLogprobs) -> dict[str, dict[str, Any]]:
    ranks = {token_id: rank for rank, (token_id, _) in enumerate(entry.top, start=1)}
    listed = {entry.token_id: entry.logprob, **dict(entry.top)}
    return {str(token_id): {"logprob": _finite(logprob), "rank": ranks.get(token_id),
                            "decoded_token": tokenizer.token_text(token_id)}
            for token_id, logprob in listed.items()}


def chat_logprobs(tokenizer: Tokenizer, scored: Sequence[Scored]) -> list[dict[str, Any]]:
    """The `content` entries of chat logprobs for these tokens."""
    return [
        {**_chat_token(tokenizer, token_id, entry.logprob),
         "top_logprobs": [_chat_token(tokenizer, alt, logprob) for alt, logprob in entry.top]}
        for token_id, entry in scored
    ]


def completion_logprobs(
    tokenizer: Tokenizer, scored: Sequence[Scored], offset: int = 0
) -> dict[str, Any]:
    """Completions logprobs for these tokens, the first starting at `offset` in the text."""
    tokens = [tokenizer.token_text(token_id) for token_id, _ in scored]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [entry and _finite(entry.logprob) for _, entry in scored],
        "top_logprobs": [entry and _top_map(tokenizer, entry) for _, entry in scored],
        "text_offset": offsets,
    }


def _top_map(tokenizer: Tokenizer, entry: TokenLogprobs) -> dict[str, float]:
    alternatives = [*entry.top, (entry.token_id, entry.logprob)]
    return {tokenizer.token_text(token_id): _finite(logprob) for token_id, logprob in alternatives}


def _chat_token(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": tokenizer.token_text(token_id), "logprob": _finite(logprob),
            "bytes": list(tokenizer.token_bytes(token_id))}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FORBIDDEN_LOGPROB


def check_count(value: Any, name: str) -> None:
    """A 400 unless `value` is a number of alternatives per token (0 to 20)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}", name)
