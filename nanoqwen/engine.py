"""The engine: the loop that ties tokenizer, scheduler, runner, sampler and cache together.

`LLMEngine` is the online interface a server drives. `add_request` validates and queues a
prompt; each `step()` asks the scheduler for a batch, runs it through the model and the
sampler, appends each sampled token to its request (with speculative decoding, a step's
accepted tokens one at a time: `speculative.py`), checks the stop conditions (EOS,
stop token ids, stop strings, `max_tokens`, `max_model_len`), and returns one
`RequestOutput` per request that made progress: the new text (`delta_text`, safe to
stream) plus everything so far. Finished requests release their pages, leaving their
full pages to the prefix cache so a follow-up turn can reuse them.

The offline interface built on it, `LLM` (generate, chat, stream), is in `llm.py`.

Bad input fails in `add_request` with a `ValueError`, before anything is queued.

A request may ask for a prompt's embedding instead of a continuation (`PoolingParams`,
`pooling.py`): it is scheduled like the others and finishes once its prompt is computed.
A structured-output request gets its grammar compiled (`grammar.py`; `self.grammars`, which
a server calls first on its own threads, keeps compiled grammars for reuse).

With `tensor_parallel_size=N` the engine also starts the N-1 other ranks that hold the
rest of the model (`distributed.py`); `shutdown()` (or leaving a `with LLM(...)` block,
or the program's exit) stops them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanoqwen.config import EngineConfig
from nanoqwen.memory.radix_cache import RadixCache
from nanoqwen.model.config import resolve_max_model_len
from nanoqwen.outputs import RequestOutput, StepError
from nanoqwen.parallel.sharding import SINGLE, check_tensor_parallel
from nanoqwen.parallel.workers import Workers, launch, starting
from nanoqwen.runner.runner import ModelRunner
from nanoqwen.sampling.grammar import GrammarCompiler
from nanoqwen.sampling.params import SamplingParams
from nanoqwen.sampling.pooling import PoolingParams
from nanoqwen.sampling.sampler import make_generator
from nanoqwen.scheduling.batch import ScheduledBatch
from nanoqwen.scheduling.request import Request, Status
from nanoqwen.scheduling.scheduler import Scheduler
from nanoqwen.scheduling.waiting_queue import check_priority
from nanoqwen.speculative.proposers import make_proposer, resolve_draft_model
from nanoqwen.text.detokenizer import IncrementalDetokenizer
from nanoqwen.text.tokenizer import Tokenizer
from nanoqwen.weights.checkpoint import open_checkpoint
from nanoqwen.weights.loader import check_splittable

Prompt = str | list[int]
# How an embedding request is run: its one "sampled" token is never kept (and with room
# for one token only, its row carries no draft tokens either).
EMBEDDING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt's token ids, already checked by `LLMEngine.encode_prompt` to fit the engine."""

    token_ids: list[int]
# The phases of a step, in order, as `instrument` names them.
STEP_PHASES = ("schedule", "propose", "prepare", "forward", "sample", "postprocess")
PhaseWrapper = Callable[[str, Callable[..., Any]], Callable[..., Any]]


class LLMEngine:
    def __init__(self, model: str, **options: Any) -> None:
        self.config = EngineConfig(model=model, **options)
        self.checkpoint = checkpoint = open_checkpoint(model)
        self.model_config = checkpoint.model_config
        self.tokenizer = Tokenizer(checkpoint.path)
        self.max_model_len = resolve_max_model_len(self.config.max_model_len, self.model_config)
        # What a request's left-out sampling settings become: the one place they are set.
        self.sampling_defaults = (
            self.tokenizer.sampling_defaults if self.config.generation_config == "auto" else {}
        )
        runner_args = (checkpoint, self.max_model_len)
        tp, rank_config = SINGLE, self.config
        self.workers: Workers | None = None
        if self.config.tensor_parallel_size > 1:
            check_tensor_parallel(self.model_config, self.config.tensor_parallel_size)
            check_splittable(checkpoint, self.config.quantization)
            # Under torchrun, only rank 0 returns from here.
            tp, rank_config, self.workers = launch(self.config, ModelRunner, runner_args)
        draft = resolve_draft_model(self.config, self.tokenizer)
        with starting(self.workers):  # if rank 0 fails to start, the other ranks go too
            self.runner = ModelRunner(
                rank_config, *runner_args, tp=tp, workers=self.workers,
                draft_model_config=draft.model_config if draft else None,
            )
        self.device = self.runner.device  # exact (cuda:N): seeded generators are made on it
        self.pool = self.runner.pool
        self.cache = RadixCache(self.pool) if self.config.enable_prefix_cache else None
        self.scheduler = Scheduler(self.pool, self.cache, self.config)
        self.proposer = make_proposer(self.config, self.scheduler, self.runner, draft)
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
            if self.config.tensor_parallel_size > 1:
                raise ValueError("embeddings need tensor_parallel_size=1")
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
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                "(leave room for at least one generated token)"
            )
        pages_needed = -(-(len(ids) + 1) // self.pool.page_size)
        if pages_needed > self.pool.num_usable_pages:
            raise ValueError(
                f"prompt has {len(ids)} tokens but the KV pool holds only "
                f"{self.pool.num_usable_pages * self.pool.page_size}"
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
        batch = schedule.batch
        if not batch:
            return outputs
        try:
            self.proposer.propose(batch)  # draft tokens, with speculative decoding
            sampled = self.runner.run(batch)
        except Exception as error:
            self.proposer.discard(batch)
            failed = [request.request_id for request in batch.requests]
            raise StepError(failed, outputs) from error
        return outputs + self._postprocess(batch, sampled)

    def _postprocess(
        self, batch: ScheduledBatch, sampled: list[tuple[Request, list[int]]]
    ) -> list[RequestOutput]:
        """Record the step's K/V as computed, then append each request's new tokens and stop."""
        self.scheduler.advance(batch)
        outputs = [self._append_tokens(request, token_ids) for request, token_ids in sampled]
        self.proposer.settle(sampled)  # keeps accepted drafts' K/V, rolls back the rest
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

    def instrument(self, wrap: PhaseWrapper) -> None:
        """Route every phase of `step()` through `wrap(phase, function)`, which returns the
        function to call instead: how a benchmark times the phases (`STEP_PHASES`) without
        the engine keeping clocks of its own."""
        runner = self.runner
        self.scheduler.schedule = wrap("schedule", self.scheduler.schedule)
        self.proposer.propose = wrap("propose", self.proposer.propose)
        runner.prepare = wrap("prepare", runner.prepare)
        runner.forward = wrap("forward", runner.forward)
        runner.sample = wrap("sample", runner.sample)
        self._postprocess = wrap("postprocess", self._postprocess)

    # ----------------------------------------------------------------- introspection
    def stats(self) -> dict[str, Any]:
        pool = self.pool
        cached = pool.num_cache_only_pages
        free = pool.num_free_pages
        cache = self.cache
        query = cache.query_tokens if cache else 0
        hits = cache.hit_tokens if cache else 0
        return {
            "pages_total": pool.num_usable_pages,
            "pages_free": free,
            "pages_cached": cached,
            "pages_used": pool.num_usable_pages - free - cached,
            "page_size": pool.page_size,
            "kv_cache_bytes": pool.nbytes * self.config.tensor_parallel_size,  # every rank's
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "prefix_query_tokens": query,
            "prefix_hit_tokens": hits,
            "prefix_hit_rate": hits / query if query else 0.0,
            "evicted_pages": cache.evicted_pages if cache else 0,
            "preemptions": sum(self.scheduler.preemptions.values()),
            "preemptions_by_cause": dict(self.scheduler.preemptions),
            "prompt_tokens": self.num_prompt_tokens,
            "generated_tokens": self.num_generated_tokens,
            "finished": dict(self.num_finished),
            **self.proposer.stats.as_dict(),
        }

    def reset_prefix_cache(self) -> int:
        return self.cache.reset() if self.cache else 0

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (idempotent)."""
        if self.workers is not None:
            self.workers.shutdown()
