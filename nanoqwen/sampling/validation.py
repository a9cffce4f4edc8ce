"""Checking `SamplingParams`: every field once, when the params are made.

A bad value raises a `ValueError` that names the field and what it may be, so a sampler
handed a `SamplingParams` never has to ask, and a server answers a bad field with a 400
that says which. The limits bound what one request may cost everyone else (stop lists,
logit biases); they sit far above what anyone needs.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from nanoqwen.sampling.structured import StructuredOutput

_MIN_SEED, _MAX_SEED = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # alternatives per position, as OpenAI's top_logprobs and vLLM allow
MAX_LOGIT_BIAS = 100.0  # OpenAI's range is [-100, 100]: enough to ban or force a token
# Stop lists cost memory and setup per request, and stop ids a scan per token: bounded, far
# above what anyone needs (OpenAI allows 4 stop strings). Matching stop strings costs no
# more per token for more of them (`nanoqwen/text/stop_strings.py`).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


def check_fields(params: Any) -> None:
    """Normalise and check every field of a `SamplingParams`, in place (see the module
    docstring)."""
    params.temperature = _real("temperature", params.temperature)
    params.top_p = _real("top_p", params.top_p)
    params.top_k = _integer("top_k", params.top_k)
    params.min_p = _real("min_p", params.min_p)
    params.max_tokens = _integer("max_tokens", params.max_tokens)
    params.repetition_penalty = _real("repetition_penalty", params.repetition_penalty)
    params.presence_penalty = _real("presence_penalty", params.presence_penalty)
    params.frequency_penalty = _real("frequency_penalty", params.frequency_penalty)

    _check(params.temperature >= 0, "temperature", ">= 0", params.temperature)
    _check(0 < params.top_p <= 1, "top_p", "in (0, 1]", params.top_p)
    _check(params.top_k >= 0, "top_k", ">= 0 (0 disables it)", params.top_k)
    _check(0 <= params.min_p <= 1, "min_p", "in [0, 1]", params.min_p)
    _check(params.max_tokens >= 1, "max_tokens", ">= 1", params.max_tokens)
    _check(params.repetition_penalty > 0, "repetition_penalty", "> 0", params.repetition_penalty)
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        _check(-2 <= value <= 2, name, "in [-2, 2]", value)

    params.stop = _stop_strings(params.stop)
    params.stop_token_ids = _stop_token_ids(params.stop_token_ids)
    if not isinstance(params.ignore_eos, bool):
        raise ValueError(f"ignore_eos must be a bool, got {params.ignore_eos!r}")
    if params.seed is not None:
        params.seed = _integer("seed", params.seed)
        _check(_MIN_SEED <= params.seed <= _MAX_SEED, "seed", "a 64-bit integer", params.seed)
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            value = _integer(name, getattr(params, name))
            _check(0 <= value <= MAX_LOGPROBS, name, f"in [0, {MAX_LOGPROBS}]", value)
            setattr(params, name, value)
    params.logit_bias = _logit_bias(params.logit_bias)
    params.allowed_token_ids = _allowed_token_ids(params.allowed_token_ids)
    if params.structured_output is not None:
        if not isinstance(params.structured_output, StructuredOutput):
            raise ValueError("structured_output must be a StructuredOutput, "
                             f"got {type(params.structured_output).__name__}")
        if params.ignore_eos:  # a finished grammar allows nothing but the end of text
            raise ValueError("ignore_eos cannot be combined with structured_output")


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


def _allowed_token_ids(ids: object) -> list[int] | None:
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"allowed_token_ids must be a non-empty list of ints, got {ids!r}")
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral) or token_id < 0:
            raise ValueError(f"allowed_token_ids must hold ints >= 0, got {token_id!r}")
    return sorted({int(token_id) for token_id in ids})
