"""Log-probabilities: what the model thought of each token, as well as which one it chose.

A request may ask for two kinds (`SamplingParams.logprobs`, `.prompt_logprobs`), each
as "the token's own log-probability plus the `k` likeliest tokens' at that position"
(`TokenLogprobs`):

* **Generated tokens** are scored by the sampler, in the same step that chooses them,
  from the distribution it chose them from: the log-softmax of the *processed* logits,
  after `logit_bias`, the grammar's mask, the repetition/presence/frequency penalties and
  the temperature (a greedy request's temperature counts as 1), but before top-k, top-p
  and min-p cut the tail off (so every token keeps a finite value and the top-`k` list
  means what it says). vLLM calls this "processed_logprobs" (its default is the raw
  model output); with no penalties, no bias and temperature 0 or 1 the two are the same,
  which is what evaluation harnesses send.
* **Prompt tokens** are scored by the prefill pass that computes them, from the raw model
  output (nothing is being sampled there): the logits at position `p` give token `p + 1`
  its value, so a prompt's first token has none. The runner computes those rows' logits
  besides the sampled ones (`step_inputs.py`), chunk by chunk with chunked prefill.

Both are computed on the device for all rows at once and copied to the host in one
transfer per step: the sampler packs them with the chosen token ids (`score_rows`,
`unpack_rows`), so asking for logprobs adds no device-to-host synchronisation of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

# Rows of prompt logits scored at a time: bounds the float32 temporaries of a long chunk.
PROMPT_ROWS_PER_PASS = 256


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token there, its log-probability, and the likeliest tokens'."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


def score_rows(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """``[R, 1 + 2k]`` float64 on the device: each row's log-probability of its token, then
    its `k` best log-probabilities, then their token ids (exact in float64), packed so
    that one copy brings everything to the host."""
    chosen = logprobs.gather(1, token_ids[:, None].long())
    best, best_ids = logprobs.topk(k, dim=-1)
    return torch.cat([chosen, best, best_ids.to(logprobs.dtype)], dim=1).double()


def unpack_rows(
    values: Sequence[float], token_ids: Sequence[int], counts: Sequence[int], k: int
) -> list[TokenLogprobs]:
    """`score_rows`' output, flattened on the host, as one `TokenLogprobs` per row; row `i`
    keeps its `counts[i]` best alternatives."""
    width = 1 + 2 * k
    scored = []
    for row, (token_id, count) in enumerate(zip(token_ids, counts)):
        start = row * width
        best = values[start + 1 : start + 1 + count]
        ids = values[start + 1 + k : start + 1 + k + count]
        top = [(int(token), logprob) for token, logprob in zip(ids, best)]
        scored.append(TokenLogprobs(int(token_id), values[start], top))
    return scored


class ScoredPrompt(Protocol):
    """What prompt scoring reads and writes of a request."""

    params: object  # SamplingParams: its `prompt_logprobs`
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs] | None  # token 1, 2, ...: appended as computed


@dataclass(frozen=True)
class PromptRows:
    """A request's prompt rows in one step: positions `first, first + 1, ...` (`count` of
    them), whose logits score prompt tokens `first + 1, ...`."""

    request: ScoredPrompt
    first: int
    count: int


def score_prompts(logits: torch.Tensor, spans: Sequence[PromptRows]) -> None:
    """Append to each request's `prompt_logprobs` the tokens its rows of `logits` (the raw
    model output, the spans' rows back to back) score."""
    targets = [
        token for span in spans
        for token in span.request.prompt_token_ids[span.first + 1 : span.first + 1 + span.count]
    ]
    counts = [span.request.params.prompt_logprobs for span in spans for _ in range(span.count)]
    k = max(counts)
    target_ids = torch.tensor(targets, dtype=torch.int64).to(logits.device, non_blocking=True)
    parts = [
        score_rows(
            torch.log_softmax(logits[start : start + PROMPT_ROWS_PER_PASS].float(), dim=-1),
            target_ids[start : start + PROMPT_ROWS_PER_PASS], k,
        )
        for start in range(0, len(targets), PROMPT_ROWS_PER_PASS)
    ]
    scored = iter(unpack_rows(torch.cat(parts).flatten().tolist(), targets, counts, k))
    for span in spans:
        span.request.prompt_logprobs.extend(next(scored) for _ in range(span.count))
