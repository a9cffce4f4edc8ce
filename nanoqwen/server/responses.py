"""The OpenAI protocol, responses side: the JSON a completion answers with, whole or streamed.

A non-streaming request gets one object whose `choices` hold each sequence's full text. A
streaming one gets Server-Sent Events: one `chunk` per delta (same `id`, `created` and
`model` in every chunk), an optional last chunk with the `usage` and no choices, then
`data: [DONE]`. `/v1/completions` and `/v1/chat/completions` differ in how a choice looks,
which `CompletionsAPI` and `ChatAPI` describe. One of them is made per request, with what
the request asked for beyond text (logprobs, echo, tool calls), and keeps each choice's
stream position (`ChoiceStream`): logprobs of tokens whose text is still held back ride
along with the next chunk that has text, and a tool call goes out once its block closes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanoqwen.outputs import RequestOutput
from nanoqwen.server.logprobs import Scored, chat_logprobs, completion_logprobs
from nanoqwen.server.tools import ToolCallStream, ToolOptions, parse_tool_calls
from nanoqwen.text.tokenizer import Tokenizer


@dataclass
class ChoiceStream:
    """How far one streamed choice has got."""

    started: bool = False
    num_scored_sent: int = 0  # generated tokens whose logprobs went out
    text_offset: int = 0  # characters of text sent (completions logprobs' text_offset)
    tool_calls: ToolCallStream = field(default_factory=ToolCallStream)
    called: bool = False  # a tool call went out


class CompletionsAPI:
    """/v1/completions: each choice carries `text`, in responses and chunks alike."""

    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokenizer: Tokenizer, logprobs: bool = False, echo: bool = False) -> None:
        self.tokenizer, self.logprobs, self.echo = tokenizer, logprobs, echo
        self.streams: dict[int, ChoiceStream] = {}

    def choice(self, index: int, output: RequestOutput) -> dict[str, Any]:
        scored = _generated(output, 0)
        text = output.text
        if self.echo:
            text = self._prompt_text(output) + text
            scored = _prompt(output) + scored
        return self._choice(index, text, scored, 0, output.finish_reason)

    def delta_choice(self, index: int, output: RequestOutput) -> dict[str, Any] | None:
        stream = self.streams.setdefault(index, ChoiceStream())
        echo = self.echo and not stream.started  # the first chunk carries the prompt
        text = (self._prompt_text(output) if echo else "") + output.delta_text
        if not text and not output.finished:
            return None
        generated = _generated(output, stream.num_scored_sent)
        scored = (_prompt(output) if echo else []) + generated
        stream.started = True
        stream.num_scored_sent += len(generated)
        choice = self._choice(index, text, scored, stream.text_offset, output.finish_reason)
        stream.text_offset += len(text)
        return choice

    def opening_choices(self, count: int) -> list[dict[str, Any]]:
        return []

    def _choice(
        self, index: int, text: str, scored: list[Scored], offset: int, finish_reason: str | None
    ) -> dict[str, Any]:
        logprobs = completion_logprobs(self.tokenizer, scored, offset) if self.logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _prompt_text(self, output: RequestOutput) -> str:
        return self.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)


class ChatAPI:
    """/v1/chat/completions: a `message` per choice; a stream opens with the role, then deltas."""

    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self, tokenizer: Tokenizer, logprobs: bool = False, tools: ToolOptions | None = None
    ) -> None:
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self.parses_calls = tools is not None and tools.parses_calls
        self.streams: dict[int, ChoiceStream] = {}

    def choice(self, index: int, output: RequestOutput) -> dict[str, Any]:
        content, calls = parse_tool_calls(output.text) if self.parses_calls else (output.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return {
            "index": index, "message": message, "logprobs": self._logprobs(_generated(output, 0)),
            "finish_reason": _finish_reason(output, bool(calls)),
        }

    def delta_choice(self, index: int, output: RequestOutput) -> dict[str, Any] | None:
        stream = self.streams.setdefault(index, ChoiceStream())
        content, calls = output.delta_text, []
        if self.parses_calls:
            content, calls = stream.tool_calls.feed(content)
            if output.finished:
                content += stream.tool_calls.finish()
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
            stream.called = True
        if not delta and not output.finished:
            return None
        scored = _generated(output, stream.num_scored_sent)
        stream.num_scored_sent += len(scored)
        return {"index": index, "delta": delta, "logprobs": self._logprobs(scored),
                "finish_reason": _finish_reason(output, stream.called)}

    def opening_choices(self, count: int) -> list[dict[str, Any]]:
        opening = {"role": "assistant", "content": ""}
        return [{"index": i, "delta": opening, "logprobs": None, "finish_reason": None}
                for i in range(count)]

    def _logprobs(self, scored: list[Scored]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": chat_logprobs(self.tokenizer, scored), "refusal": None}


API = CompletionsAPI | ChatAPI


def _generated(output: RequestOutput, start: int) -> list[Scored]:
    """The generated tokens from `start` on, with their logprobs (when computed)."""
    if output.logprobs is None:
        return []
    return list(zip(output.token_ids[start:], output.logprobs[start:]))


def _prompt(output: RequestOutput) -> list[Scored]:
    entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    return list(zip(output.prompt_token_ids, entries))


def _finish_reason(output: RequestOutput, called: bool) -> str | None:
    """OpenAI says "tool_calls" when a reply that ended by itself called tools."""
    return "tool_calls" if called and output.finish_reason == "stop" else output.finish_reason


@dataclass(frozen=True)
class Reply:
    """Builds one request's response objects: the whole response, or its stream chunks."""

    api: API
    response_id: str
    model: str
    created: int
    include_usage: bool

    def response(self, outputs: list[RequestOutput], usage: dict[str, Any]) -> dict[str, Any]:
        choices = [self.api.choice(i, out) for i, out in enumerate(outputs)]
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
