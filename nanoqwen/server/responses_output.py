"""The Responses API, answers side: a response object, or the typed events that build it.

Where a chat completion answers with `choices`, a response answers with `output`: items in
the order the model wrote them, a `message` item (the assistant's text, in an
`output_text` part) and a `function_call` item per tool call (`call_id`, `name`, and
`arguments` as JSON text). `status` is `completed`, or `incomplete` with
`incomplete_details: {"reason": "max_output_tokens"}` when the length limit cut the reply;
`usage` counts `input_tokens` and `output_tokens`. Besides, the object repeats what the
request set (`instructions`, `tools`, `temperature`, ...), as OpenAI's does.

A stream is typed Server-Sent Events, `event: <type>` then `data: {"type": <type>, ...,
"sequence_number": n}`, each one step in building that same object, so that a client can
keep a copy up to date:

    response.created, response.in_progress       the response: in_progress, no output yet
    response.output_item.added                   a message item opens
      response.content_part.added                its output_text part, still empty
      response.output_text.delta ...             the text as it is generated
      response.output_text.done                  then the whole text,
      response.content_part.done                 the whole part,
    response.output_item.done                    and the whole item
    response.output_item.added                   a function_call item, once its block closes
      response.function_call_arguments.delta     its arguments, whole (they arrive whole)
      response.function_call_arguments.done
    response.output_item.done
    response.completed / response.incomplete     the finished response, with its usage

No `[DONE]` follows: the last event says the response is over. A stream that fails after
its `200` ends with an `error` event and `response.failed`.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from typing import Any

from nanoqwen.outputs import RequestOutput
from nanoqwen.server.logprobs import chat_logprobs
from nanoqwen.server.plumbing import Event
from nanoqwen.server.protocol import APIError
from nanoqwen.server.responses_input import ResponsesRequest
from nanoqwen.server.tools import ToolCallStream, ToolOptions, parse_tool_calls
from nanoqwen.text.tokenizer import Tokenizer

ID_PREFIX = "resp_"


class ResponsesReply:
    """One Responses request's answer (a `generation.Answer`): whole, or as its events."""

    def __init__(
        self, response_id: str, model: str, created: int, usage: Callable[[], dict[str, Any]],
        tokenizer: Tokenizer, request: ResponsesRequest, tools: ToolOptions | None,
    ) -> None:
        self.response_id, self.model, self.created = response_id, model, created
        self.usage, self.tokenizer = usage, tokenizer
        self.logprobs = request.logprobs is not None
        self.settings = request.settings
        self.parses_calls = tools is not None and tools.parses_calls
        self.calls = ToolCallStream()
        self.sequence = itertools.count()
        self.items: list[dict[str, Any]] = []  # the output items streamed whole
        self.message: dict[str, Any] | None = None  # the message item being streamed
        self.text, self.text_logprobs = "", []  # its text and logprobs so far
        self.num_scored = 0  # generated tokens whose logprobs went out
        self.final: RequestOutput | None = None

    # ------------------------------------------------------------ the whole response
    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        (output,) = outputs  # a response has one reply: there is no `n`
        content, calls = parse_tool_calls(output.text) if self.parses_calls else (output.text, [])
        items = [_call_item(call) for call in calls]
        if content or not calls:
            logprobs = self._logprobs(output, 0)
            items.insert(0, _message_item(_new_id("msg_"), _item_status(output),
                                          content or "", logprobs))
        return self._object(_status(output), items, with_usage=True)

    # ------------------------------------------------------------ the stream
    def opening_events(self, count: int) -> list[Event]:
        snapshot = self._object("in_progress", [])
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def output_events(self, index: int, output: RequestOutput) -> list[Event]:
        text, calls = output.delta_text, []
        if self.parses_calls:
            text, calls = self.calls.feed(text)
            if output.finished:
                text += self.calls.finish()
        events = self._text_events(text, output) if text else []
        for call in calls:
            events += self._close_message(output) + self._call_events(call)
        if output.finished:
            self.final = output
            if not self.items and self.message is None:  # an empty reply: an empty message
                events += self._open_message()
            events += self._close_message(output)
        return events

    def closing_events(self) -> list[Event]:
        status = _status(self.final)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [self._event(kind, response=self._object(status, self.items, with_usage=True))]

    def error_events(self, error: APIError) -> list[Event]:
        failed = self._object("failed", self.items)
        failed["error"] = {"code": error.code or error.type, "message": error.message}
        return [self._event("error", code=error.code, message=error.message, param=error.param),
                self._event("response.failed", response=failed)]

    def _text_events(self, text: str, output: RequestOutput) -> list[Event]:
        events = self._open_message() if self.message is None else []
        logprobs = self._logprobs(output, self.num_scored)
        self.num_scored = len(output.token_ids)
        self.text += text
        self.text_logprobs += logprobs
        events.append(self._event("response.output_text.delta", **self._where(), delta=text,
                                  logprobs=logprobs))
        return events

    def _open_message(self) -> list[Event]:
        self.message = _message_item(_new_id("msg_"), "in_progress", "", [])
        part = self.message["content"][0]
        return [self._event("response.output_item.added", output_index=len(self.items),
                            item={**self.message, "content": []}),
                self._event("response.content_part.added", **self._where(), part=part)]

    def _close_message(self, output: RequestOutput) -> list[Event]:
        if self.message is None:
            return []
        where = self._where()
        item = _message_item(self.message["id"], _item_status(output), self.text,
                             self.text_logprobs)
        self.items.append(item)
        self.message, self.text, self.text_logprobs = None, "", []
        return [self._event("response.output_text.done", **where, text=item["content"][0]["text"],
                            logprobs=item["content"][0]["logprobs"]),
                self._event("response.content_part.done", **where, part=item["content"][0]),
                self._event("response.output_item.done", output_index=where["output_index"],
                            item=item)]

    def _call_events(self, call: dict[str, Any]) -> list[Event]:
        item, index = _call_item(call), len(self.items)
        self.items.append(item)
        where = {"output_index": index, "item_id": item["id"]}
        return [self._event("response.output_item.added", output_index=index,
                            item={**item, "status": "in_progress", "arguments": ""}),
                self._event("response.function_call_arguments.delta", **where,
                            delta=item["arguments"]),
                self._event("response.function_call_arguments.done", **where,
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    # ------------------------------------------------------------ shapes
    def _where(self) -> dict[str, Any]:
        """Where the open message's text goes: its item, and its only part."""
        return {"output_index": len(self.items), "item_id": self.message["id"],
                "content_index": 0}

    def _logprobs(self, output: RequestOutput, start: int) -> list[dict[str, Any]]:
        if not self.logprobs or output.logprobs is None:
            return []
        scored = zip(output.token_ids[start:], output.logprobs[start:])
        return chat_logprobs(self.tokenizer, list(scored))

    def _event(self, kind: str, **fields: Any) -> Event:
        return kind, {"type": kind, **fields, "sequence_number": next(self.sequence)}

    def _object(self, status: str, items: list[dict[str, Any]],
                with_usage: bool = False) -> dict[str, Any]:
        return {
            "id": self.response_id, "object": "response", "created_at": self.created,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "model": self.model, "output": list(items), **self.settings,
            "previous_response_id": None, "store": False, "truncation": "disabled",
            "usage": _usage(self.usage()) if with_usage else None,
        }


def _status(output: RequestOutput) -> str:
    return "incomplete" if output.finish_reason == "length" else "completed"


def _item_status(output: RequestOutput) -> str:
    """A message item cut by the length limit is incomplete; any other is complete."""
    return "incomplete" if output.finished and output.finish_reason == "length" else "completed"


def _message_item(item_id: str, status: str, text: str,
                  logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [part]}


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    """Chat's tool call (`tools.parse_tool_calls`) as a `function_call` item."""
    function = call["function"]
    return {"id": _new_id("fc_"), "type": "function_call", "status": "completed",
            "call_id": call["id"], "name": function["name"], "arguments": function["arguments"]}


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage block in the Responses API's names. Qwen3's reasoning is part of the
    text (between <think> tags), not counted apart."""
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"
