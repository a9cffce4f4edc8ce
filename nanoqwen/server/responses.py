"""The OpenAI protocol, responses side: the JSON a completion answers with, whole or streamed.

A non-streaming request gets one object whose `choices` hold each sequence's full text. A
streaming one gets Server-Sent Events: one `chunk` per delta (same `id`, `created` and
`model` in every chunk), an optional last chunk with the `usage` and no choices, then
`data: [DONE]`. `/v1/completions` and `/v1/chat/completions` differ only in how a choice
looks, which `CompletionsAPI` and `ChatAPI` describe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoqwen.outputs import RequestOutput


class CompletionsAPI:
    """/v1/completions: each choice carries `text`, in responses and chunks alike."""

    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def delta_choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return self.choice(index, text, finish_reason)

    def opening_choices(self, count: int) -> list[dict[str, Any]]:
        return []


class ChatAPI:
    """/v1/chat/completions: a `message` per choice; a stream opens with the role, then deltas."""

    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        return {
            "index": index, "message": message, "logprobs": None, "finish_reason": finish_reason
        }

    def delta_choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def opening_choices(self, count: int) -> list[dict[str, Any]]:
        opening = {"role": "assistant", "content": ""}
        return [{"index": i, "delta": opening, "logprobs": None, "finish_reason": None}
                for i in range(count)]


API = CompletionsAPI | ChatAPI


@dataclass(frozen=True)
class Reply:
    """Builds one request's response objects: the whole response, or its stream chunks."""

    api: API
    response_id: str
    model: str
    created: int
    include_usage: bool

    def response(self, outputs: list[RequestOutput], usage: dict[str, Any]) -> dict[str, Any]:
        choices = [self.api.choice(i, out.text, out.finish_reason) for i, out in enumerate(outputs)]
        return self._envelope(self.api.object, choices, usage=usage)

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        # With include_usage OpenAI sends "usage": null in every chunk but the last.
        return self._envelope(
            self.api.chunk_object, choices, **({"usage": None} if self.include_usage else {})
        )

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._envelope(self.api.chunk_object, [], usage=usage)

    def _envelope(self, object_name: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.response_id, "object": object_name, "created": self.created,
            "model": self.model, "choices": choices, **extra,
        }


def usage(latest: dict[int, RequestOutput], samples_per_prompt: int) -> dict[str, Any]:
    """OpenAI's usage block from each choice's newest output; the `n` samples of a prompt
    count its tokens once."""
    firsts = [out for i, out in latest.items() if i % samples_per_prompt == 0]
    prompt_tokens = sum(len(out.prompt_token_ids) for out in firsts)
    completion_tokens = sum(len(out.token_ids) for out in latest.values())
    cached_tokens = sum(out.num_cached_tokens for out in firsts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
