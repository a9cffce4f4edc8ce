"""Shared by the quantized-model tests: a wider tiny model, an engine with a weight
quantization mode, and the greedy near-tie check against full precision."""

from __future__ import annotations

from pathlib import Path

import torch
from oracle import hf_model

from nanoqwen import LLM
from tools.checkpoints import build_qwen2, build_qwen3

# Every linear layer's input a multiple of 256, the k-quants' super-block, and of every int4
# group size. head_dim 128 is also what transformers assumes for a Qwen3 GGUF file.
WIDE_SHAPE = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=512)


def build_wide(architecture: str, directory: Path) -> str:
    if architecture == "qwen2":
        return build_qwen2(directory, **WIDE_SHAPE)
    return build_qwen3(directory, **{**WIDE_SHAPE, "head_dim": 128})


def quantized_llm(path: str, quantization: str | None, **options) -> LLM:
    """`LLM(path, quantization=...)` with a KV pool just big enough for a few short requests."""
    return LLM(path, quantization=quantization, num_pages=64, **{"device": "cpu", **options})


@torch.no_grad()
def largest_greedy_gap(model_dir: str, prompt: list[int], output_ids: list[int]) -> float:
    """How far below the best logit the chosen tokens fall, at worst, under full-precision
    transformers fed the same tokens: 0 when every token is its greedy choice, small when
    the quantized model only broke near-ties differently."""
    logits = hf_model(model_dir)(torch.tensor([prompt + output_ids])).logits[0, len(prompt) - 1 : -1]
    chosen = logits.gather(-1, torch.tensor(output_ids)[:, None])[:, 0]
    return float((logits.max(-1).values - chosen).max())
