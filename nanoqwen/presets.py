"""Checkpoints with random weights, for benchmarking where no real model can be downloaded.

How fast an engine runs depends on the model's *shape* (layers, widths, heads, vocabulary),
not on what its weights have learned. So a benchmark needs no trained model: a checkpoint
with the right shape and random weights costs exactly as much per token. `random_checkpoint`
writes one, from a named preset or from any Qwen2/Qwen3 `config.json`, as an ordinary
transformers directory that both nanoqwen and transformers load, and keeps it in a cache
directory so later runs start at once.

A checkpoint also needs a tokenizer: the engine detokenizes every generated token, and that
cost belongs in the measurement. Training a real 150k-token BPE needs a large corpus, so
`synthetic_tokenizer` builds a byte-level BPE whose merges are invented: each extends an
existing token by a random letter or space, until the vocabulary fills the model's
embedding table. Its tokens decode to plain ASCII words, like most tokens of a real
vocabulary, so streaming text costs what it costs with a real model. Three ChatML special
tokens sit at the end of the vocabulary, as in Qwen's.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Byte-level BPE shows a space as "Ġ"; with the letters it spells word-like tokens.
WORD_SYMBOLS = ["Ġ", *"abcdefghijklmnopqrstuvwxyz"]

PRESETS: dict[str, dict[str, Any]] = {
    # The shape of Qwen/Qwen3-0.6B: a GPU-sized model.
    "qwen3-0.6b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        dtype="bfloat16",
    ),
    # The same architecture scaled down so that a benchmark, transformers included, runs
    # in minutes on a couple of CPU cores.
    "qwen3-cpu": dict(
        model_type="qwen3",
        vocab_size=32000,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        dtype="float32",
    ),
}


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "nanoqwen" / "random-weights"


def random_checkpoint(preset_or_config: str, cache_dir: Path | None = None, seed: int = 0) -> str:
    """Directory of a random-weights checkpoint, built on first use.

    `preset_or_config` is a key of `PRESETS` or the path of a Qwen2/Qwen3 `config.json`.
    """
    name, shape = _resolve_shape(preset_or_config)
    fingerprint = hashlib.sha256(json.dumps([shape, seed], sort_keys=True).encode()).hexdigest()
    directory = (cache_dir or default_cache_dir()) / f"{name}-{fingerprint[:12]}"
    if not directory.is_dir():
        _build_atomically(directory, shape, seed)
    return str(directory)


def _resolve_shape(preset_or_config: str) -> tuple[str, dict[str, Any]]:
    if preset_or_config in PRESETS:
        return preset_or_config, PRESETS[preset_or_config]
    path = Path(preset_or_config)
    if not path.is_file():
        presets = ", ".join(PRESETS)
        raise ValueError(f"{preset_or_config!r} is neither a preset ({presets}) nor a config.json")
    shape = json.loads(path.read_text())
    if shape.get("model_type") not in ("qwen2", "qwen3"):
        raise ValueError(
            f"{path} is not a Qwen2/Qwen3 config (model_type {shape.get('model_type')!r})"
        )
    return "config", shape


def _build_atomically(directory: Path, shape: dict[str, Any], seed: int) -> None:
    """Build in a scratch directory and rename it into place, so that an interrupted
    build, or two running at once, never leave a half-written checkpoint behind."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".building-"))
    try:
        build_random_checkpoint(scratch, shape, seed)
        os.replace(scratch, directory)
    except OSError:
        if not directory.is_dir():  # losing the race to a concurrent build is fine
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def build_random_checkpoint(directory: Path, shape: dict[str, Any], seed: int = 0) -> None:
    """Write config, random weights and a synthetic tokenizer into `directory`."""
    vocab_size = shape["vocab_size"]
    tokenizer = synthetic_tokenizer(vocab_size, seed)
    special_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = _model_config(shape, bos_id=special_ids[END_OF_TEXT], eos_id=special_ids[IM_END])
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    model.generation_config.eos_token_id = [special_ids[IM_END], special_ids[END_OF_TEXT]]
    model.generation_config.pad_token_id = special_ids[END_OF_TEXT]
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _model_config(shape: dict[str, Any], bos_id: int, eos_id: int) -> PretrainedConfig:
    fields = {key: value for key, value in shape.items() if key != "model_type"}
    # Whatever ids the source config names, this checkpoint's tokenizer has its own.
    fields.update(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=None)
    return AutoConfig.for_model(shape["model_type"], **fields)


def synthetic_tokenizer(vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE of exactly `vocab_size` tokens: 256 bytes, invented merges, specials."""
    num_merged = vocab_size - 256 - len(SPECIAL_TOKENS)
    if num_merged < 0:
        raise ValueError(
            f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)}, got {vocab_size}"
        )
    vocab = {
        symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))
    }
    merges = _invent_merges(num_merged, random.Random(seed))
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _invent_merges(count: int, rng: random.Random) -> list[tuple[str, str]]:
    """`count` BPE merges, each extending a random existing token by one more symbol.

    Growing tokens one symbol at a time keeps them word-sized: a token's length is its depth
    in a random tree, which grows only with the logarithm of the vocabulary size.
    """
    tokens = list(WORD_SYMBOLS)
    known = set(tokens)
    merges: list[tuple[str, str]] = []
    while len(merges) < count:
        left, right = rng.choice(tokens), rng.choice(WORD_SYMBOLS)
        if left + right in known:
            continue
        known.add(left + right)
        tokens.append(left + right)
        merges.append((left, right))
    return merges
