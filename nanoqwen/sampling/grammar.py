"""Structured output: text that follows a grammar, whatever the model's weights would say.

The problem: a client asks for JSON matching a schema (or one of a few words, or text
matching a regex) and a sampler that only looks at logits may write anything. The fix
vLLM and SGLang use, with the same library (xgrammar), works token by token:

* A grammar (`StructuredOutput`: a JSON schema, any JSON object, a regex, a list of
  choices, an EBNF grammar, or xgrammar's structural tag) is **compiled** once against
  the tokenizer's vocabulary into an automaton that knows, in every state, which tokens
  may come next. `GrammarCompiler.compile` does it, and keeps the result in xgrammar's
  cache (bounded to `CACHE_BYTES`): the same schema sent again costs a lookup.
* Each request walks that automaton with its own **matcher** (`Request.grammar`). Before
  a step samples it, the matcher writes a **token bitmask**, one bit per vocabulary
  entry, and the sampler sets the logits of forbidden tokens to -inf (`GrammarMasks`, a
  logits processor); the chosen token then advances the matcher. Greedy or sampled, the
  text stays a prefix of some sentence of the grammar; once the grammar is complete only
  end-of-text remains allowed, so the request stops there.

Compiling can take a while for a big schema, so it happens off the engine thread: a
server compiles on the thread that handles the HTTP request (an invalid grammar is a
`ValueError` there, a 400), and the engine's own compile when it adds the request finds
the result in the cache. Masks are filled on the host and applied where the logits live.
Invariant: a matcher has accepted exactly the request's generated tokens.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import xgrammar
from transformers import PreTrainedTokenizerBase

from nanoqwen.sampling.sampler import LogitsProcessor
from nanoqwen.sampling.structured import StructuredOutput

CACHE_BYTES = 256 << 20  # compiled grammars kept for reuse, least recently used dropped first
# Where a compiler error message begins: xgrammar prefixes "[time] file.cc:line: ".
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")


class GrammarMatcher(Protocol):
    """What the sampler needs of a request's matcher (an `xgrammar.GrammarMatcher`)."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> Any: ...
    def accept_token(self, token_id: int) -> bool: ...


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one tokenizer, caching them; safe from any thread.

    Reading the vocabulary (xgrammar's `TokenizerInfo`) takes a moment for a large one, so
    it happens on first use: an engine that never sees a grammar never pays for it.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar, or a ValueError saying what is wrong with it."""
        compiler = self._xgrammar_compiler()
        try:
            if spec.json is not None or spec.json_object:
                schema = spec.json if spec.json is not None else {"type": "object"}
                text = schema if isinstance(schema, str) else json.dumps(schema)
                return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return compiler.compile_grammar(choice_grammar(spec.choice))
            if spec.grammar is not None:
                return compiler.compile_grammar(spec.grammar)
            tag = spec.structural_tag
            return compiler.compile_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
        except (RuntimeError, ValueError, TypeError) as error:
            message = _SOURCE_PREFIX.sub("", str(error).strip())
            raise ValueError(f"structured_output.{spec.kind} is invalid: {message}") from error

    def matcher(self, spec: StructuredOutput) -> xgrammar.GrammarMatcher:
        """A fresh matcher at the start of the grammar, for one request."""
        return xgrammar.GrammarMatcher(self.compile(spec))

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=CACHE_BYTES)
            return self._compiler


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`. JSON string escapes are the
    EBNF's own, so `json.dumps` writes each choice as a literal."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class GrammarRequest(Protocol):
    """What the mask reads of a request."""

    params: Any  # SamplingParams (its `structured_output`)
    grammar: GrammarMatcher | None


class GrammarMasks(LogitsProcessor):
    """The sampler's processor for structured outputs: each constrained row's forbidden
    tokens set to -inf before the draw, its matcher moved past the chosen token after."""

    order = 3  # last: nothing after it may lift a forbidden token off -inf

    def uses(self, requests: Sequence[GrammarRequest]) -> bool:
        return any(request.params.structured_output is not None for request in requests)

    def process(self, logits: torch.Tensor, requests: Sequence[GrammarRequest]) -> None:
        rows = [row for row, request in enumerate(requests)
                if request.params.structured_output is not None]
        bitmask = xgrammar.allocate_token_bitmask(len(requests), logits.shape[-1])
        for row in rows:
            requests[row].grammar.fill_next_token_bitmask(bitmask, row)
        bitmask = bitmask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)

    def accept(self, requests: Sequence[GrammarRequest], token_ids: list[int]) -> None:
        for request, token_id in zip(requests, token_ids):
            if request.params.structured_output is not None and not request.grammar.accept_token(
                token_id
            ):
                raise RuntimeError(f"token {token_id} was sampled against its request's grammar")
