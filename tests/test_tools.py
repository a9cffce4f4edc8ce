"""Tool calling: Qwen's template renders the tools and the call history, replies' <tool_call>
blocks become OpenAI tool_calls (whole or streamed), and tool_choice is honoured.

A random-weights model never calls a tool by itself, so replies are controlled: a
structured-output choice makes the model write exactly a given text (which "auto" then
parses), and "required" / named choices force a call through the grammar engine.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_helpers import MODEL, assert_error_shape, call

from nanoqwen import LLM
from nanoqwen.server import OpenAIServer
from nanoqwen.server.tools import ToolCallStream, parse_tool_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def block(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# ---------------------------------------------------------------------------- the parser
REPLY = ("Let me look.\n" + block("get_weather", {"city": "Oslo"}) + "\n"
         + "<tool_call>{not json}</tool_call>\n" + block("get_time", {"zone": "CET"}))


def test_parser_splits_content_and_calls() -> None:
    content, calls = parse_tool_calls(REPLY)
    assert content == "Let me look.\n\n<tool_call>{not json}</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_tool_calls("no calls <tool_call") == ("no calls <tool_call", [])
    assert parse_tool_calls(block("get_time", {"zone": "UTC"}))[0] is None


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_streamed_parser_agrees_with_the_whole_one(piece: int) -> None:
    stream, content, calls = ToolCallStream(), "", []
    for start in range(0, len(REPLY), piece):
        text, new_calls = stream.feed(REPLY[start : start + piece])
        assert "<tool_c" not in text or "{not json}" in text  # a call's text never leaks
        content += text
        calls += new_calls
    content += stream.finish()
    whole_content, whole_calls = parse_tool_calls(REPLY)
    assert content.strip() == whole_content
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    unfinished = ToolCallStream()
    assert unfinished.feed("hi <tool_call>\n{") == ("hi ", [])
    assert unfinished.finish() == "<tool_call>\n{"


# ---------------------------------------------------------------------------- the server
def test_tools_and_call_history_reach_the_template(server: OpenAIServer, qwen3_dir: str) -> None:
    history = [
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 3}'},
    ]
    status, _, tokenized = call(server, "POST", "/tokenize", {"messages": history, "tools": TOOLS})
    assert status == 200
    offline = LLM(qwen3_dir, device="cpu", dtype="float32", num_pages=64)
    parsed = [*history[:2], {**history[2], "content": "", "tool_calls": [{
        **history[2]["tool_calls"][0],
        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}, history[3]]
    expected = offline.chat_prompt(parsed, tools=TOOLS)
    assert tokenized["tokens"] == expected
    text = offline.tokenizer.decode(expected, skip_special_tokens=False)
    assert '"name": "get_time"' in text  # the tools are listed
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text  # an object
    assert '<tool_response>\n{"celsius": 3}\n</tool_response>' in text


def controlled(reply: str) -> dict:
    """Make the model write exactly `reply`."""
    return {"structured_outputs": {"choice": [reply]}}


def test_auto_parses_calls_whole_and_streamed(client: openai.OpenAI) -> None:
    reply = "Checking.\n" + block("get_weather", {"city": "Oslo"}) + "\n" + block(
        "get_time", {"zone": "UTC"})
    args = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300,
                extra_body=controlled(reply))
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] \
        == [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "UTC"})]

    chunks = list(client.chat.completions.create(**args, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert "".join(d.content or "" for d in deltas).strip() == "Checking."
    streamed = [call_ for d in deltas for call_ in d.tool_calls or []]
    assert [(c.index, c.function.name) for c in streamed] == [(0, "get_weather"), (1, "get_time")]
    assert [json.loads(c.function.arguments) for c in streamed] == [
        {"city": "Oslo"}, {"zone": "UTC"}]
    assert all(c.id.startswith("call_") and c.type == "function" for c in streamed)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # tool_choice none: the same reply is plain text.
    none = client.chat.completions.create(**{**args, "tool_choice": "none"}).choices[0]
    assert none.message.tool_calls is None and none.message.content == reply
    assert none.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_choices_force_calls(client: openai.OpenAI, stream: bool) -> None:
    def calls_of(tool_choice: object, **extra: object) -> list[tuple[str, dict]]:
        response = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=400,
            temperature=0.8, seed=5, stream=stream, **extra)
        if not stream:
            choice = response.choices[0]
            assert choice.finish_reason == "tool_calls"
            return [(c.function.name, json.loads(c.function.arguments))
                    for c in choice.message.tool_calls]
        chunks = list(response)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        return [(c.function.name, json.loads(c.function.arguments))
                for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]

    named = calls_of({"type": "function", "function": {"name": "get_time"}})
    assert len(named) == 1 and named[0][0] == "get_time" and named[0][1]["zone"] in ("UTC", "CET")
    required = calls_of("required")
    assert required and all(name in ("get_weather", "get_time") for name, _ in required)
    single = calls_of("required", parallel_tool_calls=False)
    assert len(single) == 1


BAD_TOOLS = [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bad"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
]


@pytest.mark.parametrize("extra, param", BAD_TOOLS, ids=[str(i) for i in range(len(BAD_TOOLS))])
def test_bad_tool_requests_name_the_field(server: OpenAIServer, extra: dict, param: str) -> None:
    status, _, body = call(server, "POST", "/v1/chat/completions",
                           {"messages": ASK, "max_tokens": 5, **extra})
    assert status == 400, body
    assert_error_shape(body)
    assert body["error"]["param"] == param


def test_bad_tool_history_is_refused(server: OpenAIServer) -> None:
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function",
         "function": {"name": "get_weather", "arguments": "{oops"}}]}]
    status, _, body = call(server, "POST", "/v1/chat/completions", {"messages": history})
    assert status == 400
    assert body["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


# ---------------------------------------------------------------------------- loose schemas
# Types as hand-written tools spell them; JSON Schema says integer, number, string, null.
# Strings and lists are bounded: a random model would never close them by itself.
LOOSE = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object",
    "properties": {"hour": {"type": "int"}, "volume": {"type": "float"},
                   "label": {"type": ["str", "None"], "maxLength": 8},
                   "days": {"type": "list", "items": {"type": "String", "enum": ["mon", "tue"]},
                            "maxItems": 3}},
    "required": ["hour", "volume", "label", "days"]}}}
STRICT = {"type": "object",
          "properties": {"hour": {"type": "integer"}, "volume": {"type": "number"},
                         "label": {"type": ["string", "null"]},
                         "days": {"type": "array", "items": {"type": "string"}}},
          "required": ["hour", "volume", "label", "days"], "additionalProperties": False}
# A parameter of any value: no type, or a type that says so.
ANYTHING = {"type": "function", "function": {"name": "note", "parameters": {
    "properties": {"what": {"description": "anything"}, "more": {"type": "any"}}}}}
CHOICES = {"auto": "auto", "required": "required",
           "named": {"type": "function", "function": {"name": "set_alarm"}}}


@pytest.mark.parametrize("choice", CHOICES.values(), ids=CHOICES.keys())
def test_tool_schemas_as_people_write_them_are_served(client: openai.OpenAI,
                                                      choice: object) -> None:
    """The same loosely written tools are served under every tool_choice."""
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[LOOSE, ANYTHING],
                                           tool_choice=choice, max_tokens=8)
    assert reply.choices[0].finish_reason in ("length", "tool_calls")


@pytest.mark.parametrize("choice", ["required", CHOICES["named"]], ids=["required", "named"])
def test_forced_calls_to_loose_schemas_are_well_formed(client: openai.OpenAI,
                                                       choice: object) -> None:
    """A model that would never call a tool writes a call that parses, whose arguments
    validate against the schema the loose one means."""
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[LOOSE], tool_choice=choice, temperature=0.7,
            seed=seed, parallel_tool_calls=False).choices[0]
        assert reply.finish_reason == "tool_calls", reply
        (called,) = reply.message.tool_calls
        assert called.function.name == "set_alarm"
        jsonschema.validate(json.loads(called.function.arguments), STRICT)


@pytest.mark.parametrize("choice", CHOICES.values(), ids=CHOICES.keys())
def test_an_unknown_type_names_the_function_and_the_parameter(server: OpenAIServer,
                                                              choice: object) -> None:
    alarm = json.loads(json.dumps(LOOSE))
    alarm["function"]["parameters"]["properties"]["days"]["items"] = {"type": "foo"}
    status, _, body = call(server, "POST", "/v1/chat/completions",
                           {"messages": ASK, "tools": [WEATHER, alarm], "tool_choice": choice})
    assert status == 400, body
    error = body["error"]
    assert error["param"] == "tools[1].function.parameters"
    assert "'set_alarm'" in error["message"] and "'days[]'" in error["message"]
    assert "'foo'" in error["message"] and "structural_tag" not in error["message"]


def test_a_schema_the_grammar_refuses_names_its_function(server: OpenAIServer) -> None:
    broken = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}
    status, _, body = call(server, "POST", "/v1/chat/completions",
                           {"messages": ASK, "tools": [WEATHER, broken],
                            "tool_choice": "required"})
    assert status == 400, body
    assert body["error"]["param"] == "tools[1].function.parameters"
    assert "'broken'" in body["error"]["message"]
