"""The Responses API, requests side: `POST /v1/responses` read as a chat turn.

OpenAI's Responses API is its newer shape for the same thing chat completions do: a
conversation in, the assistant's next turn out. The openai client's
`client.responses.create(...)`, the OpenAI Agents SDK's default model and Codex-style
clients speak it. What differs is the wire format, not the work:

| chat completions                          | Responses API                                        |
|-------------------------------------------|------------------------------------------------------|
| `messages`                                | `input`: a string (one user message) or a list of items |
| a system message                          | `instructions` (or a `system`/`developer` item)       |
| assistant `tool_calls`, `tool` messages   | `function_call` and `function_call_output` items      |
| `tools: [{type, function: {name, ...}}]`  | `tools: [{type: "function", name, ...}]` (flat)       |
| `max_tokens`, `response_format`           | `max_output_tokens`, `text.format`                    |
| `logprobs`, `top_logprobs`                | `include: ["message.output_text.logprobs"]`, `top_logprobs` |
| `choices` of chunks, then `[DONE]`        | output items, typed events (`responses_output`)       |

So a Responses request is translated into the pieces the chat route already checks and
serves (messages for the template, tools, a grammar, sampling settings), each refusal
naming the field as the Responses API spells it. One thing does not translate: OpenAI
keeps responses (`store`, on by default there) so that `previous_response_id` can continue
one. This server stores nothing, as a chat server doesn't: such a request is a 400 that
says to send the conversation so far as `input`, which is what a stateless client does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from nanoqwen.sampling.structured import StructuredOutput
from nanoqwen.server.logprobs import check_count
from nanoqwen.server.protocol import bad_request, checked_field
from nanoqwen.server.structured import parse_response_format

ROLES = ("user", "assistant", "system", "developer")
# A message's text parts: what a client writes (input_text) and what it sends back of an
# earlier answer (output_text).
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"
# `include` values this server honours; reasoning.encrypted_content asks for something of
# reasoning items, which this server never answers with, so it changes nothing.
INCLUDES = (LOGPROBS, "reasoning.encrypted_content")
# Sampling settings passed on as the chat route takes them: OpenAI's, and vLLM's extras.
SAMPLING = ("max_output_tokens", "temperature", "top_p", "stream", "top_k", "min_p", "seed",
            "stop", "stop_token_ids", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "ignore_eos", "logit_bias", "priority", "deadline", "user",
            "allowed_token_ids")


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request in the chat route's terms (see the module docstring)."""

    chat: dict[str, Any]  # `messages` and `chat_template_kwargs`, as a chat request has them
    sampling: dict[str, Any]  # the fields `protocol.parse_generation_options` reads
    text_format: StructuredOutput | None  # the grammar `text.format` asks for
    logprobs: int | None  # alternatives per token, None for no logprobs
    settings: dict[str, Any]  # what the response object repeats back


def parse_request(body: dict[str, Any]) -> ResponsesRequest:
    """The request's parts, each checked; tools are read by `tools.parse_tools(flat=True)`."""
    messages = _instructions(body) + _input_messages(body)
    chat = {"messages": messages, "chat_template_kwargs": body.get("chat_template_kwargs")}
    sampling = {name: body[name] for name in SAMPLING if name in body}
    settings = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "text": body.get("text") or {"format": {"type": "text"}},
        "top_logprobs": body.get("top_logprobs"),
        "metadata": body.get("metadata") or {}, "user": body.get("user"),
    }
    return ResponsesRequest(chat, sampling, _text_format(body), _logprobs(body), settings)


def _instructions(body: dict[str, Any]) -> list[dict[str, Any]]:
    instructions = checked_field(body, "instructions", str, "a string", None)
    return [] if instructions is None else [{"role": "system", "content": instructions}]


def _input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user message; a list holds items."""
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty list of input items", "input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        _add_item(messages, item, f"input[{index}]")
    return messages


def _add_item(messages: list[dict[str, Any]], item: Any, param: str) -> None:
    if not isinstance(item, dict):
        raise bad_request(f"{param} must be an object (a message or a function call item)", param)
    kind = item.get("type", "message")
    if kind == "message":
        messages.append(_message(item, param))
    elif kind == "function_call":
        call = _function_call(item, param)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # one turn: its text, then calls
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param),
                         "content": _text(output, f"{param}.output")})
    else:
        raise bad_request(f"{param}.type {kind!r} is not supported: input items are messages, "
                          "function_call and function_call_output (this server keeps no "
                          "earlier responses to refer to)", f"{param}.type")


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"{param}.role must be one of {', '.join(ROLES)}, got {role!r}",
                          f"{param}.role")
    return {"role": role, "content": _text(item.get("content"), f"{param}.content")}


def _text(content: Any, param: str) -> str:
    """A message's text: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of text parts", param)
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{param}[{index}] must be a text part ({', '.join(TEXT_PARTS)}) "
                              f"with a text; got type {kind!r} (this server serves a text "
                              "model)", f"{param}[{index}]")
    return "".join(part["text"] for part in content)


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    """A `function_call` item as chat's assistant tool call."""
    arguments = _string(item, "arguments", param)
    try:
        json.loads(arguments)
    except ValueError as error:
        raise bad_request(f"{param}.arguments is not valid JSON", f"{param}.arguments") from error
    return {"id": _string(item, "call_id", param), "type": "function",
            "function": {"name": _string(item, "name", param), "arguments": arguments}}


def _string(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{param}.{name} must be a string", f"{param}.{name}")
    return value


def _text_format(body: dict[str, Any]) -> StructuredOutput | None:
    """`text.format`: plain text, any JSON object, or JSON matching a schema."""
    text = checked_field(body, "text", dict, "an object", {})
    if text.get("verbosity") is not None:
        raise bad_request("text.verbosity is not supported by this server", "text.verbosity")
    form = text.get("format")
    return None if form is None else parse_response_format(form, "text.format", flat=True)


def _logprobs(body: dict[str, Any]) -> int | None:
    """Alternatives per token when `include` asks for logprobs; None when it doesn't."""
    include = checked_field(body, "include", list, "a list", [])
    for value in include:
        if value not in INCLUDES:
            raise bad_request(f"include {value!r} is not supported by this server (it takes "
                              f"{', '.join(INCLUDES)})", "include")
    top = body.get("top_logprobs")
    if top is not None:
        check_count(top, "top_logprobs")
    if LOGPROBS not in include:
        if top:
            raise bad_request(f"top_logprobs needs include: [{LOGPROBS!r}]", "top_logprobs")
        return None
    return top or 0
