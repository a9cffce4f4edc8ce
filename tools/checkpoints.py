"""Checkpoints with random weights: tiny ones for the tests, model-sized ones for benchmarks.

How fast an engine runs depends on a model's *shape* (layers, widths, heads, vocabulary),
and whether it computes the right thing can be checked against transformers on *any*
weights. So neither the tests nor the benchmarks need a trained model, or a network: this
module writes ordinary transformers checkpoint directories (`config.json`,
`model.safetensors`, tokenizer files with the ChatML special tokens and a chat template,
`generation_config.json`) that both nanoqwen and transformers load.

* **Tests** use `build_qwen2` / `build_qwen3`: a few-MB model and a byte-level BPE
  *trained* on English, accented Latin, Chinese and emoji with a vocabulary too small to
  hold every character, so many characters split across tokens (what streaming
  detokenization must get right). Parameters that transformers initialises to a
  constant (RMSNorm weights to one, Qwen2's q/k/v biases to zero) are randomised, so an
  engine that forgot a norm weight or a bias would still produce different logits.
* **Benchmarks** use `random_checkpoint(preset_or_config)`: the shape of a real model
  (`PRESETS`, or any Qwen `config.json` nanoqwen runs) with a *synthetic* tokenizer of the full
  vocabulary size, whose invented merges spell word-like ASCII tokens, so detokenizing
  costs what it costs with a real model. Built once into a cache directory.

Everything is seeded: the same ids and weights come out on every run.
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
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]
# ChatML as Qwen uses it. Like Qwen3's template, `enable_thinking=false` pre-fills an empty
# reasoning block so the model answers directly. Tools are rendered as Qwen2.5 and Qwen3 do
# (shortened): a system block listing them, each assistant tool call as a `<tool_call>` block
# of JSON, and tool results as `<tool_response>` blocks of a user turn.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nCall a function as <tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- if message['content'] -%}{{- '\\n' + message['content'] -}}{%- endif -%}"
    "{%- for tool_call in message['tool_calls'] -%}"
    "{%- set call = tool_call['function'] -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' -}}"
    "{{- call['arguments'] | tojson -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# --------------------------------------------------------------------------- test fixtures
TINY_VOCAB_SIZE = 800
TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=1024,
    # Wider than the usual 0.02 so the logits of a random model are far from uniform and
    # greedy decoding is not decided by float noise.
    initializer_range=0.08,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    dtype="float32",
)
ENGLISH_WORDS = (
    "the quick brown fox jumps over a lazy dog and then it sleeps while we write some more "
    "text about models tokens streams caches pages user assistant system think hello world"
).split()
ACCENTED_WORDS = "café naïve façade jalapeño Ærø Łódź crème brûlée smörgåsbord déjà señor".split()
# A range wider than the vocabulary can absorb, so most of these stay split into byte tokens.
CHINESE_CHARS = [chr(code) for code in range(0x4E00, 0x4E00 + 300)]
EMOJI = [chr(code) for code in range(0x1F600, 0x1F640)]


def build_tiny(directory: str | Path, shape: dict[str, Any], seed: int) -> str:
    """A tiny random checkpoint of `shape` with the tests' tokenizer, in `directory`."""
    build_checkpoint(directory, shape, build_tokenizer(directory), seed, randomize_constants=True)
    return str(directory)


def build_qwen2(directory: str | Path, seed: int = 0, **overrides: Any) -> str:
    """Qwen2: q/k/v projections with bias, separate (untied) lm_head."""
    shape = {**TINY_SHAPE, "model_type": "qwen2", "tie_word_embeddings": False, **overrides}
    return build_tiny(directory, shape, seed)


def build_qwen3(directory: str | Path, seed: int = 0, **overrides: Any) -> str:
    """Qwen3: RMSNorm on every query/key head, lm_head tied to the embedding, and a
    head_dim (32) that is not hidden_size / num_heads (16)."""
    shape = {
        **TINY_SHAPE, "model_type": "qwen3", "tie_word_embeddings": True, "head_dim": 32,
        **overrides,
    }
    return build_tiny(directory, shape, seed)


# The newer Qwen kinds, as small: experts (Qwen2-MoE with a shared expert and a dense
# layer, Qwen3-MoE with renormalised routing), and the hybrid decoders (three Gated
# DeltaNet layers, then one of gated full attention, twice).
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
TINY_HYBRID = dict(
    num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def build_qwen2_moe(directory: str | Path, seed: int = 0, **overrides: Any) -> str:
    """Qwen2-MoE: experts with a gated shared expert, unnormalised routing, layer 1 dense."""
    shape = {
        **TINY_SHAPE, **TINY_MOE, "model_type": "qwen2_moe", "tie_word_embeddings": False,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [1],
        **overrides,
    }
    return build_tiny(directory, shape, seed)


def build_qwen3_moe(directory: str | Path, seed: int = 0, **overrides: Any) -> str:
    """Qwen3-MoE: q/k norms, routing weights renormalised to sum to one, no shared expert."""
    shape = {
        **TINY_SHAPE, **TINY_MOE, "model_type": "qwen3_moe", "tie_word_embeddings": False,
        "head_dim": 32, "norm_topk_prob": True, **overrides,
    }
    return build_tiny(directory, shape, seed)


def build_qwen3_next(directory: str | Path, seed: int = 0, **overrides: Any) -> str:
    """Qwen3-Next: the hybrid decoder, with fused linear-attention projections and experts."""
    shape = {
        **TINY_SHAPE, **TINY_HYBRID, **TINY_MOE, "model_type": "qwen3_next",
        "shared_expert_intermediate_size": 48, "tie_word_embeddings": False, **overrides,
    }
    return build_tiny(directory, shape, seed)


def build_qwen3_5(directory: str | Path, seed: int = 0, **overrides: Any) -> str:
    """Qwen3.5 (dense): the hybrid decoder with separate projections and a dense MLP."""
    shape = {**TINY_SHAPE, **TINY_HYBRID, "model_type": "qwen3_5_text",
             "tie_word_embeddings": True, **overrides}
    return build_tiny(directory, shape, seed)


def build_qwen3_5_moe(directory: str | Path, seed: int = 0, **overrides: Any) -> str:
    """Qwen3.5-MoE: the hybrid decoder with experts and a shared expert."""
    shape = {
        **TINY_SHAPE, **TINY_HYBRID, **TINY_MOE, "model_type": "qwen3_5_moe_text",
        "shared_expert_intermediate_size": 48, "tie_word_embeddings": False, **overrides,
    }
    return build_tiny(directory, shape, seed)


def build_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    """Train the tests' tokenizer and save it, with its chat template, as transformers files."""
    tokenizer = _fast_tokenizer(train_byte_level_bpe())
    tokenizer.model_max_length = TINY_SHAPE["max_position_embeddings"]
    tokenizer.save_pretrained(directory)
    return tokenizer


def train_byte_level_bpe() -> Tokenizer:
    """A GPT-2/Qwen-style byte-level BPE: any byte sequence is encodable, and decoding
    concatenates token bytes, so a token may end in the middle of a UTF-8 character."""
    tokenizer = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, not only those seen in the corpus, so nothing is unknown.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(generate_corpus(), trainer)
    return tokenizer


def generate_corpus(num_lines: int = 2000, seed: int = 0) -> list[str]:
    """Random sentences mixing the four scripts, each word separated by a space."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = []
        for _ in range(rng.randint(3, 12)):
            kind = rng.random()
            if kind < 0.5:
                words.append(rng.choice(ENGLISH_WORDS))
            elif kind < 0.7:
                words.append(rng.choice(ACCENTED_WORDS))
            elif kind < 0.9:
                words.append("".join(rng.choices(CHINESE_CHARS, k=rng.randint(1, 4))))
            else:
                words.append(rng.choice(EMOJI))
        lines.append(" ".join(words))
    return lines


# --------------------------------------------------------------------------- benchmark presets
# The architecture of Qwen3 scaled down so that a benchmark, transformers included, runs
# in minutes on a couple of CPU cores; the MoE and hybrid CPU presets are built from it.
QWEN3_CPU: dict[str, Any] = dict(
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
)

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
    # The shape of Qwen/Qwen2.5-1.5B-Instruct: the CPU comparison with vLLM and llama.cpp.
    "qwen2.5-1.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        dtype="bfloat16",
    ),
    "qwen3-cpu": QWEN3_CPU,
    # The shape of Qwen/Qwen3-30B-A3B, the mixture of experts most run on their own machines:
    # 128 experts of width 768, 8 per token. 30.5B parameters, 3.3B of them per token: a GPU's.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        dtype="bfloat16",
    ),
    # `qwen3-cpu` with Qwen3-30B-A3B's experts in place of its MLPs: 128 experts of width
    # 128, 8 per token, so a token runs the 1024 MLP channels `qwen3-cpu` runs, out of 16384.
    "qwen3-moe-cpu": {
        **QWEN3_CPU, "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 128, "norm_topk_prob": True,
    },
    # `qwen3-cpu` as Qwen3.5 (dense) builds it: of its 6 layers, layer 4 is gated full
    # attention and the rest Gated DeltaNet, each of about the attention's parameters
    # (q and k in 2 heads of 64, v in 4, as Qwen3.5 has twice the value heads).
    "qwen3.5-cpu": {
        **QWEN3_CPU, "model_type": "qwen3_5_text", "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                            "partial_rotary_factor": 0.25},
    },
}
# The model types a config.json may name (transformers' names).
MODEL_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_text",
               "qwen3_5_moe_text")
# Byte-level BPE shows a space as "Ġ"; with the letters it spells word-like tokens.
WORD_SYMBOLS = ["Ġ", *"abcdefghijklmnopqrstuvwxyz"]


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "nanoqwen" / "random-weights"


def random_checkpoint(preset_or_config: str, cache_dir: Path | None = None, seed: int = 0) -> str:
    """Directory of a random-weights checkpoint, built on first use.

    `preset_or_config` is a key of `PRESETS` or the path of a Qwen `config.json` (dense,
    mixture-of-experts or hybrid: `MODEL_TYPES`).
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
    if shape.get("model_type") not in MODEL_TYPES:
        raise ValueError(
            f"{path} is not a config of a Qwen nanoqwen runs (model_type "
            f"{shape.get('model_type')!r}, not one of {', '.join(MODEL_TYPES)})"
        )
    return "config", shape


def _build_atomically(directory: Path, shape: dict[str, Any], seed: int) -> None:
    """Build in a scratch directory and rename it into place, so that an interrupted
    build, or two running at once, never leave a half-written checkpoint behind."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".building-"))
    try:
        tokenizer = synthetic_tokenizer(shape["vocab_size"], seed)
        tokenizer.save_pretrained(scratch)
        build_checkpoint(scratch, shape, tokenizer, seed)
        os.replace(scratch, directory)
    except OSError:
        if not directory.is_dir():  # losing the race to a concurrent build is fine
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


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
    backend = _byte_level(models.BPE(vocab=vocab, merges=merges))
    backend.add_special_tokens(SPECIAL_TOKENS)
    return _fast_tokenizer(backend)


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


# --------------------------------------------------------------------------- shared
def build_checkpoint(
    directory: str | Path,
    shape: dict[str, Any],
    tokenizer: PreTrainedTokenizerFast,
    seed: int = 0,
    randomize_constants: bool = False,
) -> None:
    """Write config, random weights and generation config for `tokenizer` into `directory`.

    `shape` is a Qwen config as a dict (with `model_type`); its vocabulary defaults
    to the tokenizer's, and its special ids are always the tokenizer's own.
    """
    special_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = _model_config(
        {"vocab_size": len(tokenizer), **shape},
        bos_id=special_ids[END_OF_TEXT],
        eos_id=special_ids[IM_END],
    )
    # Fork the RNG so building a checkpoint does not shift the random stream of a test.
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
        if randomize_constants:
            _randomize_constant_parameters(model, config.initializer_range)
    # Like Qwen's instruct checkpoints: the chat turn end and the document end both stop.
    model.generation_config = GenerationConfig(
        bos_token_id=special_ids[END_OF_TEXT],
        eos_token_id=[special_ids[IM_END], special_ids[END_OF_TEXT]],
        pad_token_id=special_ids[END_OF_TEXT],
    )
    model.save_pretrained(directory)


def _model_config(shape: dict[str, Any], bos_id: int, eos_id: int) -> PretrainedConfig:
    fields = {key: value for key, value in shape.items() if key != "model_type"}
    # Whatever ids the source config names, this checkpoint's tokenizer has its own.
    fields.update(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=None)
    return AutoConfig.for_model(shape["model_type"], **fields)


@torch.no_grad()
def _randomize_constant_parameters(model: torch.nn.Module, scale: float) -> None:
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):
            parameter.copy_(1.0 + 0.2 * torch.randn_like(parameter))
        elif name.endswith(".bias"):
            parameter.copy_(scale * torch.randn_like(parameter))


def _byte_level(model: models.Model) -> Tokenizer:
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _fast_tokenizer(backend: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
