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
  besides the sampled ones, chunk by chunk with chunked prefill: `PromptScorer` is an
  output hook of the runner (`runner/runner.py`).

Both are computed on the device for all rows at once and copied to the host in one
transfer per step: the sampler's final copy packs them with the chosen token ids
(`with_logprobs`), so asking for logprobs adds no device-to-host synchronisation of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from nanoqwen.outputs import TokenLogprobs
from nanoqwen.sampling.sampler import SamplingRequest, to_device

# Rows of prompt logits scored at a time: bounds the float32 temporaries of a long chunk.
PROMPT_ROWS_PER_PASS = 256


def with_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[SamplingRequest]
) -> list[int]:
    """The sampler's final copy when logprobs are on: the chosen ids as a list, and each
    asking row's log-probabilities appended to its request, both in one copy."""
    scored = [row for row, request in enumerate(requests) if request.params.logprobs is not None]
    if not scored:
        return token_ids.tolist()
    params = [requests[row].params for row in scored]
    rows = to_device(scored, torch.int64, logits.device)
    chosen_logits = logits[rows].float()
    temperatures = [p.scoring_temperature for p in params]
    if any(t != 1.0 for t in temperatures):
        scale = to_device(temperatures, torch.float32, logits.device)
        chosen_logits = chosen_logits / scale[:, None]
    k = max(p.logprobs for p in params)
    packed = score_rows(torch.log_softmax(chosen_logits, dim=-1), token_ids[rows], k)
    host = torch.cat([token_ids.double(), packed.flatten()]).tolist()
    tokens = [int(token) for token in host[: len(requests)]]
    entries = unpack_rows(host[len(requests) :], [tokens[row] for row in scored],
                          [p.logprobs for p in params], k)
    for row, entry in zip(scored, entries):
        requests[row].logprobs.append(entry)
    return tokens


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


class PromptScorer:
    """The runner's output hook for prompt logprobs: asks for the rows of each prompt chunk
    whose tokens are not scored yet, and scores them from the raw logits."""

    def __init__(self) -> None:
        self.spans: list[PromptRows] = []

    def extra_rows(self, rows: Sequence, row_starts: Sequence[int]) -> list[int]:
        self.spans, wanted = [], []
        for row, first_row in zip(rows, row_starts):
            request = row.request
            if request.prompt_logprobs is None:
                continue
            span = unscored_prompt_rows(request, row.start, row.start + len(row.token_ids))
            if span.count:
                self.spans.append(span)
                start = first_row + span.first - row.start
                wanted.extend(range(start, start + span.count))
        return wanted

    def take(self, sampled: Sequence, hidden: torch.Tensor, extra_logits: torch.Tensor) -> None:
        if self.spans:
            score_prompts(extra_logits, self.spans)


def unscored_prompt_rows(request: ScoredPrompt, start: int, end: int) -> PromptRows:
    """The positions in `[start, end)` whose logits score a prompt token not scored yet:
    position `p` scores token `p + 1`, and tokens up to `len(prompt_logprobs)` are done
    (a request recomputing its prompt after a preemption does not score it twice)."""
    first = max(start, len(request.prompt_logprobs))
    stop = min(end, len(request.prompt_token_ids) - 1)
    return PromptRows(request, first, max(0, stop - first))


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
