"""Verification: keep the draft tokens the target model agrees with, and stay exact.

A request with `k` drafts has `k + 1` rows of logits in the step: row `i` predicts the
token after draft `i` (row 0: after the last accepted token), the last row one token beyond
the drafts. Each request turns its rows into 1 to `k + 1` new tokens:

* greedy: the longest prefix of drafts equal to the target's argmax, then the target's
  argmax at the first disagreement (or, all accepted, the bonus token after the last);
* sampled: rejection sampling (Leviathan et al.; Chen et al., 2023): accept draft `x`,
  drawn from `q` (a draft model's distribution, or a point mass for a guess copied from
  the text), with probability `min(1, p(x) / q(x))`; at the first rejection draw from the
  normalised residual `max(0, p - q)` and stop; all accepted, draw the bonus from `p`.

`p` is what the sampler would sample from at that row (`Sampler.distribution`: penalties,
temperature, top-k/top-p/min-p), with the drafts before the row in its history
(`DraftRow`). Random numbers come from a seeded request's own generator, in a fixed order.

Invariant: every emitted token is distributed exactly as if the target had sampled it
alone; greedy output is what decoding one token at a time gives. The proof, and a picture
of accepted and rejected drafts: docs/learn/10-speculative-decoding.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from nanoqwen.sampling.params import SamplingParams
from nanoqwen.sampling.sampler import Sampler, draw, to_device, uniform_noise
from nanoqwen.scheduling.request import Request


class DraftRow:
    """How the sampler sees one row of a request's draft block: the request, with the
    drafts before this row appended to its output."""

    __slots__ = ("request", "num_drafts")

    def __init__(self, request: Request, num_drafts: int) -> None:
        self.request, self.num_drafts = request, num_drafts

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.request.proposed_token_ids[: self.num_drafts]

    @property
    def generator(self) -> torch.Generator | None:
        return self.request.generator


# The distributions a draft model sampled a request's drafts from, `[num_drafts, vocab]`;
# None for greedy requests and guesses copied from the text.
DraftProbs = Callable[[Request], "torch.Tensor | None"]


def no_draft_probs(request: Request) -> None:
    return None


def sample_with_drafts(
    sampler: Sampler,
    logits: torch.Tensor,
    requests: Sequence[Request],
    draft_probs: DraftProbs = no_draft_probs,
) -> list[list[int]]:
    """Each request's new tokens, from its `1 + len(proposed_token_ids)` consecutive rows
    of `logits`: the accepted drafts, then one token of the target's own. A request without
    drafts is sampled as it would be without speculation, in the same sampler call as the
    greedy requests' draft rows (one device-to-host copy for both)."""
    if not any(request.proposed_token_ids for request in requests):
        return [[token_id] for token_id in sampler.sample(logits, requests)]
    blocks, num_rows = [], 0  # each request's rows
    for request in requests:
        blocks.append(range(num_rows, num_rows + 1 + len(request.proposed_token_ids)))
        num_rows = blocks[-1].stop
    if logits.shape[0] != num_rows:
        raise ValueError(f"expected {num_rows} rows of logits, got {logits.shape[0]}")
    new_tokens: list[list[int]] = [[] for _ in requests]
    plain = [i for i, request in enumerate(requests) if not request.proposed_token_ids]
    greedy = [i for i, request in enumerate(requests)
              if request.proposed_token_ids and request.params.is_greedy]
    sampled = [i for i, request in enumerate(requests)
               if request.proposed_token_ids and not request.params.is_greedy]
    if plain or greedy:
        greedy_requests = [requests[i] for i in greedy]
        rows = [blocks[i].start for i in plain] + [row for i in greedy for row in blocks[i]]
        chosen = sampler.sample(
            select_rows(logits, rows), [requests[i] for i in plain] + draft_rows(greedy_requests)
        )
        for i, token_id in zip(plain, chosen):
            new_tokens[i] = [token_id]
        for i, tokens in zip(greedy, _accept_greedy(greedy_requests, chosen[len(plain) :])):
            new_tokens[i] = tokens
    if sampled:
        block = select_rows(logits, [row for i in sampled for row in blocks[i]])
        verified = _verify_sampled(sampler, block, [requests[i] for i in sampled], draft_probs)
        for i, tokens in zip(sampled, verified):
            new_tokens[i] = tokens
    return new_tokens


def select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows `rows` of `logits`; the index reaches the device without making the host wait."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[to_device(rows, torch.int64, logits.device)]


def draft_rows(requests: Sequence[Request]) -> list[DraftRow]:
    """One `DraftRow` per row of each request's draft block, in order."""
    return [
        DraftRow(request, i)
        for request in requests
        for i in range(1 + len(request.proposed_token_ids))
    ]


def _accept_greedy(requests: Sequence[Request], targets: list[int]) -> list[list[int]]:
    """Greedy requests' new tokens, given the target's argmax at every draft row."""
    accepted = [draft == target for draft, target in zip(_drafts_by_row(requests), targets)]
    return _new_tokens(requests, accepted, targets)


def _verify_sampled(
    sampler: Sampler, logits: torch.Tensor, requests: Sequence[Request], draft_probs: DraftProbs
) -> list[list[int]]:
    rows = draft_rows(requests)
    p = sampler.distribution(logits, rows)
    q = torch.zeros_like(p)  # zero on the last row of each block: its residual is p itself
    drafts = _drafts_by_row(requests)
    checked_rows = [i for i, d in enumerate(drafts) if d is not None]
    index = to_device(checked_rows, torch.int64, p.device)
    ids = to_device([d for d in drafts if d is not None], torch.int64, p.device)
    row = 0
    for request in requests:
        num_drafts = len(request.proposed_token_ids)
        probs = draft_probs(request)
        if probs is None:  # a guess copied from the text: all mass on it
            q[index[row : row + num_drafts], ids[row : row + num_drafts]] = 1.0
        else:
            q[index[row : row + num_drafts]] = probs.to(q.dtype)
        row += num_drafts
    residual = (p - q).clamp_(min=0.0)
    # p == q leaves no residual, and then rejection never happens; keep the row drawable.
    empty = residual.sum(dim=-1) <= 0
    residual[empty] = p[empty]
    tokens = draw(residual, rows)
    # Accept draft x with probability min(1, p(x) / q(x)): u < p(x) / q(x), u ~ U[0, 1).
    u = uniform_noise([rows[i] for i in checked_rows], p.device)
    accepted = u * q[index, ids] < p[index, ids]
    host = torch.cat([tokens, accepted.long()]).tolist()  # one device-to-host copy
    accepted_by_row = iter(host[len(rows) :])
    flags = [None if d is None else bool(next(accepted_by_row)) for d in drafts]
    return _new_tokens(requests, flags, host[: len(rows)])


def _drafts_by_row(requests: Sequence[Request]) -> list[int | None]:
    """Row by row, the draft that row's logits check (None on each block's last row)."""
    return [token for r in requests for token in (*r.proposed_token_ids, None)]


def _new_tokens(
    requests: Sequence[Request], accepted: list[bool | None], tokens: list[int]
) -> list[list[int]]:
    """Per request: its drafts up to the first one not accepted, then the token chosen on
    that row (`tokens`: the target's choice at every row)."""
    new_tokens, row = [], 0
    for request in requests:
        drafts = request.proposed_token_ids
        num_accepted = 0
        while num_accepted < len(drafts) and accepted[row + num_accepted]:
            num_accepted += 1
        new_tokens.append(drafts[:num_accepted] + [tokens[row + num_accepted]])
        row += 1 + len(drafts)
    return new_tokens
