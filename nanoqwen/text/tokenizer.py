"""The engine's text side: encoding prompts, and turning a stream of tokens back into text.

Encoding is the easy half and belongs to the model's own tokenizer: `Tokenizer` wraps
`transformers.AutoTokenizer` (built from the checkpoint's tokenizer files, or a GGUF file's
metadata) and adds what an engine needs besides, the chat template rendered
straight to ids and the set of end-of-sequence ids from `generation_config.json`.
Streaming the text back is `detokenizer.py`'s job.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from nanoqwen.weights.gguf import is_gguf_file, load_gguf_tokenizer

# The generation_config.json fields that are sampling settings, named as in SamplingParams.
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# For checkpoints that publish no sampling settings: Qwen3's published chat settings.
FALLBACK_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
# Texts no chat template changes, to find where it puts a message's content.
_SYSTEM_MARKER, _USER_MARKER = "nanoqwen-system-marker", "nanoqwen-user-marker"
# Byte-level BPE writes byte b as the printable character bytes_to_unicode()[b].
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}


class Tokenizer:
    """A model's tokenizer, chat template and end-of-sequence ids."""

    def __init__(self, path: str | Path) -> None:
        """From a checkpoint directory, or a GGUF file (which has no generation config)."""
        if is_gguf_file(str(path)):
            self._hf: PreTrainedTokenizerBase = load_gguf_tokenizer(str(path))
            generation_config = {}
        else:
            self._hf = AutoTokenizer.from_pretrained(path)
            generation_config = _read_generation_config(path)
        self.eos_token_ids: frozenset[int] = _read_eos_token_ids(
            generation_config, self._hf.eos_token_id
        )
        # Sampling settings a request doesn't give itself (`SamplingParams` keywords).
        self.sampling_defaults: dict[str, Any] = _sampling_defaults(generation_config)
        # Streaming decodes a few tokens per request per step. The Rust tokenizer does that
        # in a third of the time transformers' wrapper takes, which adds only an optional
        # clean-up pass (off for Qwen's byte-level BPE).
        self._special_ids = frozenset(self._hf.all_special_ids)
        backend = getattr(self._hf, "backend_tokenizer", None)
        self._decode = (
            backend.decode
            if backend is not None and not self._hf.clean_up_tokenization_spaces
            else self._hf.decode
        )

    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer underneath (what a grammar compiler reads)."""
        return self._hf

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS/EOS are added (Qwen uses none for plain prompts)."""
        return self._hf.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        enable_thinking: bool | None = None,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Prompt ids for an OpenAI-style conversation, by default ending with the
        assistant's turn header.

        `enable_thinking` is a Qwen3 template variable (False pre-fills an empty reasoning
        block); it is passed only when given, so templates that never mention it keep their
        own default. `tools` (OpenAI function definitions) are rendered as the template
        does (Qwen's: a system block listing them). `continue_final_message` leaves the
        last message, an assistant's, open instead, so the reply continues its text (a
        *prefill*); it rules out `add_generation_prompt`.
        """
        template_variables = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        return self._hf.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
            return_dict=False,  # transformers 5 returns a BatchEncoding by default
            **template_variables,
        )

    def default_system_prompt(self) -> str | None:
        """The system prompt the chat template writes into a conversation that has none
        (Qwen2.5's "You are Qwen, created by Alibaba Cloud. ..."), or None.

        Found by rendering one user message twice, alone and after a system message whose
        text is a marker: what the first rendering has where the second has the marker is
        the template's default.
        """
        user = [{"role": "user", "content": _USER_MARKER}]
        try:
            alone = self._render(user)
            marked = self._render([{"role": "system", "content": _SYSTEM_MARKER}, *user])
        except (ValueError, TemplateError):  # no template, or one that takes no system role
            return None
        before_user = alone[: alone.index(_USER_MARKER)]
        head, _, tail = marked[: marked.index(_USER_MARKER)].partition(_SYSTEM_MARKER)
        if len(before_user) > len(head) + len(tail) and before_user.startswith(head) and (
            before_user.endswith(tail)
        ):
            return before_user[len(head) : len(before_user) - len(tail)]
        return None

    def _render(self, messages: list[dict[str, Any]]) -> str:
        return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def token_text(self, token_id: int) -> str:
        """One token on its own, as text (special tokens included; a token holding part of
        a character shows U+FFFD)."""
        return self._decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for. A byte-level BPE token (Qwen's) spells them with
        one printable character per byte; any other token is its text in UTF-8."""
        piece = self._hf.convert_ids_to_tokens(token_id)
        if piece is not None and token_id not in self._special_ids and all(
            char in _BYTE_OF_CHAR for char in piece
        ):
            return bytes(_BYTE_OF_CHAR[char] for char in piece)
        return self.token_text(token_id).encode()

    def get_vocab(self) -> dict[str, int]:
        """Every token's string and id, special tokens included."""
        return self._hf.get_vocab()

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added special tokens (the model's embedding table may
        be padded to more rows than this)."""
        return len(self._hf)

    def __len__(self) -> int:
        return self.vocab_size


def _read_generation_config(path: str | Path) -> dict[str, Any]:
    """The settings `generation_config.json` spells out (none of transformers' defaults)."""
    try:
        return GenerationConfig.from_pretrained(path).to_diff_dict()
    except OSError:  # the checkpoint has no generation_config.json
        return {}


def _sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The model's recommended sampling settings, as `SamplingParams` keywords.

    Chat checkpoints publish them (Qwen3: temperature 0.6, top_p 0.95, top_k 20); a request
    that leaves a setting out gets the model's value, as vLLM does. A checkpoint that
    publishes none gets `FALLBACK_SAMPLING`; one that asks for greedy decoding
    (`do_sample: false`) gets temperature 0.
    """
    if generation_config.get("do_sample") is False:
        return {"temperature": 0.0}
    published = {
        name: generation_config[name] for name in SAMPLING_DEFAULT_FIELDS if name in generation_config
    }
    return published or dict(FALLBACK_SAMPLING)


def _read_eos_token_ids(
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


