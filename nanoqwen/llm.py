"""The offline interface: `LLM(model).generate(prompts, params)`, as in vLLM.

`LLMEngine` (`engine.py`) is driven one step at a time, which is what a server needs. A
script wants less: `generate` queues many prompts and steps the engine until all are done,
returning outputs in prompt order; `chat` renders conversations through the chat template
first; `stream` yields one request's deltas as they are produced. Bad input in a batch
queues nothing: the prompts queued before it are taken back.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from nanoqwen.engine import LLMEngine, Prompt
from nanoqwen.outputs import RequestOutput
from nanoqwen.sampling.params import SamplingParams
from nanoqwen.scheduling.waiting_queue import priority_list

Message = dict[str, str]


class LLM:
    """Offline batch inference: `LLM(model).generate(prompts, params)`."""

    def __init__(self, model: str, **options: Any) -> None:
        self.engine = LLMEngine(model, **options)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """`priority`: one per prompt, lower served sooner (`scheduling_policy="priority"`).

        Every prompt is queued or none is: one refused (a `ValueError`) takes back the
        ones queued before it.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompt_list))
        priorities = priority_list(priority, len(prompt_list))
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:
            for prompt, sampling, rank in zip(prompt_list, params_list, priorities):
                ids.append(self.engine.add_request(prompt, sampling, priority=rank))
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
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # one conversation
        prompts = [self.chat_prompt(c, enable_thinking) for c in conversations]
        return self.generate(prompts, params, priority)

    def chat_prompt(self, messages: list[Message], enable_thinking: bool | None = None) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, enable_thinking=enable_thinking)

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, priority: int = 0
    ) -> Iterator[RequestOutput]:
        """Yield this request's output after every engine step; closing the generator
        aborts it.

        A step that gave the request no token (its prompt is still being prefilled, chunk
        by chunk, or it is waiting for room) yields its unchanged progress, with empty
        deltas: a long prompt then still hands control back every step, so a caller can
        give up on it without waiting for the first token.
        """
        request_id = self.engine.add_request(prompt, params, priority=priority)
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
