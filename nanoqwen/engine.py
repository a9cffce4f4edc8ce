"""The engine: the loop that ties tokenizer, scheduler, runner, sampler and cache together.

`LLMEngine` is the online interface a server drives. `add_request` checks and queues a
prompt (bad input is a `ValueError`, and nothing is queued); each `step()` reads like the
pipeline it is:

    schedule → propose → prepare → forward → sample → postprocess

and returns one `RequestOutput` per request that moved: its new text (`delta_text`, safe to
stream) and everything so far. The engine appends a step's tokens one at a time through
the stop checks (EOS, stop ids and strings, `max_tokens`, `max_model_len`); finished
requests release their pages, leaving their full pages to the prefix cache. Embedding
requests (`sampling/pooling.py`) and structured outputs (`sampling/grammar.py`, grammars
compiled once in `self.grammars`) ride the same steps.

Start-up builds the pieces in dependency order: checkpoint and tokenizer, the other ranks
of a split model, the runners, then the KV cache sized from what they measure
(`plan_kv_pages`), with the page allocator, prefix cache and scheduler over it.

Invariant: every request is waiting, running or finished, in exactly one place; a step
that fails after scheduling raises `StepError` and leaves its requests as they were.
`LLM` (`llm.py`) is the offline interface on top; a benchmark times phases through
`observe`. The story: docs/learn/02-continuous-batching.md.
"""

from __future__ import annotations

import itertools
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from nanoqwen.config import EngineConfig
from nanoqwen.memory.page_allocator import PageAllocator
from nanoqwen.memory.radix_cache import RadixCache
from nanoqwen.memory.sizing import KVBudget, WorstStep
from nanoqwen.model.config import resolve_max_model_len
from nanoqwen.outputs import RequestOutput, StepError
from nanoqwen.parallel.launch import start_ranks
from nanoqwen.parallel.workers import Workers, starting
from nanoqwen.runner.runner import (
    ModelRunner,
    RunnerSettings,
    plan_kv_pages,
    start_runner,
)
from nanoqwen.runner.step_inputs import STEP_WIRE, StepInputs
from nanoqwen.sampling.grammar import GrammarCompiler
from nanoqwen.sampling.params import SamplingParams
from nanoqwen.sampling.pooling import PoolingParams
from nanoqwen.sampling.sampler import make_generator
from nanoqwen.scheduling.batch import ScheduledBatch
from nanoqwen.scheduling.request import Request, Status
from nanoqwen.scheduling.scheduler import Scheduler
from nanoqwen.scheduling.waiting_queue import check_priority
from nanoqwen.speculative.proposers import make_proposer
from nanoqwen.stats import Stats, kv_cache_group, memory_group, prefix_cache_group, requests_group
from nanoqwen.text.detokenizer import IncrementalDetokenizer
from nanoqwen.text.tokenizer import Tokenizer
from nanoqwen.weights.checkpoint import open_checkpoint

Prompt = str | list[int]
# How an embedding request is run: its one "sampled" token is never kept (and with room
# for one token only, its row carries no draft tokens either).
EMBEDDING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


class PromptTooLong(ValueError):
    """A prompt that cannot fit: the context, or the whole KV cache (a server answers it with
    OpenAI's `context_length_exceeded` code, which clients read to trim a conversation)."""


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt's token ids, already checked by `LLMEngine.encode_prompt` to fit the engine."""

    token_ids: list[int]


# The phases of a step, in order, as an observer sees them.
STEP_PHASES = ("schedule", "propose", "prepare", "forward", "sample", "postprocess")


class StepObserver(Protocol):
    """Watches every step (a benchmark's clock, for one): each phase (`STEP_PHASES`) runs
    inside `phase(name)`, and `laid_out` sees what the step computes once it is laid out."""

    def phase(self, name: str) -> AbstractContextManager[object]: ...

    def laid_out(self, batch: ScheduledBatch, inputs: StepInputs) -> None: ...


class Unobserved:
    def phase(self, name: str) -> AbstractContextManager[object]:
        return nullcontext()

    def laid_out(self, batch: ScheduledBatch, inputs: StepInputs) -> None:
        pass


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
        settings = runner_settings(config, self.max_model_len)
        budget = KVBudget(config.num_pages, config.kv_cache_memory, config.gpu_memory_utilization)
        self.proposer = make_proposer(config, self.tokenizer, settings, self.model_config.vocab_size)
        worst = WorstStep(
            config.max_num_seqs, config.chunk_size, self.max_model_len, self.proposer.max_proposed
        )
        # The other ranks of a split model, each starting a runner of its own. Under
        # torchrun, only rank 0 returns from here.
        self.ranks = start_ranks(
            config, checkpoint, STEP_WIRE, partial(start_runner, checkpoint, settings, budget, worst)
        )
        with starting(self.ranks.workers):  # if rank 0 fails to start, the other ranks go too
            self.runner = ModelRunner(checkpoint, settings, self.ranks, self.proposer.choose_tokens)
            runners = [self.runner, *self.proposer.runners]
            num_pages = plan_kv_pages(runners, budget, worst)
            for runner in runners:
                runner.allocate_kv_cache(num_pages)
        self.device = self.runner.device  # exact (cuda:N): seeded generators are made on it
        self.allocator = PageAllocator(num_pages, config.page_size)
        self.cache = RadixCache(self.allocator) if config.enable_prefix_cache else None
        self.scheduler = Scheduler(
            self.allocator, self.cache, config.max_num_seqs, config.chunk_size,
            config.scheduling_policy, config.priority_aging_steps,
        )
        self.observer: StepObserver = Unobserved()
        self.grammars = GrammarCompiler(
            self.tokenizer.hf_tokenizer, self.model_config.vocab_size, self.tokenizer.eos_token_ids
        )
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_finished = {"stop": 0, "length": 0, "abort": 0}
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: Prompt | EncodedPrompt,
        params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a prompt; returns its id. A lower `priority` is served sooner.

        Settings `params` leaves out take the model's recommended ones (`sampling_defaults`);
        `PoolingParams` ask for the prompt's embedding instead of a continuation.
        Bad input raises a `ValueError` naming what is wrong, and nothing is queued.
        """
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None:
            if self.workers is not None:
                raise ValueError("embeddings need one rank: the model is split across several")
            params = EMBEDDING_SAMPLING
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params = params.with_defaults(self.sampling_defaults)
        params.check_token_ids(self.model_config.vocab_size)
        spec = params.structured_output
        grammar = self.grammars.matcher(spec) if spec is not None else None
        check_priority(priority, self.config.scheduling_policy)
        if not isinstance(prompt, EncodedPrompt):
            prompt = self.encode_prompt(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = prompt.token_ids
        request = Request(
            request_id,
            prompt_ids,
            params,
            generator=make_generator(params.seed, self.device) if params.seed is not None else None,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop_strings),
            priority=priority,
            grammar=grammar,
            pooling=pooling,
        )
        self.requests[request_id] = request
        self.scheduler.add(request)
        self.num_prompt_tokens += len(prompt_ids)
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
        phase = self.observer.phase
        with phase("schedule"):
            schedule = self.scheduler.schedule()
        outputs = [self._finish(request, "length") for request in schedule.out_of_memory]
        batch = schedule.batch
        if not batch:
            return outputs
        try:
            with phase("propose"):
                self.proposer.propose(batch, self.scheduler)
            with phase("prepare"):
                inputs = self.runner.prepare(batch)
                self.observer.laid_out(batch, inputs)
            with phase("forward"):
                logits = self.runner.forward(inputs)
            with phase("sample"):
                sampled = self.runner.sample(logits, inputs)
        except Exception as error:
            self.proposer.discard(batch)
            failed = [request.request_id for request in batch.requests]
            raise StepError(failed, outputs) from error
        with phase("postprocess"):
            return outputs + self._postprocess(batch, sampled)

    def _postprocess(
        self, batch: ScheduledBatch, sampled: list[tuple[Request, list[int]]]
    ) -> list[RequestOutput]:
        """Record the step's K/V as computed, then append each request's new tokens and stop."""
        self.scheduler.advance(batch)
        outputs = [self._append_tokens(request, token_ids) for request, token_ids in sampled]
        self.proposer.settle(sampled, self.scheduler)  # keeps accepted K/V, rolls back the rest
        return outputs

    def _append_tokens(self, request: Request, token_ids: list[int]) -> RequestOutput:
        """Append tokens one at a time; the first that ends the request drops the rest."""
        if request.pooling is not None:  # its prompt is computed: the embedding is ready
            return self._finish(request, "stop")
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
        return self._output(request, delta, new_token_ids or [])

    def progress(self, request_id: str) -> RequestOutput:
        """An unfinished request's output so far, with nothing new in its deltas."""
        return self._output(self.requests[request_id], "", [])

    def _output(self, request: Request, delta: str, new_token_ids: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids,
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
        )

    def observe(self, observer: StepObserver) -> None:
        """Have `observer` watch the phases of every later step (`STEP_PHASES`)."""
        self.observer = observer

    # ----------------------------------------------------------------- introspection
    def stats(self) -> Stats:
        """The engine's figures by group: `kv_cache`, `requests`, `tokens`, and one group
        per optional feature that is on (every key is described in `nanoqwen/stats.py`)."""
        return {
            "kv_cache": kv_cache_group(self.allocator, self.runner.kv_cache_bytes),
            "requests": requests_group(self.scheduler, self.num_finished),
            "tokens": {"prompt": self.num_prompt_tokens, "generated": self.num_generated_tokens},
            **prefix_cache_group(self.cache),
            **self.proposer.stats_group(),
            **self.runner.cpu_threads.stats_group(),
            **memory_group(self.runner, self.allocator),
        }

    def reset_prefix_cache(self) -> int:
        return self.cache.reset() if self.cache else 0

    @property
    def workers(self) -> Workers | None:
        """The handle on the other ranks of a split model (None with one rank)."""
        return self.ranks.workers

    def shutdown(self) -> None:
        """Stop the other ranks of a split model, if any (idempotent)."""
        if self.workers is not None:
            self.workers.shutdown()


def runner_settings(config: EngineConfig, max_model_len: int) -> RunnerSettings:
    """The engine settings a runner uses."""
    return RunnerSettings(
        device=config.device, dtype=config.dtype, page_size=config.page_size,
        max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
        kv_storage_dtype=config.kv_storage_dtype, quantization=config.quantization,
        attention_backend=config.attention_backend, decode_buckets=config.decode_buckets,
        enforce_eager=config.enforce_eager,
    )
