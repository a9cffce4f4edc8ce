"""Verification: keep the guessed tokens the target model agrees with, and stay exact.

A row carrying `k` guesses (drafts) computes `k + 1` sampled rows of logits: row `i`
predicts the token after draft `i` (row 0: after the request's last token), the last row
one token beyond the drafts. Each request turns its rows into 1 to `k + 1` new tokens:

* greedy: the longest prefix of drafts equal to the target's argmax, then the target's
  argmax at the first disagreement (or, all accepted, the bonus token after the last);
* sampled: rejection sampling (Leviathan et al.; Chen et al., 2023): accept draft `x`,
  drawn from `q` (a draft model's distribution, or a point mass for a guess copied from
  the text), with probability `min(1, p(x) / q(x))`; at the first rejection draw from the
  normalised residual `max(0, p - q)` and stop; all accepted, draw the bonus from `p`.

`p` is what the sampler would sample from at that row (`distribution`: the logits
processors, temperature, top-k/top-p/min-p), with the drafts before the row in its history
(`DraftRow`). Random numbers come from a seeded request's own generator, in a fixed order.

Invariant: every emitted token is distributed exactly as if the target had sampled it
alone; greedy output is what decoding one token at a time gives. The proof, and a picture
of accepted and rejected drafts: docs/learn/12-speculative-decoding.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from nanoqwen.sampling.params import SamplingParams
from nanoqwen.sampling.sampler import (
    Sampler,
    SamplingRequest,
    draw,
    filtered_probs,
    random_rows,
    to_device,
)
from nanoqwen.scheduling.request import Request
from nanoqwen.scheduling.scheduler import Row


def uniform_noise(requests: Sequence[SamplingRequest], device: torch.device) -> torch.Tensor:
    """One U[0, 1) number per request, ``[B]``, each from its request's random stream."""
    return random_rows(1, requests, device, torch.Tensor.uniform_)[:, 0]


def drafts_of(row: Row) -> list[int]:
    """The guesses a row carries: its tokens after the request's last one."""
    return row.token_ids[len(row.token_ids) - row.num_sampled + 1 :]


class DraftRow:
    """How the sampler sees one row of a request's draft block: the request, with the
    drafts before this row appended to its output."""

    __slots__ = ("request", "drafts")

    def __init__(self, request: Request, drafts: list[int]) -> None:
        self.request, self.drafts = request, drafts

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts

    @property
    def generator(self) -> torch.Generator | None:
        return self.request.generator

    @property
    def grammar(self) -> object:
        return self.request.grammar


def distribution(
    sampler: Sampler, logits: torch.Tensor, requests: Sequence[SamplingRequest]
) -> torch.Tensor:
    """The normalised float32 distribution the sampler draws each row's token from: the
    processors, temperature and the filters applied; a greedy row one-hot at its argmax."""
    logits = sampler.process(logits, requests)
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    greedy = [row for row, request in enumerate(requests) if request.params.is_greedy]
    if greedy:
        rows = to_device(greedy, torch.int64, logits.device)
        probs[rows, logits[rows].max(dim=-1).indices] = 1.0
    if len(greedy) < len(requests):
        sampled = [row for row, request in enumerate(requests) if not request.params.is_greedy]
        rows = to_device(sampled, torch.int64, logits.device)
        kept = filtered_probs(logits[rows], [requests[row] for row in sampled])
        probs[rows] = kept / kept.sum(dim=-1, keepdim=True)
    return probs


# The distributions a draft model sampled a request's drafts from, `[num_drafts, vocab]`;
# None for greedy requests and guesses copied from the text.
DraftProbs = Callable[[Request], "torch.Tensor | None"]


def no_draft_probs(request: Request) -> None:
    return None


def sample_with_drafts(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: Sequence[Row],
    draft_probs: DraftProbs = no_draft_probs,
) -> list[list[int]]:
    """Each row's new tokens, from its `num_sampled` consecutive rows of `logits`: the
    accepted drafts, then one token of the target's own. A row without drafts is sampled
    as it would be without speculation, in the same sampler call as the greedy requests'
    draft rows (one device-to-host copy for both)."""
    if all(row.num_sampled == 1 for row in rows):
        return [[token] for token in sampler.sample(logits, [row.request for row in rows])]
    blocks, num_rows = [], 0  # each row's rows of logits
    for row in rows:
        blocks.append(range(num_rows, num_rows + row.num_sampled))
        num_rows = blocks[-1].stop
    if logits.shape[0] != num_rows:
        raise ValueError(f"expected {num_rows} rows of logits, got {logits.shape[0]}")
    drafts = [drafts_of(row) for row in rows]
    new_tokens: list[list[int]] = [[] for _ in rows]
    plain = [i for i, d in enumerate(drafts) if not d]
    greedy = [i for i, d in enumerate(drafts) if d and rows[i].request.params.is_greedy]
    sampled = [i for i, d in enumerate(drafts) if d and not rows[i].request.params.is_greedy]
    if plain or greedy:
        checked = [DraftRow(rows[i].request, drafts[i][:j]) for i in greedy
                   for j in range(len(drafts[i]) + 1)]
        picked = [blocks[i].start for i in plain] + [r for i in greedy for r in blocks[i]]
        chosen = sampler.sample(select_rows(logits, picked),
                                [rows[i].request for i in plain] + checked)
        for i, token_id in zip(plain, chosen):
            new_tokens[i] = [token_id]
        greedy_drafts = [drafts[i] for i in greedy]
        for i, tokens in zip(greedy, _accept_greedy(greedy_drafts, chosen[len(plain) :])):
            new_tokens[i] = tokens
    if sampled:
        block = select_rows(logits, [r for i in sampled for r in blocks[i]])
        verified = _verify_sampled(sampler, block, [rows[i].request for i in sampled],
                                   [drafts[i] for i in sampled], draft_probs)
        for i, tokens in zip(sampled, verified):
            new_tokens[i] = tokens
    return new_tokens


def select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows `rows` of `logits`; the index reaches the device without making the host wait."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[to_device(rows, torch.int64, logits.device)]


def _accept_greedy(drafts: Sequence[list[int]], targets: list[int]) -> list[list[int]]:
    """Greedy requests' new tokens, given the target's argmax at every draft row."""
    accepted = [draft == target for draft, target in zip(_by_row(drafts), targets)]
    return _new_tokens(drafts, accepted, targets)


def _verify_sampled(
    sampler: Sampler, logits: torch.Tensor, requests: Sequence[Request],
    drafts: Sequence[list[int]], draft_probs: DraftProbs,
) -> list[list[int]]:
    rows = [DraftRow(r, d[:j]) for r, d in zip(requests, drafts) for j in range(len(d) + 1)]
    p = distribution(sampler, logits, rows)
    q = torch.zeros_like(p)  # zero on the last row of each block: its residual is p itself
    by_row = _by_row(drafts)
    checked_rows = [i for i, d in enumerate(by_row) if d is not None]
    index = to_device(checked_rows, torch.int64, p.device)
    ids = to_device([d for d in by_row if d is not None], torch.int64, p.device)
    start = 0
    for request, request_drafts in zip(requests, drafts):
        count, probs = len(request_drafts), draft_probs(request)
        if probs is None:  # a guess copied from the text: all mass on it
            q[index[start : start + count], ids[start : start + count]] = 1.0
        else:
            q[index[start : start + count]] = probs.to(q.dtype)
        start += count
    residual = (p - q).clamp_(min=0.0)
    # p == q leaves no residual, and then rejection never happens; keep the row drawable.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    tokens = draw(residual, rows)
    # Accept draft x with probability min(1, p(x) / q(x)): u < p(x) / q(x), u ~ U[0, 1).
    u = uniform_noise([rows[i] for i in checked_rows], p.device)
    accepted = u * q[index, ids] < p[index, ids]
    host = torch.cat([tokens, accepted.long()]).tolist()  # one device-to-host copy
    accepted_by_row = iter(host[len(rows) :])
    flags = [None if d is None else bool(next(accepted_by_row)) for d in by_row]
    return _new_tokens(drafts, flags, host[: len(rows)])


def _by_row(drafts: Sequence[list[int]]) -> list[int | None]:
    """Row by row, the draft that row's logits check (None on each block's last row)."""
    return [token for request_drafts in drafts for token in (*request_drafts, None)]


def _new_tokens(
    drafts: Sequence[list[int]], accepted: list[bool | None], tokens: list[int]
) -> list[list[int]]:
    """Per request: its drafts up to the first one not accepted, then the token chosen on
    that row (`tokens`: the target's choice at every row)."""
    new_tokens, row = [], 0
    for request_drafts in drafts:
        num_accepted = 0
        while num_accepted < len(request_drafts) and accepted[row + num_accepted]:
            num_accepted += 1
        new_tokens.append(request_drafts[:num_accepted] + [tokens[row + num_accepted]])
        row += 1 + len(request_drafts)
    return new_tokens
