"""Batched sampling with per-request parameters.

One step gives a logits row per sampled request, and each request has its own settings.
Turning the `[B, vocab]` logits into `B` token ids stays on the device, vectorised across
rows, with one device→host copy at the end (the chosen ids, and any logprobs with them):

1. the raw logits get each row's `logit_bias`, repetition penalty (tokens seen: divide
   positive logits, multiply negative ones), presence/frequency penalties (output tokens:
   `logit -= frequency * count + presence * (count > 0)`), then a grammar's mask
   (`grammar.py`);
2. greedy rows (temperature 0, or top_k 1) take the argmax;
3. the others are tempered and softmaxed, tokens outside top-k, the top-p nucleus and
   `min_p * max_prob` are zeroed, and one is drawn by the exponential race:
   `argmax(probs / E)`, `E ~ Exp(1)`, picks `i` with probability `probs[i] / sum(probs)`,
   with each seeded row's noise from its own generator.

`distribution` returns exactly what `sample` draws from, and `draw` / `uniform_noise` draw
with the rows' own random streams, for verifying proposed tokens
(`speculative/verification.py`). Rows asking for log-probabilities get them from the
processed logits (`logprobs.py`).

Invariant: a row's result depends only on that row's logits, parameters, token history and
generator, so a seeded request gets the same tokens whatever shares its batch, in whichever
row; every filter is an exact no-op for rows that disable it. The story:
docs/learn/08-sampling.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from nanoqwen.sampling.grammar import GrammarMatcher, advance_grammars, apply_grammar_masks
from nanoqwen.sampling.logprobs import TokenLogprobs, score_rows, unpack_rows
from nanoqwen.sampling.params import SamplingParams


class SamplingRequest(Protocol):
    """What the sampler reads from a request (the engine's request object provides it)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # on the logits' device; set iff params.seed is set
    # Read only when the params ask for them:
    grammar: GrammarMatcher | None  # params.structured_output: advanced by each chosen token
    logprobs: list[TokenLogprobs] | None  # params.logprobs: each chosen token's, appended


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request, living on the device its logits live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Turns a batch of logits rows into one token id per request."""

    def sample(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> list[int]:
        """Pick the next token for each row of ``logits`` ``[B, vocab]`` under its params."""
        _check_shape(logits, requests)
        logits = _process_logits(logits, requests)
        token_ids = _choose(logits, requests)
        scored = [row for row, req in enumerate(requests) if req.params.logprobs is not None]
        if scored:
            tokens = _with_logprobs(logits, token_ids, requests, scored)
        else:
            tokens = token_ids.tolist()
        advance_grammars(requests, tokens)
        return tokens

    def distribution(
        self, logits: torch.Tensor, requests: Sequence[SamplingRequest]
    ) -> torch.Tensor:
        """The normalised float32 distribution ``sample`` draws each row's token from.

        Penalties, temperature and the filters are applied; a greedy row is one-hot at
        its argmax.
        """
        _check_shape(logits, requests)
        logits = _process_logits(logits, requests)
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        greedy = [row for row, request in enumerate(requests) if request.params.is_greedy]
        if greedy:
            rows = to_device(greedy, torch.int64, logits.device)
            probs[rows, _argmax(logits[rows])] = 1.0
        if len(greedy) < len(requests):
            sampled = [row for row, request in enumerate(requests) if not request.params.is_greedy]
            rows = to_device(sampled, torch.int64, logits.device)
            kept = _filtered_probs(logits[rows], [requests[row] for row in sampled])
            probs[rows] = kept / kept.sum(dim=-1, keepdim=True)
        return probs


def draw(probs: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
    """One token per row of ``probs`` (``[B, vocab]``, not necessarily normalised), each
    row drawn with its request's random stream. Overwrites ``probs``."""
    noise = _random_rows(probs.shape[-1], requests, probs.device, torch.Tensor.exponential_)
    return _argmax(probs.div_(noise))


def uniform_noise(requests: Sequence[SamplingRequest], device: torch.device) -> torch.Tensor:
    """One U[0, 1) number per request, ``[B]``, each from its request's random stream."""
    return _random_rows(1, requests, device, torch.Tensor.uniform_)[:, 0]


def _check_shape(logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(requests):
        raise ValueError(
            f"logits must be [len(requests), vocab] = [{len(requests)}, vocab], "
            f"got {tuple(logits.shape)}"
        )


def _argmax(rows: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum; `max` finds it faster than `argmax` on CPUs."""
    return rows.max(dim=-1).indices


def _choose(logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
    """Each row's token (on the device): the argmax for greedy rows, a draw for the rest."""
    sampled_rows = [row for row, req in enumerate(requests) if not req.params.is_greedy]
    if not sampled_rows:
        return _argmax(logits)
    if len(sampled_rows) == len(requests):
        return _sample_rows(logits, requests)
    token_ids = _argmax(logits)
    rows = to_device(sampled_rows, torch.int64, logits.device)
    token_ids[rows] = _sample_rows(logits[rows], [requests[row] for row in sampled_rows])
    return token_ids


def _with_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[SamplingRequest],
    scored: list[int],
) -> list[int]:
    """The chosen ids as a list, and each `scored` row's log-probabilities appended to its
    request, both brought to the host in one copy."""
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


def _process_logits(logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
    """Float32 logits with each row's logit bias, penalties and grammar mask applied; the
    caller's tensor itself when no row uses any of them."""
    params = [request.params for request in requests]
    uses_repetition = [p.uses_repetition_penalty for p in params]
    uses_output = [p.uses_output_penalties for p in params]
    biased = any(p.logit_bias is not None for p in params)
    constrained = any(p.structured_output is not None for p in params)
    if not (any(uses_repetition) or any(uses_output) or biased or constrained):
        return logits
    # Always copy: .float() would alias a float32 input, and the edits below are in place.
    logits = logits.to(torch.float32, copy=True)
    vocab_size, device = logits.shape[-1], logits.device

    if biased:
        _add_logit_bias(logits, params)

    if any(uses_repetition):
        # Rows without the penalty get no history, so they stay untouched (penalty 1 anyway).
        histories = [
            r.prompt_token_ids + r.output_token_ids if uses else []
            for r, uses in zip(requests, uses_repetition)
        ]
        seen = _token_counts(histories, vocab_size, device) > 0
        penalty = to_device([p.repetition_penalty for p in params], torch.float32, device)[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)

    if any(uses_output):
        outputs = [r.output_token_ids if uses else [] for r, uses in zip(requests, uses_output)]
        counts = _token_counts(outputs, vocab_size, device)
        frequency = to_device([p.frequency_penalty for p in params], torch.float32, device)
        presence = to_device([p.presence_penalty for p in params], torch.float32, device)
        logits -= frequency[:, None] * counts + presence[:, None] * (counts > 0)
    if constrained:  # last: nothing after it may lift a forbidden token off -inf
        apply_grammar_masks(logits, requests)
    return logits


def _add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add (in place) each row's `logit_bias` to the logits of the token ids it names."""
    rows, token_ids, biases = [], [], []
    for row, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            rows.append(row)
            token_ids.append(token_id)
            biases.append(bias)
    index = (to_device(rows, torch.int64, logits.device),
             to_device(token_ids, torch.int64, logits.device))
    logits.index_put_(index, to_device(biases, torch.float32, logits.device), accumulate=True)


def _sample_rows(logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
    """Draw one token per row (none of them greedy) from the filtered, tempered distribution."""
    return draw(_filtered_probs(logits, requests), requests)


def _filtered_probs(logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
    """Softmax of the tempered logits with the tokens outside top-k, top-p and min-p zeroed
    (not renormalised), for rows that are not greedy."""
    params = [request.params for request in requests]
    logits = logits.float()
    if any(p.temperature != 1.0 for p in params):
        temperature = to_device([p.temperature for p in params], torch.float32, logits.device)
        logits = logits / temperature[:, None]
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        _drop_outside_top_k_top_p(probs, params)
    if any(p.min_p > 0.0 for p in params):
        _drop_below_min_p(probs, params)
    return probs


def _drop_outside_top_k_top_p(probs: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Zero (in place) the tokens outside each row's top-k, then outside its top-p nucleus.

    Both filters are cut-offs on the rank of a token, so one descending sort serves both.
    """
    vocab_size, device = probs.shape[-1], probs.device
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    top_k = to_device([p.top_k or vocab_size for p in params], torch.int64, device)
    drop = torch.arange(vocab_size, device=device) >= top_k[:, None]
    if any(p.top_p < 1.0 for p in params):
        kept = sorted_probs.masked_fill(drop, 0.0)
        cumulative = kept.cumsum(dim=-1)
        mass_before = cumulative - kept
        # Top-p applies to the distribution left by top-k, hence the scaling by the kept total.
        # Rows with top_p == 1 get an unreachable threshold: rounding in the cumulative sum
        # could otherwise drop their tail.
        top_p = to_device([p.top_p if p.top_p < 1.0 else math.inf for p in params],
                           torch.float32, device)
        # A token is in the nucleus if the mass strictly before it is still short of top_p;
        # the top token (mass_before 0) is therefore always kept.
        drop |= mass_before >= top_p[:, None] * cumulative[:, -1:]
    drop_in_vocab_order = torch.empty_like(drop).scatter_(1, order, drop)
    probs.masked_fill_(drop_in_vocab_order, 0.0)


def _drop_below_min_p(probs: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Zero (in place) the tokens less likely than ``min_p`` times the row's top probability.

    The test is a ratio, so it gives the same answer before or after renormalisation.
    """
    min_p = to_device([p.min_p for p in params], torch.float32, probs.device)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    probs.masked_fill_(probs < threshold, 0.0)


def _random_rows(
    width: int, requests: Sequence[SamplingRequest], device: torch.device, fill: Callable
) -> torch.Tensor:
    """``[len(requests), width]`` float32 noise made by ``fill(tensor, generator=...)`` (an
    in-place torch sampler): seeded rows from their own generator, the rest shared."""
    noise = torch.empty(len(requests), width, device=device)
    seeded_rows = []
    for row, request in enumerate(requests):
        if request.generator is not None:
            seeded_rows.append((row, request.generator))
        elif request.params.seed is not None:
            raise ValueError(
                f"request in row {row} has seed {request.params.seed} but no generator"
            )
    if len(seeded_rows) < len(requests):
        fill(noise)
    for row, generator in seeded_rows:
        fill(noise[row], generator=generator)
    return noise


def _token_counts(token_lists: Sequence[list[int]], vocab_size: int,
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


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Copy host values to ``device`` without making the host wait for queued GPU work.

    A blocking copy from pageable memory synchronises the stream; staging through pinned
    memory lets the copy be queued behind the forward pass like any kernel.
    """
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
