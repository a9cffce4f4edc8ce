"""Tool calling (function calling) with Qwen's own format.

Qwen2.5 and Qwen3 learned tools from their chat templates: the template lists the tools
(OpenAI function definitions) in the system turn, and the model calls one by writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

in its reply (as many blocks as it wants calls). Past calls come back in the history as the
assistant's `tool_calls`, and their results as `tool` messages, which the template renders
in the same format. So the server's part is small:

* pass `tools` and the tool-call history to the template (`parse_tools`, `tool_fields`),
  each function's parameter types in JSON Schema's spelling (`schemas`: `"int"` is
  `"integer"`), whatever the `tool_choice`;
* turn the reply's `<tool_call>` blocks into OpenAI `tool_calls` (`parse_tool_calls`, or
  `ToolCallStream` while streaming: text outside the blocks streams as content, each call
  goes out whole once its block closes); a block that is not valid JSON stays text;
* honour `tool_choice`: "none" (the tools are shown, replies are not parsed), "auto" (the
  model decides), "required" (at least one call) or a named function (exactly that call).
  The last two, and "auto" with `parallel_tool_calls: false` (at most one call), are
  enforced by a grammar over the same format (`grammar`), so even a model that would
  never call a tool writes a valid call whose arguments match the function's schema.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanoqwen.sampling.structured import StructuredOutput
from nanoqwen.server.protocol import APIError, bad_request
from nanoqwen.server.schemas import normalize_parameters
from nanoqwen.text.stop_strings import partial_match_length

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
TOOL_CALL = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function that takes no arguments
MAX_TOOLS = 128  # OpenAI's limit; each is rendered into the prompt, and into a forcing grammar


@dataclass(frozen=True)
class ToolOptions:
    """What a chat request says about tools."""

    tools: list[dict[str, Any]]  # chat's function tools, as the template renders them
    choice: str  # "none", "auto", "required", or "function" (exactly `function`)
    function: str | None = None
    parallel: bool = True  # may a reply hold several calls?
    params: tuple[str, ...] = ()  # where the request wrote each function (for errors)

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def grammar(self) -> StructuredOutput | None:
        """The grammar that enforces the choice, if it needs one (module docstring)."""
        by_name = {tool["function"]["name"]: tool["function"] for tool in self.tools}
        if self.choice == "function":
            tag = _call_tag(by_name[self.function])
            return StructuredOutput(structural_tag=_structural_tag(tag))
        tags = [_call_tag(function) for function in by_name.values()]
        if self.choice == "required":
            return StructuredOutput(structural_tag=_structural_tag({
                "type": "tags_with_separator", "tags": tags, "separator": "\n",
                "at_least_one": True, "stop_after_first": not self.parallel,
            }))
        if self.choice == "auto" and not self.parallel:
            return StructuredOutput(structural_tag=_structural_tag({
                "type": "triggered_tags", "triggers": [CALL_START], "tags": tags,
                "stop_after_first": True,
            }))
        return None

    def schema_error(self, compile: Callable[[StructuredOutput], object]) -> APIError | None:
        """A 400 naming the first function whose parameters `compile` refuses on their own:
        the grammar of a forced call holds every function, and its error can't say which."""
        for tool, param in zip(self.tools, self.params):
            function = tool["function"]
            try:
                compile(StructuredOutput(json=function.get("parameters") or NO_PARAMETERS))
            except ValueError as error:
                reason = str(error).partition(" is invalid: ")[2] or str(error)
                return bad_request(f"{param}.parameters (function {function['name']!r}) is "
                                   f"not a schema the grammar can enforce: {reason}",
                                   f"{param}.parameters")
        return None


def parse_tools(body: dict[str, Any], flat: bool = False) -> ToolOptions | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`, checked; None without tools.

    Chat nests a function's definition (`{"type": "function", "function": {"name": ...}}`,
    and names a forced one as `{"type": "function", "function": {"name": ...}}`); the
    Responses API is `flat`: the definition's fields sit beside `type`, and so does the
    forced function's `name`. Errors name the fields as the request spelled them.
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if flat and tools == []:  # the Responses API's way to say none, where "auto" asks nothing
        tools, choice = None, None if choice == "auto" else choice
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools must be a non-empty list of function tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools lists {len(tools)} functions; this server takes at most "
                          f"{MAX_TOOLS}", "tools")
    params = tuple(f"tools[{i}]" if flat else f"tools[{i}].function" for i in range(len(tools)))
    functions = [checked_function(_function_of(tool, param, flat), param)
                 for tool, param in zip(tools, params)]
    names = [function["name"] for function in functions]
    if len(set(names)) < len(names):
        raise bad_request("tools must have distinct function names", "tools")
    choice, function = _tool_choice("auto" if choice is None else choice, names, flat)
    chat_tools = [{"type": "function", "function": function} for function in functions]
    return ToolOptions(chat_tools, choice, function, parallel is not False, params)


def _function_of(tool: Any, param: str, flat: bool) -> Any:
    """The function definition in a tool (see `parse_tools`), once the tool is a function's."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        param = param.removesuffix(".function")
        shape = "'name': ..." if flat else "'function': {...}"
        raise bad_request(f"{param} must be a function tool ({{'type': 'function', {shape}}}); "
                          f"this server runs no built-in tools", param)
    if flat:
        return {key: value for key, value in tool.items() if key != "type"}
    return tool.get("function")


def checked_function(function: Any, param: str) -> dict[str, Any]:
    """A function definition (`name`, `description`, `parameters`), checked, its
    parameters normalized (`schemas.normalize_parameters`)."""
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"{param} must be an object with a name", param)
    name = function["name"]
    if not FUNCTION_NAME.match(name):
        raise bad_request(f"{param}.name must be 1-64 letters, digits, _ or -", f"{param}.name")
    parameters = function.get("parameters")
    if parameters is None:
        return function
    if not isinstance(parameters, dict):
        raise bad_request(f"{param}.parameters must be a JSON schema object",
                          f"{param}.parameters")
    return {**function,
            "parameters": normalize_parameters(parameters, name, f"{param}.parameters")}


def tool_fields(message: dict[str, Any], param: str) -> dict[str, Any]:
    """The tool parts of a history message, in the shape chat templates read: an
    assistant's `tool_calls` (arguments as objects) and a tool result's `tool_call_id`."""
    fields: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise bad_request(f"{param}.tool_calls must be a list on an assistant message",
                              f"{param}.tool_calls")
        fields["tool_calls"] = [_history_call(call, f"{param}.tool_calls[{i}]")
                                for i, call in enumerate(calls)]
    for name in ("tool_call_id", "name"):
        if message.get(name) is not None:
            if not isinstance(message[name], str):
                raise bad_request(f"{param}.{name} must be a string", f"{param}.{name}")
            fields[name] = message[name]
    return fields


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole reply as (content, OpenAI tool calls); content is None when only calls."""
    calls, kept, last = [], [], 0
    for match in TOOL_CALL.finditer(text):
        call = _parse_call(match.group(1))
        kept.append(text[last : match.start()] if call else text[last : match.end()])
        last = match.end()
        if call:
            calls.append(call)
    content = ("".join(kept) + text[last:]).strip() if calls else text
    return content or None, calls


class ToolCallStream:
    """Splits a streamed reply into content and tool calls as its text arrives.

    Text that may be the start of `<tool_call>` is held back until the next piece shows
    whether it is; a call is released once its block closes; `finish` releases whatever
    is left (an unclosed block comes out as the text it is).
    """

    def __init__(self) -> None:
        self.pending = ""
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.pending += text
        content, calls = "", []
        while True:
            start = self.pending.find(CALL_START)
            if start < 0:
                keep = partial_match_length(self.pending, [CALL_START])
                content += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep :]
                return content, calls
            content += self.pending[:start]
            self.pending = self.pending[start:]
            end = self.pending.find(CALL_END)
            if end < 0:
                return content, calls
            end += len(CALL_END)
            block, self.pending = self.pending[:end], self.pending[end:]
            call = _parse_call(block[len(CALL_START) : -len(CALL_END)])
            if call is None:
                content += block
            else:
                calls.append({"index": self.num_calls, **call})
                self.num_calls += 1

    def finish(self) -> str:
        rest, self.pending = self.pending, ""
        return rest


def _parse_call(block: str) -> dict[str, Any] | None:
    """An OpenAI tool call from a block's JSON, or None if it is not a call.

    Raw control characters inside strings are taken (`strict=False`): xgrammar 0.2.8 lets
    a forced call's string bounded by `maxLength` hold them, and the arguments go out
    re-encoded, escaped as JSON requires.
    """
    try:
        call = json.loads(block, strict=False)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # already encoded by the model: keep its text
        encoded = arguments
    else:
        encoded = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": encoded}}


def _tool_choice(choice: Any, names: list[str], flat: bool) -> tuple[str, str | None]:
    if choice in TOOL_CHOICES:
        return choice, None
    name = _forced_name(choice, flat)
    if not isinstance(name, str):
        shape = "'name': ..." if flat else "'function': {'name': ...}"
        raise bad_request(f"tool_choice must be none, auto, required or "
                          f"{{'type': 'function', {shape}}}", "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools",
                          "tool_choice")
    return "function", name


def _forced_name(choice: Any, flat: bool) -> Any:
    """The name in a named `tool_choice` (see `parse_tools`), or None."""
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return None
    named = choice if flat else choice.get("function")
    return named.get("name") if isinstance(named, dict) else None


def _history_call(call: Any, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"{param} must have a function with a name", param)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as error:
            raise bad_request(f"{param}.function.arguments is not valid JSON",
                              f"{param}.function.arguments") from error
    return {**call, "function": {**function, "arguments": arguments}}


def _call_tag(function: dict[str, Any]) -> dict[str, Any]:
    """The structural tag of one call to `function`, in Qwen's format. One whitespace
    character at most between JSON tokens: enough for any layout, never an endless pad."""
    schema = function.get("parameters") or NO_PARAMETERS
    return {
        "type": "tag",
        "begin": f'{CALL_START}\n{{"name": {json.dumps(function["name"])}, "arguments": ',
        "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
        "end": f"}}\n{CALL_END}",
    }


def _structural_tag(format: dict[str, Any]) -> str:
    return json.dumps({"type": "structural_tag", "format": format})
