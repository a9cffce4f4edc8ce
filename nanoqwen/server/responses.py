"""The OpenAI protocol, responses side: the JSON a completion answers with, whole or streamed.

A non-streaming request gets one object whose `choices` hold each sequence's full text. A
streaming one gets Server-Sent Events: one `chunk` per delta (same `id`, `created` and
`model` in every chunk), an optional last chunk with the `usage` and no choices, then
`data: [DONE]`. `/v1/completions` and `/v1/chat/completions` differ in how a choice looks,
which `CompletionsAPI` and `ChatAPI` describe. One of them is made per request, with what
the request asked for beyond text (logprobs, echo, tool calls), and keeps each choice's
stream position (`ChoiceStream`): logprobs of tokens whose text is still held back ride
along with the next chunk that has text, and a tool call goes out once its block closes.
Every choice says which stop string or stop token id ended it (SGLang's `matched_stop`;
null when it ended otherwise). `Reply` is the `generation.Answer` of both routes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nanoqwen.outputs import RequestOutput
from nanoqwen.server.logprobs import (
    Scored,
    chat_logprobs,
    completion_logprobs,
    ranked_prompt,
)
from nanoqwen.server.plumbing import Event
from nanoqwen.server.protocol import APIError
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

    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokenizer: Tokenizer, logprobs: bool = False, echo: bool = False,
                 prompt_logprobs: bool = False) -> None:
        self.tokenizer, self.logprobs, self.echo = tokenizer, logprobs, echo
        self.prompt_logprobs = prompt_logprobs  # vLLM's field, beside the choice's logprobs
        self.streams: dict[int, ChoiceStream] = {}

    def choice(self, index: int, output: RequestOutput) -> dict[str, Any]:
        scored = _generated(output, 0)
        text = output.text
        if self.echo:
            text = self._prompt_text(output) + text
            scored = _prompt(output) + scored
        choice = self._choice(index, text, scored, 0, output)
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = ranked_prompt(self.tokenizer, output.prompt_logprobs)
        return choice

    def response_fields(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return {}

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
        choice = self._choice(index, text, scored, stream.text_offset, output)
        stream.text_offset += len(text)
        return choice

    def opening_choices(self, count: int) -> list[dict[str, Any]]:
        return []

    def _choice(
        self, index: int, text: str, scored: list[Scored], offset: int, output: RequestOutput
    ) -> dict[str, Any]:
        logprobs = completion_logprobs(self.tokenizer, scored, offset) if self.logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": output.finish_reason, "matched_stop": output.stop_reason}

    def _prompt_text(self, output: RequestOutput) -> str:
        return self.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)


class ChatAPI:
    """/v1/chat/completions: a `message` per choice; a stream opens with the role, then deltas."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self, tokenizer: Tokenizer, logprobs: bool = False, tools: ToolOptions | None = None,
        echo: str = "", prompt_logprobs: bool = False,
    ) -> None:
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self.parses_calls = tools is not None and tools.parses_calls
        self.echo = echo  # vLLM's echo: the continued message, which the reply starts with
        self.prompt_logprobs = prompt_logprobs  # vLLM's field, beside the choices
        self.streams: dict[int, ChoiceStream] = {}

    def choice(self, index: int, output: RequestOutput) -> dict[str, Any]:
        content, calls = parse_tool_calls(output.text) if self.parses_calls else (output.text, [])
        if self.echo:
            content = self.echo + (content or "")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return {
            "index": index, "message": message, "logprobs": self._logprobs(_generated(output, 0)),
            "finish_reason": _finish_reason(output, bool(calls)),
            "matched_stop": output.stop_reason,
        }

    def response_fields(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """vLLM puts a chat's prompt logprobs beside its choices: the choices share a prompt."""
        if not self.prompt_logprobs:
            return {}
        return {"prompt_logprobs": ranked_prompt(self.tokenizer, outputs[0].prompt_logprobs)}

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
                "finish_reason": _finish_reason(output, stream.called),
                "matched_stop": output.stop_reason}

    def opening_choices(self, count: int) -> list[dict[str, Any]]:
        opening = {"role": "assistant", "content": self.echo}
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
    """One chat or completions request's answer: the whole response, or its stream."""

    api: API
    response_id: str
    model: str
    created: int
    usage: Callable[[], dict[str, Any]]  # the request's usage so far
    include_usage: bool = False  # a last chunk with the usage
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage so far in every chunk

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = [self.api.choice(i, out) for i, out in enumerate(outputs)]
        return self._envelope(self.api.object, choices, usage=self.usage(),
                              **self.api.response_fields(outputs))

    def opening_events(self, count: int) -> list[Event]:
        # One per choice, as OpenAI sends them.
        return [(None, self._chunk([opening])) for opening in self.api.opening_choices(count)]

    def output_events(self, index: int, output: RequestOutput) -> list[Event]:
        choice = self.api.delta_choice(index, output)
        return [] if choice is None else [(None, self._chunk([choice]))]

    def closing_events(self) -> list[Event]:
        last = self._envelope(self.api.chunk_object, [], usage=self.usage())
        return [*([(None, last)] if self.include_usage else []), (None, "[DONE]")]

    def error_events(self, error: APIError) -> list[Event]:
        return [(None, error.body())]

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        # With include_usage OpenAI sends "usage": null in every chunk but the last.
        usage = {"usage": self.usage()} if self.continuous_usage else \
            {"usage": None} if self.include_usage else {}
        return self._envelope(self.api.chunk_object, choices, **usage)

    def _envelope(self, object_name: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.response_id, "object": object_name, "created": self.created,
            "model": self.model, "choices": choices, **extra,
        }
