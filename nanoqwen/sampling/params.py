"""`SamplingParams`: how to pick one request's next token, and when to stop generating.

Every field is checked here, once, when the object is made, and a bad value raises a
`ValueError` that names the field: a sampler handed a `SamplingParams` never has to ask.

Chat checkpoints recommend their own sampling settings in `generation_config.json`
(Qwen3: temperature 0.6, top_p 0.95, top_k 20). A setting a caller leaves out (`None`)
is remembered in `unset`, and the engine fills it from the model's recommendation, the
same way for every entry point (`with_defaults`; `LLMEngine.add_request`). Until then it
holds the neutral value (temperature 1, no top-k/top-p/min-p, no repetition penalty).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from nanoqwen.sampling.grammar import StructuredOutput

_MIN_SEED, _MAX_SEED = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # alternatives per position, as OpenAI's top_logprobs and vLLM allow
MAX_LOGIT_BIAS = 100.0  # OpenAI's range is [-100, 100]: enough to ban or force a token
# Stop lists cost memory and setup per request, and stop ids a scan per token: bounded, far
# above what anyone needs (OpenAI allows 4 stop strings). Matching stop strings costs no
# more per token for more of them (`nanoqwen/text/stop_strings.py`).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


# Below this temperature the sampled distribution is the argmax up to float precision, while
# dividing by it could overflow the logits to inf; such rows are sampled greedily (as in vLLM).
_GREEDY_TEMPERATURE = 1e-5
# The settings a model may recommend, and what each is when neither the caller nor the
# model says: the neutral value, which leaves the distribution as the logits have it.
DEFAULTABLE_SETTINGS: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
}


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
    structured_output: StructuredOutput | None = None
    # The defaultable settings the caller left out, still waiting for the model's values.
    unset: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        left_out = {name for name in DEFAULTABLE_SETTINGS if getattr(self, name) is None}
        self.unset = frozenset(self.unset) | left_out
        for name in left_out:
            setattr(self, name, DEFAULTABLE_SETTINGS[name])
        self.temperature = _real("temperature", self.temperature)
        self.top_p = _real("top_p", self.top_p)
        self.top_k = _integer("top_k", self.top_k)
        self.min_p = _real("min_p", self.min_p)
        self.max_tokens = _integer("max_tokens", self.max_tokens)
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        self.presence_penalty = _real("presence_penalty", self.presence_penalty)
        self.frequency_penalty = _real("frequency_penalty", self.frequency_penalty)

        _check(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "top_k", ">= 0 (0 disables it)", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _check(self.max_tokens >= 1, "max_tokens", ">= 1", self.max_tokens)
        _check(self.repetition_penalty > 0, "repetition_penalty", "> 0", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, "in [-2, 2]", value)

        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None:
            self.seed = _integer("seed", self.seed)
            _check(_MIN_SEED <= self.seed <= _MAX_SEED, "seed", "a 64-bit integer", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                value = _integer(name, getattr(self, name))
                _check(0 <= value <= MAX_LOGPROBS, name, f"in [0, {MAX_LOGPROBS}]", value)
                setattr(self, name, value)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise ValueError("structured_output must be a StructuredOutput, "
                                 f"got {type(self.structured_output).__name__}")
            if self.ignore_eos:  # a finished grammar allows nothing but the end of text
                raise ValueError("ignore_eos cannot be combined with structured_output")

    def with_defaults(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """These params with every setting left out taken from `defaults` (a model's
        recommended ones, as `SamplingParams` keywords); checked like any other."""
        chosen = {name: value for name, value in defaults.items() if name in self.unset}
        return replace(self, **chosen, unset=frozenset()) if self.unset else self

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise a ValueError if `logit_bias` names a token outside a `vocab_size` vocabulary."""
        outside = [token for token in self.logit_bias or {} if token >= vocab_size]
        if outside:
            raise ValueError(f"logit_bias names token ids outside the vocabulary of "
                             f"{vocab_size}: {outside[:5]}")

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list (empty when there are none)."""
        return list(self.stop)

    @property
    def is_greedy(self) -> bool:
        """True when the request always takes the most likely token."""
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def scoring_temperature(self) -> float:
        """The temperature log-probabilities are computed at (`logprobs.py`): the request's,
        or 1 for a greedy one, whose own temperature would divide by zero."""
        return self.temperature if self.temperature >= _GREEDY_TEMPERATURE else 1.0

    @property
    def uses_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def uses_output_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _real(name: str, value: object) -> float:
    # bool is an int subclass, but True as a temperature is a bug, not a number.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float's range, such as 10**400
        raise ValueError(f"{name} must be finite, got an integer too large for a float") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return number


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(strings)}")
    if any(s == "" for s in strings):
        raise ValueError("stop must not contain empty strings (they would match immediately)")
    longest = max(strings, key=len, default="")
    if len(longest) > MAX_STOP_STRING_CHARS:
        raise ValueError(f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters long, "
                         f"got one of {len(longest)}")
    return list(strings)


def _stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of ints, got {ids!r}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, "
                         f"got {len(ids)}")
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral) or token_id < 0:
            raise ValueError(f"stop_token_ids must hold ints >= 0, got {token_id!r}")
    return [int(token_id) for token_id in ids]


def _logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
    checked = {}
    for token_id, value in bias.items():
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral) or token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token_id!r}")
        value = _real("logit_bias", value)
        _check(abs(value) <= MAX_LOGIT_BIAS, "logit_bias",
               f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", value)
        checked[int(token_id)] = value
    return checked or None  # an empty bias is no bias
