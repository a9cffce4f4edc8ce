"""A request as the engine tracks it, from arrival to its last token.

transformers' `generate` holds a batch's state in tensors. A serving engine holds it per
request instead, because requests arrive, grow and leave independently. Everything the
other modules need to know about one request lives here:

* its tokens: the prompt, then every generated token, in one list (`token_ids`);
* its KV state: the pages holding its keys and values (`pages`, in token order) and how
  many of its tokens already have K/V in them (`num_computed_tokens`). Tokens past that
  still need a forward pass: a whole prompt chunk for a prefill, one token for a decode;
* its place in the queues (`status`), why it ended (`finish_reason`), and how urgent it is
  (`priority`, when it is `due`, its `user`, and the `urgency` the waiting queue orders by);
* how to sample it (`params`, a seeded `generator`) and how to stream its text
  (`detokenizer`).

Features a request may ask for keep their own state on it, untouched by the core: a
structured output's `grammar` matcher, the `logprobs` and `prompt_logprobs` computed so far,
an embedding request's `pooling` params and its `embedding`.

Invariant: `num_computed_tokens <= len(pages) * page_size`, and page `i` holds the K/V of
tokens `[i * page_size, (i + 1) * page_size)`. A request's life, step by step:
docs/learn/02-continuous-batching.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

if TYPE_CHECKING:
    from nanoqwen.outputs import TokenLogprobs
    from nanoqwen.sampling.params import SamplingParams

# (aged priority, arrival number): smaller is more urgent, and no two requests tie.
Urgency: TypeAlias = tuple[float, int]


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
    # Streams the output text (`text/tokenizer.py`'s `IncrementalDetokenizer`). Requests built
    # only to exercise the model (a start-up memory profile) have none.
    detokenizer: Any = None
    token_ids: list[int] = field(init=False)  # the prompt, then every generated token
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served; None until admitted
    num_pages_in_cache: int = 0  # leading pages already offered to the prefix cache
    finish_reason: str | None = None
    error: str | None = None  # a feature cannot go on with it: the engine ends it, alone
    priority: int = 0  # lower is more urgent
    due: float | None = None  # when its deadline falls (`time.monotonic()`), if it has one
    user: str | None = None  # who sent it (None: the one shared user)
    urgency: Urgency = (0, 0)  # set by the scheduler when the request arrives
    state_slot: int | None = None  # its slot of the state pool (models with recurrent layers)
    # What optional features keep on a request (see the module docstring).
    grammar: Any = None  # an xgrammar matcher, iff params.structured_output is set
    pooling: Any = None  # PoolingParams: an embedding request, no text
    embedding: torch.Tensor | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, when asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # one per prompt token after the first

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_reusable_tokens(self) -> int:
        """How many leading tokens may come from the prefix cache: all but the last (its
        logits give the next token), and none whose prompt logprobs are still owed."""
        if self.prompt_logprobs is None:
            return len(self.token_ids) - 1
        return min(len(self.token_ids) - 1, len(self.prompt_logprobs))
