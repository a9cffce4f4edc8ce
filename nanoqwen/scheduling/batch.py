"""The scheduler's decision for one step, in requests and token counts.

`ScheduledBatch` says which requests run this step and how many of their tokens each
computes; `runner/step_inputs.py` flattens it into the tensors the model reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoqwen.scheduling.request import Request


@dataclass
class ScheduledBatch:
    """The scheduler's decision for one step: `requests[i]` computes its next
    `num_new_tokens[i]` tokens (its proposed tokens included, when it has any)."""

    requests: list[Request]
    num_new_tokens: list[int]
    # Where each request's new tokens start. None: right after its computed tokens, which
    # is where the model always starts; a proposer's own model may run passes further on.
    starts: list[int] | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def start(self, index: int) -> int:
        return self.starts[index] if self.starts else self.requests[index].num_computed_tokens

    def reaches_last_token(self, index: int) -> bool:
        """Does this step compute request `index`'s last token, so its logits are sampled?"""
        end = self.start(index) + self.num_new_tokens[index]
        return end == self.requests[index].num_tokens_with_proposed

    def num_sampled_rows(self, index: int) -> int:
        """How many of request `index`'s trailing rows are sampled: those from its last
        accepted token on (each row's logits give the token after it)."""
        if not self.reaches_last_token(index):
            return 0
        request = self.requests[index]
        return min(self.num_new_tokens[index], 1 + len(request.proposed_token_ids))

    def is_decode_only(self) -> bool:
        return all(count == 1 for count in self.num_new_tokens)


