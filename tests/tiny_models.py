"""Tiny random Qwen2 / Qwen3 checkpoints for tests, built with transformers itself.

Real checkpoints are gigabytes and need a network; the engine's tests only need something
that has the *shape* of a Qwen checkpoint: a `config.json`, `model.safetensors`, a byte-level
BPE tokenizer with ChatML special tokens and a chat template, and a `generation_config.json`.
Because transformers writes these files, transformers can also serve as the oracle: the
engine must reproduce its logits and greedy tokens on the same weights.

Two details make the fixtures catch real bugs rather than pass by accident:

* The tokenizer is trained on English, accented Latin, Chinese and emoji, with a vocabulary
  too small to hold every character, so many characters are split across several tokens
  (the case streaming detokenization must get right).
* Parameters that transformers initialises to a constant (RMSNorm weights to one, the
  Qwen2 q/k/v biases to zero) are randomised, so an engine that forgot a norm weight or a
  bias would still produce different logits.

Everything is seeded: the same ids and weights come out on every run.
"""

import random
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]

VOCAB_SIZE = 800

# ChatML as Qwen uses it. Like Qwen3's template, `enable_thinking=false` pre-fills an empty
# reasoning block so the model answers directly.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

ENGLISH_WORDS = (
    "the quick brown fox jumps over a lazy dog and then it sleeps while we write some more "
    "text about models tokens streams caches pages user assistant system think hello world"
).split()
ACCENTED_WORDS = "café naïve façade jalapeño Ærø Łódź crème brûlée smörgåsbord déjà señor".split()
# A range wider than the vocabulary can absorb, so most of these stay split into byte tokens.
CHINESE_CHARS = [chr(code) for code in range(0x4E00, 0x4E00 + 300)]
EMOJI = [chr(code) for code in range(0x1F600, 0x1F640)]

SHARED_MODEL_SHAPE: dict[str, Any] = dict(
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


def train_byte_level_bpe() -> Tokenizer:
    """A GPT-2/Qwen-style byte-level BPE: any byte sequence is encodable, and decoding
    concatenates token bytes, so a token may end in the middle of a UTF-8 character."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, not only those seen in the corpus, so nothing is unknown.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(generate_corpus(), trainer)
    return tokenizer


def build_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    """Train the tokenizer and save it, with its chat template, as transformers files."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_byte_level_bpe(),
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=SHARED_MODEL_SHAPE["max_position_embeddings"],
    )
    tokenizer.save_pretrained(directory)
    return tokenizer


def build_qwen2(directory: str | Path, seed: int = 0, **overrides: Any) -> str:
    """Qwen2: q/k/v projections with bias, separate (untied) lm_head."""
    tokenizer = build_tokenizer(directory)
    config = Qwen2Config(**{**_shared_config(tokenizer), "tie_word_embeddings": False, **overrides})
    _save_model(Qwen2ForCausalLM, config, tokenizer, directory, seed)
    return str(directory)


def build_qwen3(directory: str | Path, seed: int = 0, **overrides: Any) -> str:
    """Qwen3: RMSNorm on every query/key head, lm_head tied to the embedding, and a
    head_dim (32) that is not hidden_size / num_heads (16)."""
    tokenizer = build_tokenizer(directory)
    config = Qwen3Config(
        **{**_shared_config(tokenizer), "tie_word_embeddings": True, "head_dim": 32, **overrides}
    )
    _save_model(Qwen3ForCausalLM, config, tokenizer, directory, seed)
    return str(directory)


def _shared_config(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    special_ids = _special_token_ids(tokenizer)
    return {
        **SHARED_MODEL_SHAPE,
        "vocab_size": len(tokenizer),
        "bos_token_id": special_ids[END_OF_TEXT],
        "eos_token_id": special_ids[IM_END],
    }


def _save_model(
    model_class: type[PreTrainedModel],
    config: Qwen2Config | Qwen3Config,
    tokenizer: PreTrainedTokenizerFast,
    directory: str | Path,
    seed: int,
) -> None:
    # Fork the RNG so building a fixture does not shift the random stream of the tests.
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
        _randomize_constant_parameters(model, config.initializer_range)
    special_ids = _special_token_ids(tokenizer)
    # Like Qwen's instruct checkpoints: the chat turn end and the document end both stop.
    model.generation_config = GenerationConfig(
        bos_token_id=special_ids[END_OF_TEXT],
        eos_token_id=[special_ids[IM_END], special_ids[END_OF_TEXT]],
        pad_token_id=special_ids[END_OF_TEXT],
    )
    model.save_pretrained(directory, safe_serialization=True)


@torch.no_grad()
def _randomize_constant_parameters(model: PreTrainedModel, scale: float) -> None:
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):
            parameter.copy_(1.0 + 0.2 * torch.randn_like(parameter))
        elif name.endswith(".bias"):
            parameter.copy_(scale * torch.randn_like(parameter))


def _special_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    return {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
