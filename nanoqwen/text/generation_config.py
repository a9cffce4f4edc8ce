"""What a checkpoint's `generation_config.json` tells an engine: when to stop, how to sample.

Chat checkpoints end a turn with one token and a document with another, and publish the
sampling settings they were tuned for (Qwen3: temperature 0.6, top_p 0.95, top_k 20). The
tokenizer knows neither; this module reads both, as vLLM's `generation_config="auto"` does:
a request that leaves a setting out gets the model's value (`SamplingParams.with_defaults`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import GenerationConfig

# The generation_config.json fields that are sampling settings, named as in SamplingParams.
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# For checkpoints that publish no sampling settings: Qwen3's published chat settings.
FALLBACK_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def read_generation_config(path: str | Path) -> dict[str, Any]:
    """The settings `generation_config.json` spells out (none of transformers' defaults)."""
    try:
        return GenerationConfig.from_pretrained(path).to_diff_dict()
    except OSError:  # the checkpoint has no generation_config.json
        return {}


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The model's recommended sampling settings, as `SamplingParams` keywords: what the
    checkpoint publishes (as vLLM reads it), `FALLBACK_SAMPLING` if nothing, and
    temperature 0 for one that asks for greedy decoding (`do_sample: false`)."""
    if generation_config.get("do_sample") is False:
        return {"temperature": 0.0}
    published = {
        name: generation_config[name] for name in SAMPLING_DEFAULT_FIELDS if name in generation_config
    }
    return published or dict(FALLBACK_SAMPLING)


def read_eos_token_ids(
    generation_config: dict[str, Any], tokenizer_eos_id: int | None
) -> frozenset[int]:
    """Chat checkpoints end a turn with one token and a document with another, and list both
    in `generation_config.json`; the tokenizer knows only one. Use all of them."""
    eos_ids = set() if tokenizer_eos_id is None else {tokenizer_eos_id}
    configured = generation_config.get("eos_token_id")
    if isinstance(configured, int):
        eos_ids.add(configured)
    elif configured is not None:
        eos_ids.update(configured)
    return frozenset(eos_ids)
