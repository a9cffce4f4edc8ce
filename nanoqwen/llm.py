"""The offline interface: `LLM(model).generate(prompts, params)`, as in vLLM.

`LLMEngine` (`engine.py`) is driven one step at a time, which is what a server needs. A
script wants less: `generate` queues many prompts and steps the engine until all are done,
returning outputs in prompt order; `chat` renders conversations through the chat template
first; `stream` yields one request's deltas as they are produced; `embed` returns each
prompt's embedding. Bad input in a batch queues nothing: the prompts queued before it are
taken back.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from nanoqwen.engine import LLMEngine, Prompt
from nanoqwen.outputs import RequestOutput
from nanoqwen.sampling.params import PoolingParams, SamplingParams

Message = dict[str, Any]
Params = SamplingParams | PoolingParams


class LLM:
    """Offline batch inference: `LLM(model).generate(prompts, params)`."""

    def __init__(self, model: str, **options: Any) -> None:
        self.engine = LLMEngine(model, **options)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: Params | Sequence[Params] | None = None,
        priority: Sequence[int] | None = None,
        deadline: Sequence[float | None] | None = None,
        user: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """`priority`, `deadline`, `user`: one per prompt, as `LLMEngine.add_request` takes them.

        Every prompt is queued or none is: one refused (a `ValueError`) takes back the
        ones queued before it.
        """
        outputs: dict[str, RequestOutput | None] = {}  # in prompt order, None until finished
        try:
            each = _one_per_prompt(prompts, params, priority, deadline, user)
            for prompt, sampling, rank, due, who in each:
                options = {"priority": rank, "deadline": due, "user": who}
                outputs[self.engine.add_request(prompt, sampling, **options)] = None
            unfinished = len(outputs)
            while unfinished:
                for output in self.engine.step():
                    if output.finished and output.request_id in outputs:
                        outputs[output.request_id] = output
                        unfinished -= 1
        finally:
            for request_id, output in outputs.items():
                if output is None:
                    self.engine.abort(request_id)
        return list(outputs.values())

    def chat(
        self,
        conversations: list[Message] | Sequence[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        enable_thinking: bool | None = None,
        priority: Sequence[int] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """`tools`: OpenAI function definitions, shown to the model by its template (its
        replies may then hold `<tool_call>` blocks). `continue_final_message`: each
        conversation ends with the start of the assistant's reply, which it continues."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # one conversation
        prompts = [
            self.chat_prompt(c, enable_thinking, tools, continue_final_message)
            for c in conversations
        ]
        return self.generate(prompts, params, priority)

    def chat_prompt(
        self,
        messages: list[Message],
        enable_thinking: bool | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        return self.tokenizer.apply_chat_template(
            messages, enable_thinking=enable_thinking, tools=tools,
            add_generation_prompt=not continue_final_message,
            continue_final_message=continue_final_message,
        )

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: PoolingParams | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Each prompt's embedding (`output.embedding`): its last token's final hidden
        state, unit length unless `PoolingParams(normalize=False)` (`sampling/pooling.py`)."""
        return self.generate(prompts, params or PoolingParams(), priority)

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


def _one_per_prompt(
    prompts: Prompt | Sequence[Prompt],
    params: Params | Sequence[Params] | None,
    *per_prompt: Sequence[Any] | None,
) -> list[tuple[Any, ...]]:
    """(prompt, params, priority, deadline, user) for each prompt. One prompt may come
    alone (a string, or a list of token ids), and one `params` may serve every prompt; the
    others are lists (or None: the defaults), checked as their requests are added."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and isinstance(prompts[0], int)):
        prompts = [prompts]
    count = len(prompts)
    if params is None or isinstance(params, (SamplingParams, PoolingParams)):
        params = [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    lists = []
    for name, values, default in zip(("priority", "deadline", "user"), per_prompt, (0, None, None)):
        if values is not None and (not isinstance(values, (list, tuple)) or len(values) != count):
            raise ValueError(f"{name} must be a list of {count}, one per prompt, got {values!r}")
        lists.append([default] * count if values is None else values)
    return list(zip(prompts, params, *lists))
