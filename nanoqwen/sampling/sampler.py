"""Batched sampling with per-request parameters: the core draw.

One step gives a logits row per sampled request, and each request has its own settings.
Turning the `[B, vocab]` logits into `B` token ids stays on the device, vectorised across
rows, with one device→host copy at the end:

1. greedy rows (temperature 0, or top_k 1) take the argmax;
2. the others are tempered and softmaxed, tokens outside top-k, the top-p nucleus and
   `min_p * max_prob` are zeroed, and one is drawn by the exponential race:
   `argmax(probs / E)`, `E ~ Exp(1)`, picks `i` with probability `probs[i] / sum(probs)`,
   with each seeded row's noise from its own generator.

Features that change the logits before the draw plug in as `LogitsProcessor`s (penalties
and logit bias in `penalties.py`, a grammar's mask in `grammar.py`); a feature that wants
the chosen tokens' log-probabilities replaces `to_host`, the final copy (`logprobs.py`).
A plain request meets none of them: its token goes straight from the logits to the draw.

Invariant: a row's result depends only on that row's logits, parameters, token history and
generator, so a seeded request gets the same tokens whatever shares its batch, in whichever
row; every filter is an exact no-op for rows that disable it. The story:
docs/learn/09-sampling.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from nanoqwen.sampling.params import SamplingParams


class SamplingRequest(Protocol):
    """What the sampler reads from a request (the engine's request object provides it)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # on the logits' device; set iff params.seed is set


class LogitsProcessor:
    """A feature that edits some rows' logits before the draw, and sees what was drawn.
    Processors run in the order of their `order` (a mask last: nothing after it may lift
    a forbidden token off -inf)."""

    order = 0

    def uses(self, requests: Sequence[SamplingRequest]) -> bool:
        """Does any row of this batch ask for it?"""
        raise NotImplementedError

    def process(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> None:
        """Edit (in place, float32) the logits of the rows that ask for it."""
        raise NotImplementedError

    def accept(self, requests: Sequence[SamplingRequest], token_ids: list[int]) -> None:
        """See the token chosen for each row (most processors need not)."""


# The last copy of a step: the chosen ids, from the device to the host (`logprobs.py`'s
# brings the chosen tokens' log-probabilities along in the same copy).
ToHost = Callable[[torch.Tensor, torch.Tensor, Sequence[SamplingRequest]], list[int]]


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request, living on the device its logits live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Turns a batch of logits rows into one token id per request."""

    def __init__(self) -> None:
        self.processors: list[LogitsProcessor] = []  # features add theirs when first used
        self.to_host: ToHost | None = None  # None: `token_ids.tolist()`

    def sample(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> list[int]:
        """Pick the next token for each row of ``logits`` ``[B, vocab]`` under its params."""
        if self.processors:
            logits = self.process(logits, requests)
        token_ids = choose(logits, requests)
        if self.to_host is None:
            tokens = token_ids.tolist()
        else:
            tokens = self.to_host(logits, token_ids, requests)
        for processor in self.processors:
            processor.accept(requests, tokens)
        return tokens

    def add_processor(self, processor_class: type[LogitsProcessor]) -> None:
        """Have every later batch pass through a processor of this class (once)."""
        if not any(type(processor) is processor_class for processor in self.processors):
            self.processors.append(processor_class())
            self.processors.sort(key=lambda processor: processor.order)

    def process(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
        """The logits after every processor the batch uses: a float32 copy when any edits
        them, the caller's tensor itself otherwise."""
        copied = False
        for processor in self.processors:
            if processor.uses(requests):
                if not copied:  # .float() would alias a float32 input: always copy
                    logits, copied = logits.to(torch.float32, copy=True), True
                processor.process(logits, requests)
        return logits


def choose(logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
    """Each row's token (on the device): the argmax for greedy rows, a draw for the rest."""
    # `max` finds the first index of each row's maximum faster than `argmax` on CPUs.
    token_ids = logits.max(dim=-1).indices
    sampled_rows = [row for row, request in enumerate(requests) if not request.params.is_greedy]
    if not sampled_rows:
        return token_ids
    if len(sampled_rows) == len(requests):
        return draw(filtered_probs(logits, requests), requests)
    rows = to_device(sampled_rows, torch.int64, logits.device)
    sampled = [requests[row] for row in sampled_rows]
    token_ids[rows] = draw(filtered_probs(logits[rows], sampled), sampled)
    return token_ids


def filtered_probs(logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
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


def draw(probs: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
    """One token per row of ``probs`` (``[B, vocab]``, not necessarily normalised), each
    row drawn with its request's random stream. Overwrites ``probs``."""
    noise = random_rows(probs.shape[-1], requests, probs.device, torch.Tensor.exponential_)
    return probs.div_(noise).max(dim=-1).indices


def random_rows(
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


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Copy host values to ``device`` without making the host wait for queued GPU work.

    A blocking copy from pageable memory synchronises the stream; staging through pinned
    memory lets the copy be queued behind the forward pass like any kernel.
    """
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
