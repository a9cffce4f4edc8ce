"""Speculative decoding: guess a few tokens cheaply, let the target model check them at once.

A proposer guesses each request's next `k` tokens; the step computes them as `k + 1` new
tokens of the request's row (its last token, then the guesses), beside everyone else's
rows, and `verification.py` keeps the guesses up to the first wrong one plus one token of
the target's own. Two proposers:

* `NgramProposer` (prompt lookup): what followed the latest earlier occurrence of the
  request's last `n` tokens in its own text, `n` from `ngram_max` down to `ngram_min`; a
  dictionary lookup that wins where outputs copy their input. No match, no guesses: the
  step is an ordinary one.
* `DraftModelProposer`: a smaller model with the same tokenizer, run by a runner of its
  own on a KV cache with the target's pages, proposes `k` tokens one at a time.

The hook: `Speculation` is the engine's `StepHook`, so the core never hears of drafts.
Before a step is laid out it appends guesses to the rows that reach their request's last
token (with pages only where they can be had without preempting anyone:
`Scheduler.reserve`) and marks them sampled; its `choose_tokens` replaces the runner's
and verifies them; once they are chosen, before they are appended, it counts them and
forgets the rejected ones' K/V (`Scheduler.rollback`), so the prefix cache only ever sees
accepted tokens. Verification steps run eagerly: their rows vary in length, so they are
shaped like small prefills, not decodes.

Invariant: the draft model's KV cache uses the target's page numbers, and a request's
first `num_computed_tokens` tokens have K/V in both pools: the draft model runs every row
of the target's step first (prefilling chunk by chunk with it), then its drafts, so
whichever drafts are accepted, both pools hold them. The story:
docs/learn/12-speculative-decoding.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from nanoqwen.config import EngineConfig
from nanoqwen.runner.runner import ModelRunner, on_device
from nanoqwen.sampling.sampler import Sampler, draw
from nanoqwen.scheduling.request import Request, Status
from nanoqwen.scheduling.scheduler import Row, Scheduler
from nanoqwen.speculative.verification import (
    DraftRow,
    distribution,
    sample_with_drafts,
    select_rows,
)
from nanoqwen.text.tokenizer import Tokenizer
from nanoqwen.weights.checkpoint import Checkpoint, open_checkpoint

# Pages for up to `count` guesses after a row's tokens; how many it may carry.
Reserve = Callable[[int, int], int]


@dataclass
class SpeculationStats:
    """What speculation achieved so far: the `speculative` group of `LLMEngine.stats()`.

    | key | meaning |
    |---|---|
    | `proposed_tokens` | draft tokens proposed and verified |
    | `accepted_tokens` | of them, those the target model agreed with |
    | `verifications` | request-steps that verified at least one draft token |
    | `acceptance_rate` | `accepted_tokens / proposed_tokens` (0 before any proposal) |
    | `mean_accepted_length` | tokens per verification: the accepted drafts, plus the target's |
    """

    proposed: int = 0
    accepted: int = 0
    verifications: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "verifications": self.verifications,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "mean_accepted_length": (
                (self.accepted + self.verifications) / self.verifications
                if self.verifications
                else 0.0
            ),
        }


class Speculation:
    """The engine's step hook for speculative decoding (see the module docstring). Made
    before the engine starts its runners: `checkpoints` (a draft model) are loaded beside
    the target, and every step may carry `max_proposed` more tokens per row."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, tokenizer: Tokenizer) -> None:
        if checkpoint.model_config.state_layers:
            raise ValueError(
                "speculative decoding does not run on models with recurrent layers (Qwen3-Next,"
                " Qwen3.5): their state would have to be kept after every guessed token, to go "
                "back to the last accepted one"
            )
        self.config, self.vocab_size = config, checkpoint.model_config.vocab_size
        self.checkpoints = [resolve_draft_model(config, tokenizer)] if config.draft_model else []
        self.num_speculative_tokens = self.max_proposed = config.num_speculative_tokens
        self.stats = SpeculationStats()
        self.drafted: dict[Request, int] = {}  # this step's guesses per request
        self.proposer: Proposer = NgramProposer(config.ngram_min, config.ngram_max)
        self.scheduler: Scheduler | None = None
        self.max_model_len = 0

    def attach(self, engine: Any, partners: Sequence[ModelRunner]) -> None:
        """Take the engine's (an `LLMEngine`'s) scheduler, verify its runner's steps, and
        propose with the draft model's runner, if there is one (`partners`)."""
        self.scheduler, self.max_model_len = engine.scheduler, engine.max_model_len
        if partners:
            self.proposer = DraftModelProposer(partners[0], self.vocab_size)
        engine.runner.choose_tokens = self.proposer.choose_tokens

    def stats_group(self) -> dict[str, dict[str, Any]]:
        return {"speculative": self.stats.as_dict()}

    def before_layout(self, rows: list[Row]) -> None:
        wanted = {i: self.wanted(row) for i, row in enumerate(rows)}
        drafts = self.proposer.propose(rows, {i: n for i, n in wanted.items() if n}, self._reserve(rows))
        for index, tokens in drafts.items():
            rows[index].token_ids.extend(tokens)
            rows[index].num_sampled += len(tokens)
            self.drafted[rows[index].request] = len(tokens)

    def wanted(self, row: Row) -> int:
        """How many guesses a row may carry: none unless it reaches the request's last
        token, never more than the request can still generate, and none for a request that
        wants each token's logprobs or follows a grammar (the sampler serves those one
        token at a time)."""
        request, params = row.request, row.request.params
        if not row.num_sampled or params.logprobs is not None or params.structured_output is not None:
            return 0
        left = min(params.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens)
        return max(0, min(self.num_speculative_tokens, left - 1))  # the target adds one

    def _reserve(self, rows: list[Row]) -> Reserve:
        def reserve(index: int, count: int) -> int:
            row = rows[index]
            end = row.start + len(row.token_ids)
            return max(0, min(count, self.scheduler.reserve(row.request, end + count) - end))

        return reserve

    def after_forward(self, sampled: list[Request], new_tokens: list[list[int]]) -> None:
        """Count the verified guesses; keep the K/V of the accepted ones only."""
        for request, tokens in zip(sampled, new_tokens):
            num_drafts = self.drafted.pop(request, 0)
            if not num_drafts:
                continue
            accepted = len(tokens) - 1
            self.stats.proposed += num_drafts
            self.stats.accepted += accepted
            self.stats.verifications += 1
            if request.status is Status.RUNNING:
                self.scheduler.rollback(request, request.num_tokens + accepted)
            self.proposer.forget(request)

    def discard(self, rows: list[Row]) -> None:
        """Forget the guesses of a step that failed before its tokens were chosen."""
        for row in rows:
            self.drafted.pop(row.request, None)
            self.proposer.forget(row.request)


class Proposer:
    """Guesses tokens for rows; this base class verifies without remembering anything."""

    def propose(self, rows: list[Row], wanted: dict[int, int], reserve: Reserve) -> dict[int, list[int]]:
        """Guesses for rows `wanted` names, at most that many each, with pages `reserve`d."""
        raise NotImplementedError

    def choose_tokens(self, sampler: Sampler, logits: torch.Tensor, rows: Sequence[Row]) -> list[list[int]]:
        """Each row's new tokens: its accepted guesses, then one of the target's own."""
        return sample_with_drafts(sampler, logits, rows)

    def forget(self, request: Request) -> None:
        """Drop what this proposer kept of `request`'s guesses (nothing, here)."""


class NgramProposer(Proposer):
    """Prompt lookup: propose what followed the latest earlier occurrence of the last n-gram."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        # One index per request, dropped with the request itself.
        self.indexes: weakref.WeakKeyDictionary[Request, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, rows: list[Row], wanted: dict[int, int], reserve: Reserve) -> dict[int, list[int]]:
        drafts = {}
        for index, count in wanted.items():
            request = rows[index].request
            lookup = self.indexes.setdefault(request, NgramIndex(self.ngram_min, self.ngram_max))
            found = lookup.propose(request.token_ids, count)
            if found:  # pages only for what was found
                drafts[index] = found[: reserve(index, len(found))]
        return drafts


class NgramIndex:
    """For one growing list of tokens: the n-grams (of every length from `min_n` to `max_n`)
    that were followed by a token, each mapped to the position of that token in its latest
    occurrence. Appended tokens are indexed as they come, so a lookup costs O(1), not a
    scan of the text."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.follower: dict[tuple[int, ...], int] = {}
        self.num_indexed = 1  # followers at positions below this are in `follower`

    def propose(self, tokens: list[int], count: int) -> list[int]:
        """Up to `count` tokens continuing the latest earlier occurrence of the longest
        suffix of `tokens` (from `max_n` down to `min_n` tokens) seen before; [] if none."""
        for follower in range(self.num_indexed, len(tokens)):
            for n in range(self.min_n, min(self.max_n, follower) + 1):
                self.follower[tuple(tokens[follower - n : follower])] = follower
        self.num_indexed = max(self.num_indexed, len(tokens))
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self.follower.get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return overlapping_copy(tokens, start, count)
        return []


def overlapping_copy(tokens: list[int], start: int, count: int) -> list[int]:
    """`count` tokens copied from `tokens[start:]`, the copy running on into itself past
    the end (as in LZ77): a repeating pattern proposes its own next repeats."""
    copied: list[int] = []
    for position in range(start, start + count):
        past_the_end = position - len(tokens)
        copied.append(tokens[position] if past_the_end < 0 else copied[past_the_end])
    return copied


class DraftModelProposer(Proposer):
    """A smaller model of the same tokenizer proposes each request's next tokens."""

    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        self.runner = runner  # the draft model's, on a cache mirroring the target's pages
        self.vocab_size = vocab_size  # the target's: draft logits are cut or padded to it
        # The distributions sampled requests' drafts came from, `[num_drafts, vocab]`:
        # verification's `q` (greedy requests and n-gram guesses need none).
        self.draft_probs: dict[Request, torch.Tensor] = {}

    def choose_tokens(self, sampler: Sampler, logits: torch.Tensor, rows: Sequence[Row]) -> list[list[int]]:
        return sample_with_drafts(sampler, logits, rows, self.draft_probs.get)

    def forget(self, request: Request) -> None:
        self.draft_probs.pop(request, None)

    def propose(self, rows: list[Row], wanted: dict[int, int], reserve: Reserve) -> dict[int, list[int]]:
        counts = {index: reserve(index, count) for index, count in wanted.items()}
        # The engine calls this from whichever thread steps it, whose current CUDA device
        # may be another GPU's: the draft's passes, and its sampling, run on the draft's.
        with on_device(self.runner.device):
            return self._draft(rows, {index: count for index, count in counts.items() if count})

    def _draft(self, rows: list[Row], counts: dict[int, int]) -> dict[int, list[int]]:
        """Run the target's rows through the draft model, then `counts[index]` one-token
        passes for row `index`: each computes a draft's K/V and, but the last, samples the
        next draft."""
        sampled = [index for index, row in enumerate(rows) if row.num_sampled]
        # The target's rows first, so the draft's K/V keeps up with the target's.
        logits = self._logits(rows)
        drafts: dict[int, list[int]] = {index: [] for index in counts}
        first = [sampled.index(index) for index in counts]
        self._extend(rows, drafts, list(counts), select_rows(logits, first))
        for position in range(max(counts.values(), default=0)):
            feeding = [index for index in counts if counts[index] > position]
            passes = [Row(rows[i].request, rows[i].request.num_tokens + position,
                          [drafts[i][position]], 1) for i in feeding]
            logits = self._logits(passes)
            growing = [row for row, index in enumerate(feeding) if counts[index] > position + 1]
            self._extend(rows, drafts, [feeding[row] for row in growing], select_rows(logits, growing))
        return drafts

    def _logits(self, rows: list[Row]) -> torch.Tensor:
        """The draft model's logits for the sampled rows, in the target's vocabulary."""
        logits = self.runner.forward(self.runner.prepare(rows))
        vocab = logits.shape[-1]
        if vocab >= self.vocab_size:  # checkpoints pad their vocabularies differently
            return logits[:, : self.vocab_size]
        return F.pad(logits, (0, self.vocab_size - vocab), value=float("-inf"))

    def _extend(
        self, rows: list[Row], drafts: dict[int, list[int]], indexes: list[int], logits: torch.Tensor
    ) -> None:
        """Sample one more draft for each of `indexes`' rows, as the request's own params
        would, keeping the distribution it came from where verification needs it."""
        if not indexes:
            return
        views = [DraftRow(rows[i].request, drafts[i]) for i in indexes]
        q = distribution(self.runner.sampler, logits, views)
        tokens = draw(q.clone(), views).tolist()
        for index, token_id, probs in zip(indexes, tokens, q):
            request = rows[index].request
            drafts[index].append(token_id)
            if not request.params.is_greedy:
                earlier = self.draft_probs.get(request)
                self.draft_probs[request] = torch.cat([*([] if earlier is None else [earlier]),
                                                       probs[None]])


def resolve_draft_model(config: EngineConfig, tokenizer: Tokenizer) -> Checkpoint:
    """The draft model asked for, checked to speak the target's tokenizer."""
    checkpoint = open_checkpoint(config.draft_model)
    if Tokenizer(checkpoint.path).get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"draft_model {config.draft_model!r} does not share the target model's tokenizer"
        )
    return checkpoint
