"""Speculative decoding: guess a few tokens cheaply, let the target model check them at once.

A proposer guesses each request's next `k` tokens; the step computes them as `k + 1` new
tokens of the request's row (its last accepted token, then the drafts), beside everyone
else's rows, and `verification.py` keeps the drafts up to the first wrong one plus one
token of the target's own. Two proposers:

* `NgramProposer` (prompt lookup): what followed the latest earlier occurrence of the
  request's last `n` tokens in its own text, `n` from `ngram_max` down to `ngram_min`; a
  dictionary lookup that wins where outputs copy their input. No match, no drafts: the
  step is an ordinary one.
* `DraftModelProposer`: a smaller model with the same tokenizer, run by its own
  `ModelRunner`, proposes `k` tokens one at a time.

The hook: the engine knows speculation only through its proposer. `propose` (right after
the schedule) puts drafts on requests (`Request.proposed_token_ids`), with pages only where
they can be had without preempting anyone (`Scheduler.make_room_for_proposed`); the runner
verifies them with the proposer's `choose_tokens`; `settle` (after the engine has appended
the accepted tokens through its stop checks) counts them and rolls the rest back
(`Scheduler.settle_proposed`). Verification steps run eagerly: their rows vary in length,
so they are shaped like small prefills, not decodes.

Invariant: the draft model's KV cache uses the target's page numbers, and a request's
first `num_computed_tokens` tokens have K/V in both pools: the draft model runs every row
of the target's step first (prefilling chunk by chunk with it), then its drafts, then one
more pass, so whichever drafts are accepted, both pools hold them. The story:
docs/learn/10-speculative-decoding.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from nanoqwen.config import EngineConfig
from nanoqwen.runner.runner import ModelRunner, RunnerSettings, on_device
from nanoqwen.sampling.sampler import Sampler, draw
from nanoqwen.scheduling.batch import ScheduledBatch
from nanoqwen.scheduling.request import Request, Status
from nanoqwen.scheduling.scheduler import Scheduler
from nanoqwen.speculative.verification import DraftRow, sample_with_drafts, select_rows
from nanoqwen.text.tokenizer import Tokenizer
from nanoqwen.weights.checkpoint import Checkpoint, open_checkpoint


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


class Proposer:
    """Attaches draft tokens to a step's rows and settles them after verification. This
    base class proposes nothing: it is the engine's proposer when speculation is off."""

    # The runners of models that keep K/V for the same tokens as the target's, in caches
    # with the same pages (sized and allocated with the target's).
    runners: Sequence[ModelRunner] = ()

    def __init__(self, num_speculative_tokens: int = 0, max_model_len: int = 0) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.stats = SpeculationStats()

    def stats_group(self) -> dict[str, dict[str, Any]]:
        """`LLMEngine.stats()`'s `speculative` group; none when nothing is ever proposed."""
        return {"speculative": self.stats.as_dict()} if self.num_speculative_tokens else {}

    @property
    def max_proposed(self) -> int:
        """The most draft tokens one request carries into a step."""
        return self.num_speculative_tokens

    def propose(self, batch: ScheduledBatch, scheduler: Scheduler) -> None:
        """Give rows of `batch` that reach their request's last token some draft tokens."""

    def choose_tokens(
        self, sampler: Sampler, logits: torch.Tensor, requests: Sequence[Request]
    ) -> list[list[int]]:
        """Each request's new tokens: its accepted drafts, then one of the target's own."""
        return sample_with_drafts(sampler, logits, requests)

    def wanted(self, batch: ScheduledBatch, index: int) -> int:
        """How many drafts row `index` may carry: none unless it reaches the request's last
        token, never more than the request can still generate, and none for a request that
        wants each token's logprobs or follows a grammar (the sampler serves those one
        token at a time)."""
        request = batch.requests[index]
        if not batch.reaches_last_token(index) or not _speculates(request):
            return 0
        left = min(
            request.params.max_tokens - request.num_output_tokens,
            self.max_model_len - request.num_tokens,
        )
        return max(0, min(self.num_speculative_tokens, left - 1))  # the target adds one

    @staticmethod
    def reserve(batch: ScheduledBatch, index: int, num_drafts: int, scheduler: Scheduler) -> int:
        """Pages for row `index` to carry `num_drafts` drafts; how many it may carry."""
        end = batch.start(index) + batch.num_new_tokens[index]
        return scheduler.make_room_for_proposed(batch.requests[index], end, num_drafts)

    def settle(self, sampled: Sequence[tuple[Request, list[int]]], scheduler: Scheduler) -> None:
        """After the new tokens are appended: count, and roll back rejected drafts."""
        for request, new_tokens in sampled:
            if not request.proposed_token_ids:
                continue
            self.stats.proposed += len(request.proposed_token_ids)
            self.stats.accepted += len(new_tokens) - 1
            self.stats.verifications += 1
            if request.status is Status.RUNNING:
                scheduler.settle_proposed(request)
            else:  # finished by one of its new tokens: its pages are released already
                request.proposed_token_ids = []
            self.forget(request)

    def discard(self, batch: ScheduledBatch) -> None:
        """Forget the drafts of a step that failed before its tokens were appended."""
        for request in batch.requests:
            request.proposed_token_ids = []
            self.forget(request)

    def forget(self, request: Request) -> None:
        """Drop what this proposer kept of `request`'s drafts (nothing, here)."""


def _speculates(request: Request) -> bool:
    params = request.params
    return params.logprobs is None and params.structured_output is None


class NgramProposer(Proposer):
    """Prompt lookup: propose what followed the latest earlier occurrence of the last n-gram."""

    def __init__(
        self, num_speculative_tokens: int, max_model_len: int, ngram_min: int, ngram_max: int,
    ) -> None:
        super().__init__(num_speculative_tokens, max_model_len)
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        # One index per request, dropped with the request itself.
        self.indexes: weakref.WeakKeyDictionary[Request, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, batch: ScheduledBatch, scheduler: Scheduler) -> None:
        for index, request in enumerate(batch.requests):
            wanted = self.wanted(batch, index)
            if not wanted:
                continue
            lookup = self.indexes.setdefault(request, NgramIndex(self.ngram_min, self.ngram_max))
            drafts = lookup.propose(request.token_ids, wanted)
            if drafts:  # pages only for what was found
                drafts = drafts[: self.reserve(batch, index, len(drafts), scheduler)]
                request.proposed_token_ids = drafts
                batch.num_new_tokens[index] += len(drafts)


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

    def __init__(
        self, num_speculative_tokens: int, max_model_len: int, runner: ModelRunner,
        vocab_size: int,
    ) -> None:
        super().__init__(num_speculative_tokens, max_model_len)
        self.runner = runner  # the draft model's, on a cache mirroring the target's pages
        self.runners = [runner]
        self.vocab_size = vocab_size  # the target's: draft logits are cut or padded to it
        # The distributions sampled requests' drafts came from, `[num_drafts, vocab]`:
        # verification's `q` (greedy requests and n-gram guesses need none).
        self.draft_probs: dict[Request, torch.Tensor] = {}

    def choose_tokens(
        self, sampler: Sampler, logits: torch.Tensor, requests: Sequence[Request]
    ) -> list[list[int]]:
        return sample_with_drafts(sampler, logits, requests, self.draft_probs.get)

    def forget(self, request: Request) -> None:
        self.draft_probs.pop(request, None)

    def propose(self, batch: ScheduledBatch, scheduler: Scheduler) -> None:
        num_drafts = {}
        for index in range(len(batch)):
            wanted = self.wanted(batch, index)
            if wanted:
                num_drafts[index] = self.reserve(batch, index, wanted, scheduler)
        # The engine calls this from whichever thread steps it, whose current CUDA device
        # may be another GPU's: the draft's passes, and its sampling, run on the draft's.
        with on_device(self.runner.device):
            self._draft(batch, num_drafts)

    def _draft(self, batch: ScheduledBatch, num_drafts: dict[int, int]) -> None:
        """Run the target's rows through the draft model, then `num_drafts[index]` one-token
        passes for row `index`, appending each sampled draft to its request."""
        sampled = [index for index in range(len(batch)) if batch.reaches_last_token(index)]
        # The target's rows first, so the draft's K/V keeps up with the target's.
        logits = self._logits(batch)
        rows = [row for row, index in enumerate(sampled) if num_drafts.get(index)]
        drafting = [sampled[row] for row in rows]
        self._extend([batch.requests[i] for i in drafting], select_rows(logits, rows))
        # Then one token per pass: the K/V of the latest draft, and the logits of the next.
        targets = {batch.requests[i]: num_drafts[i] for i in drafting}
        for position in range(max(targets.values(), default=0)):
            feeding = [r for r, count in targets.items() if count > position]
            logits = self._logits(ScheduledBatch(
                feeding, [1] * len(feeding), starts=[r.num_tokens + position for r in feeding]
            ))
            growing = [row for row, r in enumerate(feeding) if targets[r] > position + 1]
            self._extend([feeding[row] for row in growing], select_rows(logits, growing))
        for index in drafting:
            batch.num_new_tokens[index] += len(batch.requests[index].proposed_token_ids)

    def _logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """The draft model's logits for the sampled rows of `batch`, in the target's vocabulary."""
        logits = self.runner.logits(batch)
        vocab = logits.shape[-1]
        if vocab >= self.vocab_size:  # checkpoints pad their vocabularies differently
            return logits[:, : self.vocab_size]
        return F.pad(logits, (0, self.vocab_size - vocab), value=float("-inf"))

    def _extend(self, requests: list[Request], logits: torch.Tensor) -> None:
        """Sample one more draft for each request, as the request's own params would, and
        keep the distribution it came from where verification needs it (sampled requests)."""
        if not requests:
            return
        rows = [DraftRow(request, len(request.proposed_token_ids)) for request in requests]
        q = self.runner.sampler.distribution(logits, rows)
        tokens = draw(q.clone(), rows).tolist()
        for request, token_id, probs in zip(requests, tokens, q):
            request.proposed_token_ids.append(token_id)
            if not request.params.is_greedy:
                earlier = self.draft_probs.get(request)
                self.draft_probs[request] = torch.cat([*([] if earlier is None else [earlier]),
                                                       probs[None]])


def resolve_draft_model(config: EngineConfig, tokenizer: Tokenizer) -> Checkpoint | None:
    """The draft model asked for, checked to speak the target's tokenizer; None without one."""
    if config.speculative != "draft":
        return None
    checkpoint = open_checkpoint(config.draft_model)
    if Tokenizer(checkpoint.path).get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"draft_model {config.draft_model!r} does not share the target model's tokenizer"
        )
    return checkpoint


def make_proposer(
    config: EngineConfig, tokenizer: Tokenizer, settings: RunnerSettings, vocab_size: int
) -> Proposer:
    """The proposer `config` asks for (one that proposes nothing without speculation). A
    draft model is loaded here, with a runner of its own whose KV cache the engine sizes
    and allocates with the target's."""
    k, max_model_len = config.num_speculative_tokens, settings.max_model_len
    if config.speculative == "ngram":
        return NgramProposer(k, max_model_len, config.ngram_min, config.ngram_max)
    draft = resolve_draft_model(config, tokenizer)
    if draft is None:
        return Proposer()
    return DraftModelProposer(k, max_model_len, ModelRunner(draft, settings), vocab_size)
