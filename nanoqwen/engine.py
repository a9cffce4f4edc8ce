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
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from nanoqwen.attention import attention_backend_class
from nanoqwen.config import EngineConfig, ModelConfig
from nanoqwen.cuda_graph import DecodeGraphRunner, decode_buckets
from nanoqwen.kv_pool import KVPool
from nanoqwen.loader import load_model, resolve_model_path
from nanoqwen.radix_cache import RadixCache
from nanoqwen.runner import ModelRunner, peak_step_memory
from nanoqwen.sampler import Sampler, SamplingParams, make_generator
from nanoqwen.scheduler import Request, Scheduler, Status
from nanoqwen.tokenizer import IncrementalDetokenizer, Tokenizer

Prompt = str | list[int]
Message = dict[str, str]
CPU_KV_CACHE_BYTES = 2 << 30


@dataclass
class RequestOutput:
    """A request's progress after a step; the final one has `finished=True`."""

    request_id: str
    text: str  # every released character so far (stop strings excluded)
    delta_token_ids: list[int]  # generated this step
    delta_text: str  # released this step: what a stream sends
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    # Token lists are sliced from the request only when read: copying them for every
    # request on every step would cost more than the rest of the bookkeeping.
    _request: Request = field(repr=False)
    _num_tokens: int = field(repr=False)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._request.prompt_token_ids

    @property
    def token_ids(self) -> list[int]:
        """Every token generated up to this output."""
        return self._request.token_ids[self._request.num_prompt_tokens : self._num_tokens]


@dataclass(eq=False)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer


class StepError(RuntimeError):
    """A step failed after its batch was scheduled (a bug, or a failing device).

    The batch's requests are still in the engine, untouched by the failed step: the caller
    decides their fate (a server aborts them and answers 500, then keeps serving). The
    original exception is the `__cause__`.
    """

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"the engine step failed for requests {', '.join(request_ids)}")
        self.request_ids = request_ids


class PhaseTimer:
    """Wall time spent in each phase of `step()`, summed over steps (for the benchmark).

    On CUDA the forward pass only launches kernels; the wait for them lands in "sample",
    where the chosen ids are copied to the host.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.steps = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def reset(self) -> None:
        self.seconds, self.steps = {}, 0


class LLMEngine:
    def __init__(self, model: str, **options: Any) -> None:
        self.config = EngineConfig(model=model, **options)
        model_dir = resolve_model_path(model)
        self.model_config = ModelConfig.from_pretrained(model_dir)
        self.tokenizer = Tokenizer(model_dir)
        self.device: torch.device = self.config.device
        self.max_model_len = self._max_model_len()
        self.model = load_model(model_dir, self.model_config, self.config.dtype, self.device)
        cfg = self.model_config
        # Chosen before the pool: on CUDA, sizing the pool runs the model through them.
        self.attention_class = attention_backend_class(self.device, cfg.head_dim, self.config.dtype)
        self.decode_buckets = decode_buckets(self.config, cfg, self.attention_class)
        self.pool = self._make_pool()
        self.cache = RadixCache(self.pool) if self.config.enable_prefix_cache else None
        self.scheduler = Scheduler(
            self.pool, self.cache, self.config.max_num_seqs, self.config.chunk_size
        )
        backend = self.attention_class(self.pool, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        graphs = (
            DecodeGraphRunner(self.model, backend, self.decode_buckets, self.max_model_len)
            if self.decode_buckets
            else None
        )
        self.runner = ModelRunner(
            self.model, backend, Sampler(), self.pool.page_size, self.device, graphs
        )
        self.requests: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self.num_finished = {"stop": 0, "length": 0, "abort": 0}
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.timer = PhaseTimer()

    # ----------------------------------------------------------------- set-up
    def _max_model_len(self) -> int:
        trained = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is None:
            return trained
        if wanted > trained and self.model_config.rope_type == "default":
            raise ValueError(
                f"max_model_len={wanted} exceeds the model's max_position_embeddings={trained}"
            )
        return wanted

    def _make_pool(self) -> KVPool:
        cfg, page_size = self.model_config, self.config.page_size
        page_bytes = KVPool.bytes_per_page(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size, self.config.dtype
        )
        num_pages = self.config.num_pages or self._pages_for_memory(page_bytes)
        return KVPool(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size, num_pages,
            self.config.dtype, self.device,
        )

    def _pages_for_memory(self, page_bytes: int) -> int:
        memory = self.config.kv_cache_memory
        if memory is not None and memory <= 1:
            if self.device.type != "cuda":
                raise ValueError("kv_cache_memory as a fraction of free memory needs CUDA")
            memory = memory * torch.cuda.mem_get_info(self.device)[0]
        if memory is None:
            memory = self._default_kv_memory()
        return max(2, int(memory // page_bytes) + 1)

    def _default_kv_memory(self) -> float:
        if self.device.type == "cuda":
            return self._cuda_kv_memory()
        # On the CPU: room for every sequence at full length, capped at a few GiB.
        page_bytes = KVPool.bytes_per_page(
            self.model_config.num_layers, self.model_config.num_kv_heads,
            self.model_config.head_dim, self.config.page_size, self.config.dtype,
        )
        pages_per_seq = -(-self.max_model_len // self.config.page_size)
        return min(CPU_KV_CACHE_BYTES, self.config.max_num_seqs * pages_per_seq * page_bytes)

    def _cuda_kv_memory(self) -> float:
        """`gpu_memory_utilization` of the GPU, less what everything but the KV pool needs.

        That is what is in use now (weights, the CUDA context), the peak of the biggest
        step (a full prefill chunk plus a decode token for every sequence, all sampled),
        and the graph pool, which holds the temporaries of the largest decode bucket for good.
        """
        config, page_size = self.config, self.config.page_size
        num_seqs = config.max_num_seqs
        activations = peak_step_memory(
            self.model, self.attention_class, page_size, config.chunk_size + num_seqs, num_seqs
        )
        if self.decode_buckets:
            largest = self.decode_buckets[-1]
            activations += peak_step_memory(
                self.model, self.attention_class, page_size, largest, largest
            )
        torch.cuda.empty_cache()  # so that `free` counts what the profiling runs left cached
        free, total = torch.cuda.mem_get_info(self.device)
        budget = config.gpu_memory_utilization * total - (total - free) - activations
        if budget <= 0:
            gib = 2**30
            raise ValueError(
                f"no GPU memory left for the KV cache: {(total - free) / gib:.1f} GiB in use and "
                f"{activations / gib:.1f} GiB for activations exceed gpu_memory_utilization="
                f"{config.gpu_memory_utilization} of {total / gib:.1f} GiB; lower max_num_seqs "
                "or chunk_size, or raise gpu_memory_utilization"
            )
        return budget

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
        generator = make_generator(params.seed, self.device) if params.seed is not None else None
        request = Request(
            request_id, list(prompt_ids), len(prompt_ids), params, generator=generator
        )
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop_strings)
        self.requests[request_id] = _Tracked(request, detokenizer)
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
        tracked = self.requests.get(request_id)
        if tracked is None:
            return None
        return self._finish(tracked, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return an output for every request that moved."""
        with self.timer.phase("schedule"):
            batch = self.scheduler.schedule()
            outputs = [
                self._finish(self.requests[r.request_id], "length")
                for r in self._drain_out_of_memory()
            ]
        if batch is None:
            return outputs
        try:
            with self.timer.phase("prepare"):
                inputs = self.runner.prepare(batch)
            with self.timer.phase("forward"):
                logits = self.runner.forward(inputs)
            with self.timer.phase("sample"):
                token_ids = self.runner.sample(logits, inputs)
        except Exception as error:
            raise StepError([r.request_id for r in batch.requests]) from error
        with self.timer.phase("postprocess"):
            self.scheduler.advance(batch)
            for request, token_id in zip(inputs.sampled_requests, token_ids):
                outputs.append(self._append_token(self.requests[request.request_id], token_id))
        self.timer.steps += 1
        return outputs

    def _drain_out_of_memory(self) -> list[Request]:
        finished, self.scheduler.finished_out_of_memory = self.scheduler.finished_out_of_memory, []
        return finished

    def _append_token(self, tracked: _Tracked, token_id: int) -> RequestOutput:
        request = tracked.request
        request.token_ids.append(token_id)
        self.num_generated_tokens += 1
        delta = tracked.detokenizer.add_token(token_id)
        reason = self._stop_reason(tracked, token_id)
        if reason is not None:
            return self._finish(tracked, reason, delta, [token_id])
        return self._output(tracked, delta, [token_id])

    def _stop_reason(self, tracked: _Tracked, token_id: int) -> str | None:
        request, params = tracked.request, tracked.request.params
        if not params.ignore_eos and token_id in self.tokenizer.eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids or tracked.detokenizer.stopped:
            return "stop"
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(
        self, tracked: _Tracked, reason: str, delta: str = "", new_token_ids: list[int] | None = None
    ) -> RequestOutput:
        request = tracked.request
        if request.status is not Status.FINISHED:
            self.scheduler.finish(request, reason)
        else:
            request.finish_reason = reason
        delta += tracked.detokenizer.flush()
        del self.requests[request.request_id]
        self.num_finished[reason] += 1
        return self._output(tracked, delta, new_token_ids or [])

    def progress(self, request_id: str) -> RequestOutput:
        """An unfinished request's output so far, with nothing new in its deltas."""
        return self._output(self.requests[request_id], "", [])

    def _output(self, tracked: _Tracked, delta: str, new_token_ids: list[int]) -> RequestOutput:
        request = tracked.request
        return RequestOutput(
            request_id=request.request_id,
            text=tracked.detokenizer.text,
            delta_token_ids=new_token_ids,
            delta_text=delta,
            finished=request.status is Status.FINISHED,
            finish_reason=request.finish_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            _request=request,
            _num_tokens=request.num_tokens,
        )

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
