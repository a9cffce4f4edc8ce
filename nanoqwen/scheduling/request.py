"""A request as the engine tracks it, from arrival to its last token.

transformers' `generate` holds a batch's state in tensors. A serving engine holds it per
request instead, because requests arrive, grow and leave independently. Everything the
other modules need to know about one request lives here:

* its tokens: the prompt, then every generated token, in one list (`token_ids`);
* its KV state: the pages holding its keys and values (`pages`, in token order) and how
  many of its tokens already have K/V in them (`num_computed_tokens`). Tokens past that
  still need a forward pass: a whole prompt chunk for a prefill, one token for a decode;
* its place in the queues (`status`) and, once it has ended, why (`finish_reason`);
* how urgent it is: the `priority` it was given (lower is more urgent) and the `urgency`
  key the scheduler orders requests by (`waiting_queue.py` explains it);
* how to sample it (`params`, `generator`, a structured-output `grammar`) and how to
  stream its text (`detokenizer`); the log-probabilities it asked for, as they are
  computed (`logprobs`, `prompt_logprobs`); for an embedding request, its `pooling`
  params and, once computed, its `embedding`;
* during a step, tokens a proposer guessed for it, for the model to verify in the same
  pass (`proposed_token_ids`; none unless an engine proposes any). They are not part of
  `token_ids`: only the tokens verification accepts are appended there.

Invariant: `num_computed_tokens <= len(pages) * page_size`, and page `i` holds the K/V of
tokens `[i * page_size, (i + 1) * page_size)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TypeAlias

import torch

from nanoqwen.sampling.grammar import GrammarMatcher
from nanoqwen.sampling.logprobs import TokenLogprobs
from nanoqwen.sampling.params import SamplingParams
from nanoqwen.sampling.pooling import PoolingParams
from nanoqwen.text.detokenizer import IncrementalDetokenizer

# (aged priority, arrival number): smaller is more urgent, and no two requests tie.
Urgency: TypeAlias = tuple[int, int]


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None  # set when the request is seeded
    # Streams the output text. Requests built only to exercise the model (the memory
    # profile of a start-up step) have none.
    detokenizer: IncrementalDetokenizer | None = None
    token_ids: list[int] = field(init=False)  # the prompt, then every generated token
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served; None until admitted
    num_pages_in_cache: int = 0  # leading pages already offered to the prefix cache
    finish_reason: str | None = None
    priority: int = 0  # lower is more urgent
    urgency: Urgency = (0, 0)  # set by the scheduler when the request arrives
    # Guessed next tokens this step verifies (see the module docstring).
    proposed_token_ids: list[int] = field(default_factory=list)
    grammar: GrammarMatcher | None = None  # set iff params.structured_output is
    pooling: PoolingParams | None = None  # an embedding request: no text, an `embedding`
    embedding: torch.Tensor | None = None
    # Filled as computed, when the params ask: one entry per generated token, and one per
    # prompt token after the first.
    logprobs: list[TokenLogprobs] | None = field(init=False, default=None)
    prompt_logprobs: list[TokenLogprobs] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_proposed(self) -> int:
        return len(self.token_ids) + len(self.proposed_token_ids)

    def tokens_with_proposed(self, start: int, end: int) -> list[int]:
        """Tokens `[start, end)` of the sequence the proposed tokens extend."""
        num_accepted = len(self.token_ids)
        if end <= num_accepted:
            return self.token_ids[start:end]
        proposed = self.proposed_token_ids[max(start - num_accepted, 0) : end - num_accepted]
        return self.token_ids[start:end] + proposed

    @property
    def num_reusable_tokens(self) -> int:
        """How many leading tokens may come from the prefix cache: all but the last (its
        logits give the next token), and none whose prompt logprobs are still owed."""
        if self.prompt_logprobs is None:
            return self.num_tokens - 1
        return min(self.num_tokens - 1, len(self.prompt_logprobs))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
