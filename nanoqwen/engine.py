"""The engine: the loop that ties tokenizer, scheduler, runner and prefix cache together.

`LLMEngine` is the online interface a server drives. `add_request` checks and queues a
prompt (bad input is a `ValueError`, and nothing is queued); each `step()` is

    schedule → run (lay out, forward, choose tokens) → append tokens and stop

and returns one `RequestOutput` per request that moved: its new text (`delta_text`, safe to
stream) and everything so far. Tokens are appended one at a time through the stop checks
(EOS, stop ids and strings, `max_tokens`, `max_model_len`); finished requests release their
pages, leaving their full pages to the prefix cache.

Start-up reads in order: the checkpoint and tokenizer, then the runner (load the weights,
size the KV cache, allocate it: `runner/startup.py`), then the page allocator, prefix
cache and scheduler over that many pages.

Features stay out of a plain request's way. What a request asks for beyond the core draw
(penalties, a grammar, logprobs, an embedding) is plugged into the sampler or the runner
the first time a request asks (`sampling/extras.py`); speculative decoding is a `StepHook`
around the run; a split model's other ranks start beside this one (`parallel/`). None of
them is imported unless used.

Invariant: every request is waiting, running or finished, in exactly one place; a step
that fails after scheduling raises `StepError` and leaves its requests as they were. A
feature that cannot go on with one request (a grammar with no way forward) sets its
`error`, and the step ends that request alone (finish_reason "error").
`LLM` (`llm.py`) is the offline interface on top. The story:
docs/learn/02-continuous-batching.md.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Protocol

from nanoqwen.config import EngineConfig
from nanoqwen.memory.page_allocator import PageAllocator
from nanoqwen.memory.radix_cache import RadixCache
from nanoqwen.model.config import resolve_max_model_len
from nanoqwen.outputs import RequestOutput, StepError
from nanoqwen.runner.startup import start_runners
from nanoqwen.sampling.params import SamplingParams, check_defaults
from nanoqwen.sampling.sampler import make_generator
from nanoqwen.scheduling.request import Request, Status
from nanoqwen.scheduling.scheduler import Row, Scheduler
from nanoqwen.scheduling.waiting_queue import Policy
from nanoqwen.stats import (
    Stats,
    kv_cache_group,
    memory_group,
    prefix_cache_group,
    scheduling_groups,
    state_pool_group,
)
from nanoqwen.text.tokenizer import IncrementalDetokenizer, Tokenizer
from nanoqwen.weights.checkpoint import open_checkpoint

Prompt = str | list[int]
# How an embedding request is run: its one "sampled" token is never kept.
EMBEDDING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


class PromptTooLong(ValueError):
    """A prompt that cannot fit: the context, or the whole KV cache (a server answers it with
    OpenAI's `context_length_exceeded` code, which clients read to trim a conversation)."""


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt's token ids, already checked by `LLMEngine.encode_prompt` to fit the engine."""

    token_ids: list[int]


class StepHook(Protocol):
    """A feature that changes what a step computes (speculative decoding): it may append
    tokens of its own to rows before they are laid out (the runner then samples them too),
    and must settle them once the step's tokens are chosen, before they are appended."""

    def attach(self, engine: LLMEngine, partners: list[Any]) -> None: ...
    def before_layout(self, rows: list[Row]) -> None: ...
    def after_forward(self, sampled: list[Request], new_tokens: list[list[int]]) -> None: ...
    def discard(self, rows: list[Row]) -> None: ...
    def stats_group(self) -> Stats: ...


class LLMEngine:
    def __init__(self, model: str, **options: Any) -> None:
        self.config = config = EngineConfig(model=model, **options)
        self.checkpoint = checkpoint = open_checkpoint(model)
        self.model_config = checkpoint.model_config
        self.tokenizer = Tokenizer(checkpoint.path)
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.model_config)
        # What a request's left-out sampling settings become: the one place they are set.
        self.sampling_defaults = (
            self.tokenizer.sampling_defaults if config.generation_config == "auto" else {}
        )
        check_defaults(self.sampling_defaults)
        settings = config.runner_settings(self.max_model_len)
        self.step_hooks: list[StepHook] = []
        partners, max_proposed = [], 0  # runners beside the model's, and their extra tokens
        if config.speculative is not None:
            from nanoqwen.speculative.proposers import Speculation

            speculation = Speculation(config, checkpoint, self.tokenizer)
            self.step_hooks.append(speculation)
            partners, max_proposed = speculation.checkpoints, speculation.max_proposed
        self.workers = None  # rank 0's handle on the other ranks of a split model
        if config.tensor_parallel_size > 1:
            from nanoqwen.parallel.launch import start_split_model

            self.runner, self.workers = start_split_model(config, checkpoint, settings, max_proposed)
        else:
            self.runner, *partners = start_runners([checkpoint, *partners], settings,
                                                   max_proposed=max_proposed)
        self.device = self.runner.device  # exact (cuda:N): seeded generators are made on it
        self.allocator = PageAllocator(self.runner.kv_cache.num_pages, config.page_size)
        self.cache = RadixCache(self.allocator) if config.enable_prefix_cache else None
        self.states = None  # the state pool's slots, for a model with recurrent layers
        if self.runner.states is not None:
            from nanoqwen.memory.state_pool import StateSlots

            self.states = StateSlots(self.runner.states.num_slots, config.page_size)
        policy, scheduler = Policy(config.scheduling_policy, config.priority_aging_steps), Scheduler
        if not config.plain_scheduling:  # another policy, per-user caps, or swapping
            from nanoqwen.scheduling.policies import scheduling_features

            policy, scheduler = scheduling_features(config, self.cache, self.runner, self.states)
        self.scheduler = scheduler(
            self.allocator, self.cache, config.max_num_seqs, config.chunk_size, policy, self.states
        )
        for hook in self.step_hooks:
            hook.attach(self, partners)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_finished = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: Prompt | EncodedPrompt,
        params: Any = None,
        request_id: str | None = None,
        priority: int = 0,
        deadline: float | None = None,
        user: str | None = None,
    ) -> str:
        """Queue a prompt; returns its id. Scheduling (`scheduling/`): `priority`, lower sooner;
        `deadline`, seconds from now it should be done by; `user`, who sent it.

        `params` are `SamplingParams` (settings left out take the model's recommended ones,
        `sampling_defaults`), or `PoolingParams` for the prompt's embedding instead of a
        continuation. Bad input raises a `ValueError` naming what is wrong; nothing is queued.
        """
        pooling = None
        if params is not None and not isinstance(params, SamplingParams):
            if self.workers is not None:
                raise ValueError("embeddings need one rank: the model is split across several")
            from nanoqwen.sampling.extras import plug_in_pooling

            pooling, params = plug_in_pooling(params, self.runner.output_hooks), EMBEDDING_SAMPLING
        params = (params or SamplingParams()).with_defaults(self.sampling_defaults)
        self.scheduler.policy.check(priority, deadline, user)
        if not isinstance(prompt, EncodedPrompt):
            prompt = self.encode_prompt(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id, prompt.token_ids, params,
            generator=make_generator(params.seed, self.device) if params.seed is not None else None,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt.token_ids, params.stop),
            priority=priority, user=user, pooling=pooling,
            due=None if deadline is None else time.monotonic() + deadline,
        )
        if params.asks_for_more:
            from nanoqwen.sampling.extras import plug_in

            plug_in(request, self)
        self.requests[request_id] = request
        self.scheduler.add(request)
        self.num_prompt_tokens += len(prompt.token_ids)
        return request_id

    def encode_prompt(self, prompt: Prompt) -> EncodedPrompt:
        """A prompt's token ids, checked to fit this engine, or a ValueError saying why not.

        Safe to call from any thread (it reads nothing that changes), so a server tokenizes
        on its handler threads and hands `add_request` prompts it need not check again.
        """
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                "(leave room for at least one generated token)"
            )
        pages = self.allocator
        if -(-(len(ids) + 1) // pages.page_size) > pages.num_usable_pages:
            raise PromptTooLong(
                f"prompt has {len(ids)} tokens but the KV cache holds only "
                f"{pages.num_usable_pages * pages.page_size}"
            )
        return EncodedPrompt(ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its final output, or None if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return an output for every request that moved."""
        schedule = self.scheduler.schedule()
        outputs = [self._finish(request, "length") for request in schedule.out_of_memory]
        rows = schedule.rows
        if not rows:
            return outputs
        try:
            for hook in self.step_hooks:
                hook.before_layout(rows)
            new_tokens = self.runner.run(rows)
        except Exception as error:
            for hook in self.step_hooks:
                hook.discard(rows)
            raise StepError([row.request.request_id for row in rows], outputs) from error
        self.scheduler.advance(rows)
        sampled = [row.request for row in rows if row.num_sampled]
        for hook in self.step_hooks:
            hook.after_forward(sampled, new_tokens)
        return outputs + [self._append_tokens(r, tokens) for r, tokens in zip(sampled, new_tokens)]

    def _append_tokens(self, request: Request, token_ids: list[int]) -> RequestOutput:
        """Append tokens one at a time; the first that ends the request drops the rest."""
        if request.pooling is not None:  # its prompt is computed: the embedding is ready
            return self._finish(request, "stop")
        if request.error is not None:  # a feature cannot go on with it: its token is moot
            return self._finish(request, "error")
        delta = ""
        for count, token_id in enumerate(token_ids, start=1):
            request.token_ids.append(token_id)
            self.num_generated_tokens += 1
            delta += request.detokenizer.add_token(token_id)
            reason = self._stop_reason(request, token_id)
            if reason is not None:
                return self._finish(request, reason, delta, token_ids[:count])
        return self._output(request, delta, list(token_ids))

    def _stop_reason(self, request: Request, token_id: int) -> str | None:
        params = request.params
        if not params.ignore_eos and token_id in self.tokenizer.eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids or request.detokenizer.stopped:
            return "stop"
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(
        self, request: Request, reason: str, delta: str = "", new_token_ids: list[int] | None = None
    ) -> RequestOutput:
        if request.status is not Status.FINISHED:
            self.scheduler.finish(request, reason)
        else:  # the scheduler finished it already (out of memory)
            request.finish_reason = reason
        delta += request.detokenizer.flush()
        del self.requests[request.request_id]
        self.num_finished[reason] += 1
        output = self._output(request, delta, new_token_ids or [])
        if reason == "stop" and request.num_output_tokens:  # a stop string, else the last token
            output.stop_reason = request.detokenizer.stop_reason or request.output_token_ids[-1]
        return output

    def progress(self, request_id: str) -> RequestOutput:
        """An unfinished request's output so far, with nothing new in its deltas."""
        return self._output(self.requests[request_id], "", [])

    def _output(self, request: Request, delta: str, new_token_ids: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.token_ids[len(request.prompt_token_ids) :],  # generated so far
            text=request.detokenizer.text,
            delta_token_ids=new_token_ids,
            delta_text=delta,
            finished=request.status is Status.FINISHED,
            finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens or 0,
            logprobs=None if request.logprobs is None else list(request.logprobs),
            prompt_logprobs=(
                None if request.prompt_logprobs is None else [None, *request.prompt_logprobs]
            ),
            embedding=None if request.embedding is None else request.embedding.tolist(),
            error=request.error,
        )

    # ----------------------------------------------------------------- introspection
    def stats(self) -> Stats:
        """The engine's figures by group: `kv_cache`, `requests`, `tokens`, and one group
        per optional feature that is on (every key is described in `nanoqwen/stats.py`)."""
        stats = {
            "kv_cache": kv_cache_group(self.allocator, self.runner.kv_cache.nbytes * self.num_ranks),
            **scheduling_groups(self.scheduler, self.num_finished),
            "tokens": {"prompt": self.num_prompt_tokens, "generated": self.num_generated_tokens},
            **prefix_cache_group(self.cache),
            **state_pool_group(self.states),
            **self.runner.cpu_threads.stats_group(),
            **memory_group(self.runner, self.allocator, self.num_ranks),
        }
        for hook in self.step_hooks:
            stats.update(hook.stats_group())
        return stats

    @property
    def num_ranks(self) -> int:
        return self.config.tensor_parallel_size

    def reset_prefix_cache(self) -> int:
        """Drop every cached page no request uses (and every state snapshot); return how
        many pages were freed."""
        if self.states is not None:
            self.states.reset()
        return self.cache.reset() if self.cache else 0

    def shutdown(self) -> None:
        """Stop the other ranks of a split model, if any (idempotent)."""
        if self.workers is not None:
            self.workers.shutdown()
