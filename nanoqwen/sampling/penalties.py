"""Logits processors for what a request asks about its own history and vocabulary.

Each is a `LogitsProcessor` (`sampler.py`): it edits, in place and in float32, the logits
rows of the requests that ask for it, before the draw, and leaves the others untouched:

* `LogitBias`: `logit_bias` adds a number to chosen tokens' logits (OpenAI's: -100 bans a
  token, +100 all but forces it);
* `Penalties`: the repetition penalty divides the positive logits of every token seen so
  far (prompt and output) and multiplies the negative ones; presence and frequency
  penalties subtract `frequency * count + presence * (count > 0)` for tokens in the
  output;
* `AllowedTokens`: `allowed_token_ids` sets every other token's logit to -inf.

`for_params` gives the processors a request needs; the engine adds each to the sampler
when the first request asks for it. Invariant: a row that disables a processor gets
exactly its logits back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoqwen.sampling.params import SamplingParams
from nanoqwen.sampling.sampler import LogitsProcessor, SamplingRequest, to_device


class LogitBias(LogitsProcessor):
    order = 0

    def uses(self, requests: Sequence[SamplingRequest]) -> bool:
        return any(request.params.logit_bias is not None for request in requests)

    def process(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> None:
        rows, token_ids, biases = [], [], []
        for row, request in enumerate(requests):
            for token_id, bias in (request.params.logit_bias or {}).items():
                rows.append(row)
                token_ids.append(token_id)
                biases.append(bias)
        index = (to_device(rows, torch.int64, logits.device),
                 to_device(token_ids, torch.int64, logits.device))
        logits.index_put_(index, to_device(biases, torch.float32, logits.device), accumulate=True)


class Penalties(LogitsProcessor):
    order = 1

    def uses(self, requests: Sequence[SamplingRequest]) -> bool:
        return any(uses_penalties(request.params) for request in requests)

    def process(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> None:
        params = [request.params for request in requests]
        vocab_size, device = logits.shape[-1], logits.device
        repeats = [p.repetition_penalty != 1.0 for p in params]
        if any(repeats):
            # Rows without the penalty get no history, so they stay untouched (penalty 1 anyway).
            histories = [r.prompt_token_ids + r.output_token_ids if uses else []
                         for r, uses in zip(requests, repeats)]
            seen = token_counts(histories, vocab_size, device) > 0
            penalty = to_device([p.repetition_penalty for p in params], torch.float32, device)[:, None]
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits.copy_(torch.where(seen, penalised, logits))
        outputs = [r.output_token_ids if _uses_output_penalties(r.params) else [] for r in requests]
        if any(outputs):
            counts = token_counts(outputs, vocab_size, device)
            frequency = to_device([p.frequency_penalty for p in params], torch.float32, device)
            presence = to_device([p.presence_penalty for p in params], torch.float32, device)
            logits -= frequency[:, None] * counts + presence[:, None] * (counts > 0)


class AllowedTokens(LogitsProcessor):
    order = 2

    def uses(self, requests: Sequence[SamplingRequest]) -> bool:
        return any(request.params.allowed_token_ids is not None for request in requests)

    def process(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> None:
        for row, request in enumerate(requests):
            allowed = request.params.allowed_token_ids
            if allowed is not None:
                keep = to_device(allowed, torch.int64, logits.device)
                kept = logits[row, keep]
                logits[row] = float("-inf")
                logits[row, keep] = kept


def uses_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or _uses_output_penalties(params)


def _uses_output_penalties(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def for_params(params: SamplingParams) -> list[type[LogitsProcessor]]:
    """The processors a request with these params needs (none for most)."""
    needed: list[type[LogitsProcessor]] = []
    if params.logit_bias is not None:
        needed.append(LogitBias)
    if uses_penalties(params):
        needed.append(Penalties)
    if params.allowed_token_ids is not None:
        needed.append(AllowedTokens)
    return needed


def token_counts(token_lists: Sequence[list[int]], vocab_size: int,
                 device: torch.device) -> torch.Tensor:
    """``[rows, vocab]`` float32 occurrence counts of each row's token ids.

    Ragged rows are padded with the id ``vocab_size``, which lands in a spare last column that
    is sliced off, so padding needs no mask.
    """
    width = max((len(ids) for ids in token_lists), default=0)
    padded = [ids + [vocab_size] * (width - len(ids)) for ids in token_lists]
    index = to_device(padded, torch.int64, device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, index, torch.ones(index.shape, device=device))
    return counts[:, :vocab_size]
