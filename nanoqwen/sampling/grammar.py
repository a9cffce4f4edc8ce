"""Structured output: text that follows a grammar, whatever the model's weights would say.

The problem: a client asks for JSON matching a schema (or one of a few words, or text
matching a regex) and a sampler that only looks at logits may write anything. The fix
vLLM and SGLang use, with the same library (xgrammar), works token by token:

* A grammar (`StructuredOutput`: a JSON schema, any JSON object, a regex, a list of
  choices, an EBNF grammar, or xgrammar's structural tag) is **compiled** once against
  the tokenizer's vocabulary into an automaton that knows, in every state, which tokens
  may come next (`compile_spec`). A grammar that allows no token at its start (a schema
  that is only a reference to itself) admits no output, and is refused there.
* Each request walks that automaton with its own **matcher** (`Request.grammar`). Before
  a step samples it, the matcher writes a **token bitmask**, one bit per vocabulary
  entry, and the sampler sets the logits of forbidden tokens to -inf (`GrammarMasks`, a
  logits processor); the chosen token then advances the matcher. Greedy or sampled, the
  text stays a prefix of some sentence of the grammar; once the grammar is complete only
  end-of-text remains allowed, so the request stops there.
* A grammar can still lead into a state that allows nothing (a rule defined only by
  itself, reached halfway), and a matcher can fail. Then that request alone ends, with
  its `error` said (finish_reason "error"): never the others of its step.

`GrammarCompiler` keeps what it compiled, by spec, in a least-recently-used cache bounded
in bytes (`CACHE_BYTES`, the grammars and their keys) and in entries (`CACHE_ENTRIES`);
the same schema sent again costs a lookup. Compiling a hostile grammar can take minutes
and gigabytes, and native code cannot be interrupted, so a server compiles under a
`CompileBudget`: the grammar is first compiled in a worker process, stopped past the
budget's time or memory, or when the caller gives up (`grammar_sandbox.py`), and only a
grammar that passed is compiled here, one at a time, on a thread of its own. Masks are filled on the host and applied where the logits live.
Invariant: a matcher has accepted exactly the request's generated tokens.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import astuple
from typing import Any, Protocol

import torch
import xgrammar
from transformers import PreTrainedTokenizerBase

from nanoqwen.sampling.sampler import LogitsProcessor
from nanoqwen.sampling.structured import CompileBudget, StructuredOutput

CACHE_BYTES = 128 << 20  # compiled grammars kept for reuse (xgrammar's measure; RSS is ~2x)
# However small they are: each entry costs some kilobytes more than xgrammar counts, so a
# client that sends a new schema every time would otherwise grow the server for long.
CACHE_ENTRIES = 1024
# Where a compiler error message begins: xgrammar prefixes "[time] file.cc:line: ".
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")
EMPTY_GRAMMAR = "it admits no output (a rule that is only a reference to itself?)"


class GrammarMatcher(Protocol):
    """What the sampler needs of a request's matcher (an `xgrammar.GrammarMatcher`)."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> Any: ...
    def accept_token(self, token_id: int) -> bool: ...


def compile_spec(compiler: xgrammar.GrammarCompiler, spec: StructuredOutput) -> Any:
    """`spec` compiled (an `xgrammar.CompiledGrammar`), or a ValueError saying what is
    wrong with it; shared by this process and the sandbox's worker."""
    try:
        compiled = _compile(compiler, spec)
    except (RuntimeError, ValueError, TypeError) as error:
        message = _SOURCE_PREFIX.sub("", str(error).strip())
        raise ValueError(f"structured_output.{spec.kind} is invalid: {message}") from error
    bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    if not bitmask.any():
        raise ValueError(f"structured_output.{spec.kind} is invalid: {EMPTY_GRAMMAR}")
    return compiled


def _compile(compiler: xgrammar.GrammarCompiler, spec: StructuredOutput) -> Any:
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


def cache_key(spec: StructuredOutput) -> str:
    """The same grammar asked for twice gets the same key (dicts in any key order)."""
    return json.dumps(astuple(spec), sort_keys=True, ensure_ascii=False)


def _entry_bytes(key: str, compiled: Any) -> int:
    """What one cache entry holds: the grammar, and its key (a schema up to 64 KiB, which
    may compile to far less)."""
    return compiled.memory_size_bytes + len(key)


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
        self._info: xgrammar.TokenizerInfo | None = None  # the vocabulary, as xgrammar reads it
        self._lock = threading.Lock()  # guards the compiler's making and the caches
        self._cache: OrderedDict[str, Any] = OrderedDict()  # newest last
        # Grammars someone still holds (a request about to be added), found even once
        # the cache has dropped them.
        self._alive: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self._lane = threading.Lock()  # one bounded compile at a time
        self._sandbox: Any = None  # grammar_sandbox.Sandbox, once a budget asks for one

    def compile(
        self, spec: StructuredOutput, budget: CompileBudget | None = None,
        check: Callable[[], None] = lambda: None,
    ) -> Any:
        """The compiled grammar (an `xgrammar.CompiledGrammar`), or a ValueError saying
        what is wrong with it, or why it may not be compiled (past the `budget`).

        Without a budget it compiles on this thread. With one, `check` is called every
        `POLL_SECONDS` while this waits, and may raise to give up (a client that left):
        see the module docstring.
        """
        key = cache_key(spec)
        compiled = self._cached(key)
        if compiled is not None:
            return compiled
        if budget is None:
            return self._remember(key, compile_spec(self._xgrammar(), spec))
        return self._compile_bounded(key, spec, budget, check)

    def matcher(self, spec: StructuredOutput) -> xgrammar.GrammarMatcher:
        """A fresh matcher at the start of the grammar, for one request."""
        return xgrammar.GrammarMatcher(self.compile(spec))

    def _compile_bounded(
        self, key: str, spec: StructuredOutput, budget: CompileBudget, check: Callable[[], None]
    ) -> Any:
        """Vet `spec` in the sandbox, then compile it here (module docstring), one grammar
        at a time: the lane is held from the vetting until the compile here is done."""
        from nanoqwen.sampling.grammar_sandbox import (
            POLL_SECONDS,
            sandbox_for,
            wait_for,
        )

        wait_for(lambda: self._lane.acquire(timeout=POLL_SECONDS), check)
        try:
            compiled = self._cached(key)  # compiled while this waited for the lane
            if compiled is None:
                if self._sandbox is None:
                    self._xgrammar()
                    self._sandbox = sandbox_for(self._info.serialize_json())
                self._sandbox.vet(spec, budget, check)
        except BaseException:
            self._lane.release()
            raise
        if compiled is not None:
            self._lane.release()
            return compiled
        done: Future = Future()
        threading.Thread(target=self._compile_vetted, args=(key, spec, done),
                         name="nanoqwen-grammar", daemon=True).start()
        return wait_for(lambda: _result(done, POLL_SECONDS), check)

    def _compile_vetted(self, key: str, spec: StructuredOutput, done: Future) -> None:
        """Compile a grammar the sandbox passed, whether or not its caller still waits (it
        takes about as long as it took there), then give the lane back."""
        try:
            done.set_result(self._remember(key, compile_spec(self._xgrammar(), spec)))
        except Exception as error:
            done.set_exception(error)
        finally:
            self._lane.release()

    def _cached(self, key: str) -> Any:
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            return self._alive.get(key)

    def _remember(self, key: str, compiled: Any) -> Any:
        with self._lock:
            self._cache[key] = self._alive[key] = compiled
            self._cache.move_to_end(key)
            total = sum(_entry_bytes(*entry) for entry in self._cache.items())
            while len(self._cache) > 1 and (total > CACHE_BYTES
                                            or len(self._cache) > CACHE_ENTRIES):
                total -= _entry_bytes(*self._cache.popitem(last=False))
        return compiled

    def _xgrammar(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = make_compiler(self._info)
            return self._compiler


def compiler_for(engine: Any) -> GrammarCompiler:
    """The grammar compiler of `engine` (an `LLMEngine`), made on first use: an engine that
    never sees a grammar never pays for one."""
    with _COMPILERS_LOCK:
        if engine not in _COMPILERS:
            _COMPILERS[engine] = GrammarCompiler(engine.tokenizer.hf_tokenizer,
                                                 engine.model_config.vocab_size,
                                                 engine.tokenizer.eos_token_ids)
        return _COMPILERS[engine]


_COMPILERS: weakref.WeakKeyDictionary[Any, GrammarCompiler] = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def make_compiler(info: xgrammar.TokenizerInfo, max_threads: int = 8) -> xgrammar.GrammarCompiler:
    """xgrammar's compiler (on up to `max_threads` threads, its default), without its own
    cache (`GrammarCompiler` keeps one)."""
    return xgrammar.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)


def _result(done: Future, timeout: float) -> Any:
    """The future's result, or None if it is not done within `timeout` seconds."""
    try:
        return done.result(timeout=timeout)
    except FutureTimeout:
        return None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`. JSON string escapes are the
    EBNF's own, so `json.dumps` writes each choice as a literal."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class GrammarRequest(Protocol):
    """What the mask reads of a request, and `error`, which it sets when the grammar
    cannot go on."""

    params: Any  # SamplingParams (its `structured_output`)
    grammar: GrammarMatcher | None
    error: str | None


class GrammarMasks(LogitsProcessor):
    """The sampler's processor for structured outputs: each constrained row's forbidden
    tokens set to -inf before the draw, its matcher moved past the chosen token after.
    A row whose grammar allows nothing, or fails, is left unmasked and its request given
    an `error`: the engine ends it without keeping the token drawn."""

    order = 3  # last: nothing after it may lift a forbidden token off -inf

    def uses(self, requests: Sequence[GrammarRequest]) -> bool:
        return any(request.params.structured_output is not None for request in requests)

    def process(self, logits: torch.Tensor, requests: Sequence[GrammarRequest]) -> None:
        rows = [row for row, request in enumerate(requests) if _follows_grammar(request)]
        bitmask = xgrammar.allocate_token_bitmask(len(requests), logits.shape[-1])
        for row in rows:
            try:
                requests[row].grammar.fill_next_token_bitmask(bitmask, row)
            except Exception as error:  # a matcher in a state it cannot leave
                requests[row].error = f"the structured output's grammar failed: {error}"
        # A mask that allows nothing sets every logit to -inf, and the draw still returns
        # a token (the first), which the matcher then refuses: such a row is not masked,
        # and its request ends instead.
        allows_some = bitmask.any(dim=-1).tolist()
        for row in rows:
            if not allows_some[row] and requests[row].error is None:
                requests[row].error = (
                    "the structured output's grammar allows no token after the output so far "
                    "(a rule that is only a reference to itself?)"
                )
        masked = [row for row in rows if requests[row].error is None]
        if masked:
            bitmask = bitmask.to(logits.device, non_blocking=True)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=masked)

    def accept(self, requests: Sequence[GrammarRequest], token_ids: list[int]) -> None:
        for request, token_id in zip(requests, token_ids):
            if not _follows_grammar(request):
                continue
            try:
                accepted = request.grammar.accept_token(token_id)
            except Exception:  # a matcher that fails is a grammar that cannot go on
                accepted = False
            if not accepted:
                request.error = f"token {token_id} was drawn against the structured output's grammar"


def _follows_grammar(request: GrammarRequest) -> bool:
    return request.params.structured_output is not None and request.error is None
