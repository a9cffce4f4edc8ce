"""The engine's text side: encoding prompts, and turning a stream of tokens back into text.

Encoding is the easy half and belongs to the model's own tokenizer: `Tokenizer` wraps
`transformers.AutoTokenizer` (built from the checkpoint's tokenizer files, or a GGUF file's
metadata) and adds what an engine needs besides, the chat template rendered
straight to ids and the set of end-of-sequence ids from `generation_config.json`.

Decoding while streaming is the subtle half, handled by `IncrementalDetokenizer`, one per request.
Two things can make the text of the tokens generated so far *not yet final*:

1. Half a character. Qwen's byte-level BPE tokens are byte strings, and a Chinese character or
   an emoji (3-4 bytes of UTF-8) is often split over several tokens. Decoding after the first of
   them yields the replacement character U+FFFD. We therefore decode a small window of recent
   tokens, `[prefix_offset, end)`, and compare it with the decoding of `[prefix_offset,
   read_offset)`, text the client has already seen. While the window's text ends in U+FFFD the
   character is unfinished and nothing is released; once it ends cleanly, the new characters
   are released and the window slides forward. The window holds only the tokens since the
   last release (plus the ones before, as left context), so each step costs O(window), not
   O(length of the output).

2. Part of a stop string. With `stop=["\\n\\nUser:"]`, a delta ending in "\\n\\nUs" cannot be sent:
   the next token may complete the stop string, and the stop string must not reach the client.
   We hold back the longest tail of the text that is the beginning of some stop string, and
   release it once the following text rules the stop string out (or at `flush()`).

Invariant: the deltas returned by `add_token` and `flush` concatenate to `text`, which equals
`tokenizer.decode(output_ids)` cut at the first stop string, where "first" means the one
that is complete earliest in the text: generation stops as soon as a stop string appears.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from nanoqwen.gguf_checkpoint import is_gguf_file, load_gguf_tokenizer

REPLACEMENT_CHAR = "\ufffd"

# The generation_config.json fields that are sampling settings, named as in SamplingParams.
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# For checkpoints that publish no sampling settings: Qwen3's published chat settings.
FALLBACK_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}

# Prompt tokens decoded as left context for the first generated tokens. Byte-level BPE does
# not need it, but tokenizers that render a word-initial space differently at the very start
# of a string (SentencePiece) then stream the same text as they decode in context.
PROMPT_CONTEXT_TOKENS = 5


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
        backend = getattr(self._hf, "backend_tokenizer", None)
        self._decode = (
            backend.decode
            if backend is not None and not self._hf.clean_up_tokenization_spaces
            else self._hf.decode
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS/EOS are added (Qwen uses none for plain prompts)."""
        return self._hf.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], enable_thinking: bool | None = None
    ) -> list[int]:
        """Prompt ids for an OpenAI-style conversation, ending with the assistant's turn header.

        `enable_thinking` is a Qwen3 template variable (False pre-fills an empty reasoning
        block); it is passed only when given, so templates that never mention it keep their
        own default.
        """
        template_variables = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        return self._hf.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,  # transformers 5 returns a BatchEncoding by default
            **template_variables,
        )

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


class IncrementalDetokenizer:
    """Streams one request's output text: UTF-8-safe deltas, cut before any stop string."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()
    ) -> None:
        self._tokenizer = tokenizer
        # An empty stop string would match before the first character; it means "no stop".
        self._stop_strings = [stop_string for stop_string in stop if stop_string]

        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if tokenizer.decode(context).endswith(REPLACEMENT_CHAR):
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
        seen_text = self._tokenizer.decode(self._window[: self._read_offset])
        window_text = self._tokenizer.decode(self._window)
        if window_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        # Slide forward: the tokens just read become the left context of the next window.
        self._window = self._window[self._read_offset :]
        self._read_offset = len(self._window)
        return window_text[len(seen_text) :]

    def _release(self, new_text: str) -> str:
        """Stop-string stage: cut at a completed stop string, or hold back a possible start."""
        # `_held_back` never contains a whole stop string, so any match ends in `new_text`;
        # and no match can start in text already released, since that would have been held.
        pending = self._held_back + new_text
        match = self._first_stop_string(pending)
        if match is not None:
            start, self.stop_reason = match
            self.stopped = True
            delta, self._held_back = pending[:start], ""
        else:
            keep = partial_match_length(pending, self._stop_strings)
            delta, self._held_back = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self._text_parts.append(delta)
        return delta

    def _first_stop_string(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first; on a tie, the longer one."""
        best: tuple[int, int, str] | None = None
        for stop_string in self._stop_strings:
            start = text.find(stop_string)
            if start >= 0:
                candidate = (start + len(stop_string), start, stop_string)
                best = candidate if best is None else min(best, candidate)
        return None if best is None else (best[1], best[2])


def partial_match_length(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that some marker starts with (and is shorter
    than it): the part of a stream to hold back until the next piece shows whether the
    marker really follows."""
    longest_possible = max((len(marker) - 1 for marker in markers), default=0)
    for length in range(min(longest_possible, len(text)), 0, -1):
        tail = text[-length:]
        if any(marker.startswith(tail) for marker in markers):
            return length
    return 0
