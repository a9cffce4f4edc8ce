"""The engine's text side: prompts in, and a stream of tokens back out as text.

Encoding belongs to the model's own tokenizer: `Tokenizer` wraps `transformers.AutoTokenizer`
(built from the checkpoint's tokenizer files, or a GGUF file's metadata) and adds what an
engine needs besides: the chat template rendered straight to ids, the end-of-sequence ids
and the sampling settings of `generation_config.json` (`generation_config.py`).

Decoding while streaming is the subtle half, `IncrementalDetokenizer`, one per request.
Two things can make the text of the tokens generated so far *not yet final*:

1. Half a character. Qwen's byte-level BPE tokens are byte strings, and a Chinese character
   or an emoji is often split over several tokens; decoding after the first of them yields
   U+FFFD. So a small window of recent tokens is decoded and compared with the text already
   released; while it ends in U+FFFD nothing is released, and once it ends cleanly the new
   characters are, and the window slides on. Each step costs O(window), not O(output).
2. Part of a stop string. With `stop=["\\n\\nUser:"]`, a delta ending in "\\n\\nUs" cannot be
   sent: the next token may complete the stop string, which must not reach the client. The
   longest tail that could begin a stop string is held back until the text rules it out
   (or at `flush()`), found by a `StopStringMatcher` (`stop_strings.py`), which reads each
   character once however many stop strings there are.

Invariant: the deltas of `add_token` and `flush` concatenate to `text`, which equals
`tokenizer.decode(output_ids)` cut at the first stop string (the one complete earliest).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from nanoqwen.text.generation_config import (
    read_eos_token_ids,
    read_generation_config,
    sampling_defaults,
)
from nanoqwen.weights.formats import is_gguf_file

# Byte-level BPE writes byte b as the printable character bytes_to_unicode()[b].
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}
REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context for the first generated tokens. Byte-level BPE does
# not need it, but tokenizers that render a word-initial space differently at the very start
# of a string (SentencePiece) then stream the same text as they decode in context.
PROMPT_CONTEXT_TOKENS = 5


class Tokenizer:
    """A model's tokenizer, chat template, end-of-sequence ids and sampling defaults."""

    def __init__(self, path: str | Path) -> None:
        """From a checkpoint directory, or a GGUF file (which has no generation config)."""
        if is_gguf_file(str(path)):
            from nanoqwen.weights.gguf import load_gguf_tokenizer

            self._hf: PreTrainedTokenizerBase = load_gguf_tokenizer(str(path))
            generation_config = {}
        else:
            self._hf = AutoTokenizer.from_pretrained(path)
            generation_config = read_generation_config(path)
        self.eos_token_ids = read_eos_token_ids(generation_config, self._hf.eos_token_id)
        # Sampling settings a request doesn't give itself (`SamplingParams` keywords).
        self.sampling_defaults: dict[str, Any] = sampling_defaults(generation_config)
        # Streaming decodes a few tokens per request per step. The Rust tokenizer does that
        # in a third of the time transformers' wrapper takes, which adds only an optional
        # clean-up pass (off for Qwen's byte-level BPE): `decode_ids(ids,
        # skip_special_tokens=...)` is the fastest that decodes right.
        self._special_ids = frozenset(self._hf.all_special_ids)
        backend = getattr(self._hf, "backend_tokenizer", None)
        clean_up = self._hf.clean_up_tokenization_spaces
        self.decode_ids = backend.decode if backend is not None and not clean_up else self._hf.decode

    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer underneath (what a grammar compiler reads)."""
        return self._hf

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS/EOS are added (Qwen uses none for plain prompts)."""
        return self._hf.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.decode_ids(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        enable_thinking: bool | None = None,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Prompt ids for an OpenAI-style conversation, by default ending with the
        assistant's turn header. `enable_thinking` is a Qwen3 template variable (False
        pre-fills an empty reasoning block), passed only when given; `tools` (OpenAI
        function definitions) are rendered as the template does; `continue_final_message`
        leaves the last message, an assistant's, open so the reply continues its text."""
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

    def token_text(self, token_id: int) -> str:
        """One token on its own, as text (special tokens included; a token holding part of
        a character shows U+FFFD)."""
        return self.decode_ids([token_id], skip_special_tokens=False)

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


class IncrementalDetokenizer:
    """Streams one request's output text: UTF-8-safe deltas, cut before any stop string."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()
    ) -> None:
        self._decode = tokenizer.decode_ids
        self._stops = None
        if stop:  # an empty stop string would match at once: it means "no stop"
            from nanoqwen.text.stop_strings import StopStringMatcher

            self._stops = StopStringMatcher([stop_string for stop_string in stop if stop_string])
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if self._decode(context, skip_special_tokens=True).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: the output's first bytes cannot complete it
            # as far as the output's own text is concerned, so decode them without it.
            context = []
        self._window: list[int] = context  # tokens from prefix_offset on
        self._read_offset = len(context)  # window[:read_offset] is text already released
        self._held_back = ""  # released by the UTF-8 stage, but maybe the start of a stop string
        self._text_parts: list[str] = []
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        """All text returned so far."""
        # Join lazily and keep the result, so reading `text` every step stays cheap.
        if len(self._text_parts) > 1:
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the text that may now be sent to the client."""
        if self.stopped:
            return ""
        self._window.append(token_id)
        return self._release(self._take_complete_text(final=False))

    def flush(self) -> str:
        """The request ended without a stop string: release everything still held back,
        including an unfinished character (as U+FFFD, like a full decode shows it)."""
        if self.stopped:
            return ""
        delta = self._release(self._take_complete_text(final=True))
        if self.stopped:
            return delta
        delta += self._held_back
        self._text_parts.append(self._held_back)
        self._held_back = ""
        return delta

    def _take_complete_text(self, final: bool) -> str:
        """UTF-8 stage: the text of the unread tokens, or "" while it ends mid-character."""
        seen_text = self._decode(self._window[: self._read_offset], skip_special_tokens=True)
        window_text = self._decode(self._window, skip_special_tokens=True)
        if window_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        # Slide forward: the tokens just read become the left context of the next window.
        self._window = self._window[self._read_offset :]
        self._read_offset = len(self._window)
        return window_text[len(seen_text) :]

    def _release(self, new_text: str) -> str:
        """Stop-string stage: cut at a completed stop string, or hold back a possible start."""
        if self._stops is None:
            self._text_parts.append(new_text)
            return new_text
        # The matcher has read `_held_back` already: it reads each character once. A match
        # ends in `new_text`, and starts no earlier than `_held_back` (or it would be held).
        pending = self._held_back + new_text
        match = self._stops.feed(new_text)
        if match is not None:
            end, self.stop_reason = match
            self.stopped = True
            start = len(self._held_back) + end - len(self.stop_reason)
            delta, self._held_back = pending[:start], ""
        else:
            keep = self._stops.partial_length
            delta, self._held_back = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self._text_parts.append(delta)
        return delta
