"""Turning a stream of tokens back into text, one request at a time.

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
   release it once the following text rules the stop string out (or at `flush()`). A
   `StopStringMatcher` (`stop_strings.py`) reads each new character once and knows both
   the first completed stop string and that tail, however many stop strings there are.

Invariant: the deltas returned by `add_token` and `flush` concatenate to `text`, which equals
`tokenizer.decode(output_ids)` cut at the first stop string, where "first" means the one
that is complete earliest in the text: generation stops as soon as a stop string appears.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanoqwen.text.stop_strings import StopStringMatcher
from nanoqwen.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context for the first generated tokens. Byte-level BPE does
# not need it, but tokenizers that render a word-initial space differently at the very start
# of a string (SentencePiece) then stream the same text as they decode in context.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Streams one request's output text: UTF-8-safe deltas, cut before any stop string."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()
    ) -> None:
        self._tokenizer = tokenizer
        # An empty stop string would match before the first character; it means "no stop".
        self._stops = StopStringMatcher([stop_string for stop_string in stop if stop_string])

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
