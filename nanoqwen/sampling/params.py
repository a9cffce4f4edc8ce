"""`SamplingParams`: how to pick one request's next token, and when to stop generating.

Every field is checked once, when the object is made (`validation.py`), and a bad value
raises a `ValueError` that names the field: a sampler handed a `SamplingParams` never has
to ask.

Chat checkpoints recommend their own sampling settings in `generation_config.json`
(Qwen3: temperature 0.6, top_p 0.95, top_k 20). A setting a caller leaves out (`None`)
is remembered in `unset`, and the engine fills it from the model's recommendation, the
same way for every entry point (`with_defaults`; `LLMEngine.add_request`). Until then it
holds the neutral value (temperature 1, no top-k/top-p/min-p, no repetition penalty).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nanoqwen.sampling.structured import StructuredOutput
from nanoqwen.sampling.validation import MAX_LOGPROBS, check_fields

# Below this temperature the sampled distribution is the argmax up to float precision, while
# dividing by it could overflow the logits to inf; such rows are sampled greedily (as in vLLM).
_GREEDY_TEMPERATURE = 1e-5
# The settings a model may recommend, and what each is when neither the caller nor the
# model says: the neutral value, which leaves the distribution as the logits have it.
DEFAULTABLE_SETTINGS: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
}
__all__ = ["DEFAULTABLE_SETTINGS", "MAX_LOGPROBS", "PoolingParams", "SamplingParams"]


@dataclass
class SamplingParams:
    """How to pick the next token of one request, and when to stop generating.

    ``stop`` and ``stop_token_ids`` are normalised to (possibly empty) lists. The settings
    of `DEFAULTABLE_SETTINGS` left as None take the model's recommended values once the
    engine gets the request (see the module docstring).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 disables top-k
    min_p: float | None = None
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; k: the token's and the k likeliest alternatives'
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (all but the first)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    structured_output: StructuredOutput | None = None
    # The defaultable settings the caller left out, still waiting for the model's values.
    unset: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        left_out = {name for name in DEFAULTABLE_SETTINGS if getattr(self, name) is None}
        self.unset = frozenset(self.unset) | left_out
        for name in left_out:
            setattr(self, name, DEFAULTABLE_SETTINGS[name])
        check_fields(self)

    def with_defaults(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """These params with every setting left out taken from `defaults` (a model's
        recommended ones, as `SamplingParams` keywords, checked once when the engine
        starts: `check_defaults`)."""
        if not self.unset:
            return self
        filled = copy.copy(self)
        for name in self.unset & defaults.keys():
            setattr(filled, name, defaults[name])
        filled.unset = frozenset()
        return filled

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise a ValueError if `logit_bias` or `allowed_token_ids` names a token outside a
        `vocab_size` vocabulary."""
        for name in ("logit_bias", "allowed_token_ids"):
            outside = [token for token in getattr(self, name) or () if token >= vocab_size]
            if outside:
                raise ValueError(f"{name} names token ids outside the vocabulary of "
                                 f"{vocab_size}: {outside[:5]}")

    @property
    def asks_for_more(self) -> bool:
        """Does the request want anything beyond the core draw (a logits processor, a
        grammar, logprobs)? The engine plugs those features in (`sampling/extras.py`)."""
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0 or self.logit_bias is not None
            or self.allowed_token_ids is not None or self.structured_output is not None
            or self.logprobs is not None or self.prompt_logprobs is not None
        )

    @property
    def is_greedy(self) -> bool:
        """True when the request always takes the most likely token."""
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def scoring_temperature(self) -> float:
        """The temperature log-probabilities are computed at (`logprobs.py`): the request's,
        or 1 for a greedy one, whose own temperature would divide by zero."""
        return self.temperature if self.temperature >= _GREEDY_TEMPERATURE else 1.0



@dataclass(frozen=True)
class PoolingParams:
    """Ask for a prompt's embedding (its last token's final hidden state) instead of text
    (`pooling.py`)."""

    normalize: bool = True  # scale to unit length


def check_defaults(defaults: Mapping[str, Any]) -> None:
    """A ValueError unless `defaults` are valid values of the settings they name (a model's
    recommended ones, which `with_defaults` later applies without checking again)."""
    unknown = set(defaults) - DEFAULTABLE_SETTINGS.keys()
    if unknown:
        raise ValueError(f"unknown sampling defaults: {sorted(unknown)}")
    SamplingParams(**defaults)
