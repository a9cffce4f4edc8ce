"""The engine: the loop that ties tokenizer, scheduler, runner, sampler and cache together.

`LLMEngine` is the online interface a server drives. `add_request` validates and queues a
prompt; each `step()` asks the scheduler for a batch, runs it through the model and the
sampler, appends each sampled token to its request, checks the stop conditions (EOS,
stop token ids, stop strings, `max_tokens`, `max_model_len`), and returns one
`RequestOutput` per request that made progress: the new text (`delta_text`, safe to
stream) plus everything so far. Finished requests release their pages, leaving their
full pages to the prefix cache so a follow-up turn can reuse them.

`LLM` is the offline interface: `generate` queues many prompts and steps until all are
done, returning outputs in prompt order; `chat` renders conversations through the chat
template first; `stream` yields one request's deltas as they are produced.

Bad input fails in `add_request` with a `ValueError`, before anything is queued.

With `tensor_parallel_size=N` the engine also starts the N-1 other ranks that hold the
rest of the model (`distributed.py`); `shutdown()` (or leaving a `with LLM(...)` block,
or the program's exit) stops them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from nanoqwen.batch import ScheduledBatch
from nanoqwen.config import EngineConfig, ModelConfig, resolve_max_model_len
from nanoqwen.distributed import Workers, launch, starting
from nanoqwen.loader import check_splittable, resolve_model_path
from nanoqwen.parallel import SINGLE, check_tensor_parallel
from nanoqwen.radix_cache import RadixCache
from nanoqwen.request import Request, Status
from nanoqwen.runner import ModelRunner
from nanoqwen.sampler import SamplingParams, make_generator
from nanoqwen.scheduler import Scheduler
from nanoqwen.tokenizer import IncrementalDetokenizer, Tokenizer

Prompt = str | list[int]
Message = dict[str, str]
# The phases of a step, in order, as `instrument` names them.
STEP_PHASES = ("schedule", "prepare", "forward", "sample", "postprocess")
PhaseWrapper = Callable[[str, Callable[..., Any]], Callable[..., Any]]


@dataclass
class RequestOutput:
    """A request's progress after a step; the last one has `finished=True`."""

    request_id: str
    prompt_token_ids: list[int]  # shared with the engine: read, don't modify
    token_ids: list[int]  # every token generated so far
    text: str  # every released character so far (stop strings excluded)
    delta_token_ids: list[int]  # generated this step
    delta_text: str  # released this step: what a stream sends
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache (0 until admitted)


class StepError(RuntimeError):
    """A step failed after its batch was scheduled (a bug, or a failing device).

    The batch's requests are still in the engine, untouched by the failed step: the caller
    decides their fate (a server aborts them and answers 500, then keeps serving). Requests
    the same step had already finished (the scheduler's out-of-memory ones) are in
    `finished`, with their final outputs. The original exception is the `__cause__`.
    """

    def __init__(self, request_ids: list[str], finished: list[RequestOutput]) -> None:
        super().__init__(f"the engine step failed for requests {', '.join(request_ids)}")
        self.request_ids = request_ids
        self.finished = finished


class LLMEngine:
    def __init__(self, model: str, **options: Any) -> None:
        self.config = EngineConfig(model=model, **options)
        checkpoint = resolve_model_path(model)
        self.model_config = ModelConfig.from_pretrained(checkpoint)
        self.tokenizer = Tokenizer(checkpoint)
        self.max_model_len = resolve_max_model_len(self.config, self.model_config)
        runner_args = (self.model_config, checkpoint, self.max_model_len)
        tp, rank_config = SINGLE, self.config
        self.workers: Workers | None = None
        if self.config.tensor_parallel_size > 1:
            check_tensor_parallel(self.model_config, self.config.tensor_parallel_size)
            check_splittable(checkpoint, self.model_config, self.config.quantization)
            # Under torchrun, only rank 0 returns from here.
            tp, rank_config, self.workers = launch(self.config, ModelRunner, runner_args)
        with starting(self.workers):  # if rank 0 fails to start, the other ranks go too
            self.runner = ModelRunner(rank_config, *runner_args, tp=tp, workers=self.workers)
        self.device = self.runner.device  # exact (cuda:N): seeded generators are made on it
        self.pool = self.runner.pool
        self.cache = RadixCache(self.pool) if self.config.enable_prefix_cache else None
        self.scheduler = Scheduler(
            self.pool, self.cache, self.config.max_num_seqs, self.config.chunk_size
        )
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_finished = {"stop": 0, "length": 0, "abort": 0}
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt_ids = self.encode_prompt(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id,
            prompt_ids,
            params,
            generator=make_generator(params.seed, self.device) if params.seed is not None else None,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop_strings),
        )
        self.requests[request_id] = request
        self.scheduler.add(request)
        self.num_prompt_tokens += len(prompt_ids)
        return request_id

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, or a ValueError saying why it can't be served."""
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
        return ids

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
            sampled = self.runner.run(batch)
        except Exception as error:
            failed = [request.request_id for request in batch.requests]
            raise StepError(failed, outputs) from error
        return outputs + self._postprocess(batch, sampled)

    def _postprocess(
        self, batch: ScheduledBatch, sampled: list[tuple[Request, int]]
    ) -> list[RequestOutput]:
        """Record the step's K/V as computed, then append each sampled token and stop."""
        self.scheduler.advance(batch)
        return [self._append_token(request, token_id) for request, token_id in sampled]

    def _append_token(self, request: Request, token_id: int) -> RequestOutput:
        request.token_ids.append(token_id)
        self.num_generated_tokens += 1
        delta = request.detokenizer.add_token(token_id)
        reason = self._stop_reason(request, token_id)
        if reason is not None:
            return self._finish(request, reason, delta, [token_id])
        return self._output(request, delta, [token_id])

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
        )

    def instrument(self, wrap: PhaseWrapper) -> None:
        """Route every phase of `step()` through `wrap(phase, function)`, which returns the
        function to call instead: how a benchmark times the phases (`STEP_PHASES`) without
        the engine keeping clocks of its own."""
        runner = self.runner
        self.scheduler.schedule = wrap("schedule", self.scheduler.schedule)
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
            "kv_cache_bytes": pool.kv.nbytes * self.config.tensor_parallel_size,  # every rank's
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "prefix_query_tokens": query,
            "prefix_hit_tokens": hits,
            "prefix_hit_rate": hits / query if query else 0.0,
            "evicted_pages": cache.evicted_pages if cache else 0,
            "preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens,
            "generated_tokens": self.num_generated_tokens,
            "finished": dict(self.num_finished),
        }

    def reset_prefix_cache(self) -> int:
        return self.cache.reset() if self.cache else 0

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (idempotent)."""
        if self.workers is not None:
            self.workers.shutdown()


class LLM:
    """Offline batch inference: `LLM(model).generate(prompts, params)`."""

    def __init__(self, model: str, **options: Any) -> None:
        self.engine = LLMEngine(model, **options)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        params_list = _as_params_list(params, len(_as_prompt_list(prompts)))
        # Tokenize and validate everything before queueing anything.
        prompt_ids = [self.engine.encode_prompt(p) for p in _as_prompt_list(prompts)]
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompt_ids, params_list)]
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(ids):
                for output in self.engine.step():
                    if output.finished:
                        final[output.request_id] = output
        finally:
            for request_id in ids:
                if request_id not in final:
                    self.engine.abort(request_id)
        return [final[request_id] for request_id in ids]

    def chat(
        self,
        conversations: list[Message] | Sequence[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        enable_thinking: bool | None = None,
    ) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # one conversation
        prompts = [self.chat_prompt(c, enable_thinking) for c in conversations]
        return self.generate(prompts, params)

    def chat_prompt(self, messages: list[Message], enable_thinking: bool | None = None) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, enable_thinking=enable_thinking)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield this request's output after every engine step; closing the generator
        aborts it.

        A step that gave the request no token (its prompt is still being prefilled, chunk
        by chunk, or it is waiting for room) yields its unchanged progress, with empty
        deltas: a long prompt then still hands control back every step, so a caller can
        give up on it without waiting for the first token.
        """
        request_id = self.engine.add_request(prompt, params)
        finished = False
        try:
            while not finished:
                moved = {output.request_id: output for output in self.engine.step()}
                output = moved.get(request_id) or self.engine.progress(request_id)
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.engine.abort(request_id)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    return list(prompts)


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
